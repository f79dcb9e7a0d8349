"""Speed against llama-server (issue 19): where corral's time goes, and an interleaved A/B of the two.

Usage:
  .venv/bin/python bench/speed.py profile [--streams 1,16] [--tokens 96] [--seconds 12] [--top N]
  .venv/bin/python bench/speed.py passes
  .venv/bin/python bench/speed.py cpu [--streams 1,16] [--tokens 96] [--seconds 12] [--rounds 2] [CONFIG ...]
  bench/setup_peers.sh && .venv/bin/python bench/speed.py ab [--streams 1,4,8,16] [--tokens 96] [--rounds 5]
      [--bursts 3] [--api generate|completions|completions-raw|chat] [--prompt bench|story]
      [CONFIG ... (default: corral llama-server)]

``profile`` starts corral (``CORRAL_NUM_PARALLEL=16``), and at each load level keeps that many greedy streamed
completions going for ``--seconds`` while py-spy samples the runner child and the daemon (non-blocking, 200 Hz,
py-spy installed in the venv: ``.venv/bin/pip install py-spy``). It prints each process's CPU time per generated
token (psutil) and what py-spy saw, grouped: ``llama_decode``, sampling, detokenization, per-step Python, the
runner's frames to the daemon (JSON encoding, pipe writes), the daemon's reading of them, its HTTP streaming.

``cpu`` starts each corral CONFIG (as ``ab`` takes them, default ``corral``) in turn and, at each load level, keeps
that many greedy streamed completions going for ``--seconds``: the CPU time of the daemon, of the runner (llama.cpp's
threads included) and of the client (this process's load threads) per generated token, and the tokens/s,
``--rounds`` times (no profiler attached).

``passes`` times one ``llama_decode`` in-process for several batch layouts over 16 KV streams (how llama.cpp's
passes over consecutive sequence ids make scattered slots cost more).

``ab`` starts corral (``CORRAL_NUM_PARALLEL=16``) and llama-server (``-np 16``) at once (idle servers use no CPU)
and, ``--rounds`` times, runs every load level on each in an order that rotates (a level: ``--bursts`` bursts of as
many simultaneous requests as streams, at least 16 requests in all, one burst after the other, pooled); it reports
the medians of the per-round ratios to the last configuration (llama-server) of aggregate tokens/s and of time to
first token p50 and p95. A CONFIG is ``llama-server`` or ``corral`` with environment settings
(``corral:NAME=VALUE,NAME=VALUE``), as in bench/ab.py; ``corral@DIR`` runs the corral checked out in DIR (``git
worktree add /tmp/before ac8d809``) instead of this one. Both servers and the load come from bench/batching.py
(SmolLM2-135M-Instruct Q4_1, greedy, streamed, no repeat penalty).

``--api`` picks the APIs the servers are spoken to through, comma-separated (each configuration is then measured
through each, in the same rounds, and compared with the last configuration through the same API; TTFT: the first
line or SSE event with text in it, at the client):

* ``generate`` (the default): corral's ``/api/generate`` with ``raw``, llama-server's ``/v1/completions``: the
  same prompt tokens on both;
* ``completions``: ``/v1/completions`` on both. corral applies the model's chat template there, as Ollama does
  (llama-server does not), so it evaluates the template's tokens as well (for SmolLM2 and a new prompt of a few
  words, about twice as many);
* ``completions-raw``: ``/v1/completions`` on both, with corral's ``raw`` (no template): the same prompt tokens
  on both, so it measures what the OpenAI layer itself costs;
* ``chat``: ``/v1/chat/completions`` on both, one user message (both apply the model's chat template).

``--prompt`` picks the prompts: ``bench`` (bench/batching.py's, stream i: prompt i mod 4 plus "(reader i)"), or
``story`` (issue 25's: "Story number i: Once upon a time", i the stream's index in its burst).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching

SLOTS = 16
CTX = 2048
PY_SPY = Path(sys.executable).parent / "py-spy"


# -- profile -------------------------------------------------------------------------------------------------------
def _line(frame: str) -> str:
    """The source text of a py-spy frame ``func (path:line)``, for the frames of this repository."""
    try:
        where = frame.rsplit("(", 1)[1].rstrip(")")
        path, _, lineno = where.rpartition(":")
        full = batching.REPO / path
        if not full.is_file():
            return ""
        return full.read_text().splitlines()[int(lineno) - 1].strip()
    except (IndexError, ValueError, OSError):
        return ""


def runner_category(stack: list[str]) -> str:
    text = ";".join(stack)
    leaf = stack[-1]
    if "_loop (daemon/llama/engine.py" not in text:
        if "read_frame" in text or "Runner.handle" in text:
            return "runner: request intake (read frame, tokenize, submit)"
        return "runner: other threads"
    if "_flush" in text or "send_many" in text:
        if "encode" in text or "json" in text:
            return "runner: JSON encoding of frames"
        return "runner: pipe write to the daemon"
    if "llama_decode" in _line(leaf):
        return "llama_decode"
    if "sampling.py" in text or "_logits" in text or "sample_rows" in _line(leaf):
        return "sampling (numpy over the logits)"
    if "_token_bytes" in text or "codecs" in text or "split_stop" in text or "decoder.decode" in _line(leaf):
        return "detokenization (token to piece, UTF-8, stop strings)"
    if "_admit" in text or "_reap_cancelled" in text or "_finish" in text or "_release" in text:
        return "per-step Python: admission, finishing"
    return "per-step Python: batch building, bookkeeping"


def daemon_category(stack: list[str]) -> str:
    """By the innermost frame that says what the work is (every stack starts in uvicorn's event loop)."""
    text = ";".join(stack)
    leaf = stack[-1]
    if "_read_frames" in text:
        return "daemon: frames from the runner (read, JSON decode)"
    if "json/" in leaf or "encoder.py" in leaf:
        return "daemon: JSON encoding/decoding"
    if "selector_events.py" in leaf or "h11/" in leaf or "h11_impl" in leaf:
        return "daemon: HTTP (h11, socket writes)"
    inner = [f for f in stack if "(daemon/" in f or "(registry/" in f or "(modelfile/" in f]
    if inner and "server.py" not in inner[-1]:
        return "daemon: request handling (routes, scheduler, store, prompt, streaming)"
    if "starlette/" in text or "fastapi/" in text:
        return "daemon: starlette/fastapi"
    if "asyncio/" in leaf or "selectors.py" in leaf:
        return "daemon: asyncio event loop"
    return "daemon: other"


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    out: list[tuple[list[str], int]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def intake(server: batching.Corral, daemon: psutil.Process, runner: psutil.Process) -> None:
    """CPU time of the daemon and the runner per request, for 40 streamed requests of one token one after another
    (what a request costs before its first token), and per streamed token (one request of 96 tokens, five times)."""
    body: dict[str, object] = {
        "model": "bench",
        "prompt": batching.PROMPTS[1] + " (reader 0)",
        "raw": True,
        "options": {"temperature": 0, "num_predict": 1, "repeat_penalty": 1.0},
    }

    def run(count: int) -> tuple[float, float, float]:
        c0, r0, t0 = cpu_seconds(daemon), cpu_seconds(runner), time.perf_counter()
        for _ in range(count):
            with batching.CLIENT.stream("POST", server.url + "/api/generate", json=body) as r:
                for _ in r.iter_lines():
                    pass
        return (
            1000 * (time.perf_counter() - t0) / count,
            1000 * (cpu_seconds(daemon) - c0) / count,
            1000 * (cpu_seconds(runner) - r0) / count,
        )

    run(3)
    wall, d1, r1 = run(40)
    print(f"one-token requests: {wall:.1f} ms each, CPU per request: daemon {d1:.2f} ms, runner {r1:.2f} ms")
    body["options"] = {"temperature": 0, "num_predict": 96, "repeat_penalty": 1.0}
    _, d96, _ = run(5)
    print(f"96-token requests: daemon CPU per streamed token {(d96 - d1) / 95:.3f} ms")


def profile(args: argparse.Namespace) -> None:
    gguf = batching.smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    if not PY_SPY.exists():
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = batching.Corral(gguf, CTX, work, SLOTS)
        try:
            server.stream(batching.PROMPTS[0], 8)
            daemon = psutil.Process(server.proc.pid)
            runner = next(p for p in daemon.children(recursive=True) if "daemon.llama.runner" in " ".join(p.cmdline()))
            intake(server, daemon, runner)
            for n in [int(x) for x in args.streams.split(",")]:
                batching.load_test(server, n, args.tokens)  # warm this level up
                outs = {name: work / f"{name}-{n}.txt" for name in ("runner", "daemon")}
                spies = [
                    subprocess.Popen(
                        [
                            str(PY_SPY),
                            "record",
                            "-p",
                            str(p.pid),
                            "-r",
                            "200",
                            "--nonblocking",
                            "-f",
                            "raw",
                            "-o",
                            str(outs[name]),
                            "-d",
                            str(args.seconds),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for name, p in (("runner", runner), ("daemon", daemon))
                ]
                time.sleep(0.5)  # py-spy attaches
                cpu0 = (cpu_seconds(runner), cpu_seconds(daemon))
                start, runs = time.perf_counter(), []
                while time.perf_counter() - start < args.seconds - 1.5:
                    runs.append(batching.load_test(server, n, args.tokens))
                wall = time.perf_counter() - start
                cpu1 = (cpu_seconds(runner), cpu_seconds(daemon))
                for spy in spies:
                    spy.wait()
                generated = n * args.tokens * len(runs)  # greedy streams of these prompts never stop early
                print(
                    f"\n== {n} streams: {len(runs)} runs, {generated} tokens in {wall:.1f} s "
                    f"({generated / wall:.1f} tok/s incl. gaps); median tok/s "
                    f"{statistics.median(r['tps'] for r in runs):.1f}, TTFT p50 "
                    f"{statistics.median(r['p50'] for r in runs):.0f} ms"
                )
                print(
                    f"   CPU per generated token: runner {1000 * (cpu1[0] - cpu0[0]) / generated:.2f} ms "
                    f"(llama.cpp's threads included), daemon {1000 * (cpu1[1] - cpu0[1]) / generated:.2f} ms"
                )
                for name, categorise in (("runner", runner_category), ("daemon", daemon_category)):
                    samples = read_raw(outs[name])
                    counts: Counter[str] = Counter()
                    for stack, c in samples:
                        counts[categorise(stack)] += c
                    total = sum(counts.values()) or 1
                    print(f"   {name}: {total} samples")
                    for cat, c in counts.most_common():
                        print(f"     {100 * c / total:5.1f}%  {cat}")
                    if args.top:
                        leaves: Counter[str] = Counter()
                        for stack, c in samples:
                            leaves[stack[-1]] += c
                        for leaf, c in leaves.most_common(args.top):
                            print(f"        {100 * c / total:5.1f}%  {leaf}  {_line(leaf)[:60]}")
        finally:
            server.close()


# -- A/B -------------------------------------------------------------------------------------------------------------
def start(config: str, gguf: Path, work: Path) -> batching.Corral:
    """``llama-server`` (``-np 16``), or ``corral`` with environment settings for its daemon and runner
    (``corral:NAME=VALUE,NAME=VALUE``; ``CORRAL_NUM_PARALLEL`` is 16 unless given)."""
    if config == "llama-server":
        return batching.LlamaServer(gguf, CTX, work, SLOTS)
    name, _, settings = config.partition(":")
    name, _, checkout = name.partition("@")
    if name != "corral":
        sys.exit(f"unknown configuration {config!r}: use corral[@CHECKOUT][:NAME=VALUE,...] or llama-server")
    saved, repo = dict(os.environ), batching.REPO
    try:
        for pair in filter(None, settings.split(",")):
            key, _, value = pair.partition("=")
            os.environ[key] = value
        if checkout:  # another copy of corral (an older commit, say), run with this venv
            batching.REPO = Path(checkout).resolve()
        return batching.Corral(gguf, CTX, work, int(os.environ.get("CORRAL_NUM_PARALLEL", str(SLOTS))))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        batching.REPO = repo


def ab(args: argparse.Namespace) -> None:
    gguf = batching.smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    levels = [int(x) for x in args.streams.split(",")]
    names = list(args.configs)
    apis = args.api.split(",")
    if unknown := [a for a in apis if a not in APIS]:
        sys.exit(f"unknown --api {', '.join(unknown)}: use {', '.join(APIS)} (several, comma-separated)")

    def key(name: str, api: str) -> str:
        return name if len(apis) == 1 else f"{name} [{api}]"

    # one group of rows per API, its reference (the last configuration, llama-server) last
    groups = [[key(name, api) for name in names] for api in apis]
    runs: dict[str, dict[int, list[dict[str, float]]]] = {k: {n: [] for n in levels} for g in groups for k in g}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        up = []
        for i, name in enumerate(names):
            work = Path(tmp) / str(i)
            work.mkdir()
            server = start(name, gguf, work)
            stack.callback(server.close)
            server.stream(batching.PROMPTS[0], 8)  # warm up
            up.append((name, server))
        batching.check_idle([s for _, s in up])
        for r in range(args.rounds):
            for n in levels:
                for api in apis:
                    k = (r + n) % len(up)  # the order rotates with the round and the level
                    for name, server in up[k:] + up[:k]:
                        runs[key(name, api)][n].append(
                            bursts(server, n, args.tokens, max(args.bursts, -(-16 // n)), api, args.prompt)
                        )
            keys = [k for g in groups for k in g]
            print(
                f"round {r + 1}: "
                + "  |  ".join(
                    f"{n}: "
                    + " ".join(f"{runs[c][n][-1]['tps']:.0f}" for c in keys)
                    + " tok/s, p50 "
                    + " ".join(f"{runs[c][n][-1]['p50']:.0f}" for c in keys)
                    + " ms"
                    for n in levels
                ),
                flush=True,
            )
    print("\n".join(render(runs, levels, args, groups)))


def bursts(
    server: batching.Corral, streams: int, tokens: int, count: int, api: str = "generate", prompt: str = "bench"
) -> dict[str, float]:
    """``count`` bursts of ``streams`` simultaneous requests one after another, pooled: aggregate tokens/s over the
    bursts' time, TTFT percentiles over all ``count * streams`` requests (at one stream a single request's first
    token is too few to take a median of)."""
    tokens_done, wall, ttfts = 0.0, 0.0, []
    for _ in range(count):
        r = load(server, streams, tokens, api, prompt)
        tokens_done += r["tokens"]
        wall += r["wall"]
        ttfts += r["ttfts"]
    return {"tps": tokens_done / wall, "p50": batching.pct(ttfts, 0.5), "p95": batching.pct(ttfts, 0.95)}


APIS = ("generate", "completions", "completions-raw", "chat")


def prompts(kind: str, streams: int) -> list[str]:
    if kind == "story":
        return [f"Story number {i}: Once upon a time" for i in range(streams)]
    return [batching.PROMPTS[i % len(batching.PROMPTS)] + f" (reader {i})" for i in range(streams)]


def load(server: batching.Corral, streams: int, tokens: int, api: str, prompt: str) -> dict[str, Any]:
    """``streams`` simultaneous greedy streamed requests through ``api``: the tokens generated, the wall time from
    the first request to the last token, and each request's time to first token (ms)."""
    if api == "generate":  # bench/batching.py's own requests (corral: /api/generate raw; peers: /v1/completions)
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(streams) as ex:
            done = list(ex.map(lambda p: server.stream(p, tokens), prompts(prompt, streams)))
    else:
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(streams) as ex:
            done = list(ex.map(lambda p: openai_stream(server, api, p, tokens), prompts(prompt, streams)))
    wall = time.perf_counter() - start
    return {"tokens": sum(count for _, count in done), "wall": wall, "ttfts": [first * 1000 for first, _ in done]}


def openai_stream(server: batching.Corral, api: str, prompt: str, tokens: int) -> tuple[float, int]:
    """One streamed request through ``/v1/completions`` or ``/v1/chat/completions``: seconds to the first SSE event
    with text in it, and the completion tokens (``usage``; the text events where a server leaves usage out)."""
    chat = api == "chat"
    body: dict[str, Any] = {
        "model": "bench",
        "max_tokens": tokens,
        **batching.SAMPLING,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if isinstance(server, batching.OpenAIPeer):
        body["repeat_penalty"] = 1.0  # llama-server's own field
    else:
        body["options"] = {"repeat_penalty": 1.0}  # corral: any Ollama option (its default penalty is 1.1)
        if api == "completions-raw":
            body["raw"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start, first, events, usage = time.perf_counter(), 0.0, 0, 0
    with batching.CLIENT.stream("POST", server.url + path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = int(obj["usage"].get("completion_tokens") or 0)
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    events += 1
                    if not first:
                        first = time.perf_counter() - start
    return first, usage or events


def render(
    runs: dict[str, dict[int, list[dict[str, float]]]],
    levels: list[int],
    args: argparse.Namespace,
    groups: list[list[str]] | None = None,
) -> list[str]:
    """Each configuration against the last one of its group (llama-server, through the same API): medians of the
    per-round ratios."""
    groups = groups or [list(runs)]
    lines = [
        f"Command: `bench/setup_peers.sh && .venv/bin/python bench/speed.py ab --streams {args.streams} "
        f"--tokens {args.tokens} --rounds {args.rounds} --bursts {args.bursts} --api {args.api} "
        f"--prompt {args.prompt} {' '.join(args.configs)}`",
        "",
        "| streams | configuration | tok/s / reference | TTFT p50 / reference | TTFT p95 / reference | tok/s | "
        "TTFT p50 / p95 (ms) | tok/s ratio, each round | TTFT p50 ratio, each round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def med(rs: list[dict[str, float]], k: str) -> float:
        return statistics.median(x[k] for x in rs)

    for n in levels:
        for group in groups:
            s = runs[group[-1]][n]
            for name in group:
                c = runs[name][n]
                ratio = {k: [x[k] / y[k] for x, y in zip(c, s, strict=True)] for k in ("tps", "p50", "p95")}
                lines.append(
                    f"| {n} | {name} | **{statistics.median(ratio['tps']):.2f}** | "
                    f"**{statistics.median(ratio['p50']):.2f}** | {statistics.median(ratio['p95']):.2f} | "
                    f"{med(c, 'tps'):.0f} | {med(c, 'p50'):.0f} / {med(c, 'p95'):.0f} | "
                    + ", ".join(f"{x:.2f}" for x in ratio["tps"])
                    + " | "
                    + ", ".join(f"{x:.2f}" for x in ratio["p50"])
                    + " |"
                )
    return lines


# -- cpu -------------------------------------------------------------------------------------------------------------
def cpu(args: argparse.Namespace) -> None:
    gguf = batching.smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    levels = [int(x) for x in args.streams.split(",")]
    client = psutil.Process()  # the load's threads: what reading the streams costs an app
    for r in range(args.rounds):
        for name in args.configs:
            with tempfile.TemporaryDirectory() as tmp:
                server = start(name, gguf, Path(tmp))
                try:
                    server.stream(batching.PROMPTS[0], 8)
                    daemon = psutil.Process(server.proc.pid)
                    runner = next(
                        p for p in daemon.children(recursive=True) if "daemon.llama.runner" in " ".join(p.cmdline())
                    )
                    for n in levels:
                        batching.load_test(server, n, args.tokens)  # warm this level up
                        d0, r0, c0 = cpu_seconds(daemon), cpu_seconds(runner), cpu_seconds(client)
                        start_at, runs = time.perf_counter(), 0
                        while time.perf_counter() - start_at < args.seconds:
                            batching.load_test(server, n, args.tokens)
                            runs += 1
                        wall = time.perf_counter() - start_at
                        generated = runs * n * args.tokens  # greedy streams of these prompts never stop early
                        print(
                            f"round {r + 1} {name} {n:2d} streams: daemon "
                            f"{1000 * (cpu_seconds(daemon) - d0) / generated:.3f} ms, runner "
                            f"{1000 * (cpu_seconds(runner) - r0) / generated:.2f} ms, client (this process) "
                            f"{1000 * (cpu_seconds(client) - c0) / generated:.3f} ms CPU per token; "
                            f"{generated / wall:.0f} tok/s",
                            flush=True,
                        )
                finally:
                    server.close()


# -- passes ----------------------------------------------------------------------------------------------------------
def passes(args: argparse.Namespace) -> None:
    """What one ``llama_decode`` costs for a few batch layouts over 16 KV streams (one per slot, as the runner
    loads them), each stream holding 100 tokens: llama.cpp runs consecutive sequence ids together, with as many
    tokens each, so scattered slots or uneven chunks cost extra passes over the weights."""
    import ctypes

    import llama_cpp as lc
    from llama_cpp import _internals

    gguf = batching.smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    quiet = lc.llama_log_callback(lambda *_: None)
    lc.llama_log_set(quiet, ctypes.c_void_p(0))
    model = _internals.LlamaModel(path_model=str(gguf), params=lc.llama_model_default_params(), verbose=False)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = CTX * SLOTS, 512, 512, SLOTS, False
    cp.n_threads = cp.n_threads_batch = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
    mem = lc.llama_get_memory(ctx.ctx)
    batch = lc.llama_batch_init(512, 0, 1)
    pos = [0] * SLOTS

    def decode(layout: list[tuple[int, int]]) -> float:
        n = 0
        for seq, count in layout:
            for j in range(count):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = 100 + j, pos[seq], 1
                batch.seq_id[n][0], batch.logits[n] = seq, j == count - 1
                n += 1
                pos[seq] += 1
        batch.n_tokens = n
        start = time.perf_counter()
        if lc.llama_decode(ctx.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return 1000 * (time.perf_counter() - start)

    for seq in range(SLOTS):
        decode([(seq, 100)])
    cases = {
        "1 sequence, 1 token": [(0, 1)],
        "4 sequences in slots 0-3, 1 token each": [(s, 1) for s in range(4)],
        "4 sequences in slots 0, 5, 10, 15, 1 token each": [(s, 1) for s in (0, 5, 10, 15)],
        "8 sequences in slots 0-7, 1 token each": [(s, 1) for s in range(8)],
        "8 sequences in even slots, 1 token each": [(s, 1) for s in range(0, SLOTS, 2)],
        "16 sequences, 1 token each": [(s, 1) for s in range(SLOTS)],
        "16 sequences, 2 tokens each": [(s, 2) for s in range(SLOTS)],
        "15 sequences 1 token, 1 sequence 16 tokens": [(s, 1) for s in range(SLOTS - 1)] + [(SLOTS - 1, 16)],
        "1 sequence, 16 tokens": [(0, 16)],
    }
    for name, layout in cases.items():
        times = []
        for _ in range(args.repeat):
            times.append(decode(layout))
            for seq, count in layout:  # back to 100 tokens in every stream
                pos[seq] -= count
                lc.llama_memory_seq_rm(mem, seq, pos[seq], -1)
        print(
            f"{name:50s} {sum(c for _, c in layout):3d} tokens: median {statistics.median(times):6.1f} ms, "
            f"best {min(times):6.1f} ms"
        )
    lc.llama_batch_free(batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--seconds", type=int, default=12)
    p.add_argument("--top", type=int, default=0, help="also print the N hottest frames of each process")
    a = sub.add_parser("ab")
    a.add_argument("--streams", default="1,4,8,16")
    a.add_argument("--tokens", type=int, default=96)
    a.add_argument("--rounds", type=int, default=5)
    a.add_argument("--bursts", type=int, default=3, help="bursts of simultaneous requests per level and round")
    a.add_argument(
        "--api", default="generate", help=f"the APIs the servers are spoken to through, comma-separated: {APIS}"
    )
    a.add_argument("--prompt", choices=("bench", "story"), default="bench", help="bench/batching.py's or issue 25's")
    a.add_argument("configs", nargs="*", default=["corral", "llama-server"], help="the last is the reference")
    c = sub.add_parser("cpu")
    c.add_argument("--streams", default="1,16")
    c.add_argument("--tokens", type=int, default=96)
    c.add_argument("--seconds", type=int, default=12)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("configs", nargs="*", default=["corral"], help="corral[@CHECKOUT][:NAME=VALUE,...]")
    q = sub.add_parser("passes")
    q.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    {"profile": profile, "ab": ab, "cpu": cpu, "passes": passes}[args.cmd](args)


if __name__ == "__main__":
    main()
