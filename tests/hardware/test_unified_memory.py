"""Unified memory counted once (issue 25).

On an Apple Silicon Mac (Metal) and with integrated GPUs (llama.cpp's device type IGPU: Vulkan UMA, Jetson/GB10
CUDA, AMD APUs) the GPU's memory *is* the system's RAM. Budgeting RAM and VRAM separately there counts one memory
twice: a model with 10 GB on the "GPU" and 6 GB on the CPU would be accepted on a 16 GB machine. As Ollama does
(``server/sched.go`` ``availableMemoryForLoad``: for integrated GPUs the smaller of the GPU's and the system's free
memory; ``discover/llama_server.go``: the Apple Silicon Metal device is integrated), corral marks such GPUs, caps
their VRAM budget at the RAM budget, and counts a model's offloaded part against the RAM budget too, in the
eviction policy and when it sizes a load's slots. All with injected hardware descriptions: no GPU needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from daemon import hardware
from daemon.generation.inference import Inference
from daemon.hardware import GPU, Hardware, budgets, describe, detect
from daemon.runners.base import MemoryUse
from daemon.scheduling.eviction import Budget, Loaded, decide
from daemon.settings import Settings
from tests.hardware.test_devices import CountingProbe, _probe_of
from tests.models import write_tiny_gguf

GiB = 1 << 30
APPLE = {
    "name": "MTL0",
    "description": "Apple M3 Pro",
    "backend": "Metal",
    "type": "gpu",
    "memory_total": 12 * GiB,
    "memory_free": 12 * GiB,
    "device_id": "",
}
VULKAN_UMA = {**APPLE, "name": "Vulkan0", "description": "AMD Radeon 890M", "backend": "Vulkan", "type": "igpu"}
CUDA = {**APPLE, "name": "CUDA0", "description": "NVIDIA L4", "backend": "CUDA", "device_id": "0000:01:00.0"}


def detected(device: dict[str, Any], system: tuple[str, str], tmp_path: Path) -> Hardware:
    env = {k: v for k, v in os.environ.items() if k not in hardware.VISIBLE_ENV}
    probe = CountingProbe(_probe_of(device, backends=("CPU", str(device["backend"]))))
    return detect(environ=env, probe=probe, nvml=lambda: ((), "no NVML"), cache_dir=tmp_path, system=system)


def test_detect_knows_which_gpus_share_the_systems_memory(tmp_path: Path) -> None:
    assert detected(APPLE, ("darwin", "arm64"), tmp_path / "a").unified_memory  # Apple Silicon
    assert not detected(APPLE, ("darwin", "x86_64"), tmp_path / "b").unified_memory  # an Intel Mac's AMD GPU
    assert detected(VULKAN_UMA, ("linux", "x86_64"), tmp_path / "c").unified_memory  # llama.cpp's IGPU type
    hw = detected(CUDA, ("linux", "x86_64"), tmp_path / "d")
    assert hw.gpus and not hw.unified_memory  # a discrete GPU has its own memory
    assert hw.to_json()["unified_memory"] is False


def mac(unified: bool = True) -> Hardware:
    gpu = GPU(0, "Apple M3 Pro", "", 12 * GiB, 12 * GiB, "", "", backend="Metal", device="MTL0")
    return Hardware(8, 8, 16 * GiB, 12 * GiB, (gpu,), gpu_offload=True, unified_memory=unified)


def test_budgets_cap_a_shared_gpu_at_the_ram_budget_and_say_so() -> None:
    b = budgets(mac(), None, None)
    ram = 12 * GiB - (16 * GiB // 10)  # free RAM less a 10% reserve
    assert b.shared and b.ram == ram
    assert b.vram == ram and b.gpu_budgets == (ram,)  # 12 GiB free less 5%, capped at what RAM has
    assert any("unified" in line for line in describe(mac(), b))
    assert budgets(mac(), 4 * GiB, None).vram == 4 * GiB  # an explicit RAM budget caps it too
    discrete = budgets(mac(unified=False), None, None)
    assert not discrete.shared and discrete.vram == 12 * GiB - 12 * GiB // 20  # less its own reserve only


def test_eviction_counts_a_shared_gpus_part_against_ram_too() -> None:
    loaded = [Loaded("a", MemoryUse(ram=1 * GiB, vram=6 * GiB), busy=False, last_used=1.0)]
    need = MemoryUse(ram=1 * GiB, vram=5 * GiB)
    separate = Budget(ram=10 * GiB, vram=12 * GiB, max_loaded=0)
    assert decide(loaded, need, separate).action == "load"  # 2 GiB of RAM and 11 of VRAM: both "fit"
    shared = Budget(ram=10 * GiB, vram=10 * GiB, max_loaded=0, shared=True)
    d = decide(loaded, need, shared)
    assert d.action == "evict" and d.victims == ("a",)  # 13 GiB of one 10 GiB memory: the idle model goes
    too_big = decide([], MemoryUse(ram=4 * GiB, vram=7 * GiB), shared)
    assert too_big.action == "never" and "RAM" in too_big.reason and "GPU" in too_big.reason
    assert decide([], MemoryUse(ram=4 * GiB, vram=6 * GiB), shared).action == "load"  # exactly the budget


def test_slots_are_sized_counting_the_offloaded_part_once(tmp_path: Path) -> None:
    """With one memory, a load's slots (num_parallel) are chosen so weights, KV cache and buffers fit it whole,
    wherever llama.cpp puts them; with separate memories each part fits its own."""
    from registry.gguf import read_gguf_file

    path = write_tiny_gguf(tmp_path / "t.gguf", context_length=32768)
    ctx: Any = SimpleNamespace(
        params={}, info=read_gguf_file(str(path)), model_path=path, adapters=(), stored=SimpleNamespace()
    )

    def parallel(ram: int, vram: int, shared: bool) -> tuple[int, Any]:
        inf = Inference(
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            Settings.from_env({}),
            vram_budget=vram,
            ram_budget=ram,
            gpu_budgets=(vram,),
            shared_memory=shared,
        )
        n = inf.parallel_for(ctx, 32768, 512)
        layers = inf.choose_gpu_layers(ctx, 32768, 512, n)
        return n, inf._estimate(ctx, 32768, 512, n, layers)

    four = parallel(1 << 40, 1 << 40, False)[1]  # what four slots take, RAM and VRAM, with room for everything
    ram, vram = four.ram + four.vram // 2, four.vram  # each part fits its own; together they do not
    n, est = parallel(ram, vram, False)
    assert n == 4 and est.ram <= ram and est.vram <= vram
    n, est = parallel(ram, vram, True)
    assert n < 4 and est.ram + est.vram <= ram, (n, est)  # fewer slots: the whole load fits the one memory
