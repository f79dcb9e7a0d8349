from __future__ import annotations

from pathlib import Path

import pytest

from daemon.hardware import GPU, Hardware, budgets, describe, detect
from daemon.runners.process import parse_llama_log
from daemon.scheduling.memory import choose_gpu_layers, estimate
from registry.gguf import read_gguf_file
from tests.models import smollm2_path

GiB = 1 << 30


def test_detect_cpu_only_without_error() -> None:
    hw = detect()
    assert hw.physical_cores >= 1 and hw.total_ram > 0
    if not hw.gpus:
        assert hw.gpu_reason and not hw.gpu_offload
    assert "cpu" in describe(hw, budgets(hw, None, None))[0]


def fake_hw(vram: int = 0) -> Hardware:
    gpus = (GPU(0, "Fake", "GPU-0", vram, vram, "1", "9.0"),) if vram else ()
    return Hardware(4, 8, 16 * GiB, 12 * GiB, gpus, gpu_offload=bool(vram))


def test_budgets() -> None:
    b = budgets(fake_hw(), None, None)
    assert b.ram == 12 * GiB - 1717986918 // 1 or b.ram == 12 * GiB - (16 * GiB // 10)
    assert b.vram == 0
    assert budgets(fake_hw(), 5 * GiB, 3 * GiB).ram == 5 * GiB
    assert budgets(fake_hw(), None, 3 * GiB).vram == 0  # no GPU: no VRAM budget
    assert budgets(fake_hw(80 * GiB), None, None).vram == 80 * GiB - 4 * GiB
    assert budgets(fake_hw(80 * GiB), None, 2 * GiB).vram == 2 * GiB


def test_choose_gpu_layers(tiny_gguf: Path) -> None:
    info = read_gguf_file(tiny_gguf)
    assert choose_gpu_layers(info, num_ctx=512, vram_budget=0) == 0
    # llama.cpp's n_gpu_layers counts the output layer: every layer on the GPU is block_count + 1 (block_count
    # leaves layer 0 on the CPU, a CPU pass per token: 1.35x the time per token on an H200, docs/benchmarks.md)
    assert choose_gpu_layers(info, num_ctx=512, vram_budget=10 * GiB) == info.block_count + 1
    assert choose_gpu_layers(info, num_ctx=512, vram_budget=10 * GiB, requested=999) == info.block_count + 1
    assert choose_gpu_layers(info, num_ctx=512, vram_budget=0, requested=1) == 1
    counts = [choose_gpu_layers(info, num_ctx=512, vram_budget=b) for b in range(0, 4_000_000, 100_000)]
    assert counts == sorted(counts)


def test_the_split_follows_llama_cpps_placement(tiny_gguf: Path) -> None:
    """llama.cpp offloads the output layer first, then the repeating layers from the last: n_gpu_layers = 1 is the
    output alone, n_layer leaves layer 0 on the CPU, n_layer + 1 (or -1) is everything."""
    info = read_gguf_file(tiny_gguf)
    n = info.block_count
    cpu, out_only = estimate(info, num_ctx=512), estimate(info, num_ctx=512, n_gpu_layers=1)
    almost, full = estimate(info, num_ctx=512, n_gpu_layers=n), estimate(info, num_ctx=512, n_gpu_layers=-1)
    assert cpu.vram == 0 and out_only.vram >= out_only.output_weights > 0
    assert 0 < almost.vram < full.vram and almost.ram > full.ram
    assert full.n_gpu_layers == n + 1 and estimate(info, num_ctx=512, n_gpu_layers=10_000).vram == full.vram
    assert full.vram - almost.vram >= full.weights_per_layer[0]


def test_parse_llama_log() -> None:
    lines = [
        "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB",
        "load_tensors:        CUDA0 model buffer size =    10.00 MiB",
        "llama_kv_cache:        CPU KV buffer size =    45.00 MiB",
        "sched_reserve:        CPU compute buffer size =    99.38 MiB",
    ]
    out = parse_llama_log(lines)
    assert out.vram == 10 << 20
    assert abs(out.ram - int((92.10 + 45 + 99.38) * (1 << 20))) < 10


def llama_reported(path: Path, n_ctx: int) -> int:
    from tests.reference import run_llama

    _, stderr = run_llama(dict(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_gpu_layers=0, verbose=True))
    sizes = parse_llama_log(stderr.splitlines())
    assert sizes.ram > 0, stderr[-2000:]
    return sizes.total


@pytest.mark.parametrize("n_ctx", [512, 2048])
def test_estimate_within_15_percent_tiny(tiny_gguf: Path, n_ctx: int) -> None:
    est = estimate(read_gguf_file(tiny_gguf), num_ctx=n_ctx, num_batch=512)
    real = llama_reported(tiny_gguf, n_ctx)
    assert abs(est.total - real) / real < 0.15, (est.total, real)


@pytest.mark.real_model
@pytest.mark.parametrize("n_ctx", [512, 8192])
def test_estimate_within_15_percent_smollm2(n_ctx: int) -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not cached")
    est = estimate(read_gguf_file(path, max_array_keep=5), num_ctx=n_ctx, num_batch=512)
    real = llama_reported(path, n_ctx)
    assert abs(est.total - real) / real < 0.15, (est.total, real)
