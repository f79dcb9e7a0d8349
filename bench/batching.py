"""Many users at once: aggregate tokens/s and time to first token, corral against the servers that batch.

Usage: bench/setup_peers.sh && .venv/bin/python bench/batching.py [--tokens 64] [--streams 1,4,8,16] [--rounds 3]
       [--write docs/benchmarks.md]

Every server loads the same GGUF (SmolLM2-135M-Instruct, scripts/fetch_smollm2.py) on 127.0.0.1 with the same
num_ctx per sequence, parallel sequences and threads. The peers: llama.cpp's llama-server and llama-cpp-python's
batched example server (both from the llama-cpp-python sdist that bench/setup_peers.sh unpacks and builds), and
llama-cpp-python's stock server. All of them are up at once (the script checks that idle they use no CPU) and
take turns: at each load level every server runs in an order that rotates between rounds, so the slow drifts of a
shared 2-core machine hit every server alike. The tables show medians over the rounds.

Each stream asks for ``--tokens`` tokens at temperature 0 through the streaming API; aggregate tokens/s is the sum
of the tokens generated over the wall time from the first request to the last token. Time to first token is taken
per stream (p50, p95). The second-turn check sends a chat with a ~1,000-token history, then the same history plus
one more turn, and compares the two times to first token.

The peers need llama-cpp-python's server extras (``pip install sse-starlette starlette-context pydantic-settings``,
bench-only; corral does not depend on them); bench/setup_peers.sh installs them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.models import smollm2_path  # noqa: E402

# The peers come from llama-cpp-python's sdist (the same version corral pins), unpacked here by
# bench/setup_peers.sh: its batched example server (examples/server/server.py) and llama.cpp's llama-server,
# built from the llama.cpp sources vendored in it.
SDIST = Path(os.environ.get("CORRAL_BENCH_SDIST", Path.home() / ".cache" / "corral-bench" / "llama_cpp_python-0.3.36"))

# What every server is asked to sample with: greedy by default; --sample sets Ollama's default truncation
# (temperature 0.8, top_k 40, top_p 0.9) and min_p 0 everywhere (llama-server's default is 0.05). No repeat penalty
# anywhere (Ollama's default is 1.1, the peers' 1.0 or 1.1).
SAMPLING: dict[str, float] = {"temperature": 0}
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0}

PROMPTS = [
    "Write a long story about a dragon who learns to paint.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about your summer holiday.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# One client for every request: a new httpx client per request costs ~20 ms of CPU (its TLS context), which on 2
# cores would be taken from whichever server is being measured. Each request still gets its own connection
# (llama-server closes a kept-alive connection after a few requests, which a pool would trip over).
CLIENT = httpx.Client(limits=httpx.Limits(max_connections=64), headers={"Connection": "close"}, timeout=600)


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:  # llama-server answers 503 while it loads
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


class Corral:
    name = "corral"

    def __init__(self, gguf: Path, ctx: int, work: Path, slots: int, checkout: Path = REPO) -> None:
        """A daemon of this checkout (or ``checkout``, another copy of corral run with this venv) serving ``gguf``
        as the model "bench", loaded."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update(
            {
                "CORRAL_HOST": f"127.0.0.1:{self.port}",
                "CORRAL_MODELS": str(work / "models"),
                "CORRAL_KV_DISK_DIR": str(work / "kv"),  # its own prompt cache on disk, never the user's
                "PYTHONPATH": str(checkout),
                "CORRAL_NUM_PARALLEL": str(slots),
            }
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve"],
            env=env,
            cwd=checkout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_up(self.url + "/api/version", self.proc)
        digest = "sha256:" + __import__("hashlib").sha256(gguf.read_bytes()).hexdigest()
        with gguf.open("rb") as f:
            httpx.post(f"{self.url}/api/blobs/{digest}", content=f, timeout=120).raise_for_status()
        httpx.post(
            self.url + "/api/create",
            json={"model": "bench", "files": {gguf.name: digest}, "stream": False, "parameters": {"num_ctx": ctx}},
            timeout=120,
        ).raise_for_status()
        httpx.post(self.url + "/api/generate", json={"model": "bench"}, timeout=120).raise_for_status()

    def stream(self, prompt: str, tokens: int) -> tuple[float, int]:
        # raw: the same prompt tokens the peers' /v1/completions evaluate (no chat template); repeat_penalty 1.0:
        # the peers' default (Ollama's is 1.1)
        body = {
            "model": "bench",
            "prompt": prompt,
            "raw": True,
            "options": {**SAMPLING, "num_predict": tokens, "repeat_penalty": 1.0},
        }
        start, first, count = time.perf_counter(), 0.0, 0
        with CLIENT.stream("POST", self.url + "/api/generate", json=body) as r:
            for line in r.iter_lines():
                obj = json.loads(line)
                if obj.get("response") and not first:
                    first = time.perf_counter() - start
                if obj.get("done"):
                    count = int(obj.get("eval_count") or 0)
        return first, count

    def chat_ttft(self, messages: list[dict[str, str]]) -> tuple[float, str]:
        body = {"model": "bench", "messages": messages, "options": {"temperature": 0, "num_predict": 16}}
        start, first, text = time.perf_counter(), 0.0, ""
        with CLIENT.stream("POST", self.url + "/api/chat", json=body) as r:
            for line in r.iter_lines():
                piece = json.loads(line).get("message", {}).get("content", "")
                if piece and not first:
                    first = time.perf_counter() - start
                text += piece
        return first, text

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class OpenAIPeer(Corral):
    """A peer spoken to through its OpenAI-style streaming API (``/v1/completions``, ``/v1/chat/completions``)."""

    name = "peer"

    def start(self, argv: list[str], ready_path: str = "/v1/models") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_up(self.url + ready_path, self.proc)

    def _sse(self, path: str, body: dict[str, Any], key: str) -> tuple[float, int, str]:
        start, first, chunks, text, usage = time.perf_counter(), 0.0, 0, "", 0
        body = {**body, "model": "bench", "stream": True, "stream_options": {"include_usage": True}}
        with CLIENT.stream("POST", self.url + path, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = int(obj["usage"].get("completion_tokens") or 0)
                for choice in obj.get("choices") or []:
                    piece = choice.get("text") if key == "text" else (choice.get("delta") or {}).get("content")
                    if piece:
                        chunks += 1
                        text += piece
                        if not first:
                            first = time.perf_counter() - start
        return first, usage or chunks, text

    def stream(self, prompt: str, tokens: int) -> tuple[float, int]:
        first, count, _ = self._sse(
            "/v1/completions", {"prompt": prompt, "max_tokens": tokens, **SAMPLING, "repeat_penalty": 1.0}, "text"
        )
        return first, count

    def chat_ttft(self, messages: list[dict[str, str]]) -> tuple[float, str]:
        first, _, text = self._sse(
            "/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0}, "delta"
        )
        return first, text


class LlamaCppPythonServer(OpenAIPeer):
    name = "llama-cpp-python server"

    def __init__(self, gguf: Path, ctx: int, work: Path, slots: int) -> None:
        self.start(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--n_ctx",
                str(ctx),
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--model_alias",
                "bench",
                "--n_threads",
                str(os.cpu_count()),
                "--interrupt_requests",
                "false",
            ]
        )  # its default drops a running stream when another comes


