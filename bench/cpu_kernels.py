#!/usr/bin/env python3
"""CPU kernels: llama.cpp's extra buffer types (weight repacking, AMX) on vs off, and the KV cache in q8_0 vs f16.

Usage: .venv/bin/python bench/cpu_kernels.py [--rounds 5] [--tokens 128] [--long 1000] [--write docs/benchmarks.md]

Each configuration runs in a fresh child process (its own model load, so memory, repacked weights and kernels do
not mix), built with llama-cpp-python's low-level API as the runner builds it (``use_extra_bufts`` in the model
params, ``flash_attn_type``/``type_k``/``type_v`` in the context params), flash attention on for all. A child
measures greedy decode speed after a short prompt and after a ~1000-token prompt (where the KV cache is read at
every step), and the long prompt's evaluation speed; tokens are argmax'd over the logits with numpy, so Python's
share of a step is small and the same for all. Configurations take turns in an order that rotates each round;
numbers are medians over the rounds.

SmolLM2 ships in Q4_1, which llama.cpp's CPU repacking does not handle, so the extra buffer types are also measured
on a Q4_0 copy (requantized here with ``llama_model_quantize``; Q4_0 is what the repacked AVX2/AVX512 kernels take).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.models import smollm2_path  # noqa: E402

HEAD = "## CPU kernels: extra buffer types and KV cache type"
SHORT = "Write a short story about a robot who learns to paint. Once upon a time"
PARAGRAPH = (
    "The old lighthouse keeper kept a journal of every ship that passed the point, the weather of each "
    "morning, the birds that rested on the rail, and the letters he never sent to his brother in the city. "
)
KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml_type values, as daemon/llama/runner.py


# -- the child: one configuration, one process ---------------------------------------------------------------
def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import ctypes
    import statistics
    import time

    import numpy as np

    t0 = time.perf_counter()
    import llama_cpp as lc

    log_lines: list[str] = []

    @lc.llama_log_callback
    def on_log(level: int, text: bytes, user: Any) -> None:
        log_lines.append(text.decode("utf-8", "replace"))

    lc.llama_log_set(on_log, ctypes.c_void_p(0))
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    mparams.use_extra_bufts = bool(cfg["extra_bufts"])
    model = lc.llama_model_load_from_file(cfg["model"].encode(), mparams)
    if not model:
        raise SystemExit("model load failed")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = int(cfg["n_ctx"])
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_threads = cparams.n_threads_batch = int(cfg["threads"])
    cparams.flash_attn_type = 1  # on, for every configuration (a quantized V cache needs it)
    cparams.type_k = cparams.type_v = KV_TYPES[cfg["kv"]]
    cparams.no_perf = True
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit("context creation failed")
    load = time.perf_counter() - t0
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    mem = lc.llama_get_memory(ctx)

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        buf = (lc.llama_token * (len(raw) + 8))()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
        return list(buf[:n])

    def feed(tokens: list[int]) -> int:
        """Evaluate tokens in batches of 512; the argmax of the last one's logits."""
        for i in range(0, len(tokens), 512):
            part = tokens[i : i + 512]
            arr = (lc.llama_token * len(part))(*part)
            rc = lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(part)))
            if rc != 0:
                raise SystemExit(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    def run(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """(prompt seconds, decode tokens/s, the tokens) from an empty cache. Decode speed is one over the median
        step: on a shared 2-core machine a neighbour's burst stalls a few steps, and the median ignores them."""
        lc.llama_memory_clear(mem, True)
        start = time.perf_counter()
        tok = feed(prompt)
        prompt_s = time.perf_counter() - start
        out, steps = [tok], []
        for _ in range(n - 1):
            t = time.perf_counter()
            tok = feed([tok])  # greedy, end-of-text ignored: the kernels are what is measured
            steps.append(time.perf_counter() - t)
            out.append(tok)
        return prompt_s, 1.0 / statistics.median(steps), out

    short = tokenize(SHORT)
    long = tokenize(PARAGRAPH * (cfg["long"] // 30 + 2))[: cfg["long"]]
    run(short, 8)  # warm-up: first-use costs (thread pool, page faults) out of the measurements
    _, short_tps, short_out = run(short, cfg["tokens"])
    prompt_s, long_tps, _ = run(long, cfg["tokens"])
    text = "".join(log_lines)

    def mib(kind: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"{kind} buffer size\s*=\s*([\d.]+) MiB", text))

    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {
        "load": load,
        "short_tps": short_tps,
        "long_tps": long_tps,
        "prompt_tps": len(long) / prompt_s,
        "repack_mib": mib("CPU_REPACK model"),
        "kv_mib": mib("KV"),
        "long_tokens": len(long),
        "short_out": short_out[:16],
    }


# -- the parent ------------------------------------------------------------------------------------------------
def requantize(src: Path, dst: Path) -> None:
    """A Q4_0 copy of a GGUF (llama.cpp's own quantizer, from the Q4_1 weights)."""
    code = (
        "import sys, llama_cpp as lc\n"
        "p = lc.llama_model_quantize_default_params()\n"
        "p.ftype = lc.LLAMA_FTYPE_MOSTLY_Q4_0; p.allow_requantize = True\n"
        "sys.exit(lc.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(src), str(dst)], check=True, capture_output=True)


def cpu_description() -> tuple[str, str]:
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f.startswith(("amx", "avx512")))
    return name, " ".join(wanted) if wanted else "none (no AMX, no AVX512)"


def reading(names: list[str], med: Any, rel: Any, same: dict[str, bool], long: int) -> str:
    """The paragraph under the table, from this run's numbers. Rows: Q4_1 on/off/q8_0, then Q4_0 on/off/q8_0."""
    q41_on, q41_off, q41_q8, q40_on, q40_off, q40_q8 = names
    noise = max(abs(med(q41_off, k) / med(q41_on, k) - 1) for k in ("short_tps", "long_tps", "prompt_tps"))
    return (
        f"Reading it: Q4_1 has no repacked kernel (no CPU_REPACK buffer), so its two extra-buffer-type rows do the "
        f"same work and their difference (up to {noise:.0%}) is this machine's noise. Where weights are repacked "
        f"(Q4_0, {med(q40_on, 'repack_mib'):.0f} MiB), turning the extra buffer types off, which is corral's "
        f"fallback after a crash in those kernels, runs at {rel(q40_off, q40_on, 'short_tps')} / "
        f"{rel(q40_off, q40_on, 'long_tps')} / {rel(q40_off, q40_on, 'prompt_tps')} (short decode / decode after "
        f"{long} tokens / prompt eval). A q8_0 KV cache takes {med(q40_q8, 'kv_mib') / med(q40_on, 'kv_mib'):.2f} "
        f"of the f16 memory (34/64 = 0.53); decoding after {long} tokens runs at {rel(q40_q8, q40_on, 'long_tps')} "
        f"(Q4_0) and {rel(q41_q8, q41_on, 'long_tps')} (Q4_1) and the long prompt's evaluation at "
        f"{rel(q40_q8, q40_on, 'prompt_tps')} and {rel(q41_q8, q41_on, 'prompt_tps')} of f16 on this CPU: the "
        f"memory saving costs speed, most in prompt evaluation. The first 16 greedy tokens after the short prompt are "
        f"{'the same' if same[q41_off] else 'different'} with the extra buffer types off and "
        f"{'the same' if same[q41_q8] else 'different (the cache is rounded)'} with a q8_0 cache (Q4_1)."
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--long", type=int, default=1000, help="tokens of the long prompt")
    ap.add_argument("--write", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    model = smollm2_path()
    if model is None:
        print("run scripts/fetch_smollm2.py first", file=sys.stderr)
        return 1
    import psutil

    threads = psutil.cpu_count(logical=False) or 1
    tmp = Path(tempfile.mkdtemp())
    q40 = tmp / "SmolLM2-135M-Instruct-Q4_0.gguf"
    requantize(model, q40)
    n_ctx = 2048
    configs = {
        "Q4_1, extra bufts on, KV f16": (model, True, "f16"),
        "Q4_1, extra bufts off, KV f16": (model, False, "f16"),
        "Q4_1, extra bufts on, KV q8_0": (model, True, "q8_0"),
        "Q4_0, extra bufts on, KV f16": (q40, True, "f16"),
        "Q4_0, extra bufts off, KV f16": (q40, False, "f16"),
        "Q4_0, extra bufts on, KV q8_0": (q40, True, "q8_0"),
    }
    names = list(configs)
    load_before = os.getloadavg()[0]
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            path, extra, kv = configs[name]
            cfg = {
                "model": str(path),
                "extra_bufts": extra,
                "kv": kv,
                "n_ctx": n_ctx,
                "threads": threads,
                "tokens": args.tokens,
                "long": args.long,
            }
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name}: child failed ({out.returncode}): {out.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"round {r + 1} {name}: {results[name][-1]['short_tps']:.1f} / {results[name][-1]['long_tps']:.1f}"
                " tok/s",
                file=sys.stderr,
            )

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    def rel(name: str, base: str, key: str) -> str:
        return f"{med(name, key) / med(base, key):.2f}×"

    lines = [
        "| configuration | repacked weights (MiB) | KV cache (MiB) | decode tok/s, short prompt | "
        f"decode tok/s after {args.long} tokens | prompt eval tok/s ({args.long} tokens) | vs its baseline "
        "(short / long / prompt) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        base = name.split(",")[0] + ", extra bufts on, KV f16"
        versus = (
            "baseline"
            if name == base
            else " / ".join(rel(name, base, k) for k in ("short_tps", "long_tps", "prompt_tps"))
        )
        lines.append(
            f"| {name} | {med(name, 'repack_mib'):.1f} | {med(name, 'kv_mib'):.1f} | "
            f"{med(name, 'short_tps'):.1f} | {med(name, 'long_tps'):.1f} | {med(name, 'prompt_tps'):.0f} | "
            f"{versus} |"
        )
    same = {name: results[name][0]["short_out"] == results[names[0]][0]["short_out"] for name in names[:3]}
    table = "\n".join(lines)
    print(table)
    load_after = os.getloadavg()[0]
    cpu, flags = cpu_description()
    command = (
        f".venv/bin/python bench/cpu_kernels.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--long {args.long} --write docs/benchmarks.md"
    )
    if args.write:
        section = [
            HEAD,
            "",
            f"Command: `{command}`",
            "",
            f"CPU: {cpu}, {os.cpu_count()} logical cores, {threads} threads; AMX/AVX512 flags: {flags}. "
            f"SmolLM2-135M-Instruct as shipped (Q4_1) and a Q4_0 copy requantized by llama.cpp; num_ctx {n_ctx}, "
            f"batch 512, flash attention on for every configuration; greedy, {args.tokens} generated tokens; "
            f'each configuration in a fresh process, {args.rounds} rounds taking turns, medians. "Extra bufts" is '
            "`use_extra_bufts` in llama.cpp's model params (repacked weights for the CPU's wide kernels, AMX on "
            "CPUs that have it); the KV type is `type_k`/`type_v` (`CORRAL_KV_CACHE_TYPE`). Decode speed is one "
            "over the median step; prompt eval is one 1000-token evaluation per process, so noisier. Load average "
            f"(1 min) before the run {load_before:.2f}, after {load_after:.2f}.",
            "",
            table,
            "",
            reading(names, med, rel, same, args.long),
            "",
        ]
        text = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        if HEAD in text:
            start = text.index(HEAD)
            nxt = text.find("\n## ", start + len(HEAD))
            text = text[:start] + text[nxt + 1 :] if nxt >= 0 else text[:start]
        args.write.write_text(text.rstrip("\n") + "\n\n" + "\n".join(section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
