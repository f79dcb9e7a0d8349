"""What sampling costs the runner per step: ``daemon.llama.sampling.sample_rows`` over the logits of a batch.

Usage: .venv/bin/python bench/sampling.py [--write docs/benchmarks.md]

For SmolLM2's shape (4 rows of a 49,152-token vocabulary, the CPU benchmark's four slots) and for a Llama-3-8B
batch on a GPU (32 rows of 128,256), with Ollama's default options (temperature 0.8, top_k 40, top_p 0.9, repeat
penalty 1.1 over the last 64 tokens), greedy, and without top-k. The logits are random (standard normal x 3), so
the nucleus without top-k is wider than a real model's: those rows are a worst case. The peer is the previous
implementation (``daemon/llama/sampling.py`` at commit aeba1fc, read from git: one argpartition of every row
over the whole vocabulary for top-k, a full sort without it), timed on the same arrays in the same run. Best of 5
runs each (3 for the slowest).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon.llama.sampling import SeqSampler, sample_rows  # noqa: E402
from daemon.runners.protocol import SampleParams  # noqa: E402

CASES = [
    ("Ollama's defaults", {}),
    ("greedy", {"temperature": 0, "repeat_penalty": 1.0}),
    ("top_k 0, top_p 0.9", {"top_k": 0, "repeat_penalty": 1.0}),
    ("top_k 0, top_p 1", {"top_k": 0, "top_p": 1.0, "repeat_penalty": 1.0}),
]
SHAPES = [(4, 49152), (32, 128256)]


def best(fn: Any, logits: np.ndarray, runs: int) -> float:
    """Best time of ``fn`` on a fresh copy of ``logits`` (sampling penalises rows in place), copy not timed."""
    times = []
    for _ in range(runs):
        rows = logits.copy()
        start = time.perf_counter()
        fn(rows)
        times.append(time.perf_counter() - start)
    return min(times) * 1000


PEER_COMMIT = "aeba1fc"


def previous_implementation() -> Any:
    """The sampler as it was before top_candidates, loaded from git into a module of its own."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{PEER_COMMIT}:daemon/llama/sampling.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "previous_sampling.py").write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("previous_sampling")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    previous = previous_implementation()
    rows_out = []
    for n, vocab in SHAPES:
        logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
        windows = [[int(t) for t in rng.integers(0, vocab, 300)] for _ in range(n)]
        for name, params in CASES:
            runs = 3 if "top_k 0" in name else 5
            ours = [SeqSampler.of(SampleParams(**{"seed": i, **params}), 2048) for i in range(n)]
            theirs = [previous.SeqSampler.from_params({"seed": i, **params}, 2048) for i in range(n)]
            ms = best(lambda rows, ours=ours, windows=windows: sample_rows(rows, ours, windows), logits, runs)
            old = best(
                lambda rows, theirs=theirs, windows=windows: previous.sample_rows(rows, theirs, windows), logits, runs
            )
            rows_out.append((f"{n} x {vocab:,}", name, ms, old))
            print(rows_out[-1], flush=True)
    lines = [
        "## Sampling cost per step (issue 7)",
        "",
        "Command: `.venv/bin/python bench/sampling.py --write docs/benchmarks.md`",
        "",
        (__doc__ or "").split("\n\n", 2)[2].strip().replace("\n", " "),
        "",
        f"| batch | options | corral now (ms) | before, {PEER_COMMIT} (ms) | now / before |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {shape} | {name} | {ms:.2f} | {old:.2f} | {ms / old:.2f} |" for shape, name, ms, old in rows_out]
    lines.append("")
    print("\n".join(lines))
    if args.write:
        text = args.write.read_text()
        head = lines[0]
        if head in text:
            start = text.index(head)
            nxt = text.find("\n## ", start + len(head))
            text = text[:start] + text[nxt + 1 :] if nxt >= 0 else text[:start]
        args.write.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
