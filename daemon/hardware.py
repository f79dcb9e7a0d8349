"""What the machine has: CPU cores, RAM, NVIDIA GPUs (through NVML), and whether llama.cpp can offload.

Nothing here fails: no NVIDIA driver or no NVML simply means CPU only, with the reason recorded.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import psutil

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    uuid: str
    total_vram: int
    free_vram: int
    driver: str
    compute_capability: str


@dataclass(frozen=True)
class Hardware:
    physical_cores: int
    logical_cores: int
    total_ram: int
    available_ram: int
    gpus: tuple[GPU, ...] = ()
    gpu_offload: bool = False
    gpu_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [asdict(g) for g in self.gpus]
        return out


def _nvml() -> tuple[tuple[GPU, ...], str]:
    try:
        import pynvml
    except Exception as exc:  # noqa: BLE001 - any import problem means no NVML
        return (), f"NVML not available: {exc}"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return (), f"no NVIDIA driver: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            except Exception:  # noqa: BLE001
                cc = ""
            gpus.append(GPU(
                index=i,
                name=name.decode() if isinstance(name, bytes) else str(name),
                uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                total_vram=int(mem.total), free_vram=int(mem.free), driver=driver, compute_capability=cc,
            ))
        return tuple(gpus), "" if gpus else "NVML found no GPUs"
    except Exception as exc:  # noqa: BLE001
        return (), f"NVML error: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _llama_offload() -> bool:
    """Whether the installed llama-cpp-python was built with a GPU backend (asked in a child process, so the
    daemon itself never loads llama.cpp)."""
    import subprocess
    import sys

    try:
        r = subprocess.run(
            [sys.executable, "-c", "import llama_cpp; print(bool(llama_cpp.llama_supports_gpu_offload()))"],
            capture_output=True, text=True, timeout=60,
        )
        return r.stdout.strip().endswith("True")
    except (OSError, subprocess.SubprocessError):
        return False


def detect(*, check_offload: bool = True) -> Hardware:
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    gpus, reason = _nvml()
    offload = _llama_offload() if (check_offload and gpus) else False
    if gpus and not offload:
        reason = "this llama-cpp-python build cannot offload to a GPU (it was built for the CPU only)"
    return Hardware(physical_cores=physical, logical_cores=logical, total_ram=int(vm.total),
                    available_ram=int(vm.available), gpus=gpus, gpu_offload=offload, gpu_reason=reason)


class MemoryProbe(Protocol):
    def free_ram(self) -> int: ...

    def free_vram(self) -> int: ...


class SystemMemoryProbe:
    def free_ram(self) -> int:
        return int(psutil.virtual_memory().available)

    def free_vram(self) -> int:
        gpus, _ = _nvml()
        return sum(g.free_vram for g in gpus)


@dataclass(frozen=True)
class Budgets:
    ram: int
    vram: int
    ram_source: str = "default"
    vram_source: str = "default"
    notes: tuple[str, ...] = field(default=())


def budgets(hw: Hardware, ram_budget: int | None, vram_budget: int | None) -> Budgets:
    """Explicit budgets win; otherwise what is free less a reserve (RAM: max(1 GiB, 10%); VRAM: max(512 MiB, 5%))."""
    if ram_budget is not None:
        ram, ram_src = ram_budget, "CORRAL_RAM_BUDGET"
    else:
        ram, ram_src = max(0, hw.available_ram - max(GiB, hw.total_ram // 10)), "free RAM less a reserve"
    usable = hw.gpus if hw.gpu_offload else ()
    if vram_budget is not None:
        vram, vram_src = (vram_budget if usable else 0), "CORRAL_VRAM_BUDGET"
    else:
        vram = sum(max(0, g.free_vram - max(512 * MiB, g.total_vram // 20)) for g in usable)
        vram_src = "free VRAM less a reserve"
    return Budgets(ram=ram, vram=vram, ram_source=ram_src, vram_source=vram_src)


def describe(hw: Hardware, b: Budgets) -> list[str]:
    lines = [f"cpu physical_cores={hw.physical_cores} logical_cores={hw.logical_cores} "
             f"ram_total={hw.total_ram} ram_available={hw.available_ram}"]
    for g in hw.gpus:
        lines.append(f"gpu index={g.index} name=\"{g.name}\" vram_total={g.total_vram} vram_free={g.free_vram} "
                     f"driver={g.driver} compute={g.compute_capability}")
    if not hw.gpus or not hw.gpu_offload:
        lines.append(f"gpu none usable: {hw.gpu_reason or 'no GPU'}; running on the CPU")
    lines.append(f"budgets ram={b.ram} ({b.ram_source}) vram={b.vram} ({b.vram_source})")
    return lines
