"""Vision (issue 16): what an image costs through the daemon, and what one image request costs other users.

Usage: .venv/bin/python bench/vision.py [--rounds 7] [--streams 4] [--tokens 160]

A real daemon runs SmolLM2-135M-Instruct (scripts/fetch_smollm2.py) with the test projector (tests/vision.py: a
LLaVA-style 2-layer ViT, 64 image embeddings per image), CORRAL_NUM_PARALLEL = streams + 1, greedy, num_ctx 2048.

* Image prefill: ``/api/generate`` with one image (a new one each round, so nothing comes from the prompt cache) and
  ``num_predict`` 1, against the same prompt without the image; the difference of the medians of
  ``prompt_eval_duration`` is what the image adds (decode + preprocess + projector encode + 64 embeddings through
  the text model).
* Memory per image: the KV cache positions the image takes (64 x the model's KV bytes per position), and the growth
  of the runner's RSS over ``rounds`` image requests (the preprocessed image is freed with its request).
* Other users: ``streams`` text streams decode ``tokens`` tokens each; in the second half an image request arrives
  while they decode. Their aggregate tokens/s over the image request's lifetime, and their longest gap between two
  tokens, with and without the image (medians over rounds, taking turns).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import start_daemon, stop_daemon  # noqa: E402
from tests.models import smollm2_path  # noqa: E402
from tests.vision import image_bytes, projector_path  # noqa: E402

PROMPT = "Describe this picture in detail."
OPTIONS = {"temperature": 0, "num_ctx": 2048, "seed": 1}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def generate(url: str, prompt: str, images: list[str], num_predict: int) -> dict[str, Any]:
    body = {
        "model": "vis",
        "prompt": prompt,
        "images": images,
        "stream": False,
        "options": {**OPTIONS, "num_predict": num_predict},
    }
    r = httpx.post(url + "/api/generate", json=body, timeout=600)
    r.raise_for_status()
    return dict(r.json())


def runner_rss(pid: int) -> int:
    kids = psutil.Process(pid).children(recursive=True)
    return sum(k.memory_info().rss for k in kids if "runners" in " ".join(k.cmdline()))


def stream_times(url: str, prompt: str, tokens: int, out: list[float]) -> None:
    body = {
        "model": "vis",
        "prompt": prompt,
        "options": {**OPTIONS, "num_predict": tokens, "repeat_penalty": 1.0},
    }
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line and json.loads(line).get("response"):
                out.append(time.perf_counter())


def contention(
    url: str, streams: int, tokens: int, with_image: bool, seed: int
) -> tuple[float, float, list[list[float]]]:
    """``streams`` text streams; once all decode, an image request (``with_image``). (when it was sent, when it
    ended (= sent without one), each stream's token times)."""
    times: list[list[float]] = [[] for _ in range(streams)]
    threads = [
        threading.Thread(
            target=stream_times, args=(url, f"Write a long story number {i} about a lighthouse.", tokens, times[i])
        )
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < tokens // 4:  # all decoding
        time.sleep(0.01)
    start = time.perf_counter()
    if with_image:
        generate(url, PROMPT, [b64(image_bytes(10_000 + seed))], 1)
    end = time.perf_counter()
    for t in threads:
        t.join()
    return start, end, times


def window_rate(times: list[list[float]], start: float, end: float) -> tuple[float, float]:
    """The streams' aggregate tokens/s within [start, end], and their longest gap between two tokens there (ms)."""
    n = sum(1 for ts in times for x in ts if start <= x <= end)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False) if a >= start - 0.5 and b <= end + 0.5]
    return n / max(end - start, 1e-9), 1000 * max(gaps, default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    smol = smollm2_path()
    if smol is None:
        sys.exit("SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
    root = Path(tempfile.mkdtemp(prefix="corral-bench-vision-"))
    d = start_daemon(root / "models", root / "daemon.log", {"CORRAL_NUM_PARALLEL": str(args.streams + 1)})
    try:
        c = ollama.Client(host=d.url)
        c.create(
            model="vis",
            files={"model.gguf": c.create_blob(smol), "mmproj.gguf": c.create_blob(projector_path())},
            stream=False,
        )
        generate(d.url, PROMPT, [b64(image_bytes(9_999))], 1)  # load and warm up
        rss0 = runner_rss(d.proc.pid)
        with_img, without = [], []
        for i in range(args.rounds):
            with_img.append(generate(d.url, PROMPT, [b64(image_bytes(i))], 1)["prompt_eval_duration"] / 1e6)
            without.append(generate(d.url, PROMPT + f" ({i})", [], 1)["prompt_eval_duration"] / 1e6)
        rss1 = runner_rss(d.proc.pid)
        n_pos = (
            generate(d.url, PROMPT, [b64(image_bytes(0))], 1)["prompt_eval_count"]
            - generate(d.url, PROMPT, [], 1)["prompt_eval_count"]
        )
        # SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x 64 x f16
        kv_per_pos = 30 * 2 * 3 * 64 * 2
        img_ms, text_ms = statistics.median(with_img), statistics.median(without)
        print(
            f"image prefill: {img_ms:.0f} ms with the image, {text_ms:.0f} ms without (medians of {args.rounds}); "
            f"the image adds {img_ms - text_ms:.0f} ms"
        )
        print(
            f"memory per image: {n_pos} KV positions = {n_pos * kv_per_pos / (1 << 20):.2f} MiB of KV; runner RSS "
            f"{(rss1 - rss0) / (1 << 20):+.1f} MiB over {2 * args.rounds} requests"
        )
        rates: dict[bool, list[float]] = {True: [], False: []}
        stalls: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.rounds):
            s, e, times = contention(d.url, args.streams, args.tokens, True, i)
            r, g = window_rate(times, s, e)
            rates[True].append(r)
            stalls[True].append(g)
            s2, _, times2 = contention(d.url, args.streams, args.tokens, False, i)
            r, g = window_rate(times2, s2, s2 + (e - s))
            rates[False].append(r)
            stalls[False].append(g)
        for flag, name in ((False, "without"), (True, "with")):
            rate, gap = statistics.median(rates[flag]), statistics.median(stalls[flag])
            print(
                f"{args.streams} streams {name} an image request: {rate:.1f} tok/s aggregate, "
                f"longest gap {gap:.0f} ms (medians of {args.rounds})"
            )
    finally:
        stop_daemon(d)


if __name__ == "__main__":
    main()