class BatchedExampleServer(OpenAIPeer):
    name = "llama-cpp-python batched example"

    def __init__(self, gguf: Path, ctx: int, work: Path, slots: int) -> None:
        script = SDIST / "examples" / "server" / "server.py"
        config = work / "example.json"
        port = free_port()
        config.write_text(
            json.dumps(
                {
                    "server": {"host": "127.0.0.1", "port": port},
                    "model": {
                        "alias": "bench",
                        "path": str(gguf),
                        "n_ctx": ctx * slots,
                        "n_seq_max": slots,
                        "n_batch": 512,
                        "n_ubatch": 512,
                        "threads": os.cpu_count(),
                        "threads_batch": os.cpu_count(),
                    },
                }
            )
        )
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "-C", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_up(self.url + "/v1/models", self.proc)


LLAMA_SERVER = SDIST / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"


def llama_server_argv(gguf: Path, ctx: int, slots: int, *extra: str) -> list[str]:
    """llama-server on ``gguf`` with ``slots`` slots of ``ctx`` tokens, every core, alias ``bench``, on the port
    ``OpenAIPeer.start`` fills in, and ``extra`` flags (--lora, speculation...)."""
    return [
        str(LLAMA_SERVER),
        "-m",
        str(gguf),
        "-c",
        str(ctx * slots),
        "-np",
        str(slots),
        "-t",
        str(os.cpu_count()),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "-a",
        "bench",
        *extra,
    ]


class LlamaServer(OpenAIPeer):
    name = "llama.cpp llama-server"

    def __init__(self, gguf: Path, ctx: int, work: Path, slots: int) -> None:
        self.start(llama_server_argv(gguf, ctx, slots), "/health")


