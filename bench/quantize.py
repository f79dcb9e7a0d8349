#!/usr/bin/env python3
"""Quantize on create (issue 18): time and peak memory of the quantize worker for each type corral accepts.

Usage: .venv/bin/python bench/quantize.py [--runs 3] [--layers 4] [--write docs/benchmarks.md]

The source is a random-weight F32 llama GGUF written by tests/models.py's ``write_tiny_gguf`` (n_embd 768, n_ff
2048, vocabulary 8000; ``--layers`` blocks; about 150 MB with 4). For each type, taking turns, it runs the worker
exactly as the daemon does (``python -m daemon.llama.quantize IN OUT TYPE``) and records its wall time (process
start, llama_cpp import and quantization), the quantization alone (as the worker reports it), its peak RSS (the
kernel's high-water mark VmHWM, which the worker reports; also sampled with psutil every 10 ms) and the output
size. Then one ``POST /api/create`` with ``quantize`` through a daemon per type: the whole create (worker, GGUF
check, sha256, rename, manifest). Medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daemon.runners.quantize import worker_command  # noqa: E402
from tests.conftest import start_daemon, stop_daemon  # noqa: E402
from tests.models import write_tiny_gguf  # noqa: E402

TYPES = ("F16", "Q8_0", "Q4_K_M", "Q4_K_S")
HEAD = "## Quantize on create (issue 18)"
MB = 1e6


def run_worker(src: Path, out: Path, qtype: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.monotonic()
    proc = subprocess.Popen(
        worker_command(str(src), str(out), qtype), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT
    )
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    wall = time.monotonic() - started
    assert proc.stdout is not None
    lines = [json.loads(x) for x in proc.stdout.read().splitlines() if x.strip()]
    done = next((x for x in lines if x.get("type") == "done"), None)
    if proc.returncode != 0 or done is None:
        raise SystemExit(f"worker failed for {qtype}: {lines}")
    return {
        "wall": wall,
        "quantize": float(done["seconds"]),
        "rss": peak,
        "maxrss": float(done["max_rss"]),
        "size": out.stat().st_size,
    }


def daemon_create(url: str, digest: str, qtype: str, name: str) -> float:
    started = time.monotonic()
    with httpx.stream(
        "POST", url + "/api/create", json={"model": name, "files": {"src.gguf": digest}, "quantize": qtype}, timeout=600
    ) as r:
        last = [json.loads(x) for x in r.iter_lines() if x][-1]
    if last != {"status": "success"}:
        raise SystemExit(f"create failed for {qtype}: {last}")
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="corral-bench-q-") as tmp_s:
        tmp = Path(tmp_s)
        src = write_tiny_gguf(tmp / "src.gguf", n_embd=768, n_ff=2048, n_layer=args.layers, n_vocab=8000)
        src_size = src.stat().st_size
        print(f"source: {src_size / MB:.1f} MB F32, {args.layers} layers", flush=True)
        results: dict[str, list[dict[str, float]]] = {t: [] for t in TYPES}
        for i in range(args.runs):
            for qtype in TYPES if i % 2 == 0 else reversed(TYPES):
                out = tmp / f"out-{qtype}.gguf"
                r = run_worker(src, out, qtype)
                out.unlink()
                results[qtype].append(r)
                print(
                    f"run {i + 1} {qtype}: {r['wall']:.2f}s wall, {r['quantize']:.2f}s quantize, "
                    f"peak RSS {r['maxrss'] / MB:.0f} MB (psutil {r['rss'] / MB:.0f} MB), "
                    f"{r['size'] / MB:.1f} MB",
                    flush=True,
                )
        creates: dict[str, float] = {}
        d = start_daemon(tmp / "models", tmp / "daemon.log")
        try:
            import hashlib

            data = src.read_bytes()
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            httpx.post(f"{d.url}/api/blobs/{digest}", content=data, timeout=600).raise_for_status()
            del data
            for qtype in TYPES:
                creates[qtype] = daemon_create(d.url, digest, qtype, f"bench-{qtype.lower()}")
                print(f"create {qtype}: {creates[qtype]:.2f}s", flush=True)
        finally:
            stop_daemon(d)

    cores = os.cpu_count()
    lines = [
        HEAD,
        "",
        f"Command: `.venv/bin/python bench/quantize.py --runs {args.runs} --layers {args.layers} "
        "--write docs/benchmarks.md`",
        "",
        f"Source: a random-weight F32 llama GGUF of {src_size / MB:.0f} MB written by tests/models.py "
        f"`write_tiny_gguf` (n_embd 768, n_ff 2048, {args.layers} blocks, vocabulary 8000: "
        f"{src_size / 4 / 1e6:.0f}M parameters). The worker (`python -m daemon.llama.quantize`, llama.cpp's "
        f"`llama_model_quantize`, nthread 0 = all {cores} cores, CPU only) runs alone; medians of {args.runs} runs "
        "per type, types taking turns. Worker wall time includes the process start and the llama_cpp import; "
        "peak RSS is the worker's high-water mark (VmHWM, which the worker reads as it ends; the peak of psutil "
        "samples every 10 ms in brackets): Python, llama.cpp and the buffers of the tensor in hand, not the whole "
        "model. 2 cores shared with other work: expect noise of 10-20%. The create column is one "
        "`POST /api/create` with `quantize` through the daemon: worker, GGUF check, sha256 of the result, "
        "rename into blobs/, manifest.",
        "",
        "| type | worker wall (s) | quantize (s) | peak RSS (MB) | output (MB) | output / source "
        "| create via daemon (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for qtype in TYPES:
        rs = results[qtype]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        lines.append(
            f"| {qtype} | {med['wall']:.2f} | {med['quantize']:.2f} | {med['maxrss'] / MB:.0f} "
            f"({med['rss'] / MB:.0f}) | {med['size'] / MB:.1f} | {med['size'] / src_size:.3f} "
            f"| {creates[qtype]:.2f} |"
        )
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, lines)


def write_section(path: Path, lines: list[str]) -> None:
    """Replace this benchmark's own section (or append it), leaving the others as they are."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if HEAD in text:
        start = text.index(HEAD)
        nxt = text.find("\n## ", start + len(HEAD))
        text = text[:start] + text[nxt + 1 :] if nxt >= 0 else text[:start]
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
