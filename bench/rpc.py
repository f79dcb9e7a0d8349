"""One model over several hosts (issue 30): decode speed of a runner whose layers are split over two llama.cpp
rpc-servers, against the same runner with every layer local.

Usage: scripts/build-rpc.sh && .venv/bin/python bench/rpc.py [--rounds 3] [--tokens 128] [--model PATH]
       [--server-threads 1] [--write docs/benchmarks.md]

Both configurations are corral's own runner process (daemon/runners/process.py) on SmolLM2-135M-Instruct Q4_1
(scripts/fetch_smollm2.py), num_ctx 1024, greedy, no repeat penalty, one stream:

* ``local``: every layer on this host's CPU, the venv's llama.cpp, ``num_thread`` 2 (the machine's cores);
* ``local, 1 thread``: the same with ``num_thread`` 1: what one rpc-server computes with (a layer split is a
  pipeline: one server computes at a time), and free of the spin-waits of two threads on busy shared cores;
* ``rpc x2``: two rpc-servers (scripts/build-rpc.sh's, ``-t --server-threads`` each) on 127.0.0.1, the runner with
  ``rpc_servers`` both and ``tensor_split`` 0.5/0.5 and every layer offloaded (what ``CORRAL_RPC_SERVERS`` gives a
  load that fits the servers), loading the RPC-enabled libraries from the build's cache.

A round runs each configuration once (their order alternates between rounds): load, one warm-up generation,
then ``--tokens`` tokens from a fixed chat prompt (ChatML, written out); decode tok/s is the runner's own count
(eval_count / eval_duration, the prompt excluded), prompt tok/s likewise. The texts of the two must be equal
(checked). The table has the median of the rounds and each round's numbers; ``--write`` replaces the
``## llama.cpp RPC`` section of the given file (appended when absent).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon import rpc  # noqa: E402
from daemon.runners.base import Done, GenerateRequest, LoadSpec, SampleParams, Token  # noqa: E402
from daemon.runners.process import ProcessRunner  # noqa: E402

# SmolLM2's chat template (ChatML), written out: the runner takes the prompt as it is
PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
SECTION = "## llama.cpp RPC"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build() -> tuple[Path, Path]:
    done = subprocess.run(["bash", str(REPO / "scripts" / "build-rpc.sh")], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"scripts/build-rpc.sh failed:\n{done.stderr}")
    paths = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    return Path(paths["rpc-server"]), Path(paths["lib"])


async def run_once(spec: LoadSpec, env: dict[str, str] | None, tokens: int) -> tuple[float, float, float, str]:
    """(load seconds, prompt tok/s, decode tok/s, text)."""
    started = time.monotonic()
    r = ProcessRunner(spec, env=env)
    await r.start()
    load = time.monotonic() - started
    try:
        warm = SampleParams(temperature=0, num_predict=8, repeat_penalty=1.0)
        async for _ in r.generate(GenerateRequest(prompt="Hello", params=warm)):
            pass
        params = SampleParams(temperature=0, num_predict=tokens, repeat_penalty=1.0, seed=1)
        parts: list[str] = []
        done: Done | None = None
        async for ev in r.generate(GenerateRequest(prompt=PROMPT, params=params)):
            if isinstance(ev, Token):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                done = ev
        assert done is not None and done.eval_count > 0, "the model generated nothing"
        pp = done.prompt_eval_count / max(1e-9, done.prompt_eval_duration / 1e9)
        tg = done.eval_count / max(1e-9, done.eval_duration / 1e9)
        return load, pp, tg, "".join(parts)
    finally:
        await r.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default="")
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.models import smollm2_path

    model = Path(args.model) if args.model else smollm2_path()
    if model is None or not model.is_file():
        sys.exit("no model: run scripts/fetch_smollm2.py or pass --model")
    server, lib = build()
    logs = Path(tempfile.mkdtemp(prefix="corral-bench-rpc-"))
    procs, endpoints = [], []
    for i in range(2):
        port = free_port()
        procs.append(
            subprocess.Popen(
                [str(server), "-H", "127.0.0.1", "-p", str(port), "-t", str(args.server_threads)],
                stdout=open(logs / f"rpc-server-{i}.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            )
        )
        endpoints.append(f"127.0.0.1:{port}")
    try:
        for e in endpoints:
            deadline = time.monotonic() + 30
            while not rpc.probe(e, 1.0).ok:
                if time.monotonic() > deadline:
                    sys.exit(f"rpc-server {e} did not come up (logs in {logs})")
                time.sleep(0.1)
        base = LoadSpec(model_path=str(model), num_ctx=1024, num_thread=2)
        configs = {
            "local": (base, None),
            "local, 1 thread": (dataclasses.replace(base, num_thread=1), None),
            "rpc x2": (
                LoadSpec(
                    model_path=str(model),
                    num_ctx=1024,
                    num_thread=2,
                    num_gpu=999,
                    rpc_servers=tuple(endpoints),
                    tensor_split=(0.5, 0.5),
                ),
                rpc.runner_env(os.environ, lib),
            ),
        }
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in configs}
        texts: dict[str, str] = {}
        for rnd in range(args.rounds):
            order = list(configs) if rnd % 2 == 0 else list(reversed(configs))
            for name in order:
                spec, env = configs[name]
                load, pp, tg, text = asyncio.run(run_once(spec, env, args.tokens))
                results[name].append((load, pp, tg))
                if name in texts and texts[name] != text:
                    print(f"warning: {name}'s text changed between rounds", file=sys.stderr)
                texts[name] = text
                print(
                    f"round {rnd + 1} {name}: load {load:.2f}s prompt {pp:.1f} tok/s decode {tg:.1f} tok/s", flush=True
                )
        same = len(set(texts.values())) == 1
        load_avg = os.getloadavg()[0]
        lines = [
            SECTION,
            "",
            f"`.venv/bin/python bench/rpc.py --rounds {args.rounds} --tokens {args.tokens} "
            f"--server-threads {args.server_threads}` on {platform.machine()} with {os.cpu_count()} logical CPUs, "
            f"{model.name}, one stream, greedy, {args.tokens} tokens; rounds interleaved. `rpc x2`: two rpc-servers "
            "(scripts/build-rpc.sh) on 127.0.0.1, layers split 0.5/0.5, every layer offloaded.",
            "",
            "| config | load s | prompt tok/s | decode tok/s | decode vs local | decode per round |",
            "|---|---|---|---|---|---|",
        ]
        local_tg = statistics.median(r[2] for r in results["local"])
        for name, rows in results.items():
            tg = statistics.median(r[2] for r in rows)
            lines.append(
                f"| {name} | {statistics.median(r[0] for r in rows):.2f} | "
                f"{statistics.median(r[1] for r in rows):.1f} | {tg:.1f} | {tg / local_tg:.2f}x | "
                + ", ".join(f"{r[2]:.1f}" for r in rows)
                + " |"
            )
        lines += [
            "",
            f"Same text from all: {'yes' if same else 'NO'}. Load average at the end: {load_avg:.1f} "
            "(other sessions' work on the same cores included).",
            "",
        ]
        out = "\n".join(lines)
        print(out)
        if args.write:
            path = Path(args.write)
            doc = path.read_text() if path.exists() else ""
            if SECTION in doc:
                head, _, rest = doc.partition(SECTION)
                nxt = rest.find("\n## ")
                doc = head + out + (rest[nxt + 1 :] if nxt >= 0 else "")
            else:
                doc = doc.rstrip("\n") + "\n\n" + out
            path.write_text(doc)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