def check_idle(servers: list[Corral]) -> None:
    """Refuse to measure while an idle server burns CPU: it would slow whichever server is being measured."""
    procs = {}
    for server in servers:
        root = psutil.Process(server.proc.pid)
        procs[server.name] = [root, *root.children(recursive=True)]

    def cpu(ps: list[psutil.Process]) -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in ps)

    before = {name: cpu(ps) for name, ps in procs.items()}
    time.sleep(3)
    busy = {name: (cpu(ps) - before[name]) / 3 for name, ps in procs.items()}
    if any(v > 0.05 for v in busy.values()):
        sys.exit(f"servers busy while idle (CPU fraction): {busy}")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load_test(server: Corral, streams: int, tokens: int, *, keep: bool = False) -> dict[str, Any]:
    """``streams`` simultaneous greedy streamed completions of ``tokens`` tokens: aggregate tokens/s and the times
    to first token (ms; ``keep``: each of them too, and the wall time)."""
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (reader {i})" for i in range(streams)]
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as ex:
        results = list(ex.map(lambda p: server.stream(p, tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = [r[0] * 1000 for r in results]
    out: dict[str, Any] = {"tps": sum(r[1] for r in results) / wall, "p50": pct(ttfts, 0.5), "p95": pct(ttfts, 0.95)}
    if keep:
        out.update(ttfts=ttfts, wall=wall)
    return out


def second_turn(server: Corral, nonce: int, others: int) -> tuple[float, float, float]:
    """Times to first token of a chat's first turn (a ~1,000-token history), of its second turn, and of its third
    turn after ``others`` users (as many as the slots) each ran a chat of their own in the meantime."""
    # the nonce opens the history, so no server has the first turn cached from an earlier round
    history = [
        {
            "role": "system",
            "content": f"Session {nonce}. " + "You are a careful assistant who remembers everything. " * 12,
        }
    ]
    for i in range(24):
        history.append({"role": "user", "content": f"Note number {i}: the {i}th box holds {i * 7} red marbles."})
        history.append({"role": "assistant", "content": f"Noted: box {i} has {i * 7} red marbles."})
    history.append({"role": "user", "content": "How many marbles are in box 3?"})
    first, reply = server.chat_ttft(history)
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in box 5?"}]
    second, reply = server.chat_ttft(history)
    chats = [
        [{"role": "user", "content": f"Visitor {nonce}-{k}: " + "Tell me about the old harbour town. " * 25}]
        for k in range(others)
    ]
    with cf.ThreadPoolExecutor(max(1, others)) as ex:
        list(ex.map(server.chat_ttft, chats))
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And in box 7?"}]
    third, _ = server.chat_ttft(history)
    return first * 1000, second * 1000, third * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=4, help="parallel sequences for every server")
    ap.add_argument("--peers", default="llama-server,batched-example,llama-cpp-python-server")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every server; the tables show medians")
    ap.add_argument("--sample", action="store_true", help="sample with Ollama's default options instead of greedy")
    ap.add_argument("--skip-turns", action="store_true", help="leave out the multi-turn chat measure")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    if args.sample:
        SAMPLING.clear()
        SAMPLING.update(SAMPLED)
    gguf = smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    levels = [int(x) for x in args.streams.split(",")]
    chosen = {
        "llama-server": LlamaServer,
        "batched-example": BatchedExampleServer,
        "llama-cpp-python-server": LlamaCppPythonServer,
    }
    servers = [Corral, *(chosen[p] for p in args.peers.split(",") if p)]
    runs: dict[str, dict[int, list[dict[str, float]]]] = {cls.name: {n: [] for n in levels} for cls in servers}
    turn_runs: dict[str, list[tuple[float, float, float]]] = {cls.name: [] for cls in servers}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        up: list[Corral] = []
        for cls in servers:
            work = Path(tmp) / cls.__name__
            work.mkdir()
            server = cls(gguf, args.ctx, work, args.slots)
            stack.callback(server.close)
            server.stream(PROMPTS[0], 8)  # warm up
            up.append(server)
        check_idle(up)
        # Every measurement is taken with all the servers up (idle ones use no CPU), the servers taking turns at
        # each load level in an order that rotates: the machine's slow drifts then hit every server alike.
        for r in range(args.rounds):
            for n in levels:
                for server in up[r % len(up) :] + up[: r % len(up)]:
                    runs[server.name][n].append(load_test(server, n, args.tokens))
            for server in up:
                turn_runs[server.name].append(
                    (0.0, 0.0, 0.0) if args.skip_turns else second_turn(server, r, args.slots)
                )
            for server in up:
                print(
                    f"round {r + 1}",
                    server.name,
                    {n: round(runs[server.name][n][-1]["tps"], 1) for n in levels},
                    [round(x) for x in turn_runs[server.name][-1]],
                    flush=True,
                )
    table = {
        name: {n: {k: statistics.median(x[k] for x in per[n]) for k in ("tps", "p50", "p95")} for n in levels}
        for name, per in runs.items()
    }
    turns = {
        name: (
            statistics.median(x[0] for x in t),
            statistics.median(x[1] for x in t),
            statistics.median(x[2] for x in t),
        )
        for name, t in turn_runs.items()
    }
    lines = render(table, turns, levels, args)
    print("\n".join(lines))
    if args.write:
        write_section(args.write, lines, heading(args))


def heading(args: argparse.Namespace) -> str:
    if args.sample:
        return "## Many users at once, sampling with Ollama's default options (issue 7)"
    return "## Many users at once: continuous batching (issue 7)"


def render(
    table: dict[str, dict[int, dict[str, float]]],
    turns: dict[str, tuple[float, float, float]],
    levels: list[int],
    args: argparse.Namespace,
) -> list[str]:
    peers = [name for name in table if name != "corral"]
    c = table["corral"]
    flags = (" --sample" if args.sample else "") + (" --skip-turns" if args.skip_turns else "")
    sampling = (
        "sampled with temperature 0.8, top_k 40, top_p 0.9, min_p 0 (Ollama's default truncation; "
        "llama-server's min_p default of 0.05 turned off)"
        if args.sample
        else "at temperature 0"
    )
    lines = [
        heading(args),
        "",
        f"Command: `bench/setup_peers.sh && .venv/bin/python bench/batching.py --tokens {args.tokens} "
        f"--streams {args.streams} --ctx {args.ctx} --slots {args.slots} --rounds {args.rounds}{flags} "
        "--write docs/benchmarks.md`",
        "",
        f"SmolLM2-135M-Instruct Q4_1, CPU only, 2 cores, num_ctx {args.ctx} per sequence, {args.slots} parallel "
        f"sequences for every server that batches, {args.tokens} tokens per stream {sampling}, no repeat penalty, "
        "streaming, the same raw prompt for every server (corral: `/api/generate` with `raw`; "
        "the peers: `/v1/completions`). "
        "Peers: llama.cpp's `llama-server` built from the llama.cpp sources vendored in the llama-cpp-python 0.3.36 "
        "sdist (`-np` slots, `-c` = num_ctx x slots); that sdist's batched example server "
        "(`examples/server/server.py`, `n_seq_max` slots); llama-cpp-python's stock server (`python -m "
        "llama_cpp.server --interrupt_requests false`: one request at a time; by default a new request cuts off the "
        f"one streaming). All servers are up at once (idle, they use no CPU: checked) and take turns at each load "
        f"level, in an order that rotates, {args.rounds} rounds; each number is the median over the rounds. "
        "Aggregate generated tokens/s; ratio = corral / best peer.",
        "",
        "| streams | corral | " + " | ".join(peers) + " | corral / best peer |",
        "|---|---|" + "---|" * len(peers) + "---|",
    ]
    for n in levels:
        best = max(table[p][n]["tps"] for p in peers) if peers else 0.0
        cells = " | ".join(f"{table[p][n]['tps']:.1f}" for p in peers)
        ratio = f"{c[n]['tps'] / best:.2f}" if best else "-"
        lines.append(f"| {n} | {c[n]['tps']:.1f} | {cells} | {ratio} |")
    lines += [
        "",
        "Reading it: on this shared 2-core machine one server's rounds spread by 10-20%, so a ratio within "
        "about 0.05 of 1.0 is a tie. On the CPU all the batching servers run the same llama.cpp kernels, and "
        "corral's runner spends about 95% of each step inside `llama_decode` (py-spy, four streams), so "
        "corral matches llama-server rather than beating it by much; it is well ahead of both "
        "llama-cpp-python servers. What corral pays that llama-server does not is the hop through the "
        "daemon: ~0.25 ms of daemon CPU per streamed token, taken from the two cores the step runs on.",
    ]
    if args.sample:
        lines += [
            "",
            "Sampling: corral draws every row together with numpy, top-k without a pass over the whole "
            "vocabulary (a quarter of what one argpartition per row cost: see the sampling section). A stream that "
            "samples the end of text at once yields no token, so a level can show 0 for one server.",
        ]
    lines += [
        "",
        "Time to first token, p50 / p95 (ms):",
        "",
        "| streams | corral | " + " | ".join(peers) + " |",
        "|---|---|" + "---|" * len(peers),
    ]
    for n in levels:
        cells = " | ".join(f"{table[p][n]['p50']:.0f} / {table[p][n]['p95']:.0f}" for p in peers)
        lines.append(f"| {n} | {c[n]['p50']:.0f} / {c[n]['p95']:.0f} | {cells} |")
    if args.skip_turns:
        return lines + [""]
    lines += [
        "",
        "A chat with a ~1,000-token history (time to first token, ms): its first turn, its second turn, "
        f"and its third turn after {args.slots} other users (as many as the slots) each had a chat of their "
        "own in the meantime, which takes the chat's slot:",
        "",
        "| server | first turn | second turn | second / first | third turn, after others | third / first |",
        "|---|---|---|---|---|---|",
    ]
    for name, (a, b, c) in turns.items():
        lines.append(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.2f} | {c:.0f} | {c / a:.2f} |")
    return lines + [""]


def write_section(path: Path, lines: list[str], head: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + text[nxt + 1 :] if nxt >= 0 else text[:start]
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
