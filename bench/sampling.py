"""What sampling costs the runner per step: ``daemon.runners.sampling.sample_rows`` over the logits of a batch.

Usage: .venv/bin/python bench/sampling.py [--write docs/benchmarks.md]

For SmolLM2's shape (4 rows of a 49,152-token vocabulary, the CPU benchmark's four slots) and for a Llama-3-8B
batch on a GPU (32 rows of 128,256), with Ollama's default options (temperature 0.8, top_k 40, top_p 0.9, repeat
penalty 1.1 over the last 64 tokens), greedy, and without top-k. The logits are random (standard normal x 3), so
the nucleus without top-k is wider than a real model's: those rows are a worst case. The peer is the previous
implementation's core step, one ``argpartition`` of every row over the whole vocabulary, timed on the same
arrays. Best of 7 runs each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon.runners.sampling import SeqSampler, sample_rows  # noqa: E402

CASES = [
    ("Ollama's defaults", {}),
    ("greedy", {"temperature": 0, "repeat_penalty": 1.0}),
    ("top_k 0, top_p 0.9", {"top_k": 0, "repeat_penalty": 1.0}),
    ("top_k 0, top_p 1", {"top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0}),
]
SHAPES = [(4, 49152), (32, 128256)]


def best(fn, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows_out = []
    for n, vocab in SHAPES:
        logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
        windows = [[int(t) for t in rng.integers(0, vocab, 300)] for _ in range(n)]
        full = best(lambda: np.argpartition(-logits, 39, axis=1))
        for name, params in CASES:
            samplers = [SeqSampler.from_params({"seed": i, **params}, 2048) for i in range(n)]
            ms = best(lambda: sample_rows(logits.copy(), samplers, windows))
            rows_out.append((f"{n} x {vocab:,}", name, ms, full))
            print(rows_out[-1], flush=True)
    lines = ["## Sampling cost per step (issue 7)", "",
             "Command: `.venv/bin/python bench/sampling.py --write docs/benchmarks.md`", "",
             (__doc__ or "").split("\n\n", 2)[2].strip().replace("\n", " "), "",
             "| batch | options | corral's sample_rows (ms) | one argpartition over the vocabulary (ms) |",
             "|---|---|---|---|"]
    lines += [f"| {shape} | {name} | {ms:.2f} | {full:.2f} |" for shape, name, ms, full in rows_out]
    lines.append("")
    print("\n".join(lines))
    if args.write:
        text = args.write.read_text()
        head = lines[0]
        if head in text:
            start = text.index(head)
            nxt = text.find("\n## ", start + len(head))
            text = text[:start] + text[nxt + 1:] if nxt >= 0 else text[:start]
        args.write.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
