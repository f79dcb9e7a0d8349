"""Interleaved A/B of server configurations: which of two runner or daemon settings is faster, on a machine whose
speed drifts by 10-30% between runs.

Usage: .venv/bin/python bench/ab.py [--streams 4] [--rounds 8] [--tokens 64] [--sample] CONFIG CONFIG [CONFIG ...]

A CONFIG is ``corral`` with environment settings for its daemon and runner (``corral:GOMP_SPINCOUNT=20000``,
``corral:CORRAL_NUM_PARALLEL=2``; several separated by commas) or ``llama-server``. Every configuration is up at
once (idle servers use no CPU) and they take turns, in an order that rotates, ``--rounds`` times; what counts is
the median of each configuration's ratio to the first one's run in the same round, not single runs. Uses the
servers of bench/batching.py (bench/setup_peers.sh builds llama-server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching


def start(config: str, gguf: Path, work: Path) -> batching.Corral:
    if config == "llama-server":
        return batching.LlamaServer(gguf, 2048, work, 4)
    name, _, settings = config.partition(":")
    if name != "corral":
        sys.exit(f"unknown configuration {config!r}: use corral[:NAME=VALUE,...] or llama-server")
    saved = dict(os.environ)
    try:
        for pair in filter(None, settings.split(",")):
            key, _, value = pair.partition("=")
            os.environ[key] = value
        return batching.Corral(gguf, 2048, work, int(os.environ.get("CORRAL_NUM_PARALLEL", "4")))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sample", action="store_true", help="sample with Ollama's default options instead of greedy")
    args = ap.parse_args()
    if args.sample:
        batching.SAMPLING.clear()
        batching.SAMPLING.update(batching.SAMPLED)
    gguf = batching.smollm2_path()
    if gguf is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    runs: dict[str, list[float]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        up = []
        for i, config in enumerate(args.configs):
            work = Path(tmp) / str(i)
            work.mkdir()
            server = start(config, gguf, work)
            stack.callback(server.close)
            server.stream(batching.PROMPTS[0], 8)  # warm up
            up.append((config, server))
        for r in range(args.rounds):
            for config, server in up[r % len(up) :] + up[: r % len(up)]:
                runs[config].append(batching.load_test(server, args.streams, args.tokens)["tps"])
    first = runs[args.configs[0]]
    for config in args.configs:
        ratios = [x / y for x, y in zip(runs[config], first, strict=True)]
        print(
            f"{config:40s} median {statistics.median(runs[config]):6.1f} tok/s   ratio to the first, median of the "
            f"rounds {statistics.median(ratios):.3f}   runs {[round(x) for x in runs[config]]}"
        )


if __name__ == "__main__":
    main()
