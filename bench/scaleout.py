"""Scale-out (issue 30): aggregate tok/s of one corral daemon against three replicas behind HAProxy, on this machine.

Usage: .venv/bin/python bench/scaleout.py [--seconds 20] [--streams 6] [--tokens 32] [--write docs/benchmarks.md]

Model: SmolLM2-135M-Instruct (scripts/fetch_smollm2.py), created in each daemon's own store from the GGUF. Each
configuration starts its daemons afresh (and HAProxy with packaging/haproxy/haproxy_cfg.py's rules on loopback
ports), warms each daemon with one request, then ``--streams`` client threads send greedy ``/api/chat`` requests
(``--tokens`` tokens, short prompts, each thread its own X-Corral-Session, so the balancer spreads the threads
over the replicas) for ``--seconds``. Aggregate tok/s = generated tokens of all completed requests / wall time.

Configurations:

* ``one daemon``: one ``corral serve``, the clients talk to it directly; llama.cpp's threads as corral chooses
  (one per physical core);
* ``one daemon, num_thread 1``: the same with ``PARAMETER num_thread 1``, to tell the threads' effect from the
  replicas';
* ``3 replicas``: three daemons behind HAProxy, threads as corral chooses (each replica as many as the machine
  has cores: on a small machine they compete for them);
* ``3 replicas, num_thread 1``: the same with ``PARAMETER num_thread 1`` (what replicas sharing one small host
  should set: a core each, more or less).

On 2 cores the three replicas cannot be faster than one daemon, which already batches every stream into one
``llama_decode`` per step: the point of replicas is more machines, a restart without failures and a replica's
failure costing nothing (tests/scaleout/test_haproxy.py), not speed on one host.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import free_port
from tests.scaleout.cluster import Replica, start_balancer, stop_all

MODEL = Path(os.environ.get("CORRAL_TEST_CACHE", Path.home() / ".cache" / "corral-test")) / (
    "SmolLM2-135M-Instruct.gguf"
)
SECTION = "## Scale-out: one daemon against three replicas behind HAProxy (issue 30)"


def create(url: str, gguf: Path, num_thread: int | None) -> None:
    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=url, timeout=300) as h:
        if h.head(f"/api/blobs/{digest}").status_code != 200:
            assert h.post(f"/api/blobs/{digest}", content=data).status_code == 201
        params: dict[str, object] = {"temperature": 0, "num_ctx": 2048}
        if num_thread:
            params["num_thread"] = num_thread
        body = {"model": "smol", "files": {"m.gguf": digest}, "parameters": params, "stream": False}
        r = h.post("/api/create", json=body)
        assert r.status_code == 200, r.text


def chat(client: httpx.Client, url: str, session: str, n: int, tokens: int) -> int:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": f"Write a short note number {n} about the sea."}],
        "stream": False,
        "options": {"num_predict": tokens, "repeat_penalty": 1.0},
    }
    r = client.post(url + "/api/chat", json=body, headers={"X-Corral-Session": session}, timeout=300)
    r.raise_for_status()
    return int(r.json()["eval_count"])


def measure(url: str, streams: int, seconds: float, tokens: int) -> tuple[float, int, int]:
    """(tok/s, requests completed, failures) with ``streams`` client threads for ``seconds``."""
    stop = threading.Event()
    lock = threading.Lock()
    totals = {"tokens": 0, "requests": 0, "failures": 0}

    def client(i: int) -> None:
        with httpx.Client() as c:
            n = 0
            while not stop.is_set():
                try:
                    got = chat(c, url, f"bench-{i}", n, tokens)
                except httpx.HTTPError:
                    with lock:
                        totals["failures"] += 1
                    continue
                n += 1
                with lock:
                    totals["tokens"] += got
                    totals["requests"] += 1

    began = time.monotonic()
    with cf.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(client, i) for i in range(streams)]
        time.sleep(seconds)
        stop.set()
        for f in futures:
            f.result()
    elapsed = time.monotonic() - began
    return totals["tokens"] / elapsed, totals["requests"], totals["failures"]


def run_config(tmp: Path, count: int, num_thread: int | None, args: argparse.Namespace) -> tuple[float, int, int]:
    replicas = [
        Replica(f"b{i}", free_port(), tmp / f"models-{count}-{num_thread}-{i}", tmp / f"b{i}.log", {})
        for i in range(count)
    ]
    balancer = None
    try:
        for r in replicas:
            r.start(wait=False)
        for r in replicas:
            r.wait_up()
            create(r.url, MODEL, num_thread)
            with httpx.Client() as c:
                chat(c, r.url, "warm", 0, 4)
        url = replicas[0].url
        if count > 1:
            balancer = start_balancer(tmp, replicas, log="")
            for r in replicas:
                balancer.wait_state(r.name, "UP")
            url = balancer.url
        return measure(url, args.streams, args.seconds, args.tokens)
    finally:
        stop_all(replicas)
        if balancer is not None:
            balancer.stop()


def render(rows: list[tuple[str, float, int, int]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    """The markdown section. Each three-replica row is compared with the one-daemon row of the same threads."""
    one = {name.endswith("num_thread 1"): tps for name, tps, _, _ in rows if name.startswith("one daemon")}
    lines = [
        SECTION,
        "",
        f"Command: `.venv/bin/python bench/scaleout.py --seconds {args.seconds:g} --streams {args.streams} "
        f"--tokens {args.tokens}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} before and {load[1]:.1f} after). SmolLM2-135M-Instruct, greedy `/api/chat`, "
        f"{args.streams} client threads, each its own `X-Corral-Session`.",
        "",
        "| configuration | aggregate tok/s | vs one daemon, same threads | requests | failed |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, tps, done, failed in rows:
        base = one.get(name.endswith("num_thread 1")) or tps
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {done} | {failed} |")
    busy = load[0] > 2 * (os.cpu_count() or 1)
    lines += [
        "",
        "Replicas on one 2-core host add no speed (expected: one daemon already batches every stream into one "
        "`llama_decode` a step, and three replicas split the same cores). "
        + (
            "This run shared the machine with other sessions' work (the load average above): llama.cpp's default "
            "threads (one per core) spin while they wait for each other, and on a machine busier than its cores "
            "that costs several times over, in one daemon as in three; with `num_thread 1` the comparison is "
            "the one to read. "
            if busy
            else ""
        )
        + "Set `num_thread` to cores / replicas when replicas share a host. What replicas buy is more hosts, no "
        "failed request through a rolling restart or a replica killed mid-load (tests/scaleout/test_haproxy.py), "
        "and conversations kept on the replica that caches them.",
        "",
    ]
    return "\n".join(lines)


def write(path: Path, section: str) -> None:
    text = path.read_text()
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--write", type=Path, help="put the table in this markdown file (its own section)")
    args = parser.parse_args()
    if not MODEL.is_file():
        sys.exit(f"{MODEL} is missing: run scripts/fetch_smollm2.py")
    load_before = os.getloadavg()[0]
    rows: list[tuple[str, float, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="corral-scaleout-") as d:
        tmp = Path(d)
        for name, count, threads in (
            ("one daemon", 1, None),
            ("one daemon, num_thread 1", 1, 1),
            ("3 replicas behind HAProxy", 3, None),
            ("3 replicas behind HAProxy, num_thread 1", 3, 1),
        ):
            sub = tmp / f"c{len(rows)}"
            sub.mkdir()
            tps, done, failed = run_config(sub, count, threads, args)
            print(f"{name}: {tps:.1f} tok/s, {done} requests, {failed} failed", flush=True)
            rows.append((name, tps, done, failed))
    section = render(rows, args, (load_before, os.getloadavg()[0]))
    print(section)
    if args.write:
        write(args.write, section)


if __name__ == "__main__":
    main()
