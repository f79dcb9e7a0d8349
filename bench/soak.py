"""Soak: many clients sending a mix of valid, invalid and aborted requests to one model for a long time.

Usage: .venv/bin/python bench/soak.py [--minutes 30] [--clients 64] [--write docs/benchmarks.md]

Starts `corral serve` on a loopback port with a fresh store, builds one model from SmolLM2, then runs --clients
concurrent clients (asyncio + httpx) for --minutes. Each client loops over a random choice of:
  valid:   streamed /api/generate, non-streamed /api/chat, /v1/chat/completions, /v1/messages, /api/show, /api/tags,
           /api/ps, /api/version
  invalid: malformed JSON, an unknown model, bad options (NaN, negative, wrong types), an oversized num_ctx,
           a bad think value, traversal in a model name, a hostile Go template
  aborted: a stream dropped after its first chunk, a non-streaming request given up after 0.3 s
It samples the daemon's resident memory (daemon and runners separately) and open file descriptors every 10 s,
and at the end checks the store: every blob hashes to its name, every manifest's blobs exist, no temporary
files are left. Reports requests served, errors by class, latency percentiles, memory at start and end with
the slope of a least-squares line over the second half (the trend), and file descriptors.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.models import smollm2_path  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CHAT = [{"role": "user", "content": "Name a colour."}]
OPTS = {"num_predict": 12, "temperature": 0.7, "num_ctx": 1024}


def actions(model: str) -> list[tuple[str, str, float]]:
    """(kind, name, weight)."""
    return [
        ("valid", "generate-stream", 6),
        ("valid", "chat", 5),
        ("valid", "openai-chat", 3),
        ("valid", "anthropic", 2),
        ("valid", "show", 2),
        ("valid", "tags", 2),
        ("valid", "ps", 2),
        ("valid", "version", 2),
        ("invalid", "bad-json", 1),
        ("invalid", "unknown-model", 1),
        ("invalid", "bad-options", 1),
        ("invalid", "huge-ctx", 1),
        ("invalid", "bad-think", 1),
        ("invalid", "traversal", 1),
        ("invalid", "hostile-template", 1),
        ("aborted", "stream-drop", 2),
        ("aborted", "give-up", 2),
    ]


async def one(client: httpx.AsyncClient, name: str, model: str) -> int:
    """Run one action; returns the HTTP status (0 for a deliberately aborted request)."""
    if name == "generate-stream":
        async with client.stream(
            "POST", "/api/generate", json={"model": model, "prompt": "Count: 1 2 3", "options": OPTS}
        ) as r:
            async for line in r.aiter_lines():
                if '"error"' in line:
                    return 599  # an error inside a stream
            return r.status_code
    if name == "chat":
        r = await client.post("/api/chat", json={"model": model, "messages": CHAT, "stream": False, "options": OPTS})
        return r.status_code
    if name == "openai-chat":
        r = await client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": CHAT, "max_tokens": 12, "options": {"num_ctx": 1024}},
        )
        return r.status_code
    if name == "anthropic":
        r = await client.post(
            "/v1/messages", json={"model": model, "messages": CHAT, "max_tokens": 12, "options": {"num_ctx": 1024}}
        )
        return r.status_code
    if name in ("show", "tags", "ps", "version"):
        if name == "show":
            return (await client.post("/api/show", json={"model": model})).status_code
        return (await client.get(f"/api/{name}")).status_code
    if name == "bad-json":
        return (
            await client.post(
                "/api/chat", content=b'{"model": "x", "messages": [', headers={"Content-Type": "application/json"}
            )
        ).status_code
    if name == "unknown-model":
        return (
            await client.post(
                "/api/generate", json={"model": "nope-" + str(random.random()), "prompt": "x", "stream": False}
            )
        ).status_code
    if name == "bad-options":
        bad = random.choice(
            [
                {"temperature": -1},
                {"top_p": 7},
                {"num_ctx": "many"},
                {"repeat_penalty": 0},
                {"num_thread": 100000},
                {"top_k": -5},
            ]
        )
        return (
            await client.post("/api/generate", json={"model": model, "prompt": "x", "stream": False, "options": bad})
        ).status_code
    if name == "huge-ctx":
        return (
            await client.post(
                "/api/generate", json={"model": model, "prompt": "x", "stream": False, "options": {"num_ctx": 1 << 30}}
            )
        ).status_code
    if name == "bad-think":
        return (
            await client.post("/api/chat", json={"model": model, "messages": CHAT, "think": "very", "stream": False})
        ).status_code
    if name == "traversal":
        return (await client.post("/api/show", json={"model": "../../etc/passwd"})).status_code
    if name == "hostile-template":
        template = "{{range $i := .Messages}}" * 6 + "x" + "{{end}}" * 6
        return (
            await client.post(
                "/api/generate",
                json={"model": model, "prompt": "x", "stream": False, "template": template, "options": OPTS},
            )
        ).status_code
    if name == "stream-drop":
        async with client.stream(
            "POST",
            "/api/generate",
            json={"model": model, "prompt": "Tell a story", "options": {**OPTS, "num_predict": 64}},
        ) as r:
            async for _ in r.aiter_lines():
                break  # leave after the first chunk
        return 0
    if name == "give-up":
        try:
            await client.post(
                "/api/chat",
                json={"model": model, "messages": CHAT, "stream": False, "options": {**OPTS, "num_predict": 64}},
                timeout=0.3,
            )
        except httpx.TimeoutException:
            pass
        return 0
    raise ValueError(name)


def rss_tree(pid: int) -> tuple[int, int, int]:
    """(daemon RSS, runners' RSS, daemon open fds)."""
    p = psutil.Process(pid)
    kids = sum(c.memory_info().rss for c in p.children(recursive=True) if c.is_running())
    return p.memory_info().rss, kids, p.num_fds()


def check_store(root: Path) -> list[str]:
    problems = []
    blobs = root / "blobs"
    for f in blobs.iterdir():
        if not f.name.startswith("sha256-") or "-partial" in f.name:
            problems.append(f"unexpected file in blobs: {f.name}")
            continue
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != f.name.removeprefix("sha256-"):
            problems.append(f"corrupt blob {f.name}")
    for m in (root / "manifests").rglob("*"):
        if m.is_file():
            if m.name.startswith("."):
                problems.append(f"temporary manifest file {m}")
                continue
            data = json.loads(m.read_bytes())
            for layer in [data.get("config") or {}] + list(data.get("layers") or []):
                d = str(layer.get("digest", ""))
                if d and not (blobs / d.replace(":", "-")).is_file():
                    problems.append(f"{m.name}: missing blob {d}")
    return problems


def slope_per_hour(samples: list[tuple[float, int]]) -> float:
    """MB per hour of a least-squares line through (seconds, bytes)."""
    if len(samples) < 3:
        return 0.0
    xs = [t for t, _ in samples]
    ys = [b / 1e6 for _, b in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600


async def soak(url: str, model: str, minutes: float, clients: int, pid: int) -> dict:
    deadline = time.monotonic() + minutes * 60
    table = actions(model)
    names = [n for _, n, _ in table]
    weights = [w for _, _, w in table]
    kind_of = {n: k for k, n, _ in table}
    latencies: dict[str, list[float]] = defaultdict(list)
    statuses: Counter[tuple[str, str]] = Counter()
    transport: Counter[str] = Counter()
    samples: list[tuple[float, int, int, int]] = []
    started = time.monotonic()

    async def client_loop(i: int) -> None:
        rng = random.Random(i)
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            while time.monotonic() < deadline:
                name = rng.choices(names, weights)[0]
                t0 = time.perf_counter()
                try:
                    status = await one(client, name, model)
                except httpx.HTTPError as exc:
                    transport[f"{name}: {type(exc).__name__}"] += 1
                    continue
                latencies[kind_of[name]].append(time.perf_counter() - t0)
                cls = "aborted" if status == 0 else f"{status // 100}xx" if status != 599 else "stream error"
                statuses[(kind_of[name], cls)] += 1

    async def sampler() -> None:
        while time.monotonic() < deadline:
            d, r, fds = rss_tree(pid)
            samples.append((time.monotonic() - started, d, r, fds))
            await asyncio.sleep(10)

    await asyncio.gather(sampler(), *(client_loop(i) for i in range(clients)))
    d, r, fds = rss_tree(pid)
    samples.append((time.monotonic() - started, d, r, fds))
    return {
        "latencies": latencies,
        "statuses": statuses,
        "transport": transport,
        "samples": samples,
        "seconds": time.monotonic() - started,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(res: dict, problems: list[str], args: argparse.Namespace, log_bytes: int) -> list[str]:
    samples = res["samples"]
    half = [s for s in samples if s[0] >= samples[-1][0] / 2]
    lines = [
        "## Soak: mixed valid, invalid and aborted requests (issue 17)",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/soak.py'] + sys.argv[1:])}`: {args.clients} clients for "
        f"{res['seconds'] / 60:.1f} minutes against one SmolLM2 model on this {os.cpu_count()}-core machine.",
        "",
        "| kind | answered | by class | p50 s | p99 s |",
        "|---|---|---|---|---|",
    ]
    for kind in ("valid", "invalid", "aborted"):
        classes = {c: n for (k, c), n in res["statuses"].items() if k == kind}
        lat = res["latencies"].get(kind, [])
        lines.append(
            f"| {kind} | {sum(classes.values())} | "
            f"{', '.join(f'{c} {n}' for c, n in sorted(classes.items()))} | {pct(lat, 0.5):.2f} | "
            f"{pct(lat, 0.99):.2f} |"
        )
    transport = sum(res["transport"].values())
    lines += [
        "",
        f"- transport errors (connection refused/reset, timeouts other than the deliberate ones): "
        f"{transport}"
        + (f" ({', '.join(f'{k} {v}' for k, v in res['transport'].most_common(5))})" if transport else ""),
        f"- daemon resident memory: {samples[0][1] / 1e6:.0f} MB at start, {samples[-1][1] / 1e6:.0f} MB at "
        f"end, trend over the second half {slope_per_hour([(t, d) for t, d, _, _ in half]):+.1f} MB/hour",
        f"- runners' resident memory: {samples[0][2] / 1e6:.0f} MB at start, {samples[-1][2] / 1e6:.0f} MB at "
        f"end, trend over the second half {slope_per_hour([(t, r) for t, _, r, _ in half]):+.1f} MB/hour",
        f"- daemon open file descriptors: {samples[0][3]} at start, {max(s[3] for s in samples)} at most, "
        f"{samples[-1][3]} at end",
        f"- daemon log: {log_bytes / 1e6:.1f} MB",
        f"- store check after the soak: {'no lost or corrupted files' if not problems else '; '.join(problems)}",
        "",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    gguf = smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update({"CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_MODELS": f"{tmp}/models", "PYTHONPATH": str(REPO)})
        log_path = Path(tmp) / "daemon.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, stdout=log, stderr=log)
            try:
                for _ in range(300):
                    try:
                        if httpx.get(url + "/api/version", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        time.sleep(0.1)
                digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
                with gguf.open("rb") as f:
                    httpx.post(f"{url}/api/blobs/{digest}", content=f, timeout=120).raise_for_status()
                httpx.post(
                    url + "/api/create",
                    json={"model": "soak", "files": {gguf.name: digest}, "stream": False},
                    timeout=120,
                ).raise_for_status()
                httpx.post(
                    url + "/api/generate", json={"model": "soak", "options": {"num_ctx": 1024}}, timeout=120
                ).raise_for_status()
                res = asyncio.run(soak(url, "soak", args.minutes, args.clients, proc.pid))
                alive = proc.poll() is None
            finally:
                proc.terminate()
                proc.wait(30)
        problems = check_store(Path(tmp) / "models")
        if not alive:
            problems.append("the daemon died during the soak")
        lines = report(res, problems, args, log_path.stat().st_size)
    print("\n".join(lines))
    if args.write:
        sys.path.insert(0, str(REPO / "bench"))
        from batching import write_section

        write_section(args.write, lines, lines[0])


if __name__ == "__main__":
    main()
