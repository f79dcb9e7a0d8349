"""What the machine has: CPU cores and instruction sets, RAM, and the devices the installed llama.cpp can use.

The devices come from llama.cpp's own ggml device registry, asked in a child process (``daemon/llama/probe.py``;
the daemon never imports llama_cpp), so whatever backend llama-cpp-python was built with (CUDA, Metal, ROCm/HIP,
Vulkan, SYCL) is found the same way. NVML (pynvml), where present, adds NVIDIA details (driver, compute capability,
UUID) and fresh free-memory numbers.

Visible-device variables: the probe child (and every runner) inherits ``CUDA_VISIBLE_DEVICES``,
``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES`` and ``GGML_VK_VISIBLE_DEVICES``, so llama.cpp applies them itself;
NVML's list is filtered the same way (indices, in NVML's PCI order, or UUIDs), and a variable that is set but empty
hides every GPU of its kind from detection and from the VRAM budget.

The probe's result is cached (``<user cache dir>/corral/hardware-<key>.json``): importing llama_cpp and initialising
a GPU backend costs from 0.2 s (CPU only) to seconds (CUDA, ROCm) at every ``corral serve``, and the test suite
starts the daemon about a hundred times. The key is what decides the answer: the llama_cpp package's shared
libraries (paths, sizes, mtimes), the Python executable, the visible-device variables and the boot time (a new GPU
or driver means a reboot). On a hit, free memory is re-read cheaply: RAM from psutil, NVIDIA GPUs from NVML; a
Metal GPU's "free" is its static working-set limit, so the cached number is exact; any other GPU (ROCm, Vulkan,
SYCL, or CUDA without NVML) takes the cached number when it is under a minute old, else the probe runs again.

Nothing here fails: a probe that times out or crashes, no NVIDIA driver or no NVML simply means CPU only, with the
reason recorded.

Containers: psutil reports the host's RAM and cores, not a container's (a Kubernetes pod limited to 8 GiB on a
128 GiB node would budget ~115 GiB and be OOM-killed; one limited to 2 CPUs would start llama.cpp with a thread per
host core). :func:`read_cgroup_limits` reads the process's cgroups, v2 and v1, its own and every ancestor's (a limit
on a parent slice applies): the memory limit caps the total RAM, the limit less what the cgroup uses (less the page
cache it can drop) caps the available RAM, here and in :meth:`SystemMemoryProbe.free_ram`; the CPU quota (rounded
up) and the CPU affinity cap the core counts (a model's default ``num_thread`` is the physical ones; runners are
told the logical ones, ``LoadSpec.cpus``). :attr:`Hardware.limits` names what lowered what (``/api/info`` and the
startup log's ``limits`` line). No cgroup files (macOS, Windows) or unreadable ones mean no limits.

Unified memory: where the GPU's memory is the system's RAM (Apple Silicon's Metal GPU, and integrated GPUs, which
llama.cpp lists with the IGPU device type: Vulkan UMA, Jetson and GB10 CUDA, AMD APUs), RAM and VRAM are one memory.
Ollama treats these GPUs as integrated and counts the smaller of the GPU's and the system's free memory
(``server/sched.go``); corral marks them (:attr:`Hardware.unified_memory`), caps their VRAM budget at the RAM budget
and counts what a model puts on them against the RAM budget as well (:attr:`Budgets.shared`, used by the eviction
policy and by the sizing of a load), so one memory is never counted twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import psutil

from daemon.exits import signal_name

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

PROBE_TIMEOUT = 60.0  # CUDA/ROCm initialisation on a many-GPU machine can take several seconds
CACHE_VERSION = 1
FREE_MAX_AGE = 60.0  # seconds a cached free-memory number stands for a GPU nothing else can measure
CACHE_PRUNE_AGE = 30 * 86400.0
# Variables that change which devices llama.cpp sees (part of the cache key; shown by /api/info).
VISIBLE_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GGML_VK_VISIBLE_DEVICES",
    "ONEAPI_DEVICE_SELECTOR",
    "CUDA_DEVICE_ORDER",
)
# Backends that are not GPUs (the CPU, its helpers, remote servers corral does not configure).
CPU_BACKENDS = ("CPU", "BLAS", "AMX", "RPC", "ZenDNN", "OpenVINO-CPU")
# A variable set to "" hides every device of these ggml backends (CUDA and Vulkan do it themselves too).
EMPTY_HIDES = {
    "CUDA_VISIBLE_DEVICES": ("CUDA",),
    "HIP_VISIBLE_DEVICES": ("ROCm",),
    "ROCR_VISIBLE_DEVICES": ("ROCm",),
    "GGML_VK_VISIBLE_DEVICES": ("Vulkan",),
}


@dataclass(frozen=True)
class GPU:
    """A GPU llama.cpp can offload to; ``index`` is its place in llama.cpp's device list for a model (what
    ``main_gpu`` and ``tensor_split`` count)."""

    index: int
    name: str
    uuid: str
    total_vram: int
    free_vram: int
    driver: str
    compute_capability: str
    backend: str = ""  # the ggml backend: CUDA, Metal, ROCm, Vulkan, SYCL...
    description: str = ""
    type: str = "gpu"  # "gpu" or "igpu"
    device: str = ""  # llama.cpp's device name (CUDA0, Vulkan1, MTL0...)
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Device:
    """One entry of llama.cpp's device registry (CPU, GPUs, accelerators such as BLAS)."""

    index: int
    name: str
    description: str
    backend: str
    type: str  # "cpu", "gpu", "igpu", "accel"
    memory_total: int
    memory_free: int
    device_id: str = ""  # the PCI bus id where the backend knows it


@dataclass(frozen=True)
class Hardware:
    physical_cores: int
    logical_cores: int
    total_ram: int
    available_ram: int
    gpus: tuple[GPU, ...] = ()
    gpu_offload: bool = False
    gpu_reason: str = ""
    backends: tuple[str, ...] = ()
    devices: tuple[Device, ...] = ()
    cpu_features: tuple[str, ...] = ()
    system_info: str = ""
    probe: str = ""  # the llama.cpp probe: "ran", "cached 12s ago", "failed: ...", "not run"
    visible_devices: tuple[tuple[str, str | None], ...] = ()  # the VISIBLE_ENV variables that are set
    unified_memory: bool = False  # the usable GPUs' memory is the system's RAM (see the module docstring)
    # what lowered the RAM or CPU numbers above below the machine's (container limits, CPU affinity), one
    # human line each; empty when nothing did (see "container limits" below)
    limits: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [asdict(g) for g in self.gpus]
        out["devices"] = [asdict(d) for d in self.devices]
        out["backends"] = list(self.backends)
        out["cpu_features"] = list(self.cpu_features)
        out["visible_devices"] = dict(self.visible_devices)
        out["limits"] = list(self.limits)
        return out


# -- NVML ------------------------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pci_key(bus_id: str) -> tuple[int, int, int, int] | None:
    """``00000000:01:00.0`` (NVML) and ``0000:01:00.0`` (ggml) as one comparable value."""
    m = re.match(r"^\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", bus_id or "")
    return tuple(int(x, 16) for x in m.groups()) if m else None  # type: ignore[return-value]


def read_nvml() -> tuple[tuple[GPU, ...], str]:
    """Every NVIDIA GPU NVML sees, in NVML's (PCI) order, unfiltered; or none and why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pynvml's "deprecated, install nvidia-ml-py" FutureWarning
            import pynvml
    except Exception as exc:  # noqa: BLE001 - any import problem means no NVML
        return (), f"NVML not available: {exc}"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return (), f"no NVIDIA driver: {exc}"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
                cc = f"{major}.{minor}"
            except Exception:  # noqa: BLE001
                cc = ""
            try:
                bus = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            except Exception:  # noqa: BLE001
                bus = ""
            gpus.append(
                GPU(
                    index=i,
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    total_vram=int(mem.total),
                    free_vram=int(mem.free),
                    driver=driver,
                    compute_capability=cc,
                    backend="CUDA",
                    pci_bus_id=bus,
                )
            )
        return tuple(gpus), "" if gpus else "NVML found no GPUs"
    except Exception as exc:  # noqa: BLE001
        return (), f"NVML error: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def filter_cuda_visible(gpus: tuple[GPU, ...], value: str | None) -> tuple[GPU, ...]:
    """NVML's GPUs as CUDA_VISIBLE_DEVICES leaves them, renumbered in its order as CUDA does. Unset: all; empty:
    none; entries are indices (NVML's PCI order, as with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) or UUIDs (``GPU-...``,
    a unique prefix is enough); like CUDA, the first entry that names no device ends the list."""
    if value is None:
        return gpus
    chosen: list[GPU] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            break
        pick: GPU | None = None
        if re.fullmatch(r"[0-9]+", entry):
            n = int(entry)
            pick = gpus[n] if n < len(gpus) else None
        else:
            want = entry.lower()
            if not want.startswith(("gpu-", "mig-")):
                want = "gpu-" + want
            matches = [g for g in gpus if g.uuid.lower().startswith(want)]
            pick = matches[0] if len(matches) == 1 else None
        if pick is None:
            break
        if pick not in chosen:
            chosen.append(pick)
    return tuple(replace(g, index=i) for i, g in enumerate(chosen))


def nvml_visible(
    environ: Mapping[str, str] | None = None, nvml: Callable[[], tuple[tuple[GPU, ...], str]] | None = None
) -> tuple[tuple[GPU, ...], str]:
    """NVML's GPUs filtered by CUDA_VISIBLE_DEVICES, and why there are none."""
    gpus, reason = (nvml or read_nvml)()
    return _visible(gpus, reason, os.environ if environ is None else environ)


def _visible(gpus: tuple[GPU, ...], reason: str, env: Mapping[str, str]) -> tuple[tuple[GPU, ...], str]:
    value = env.get("CUDA_VISIBLE_DEVICES")
    visible = filter_cuda_visible(gpus, value)
    if gpus and not visible:
        reason = (
            "CUDA_VISIBLE_DEVICES is set and empty"
            if value == ""
            else f"CUDA_VISIBLE_DEVICES={value!r} names none of NVML's GPUs"
        )
    return visible, reason


# -- the llama.cpp probe ---------------------------------------------------------------------------------------
def run_probe(
    environ: Mapping[str, str] | None = None, timeout: float = PROBE_TIMEOUT
) -> tuple[dict[str, Any] | None, str]:
    """Run ``python -m daemon.llama.probe`` with this environment; its JSON, or None and why."""
    env = dict(os.environ if environ is None else environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "daemon.llama.probe"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"the llama.cpp probe did not answer within {timeout:g}s"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the llama.cpp probe could not start: {exc}"
    lines = [line for line in (r.stdout or "").splitlines() if line.strip()]
    data: Any = None
    if lines:
        try:
            data = json.loads(lines[-1])
        except ValueError:
            data = None
    tail = " ".join((r.stderr or "").strip().splitlines()[-3:])[-300:]
    if r.returncode < 0:
        return None, f"the llama.cpp probe crashed ({signal_name(-r.returncode)})" + (f": {tail}" if tail else "")
    if isinstance(data, dict) and data.get("error"):
        return None, f"the llama.cpp probe failed: {data['error']}"
    if r.returncode != 0 or not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        return None, f"the llama.cpp probe failed (exit {r.returncode})" + (f": {tail}" if tail else "")
    return data, ""


def _lib_dir(environ: Mapping[str, str]) -> Path | None:
    """Where llama-cpp-python loads its libraries from, found without importing it."""
    override = environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    try:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def cache_key(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """What decides the probe's answer (None: llama_cpp cannot be found, so nothing to cache)."""
    lib_dir = _lib_dir(environ)
    if lib_dir is None or not lib_dir.is_dir():
        return None
    libs = []
    for p in sorted(lib_dir.iterdir()):
        if any(s in p.name for s in (".so", ".dylib", ".dll")):
            try:
                st = p.stat()
            except OSError:
                continue
            libs.append([p.name, st.st_size, st.st_mtime_ns])
    if not libs:
        return None
    return {
        "v": CACHE_VERSION,
        "python": sys.executable,
        "lib_dir": str(lib_dir),
        "libs": libs,
        "env": {k: environ.get(k) for k in (*VISIBLE_ENV, "LLAMA_CPP_LIB_PATH")},
        "boot": int(psutil.boot_time()),
    }


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("corral", appauthor=False))


def _cache_file(cache_dir: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir / f"hardware-{digest}.json"


def _read_cache(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any], float] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("probe"), dict):
        return None
    return data["probe"], float(data.get("probed_at") or 0)


def _write_cache(path: Path, key: dict[str, Any], probe: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "probed_at": time.time(), "probe": probe}))
        os.replace(tmp, path)
        now = time.time()
        for old in path.parent.glob("hardware-*.json"):  # entries of libraries or settings long gone
            if old != path and now - old.stat().st_mtime > CACHE_PRUNE_AGE:
                old.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("hardware cache not written: %s", exc)


# -- container limits ------------------------------------------------------------------------------------------
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
V1_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages, ~2**63)


@dataclass(frozen=True)
class CgroupLimits:
    """The limits of this process's cgroups (its own and every ancestor up to the mount's root); None: none found.
    ``*_source`` says which file set each (the smallest one wins)."""

    memory_max: int | None = None  # bytes
    memory_max_source: str = ""
    memory_headroom: int | None = None  # the least of limit - (usage - inactive page cache) over the limited cgroups
    memory_headroom_source: str = ""
    cpu_quota: float | None = None  # CPUs (quota / period)
    cpu_quota_source: str = ""


def _read_small(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 16)
    except (OSError, ValueError):
        return None


def _int_in(path: Path) -> int | None:
    text = _read_small(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _stat_in(path: Path, *keys: str) -> int | None:
    """The first of ``keys`` found in a ``memory.stat`` file ("key value" lines)."""
    text = _read_small(path)
    if text is None:
        return None
    values: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            values.setdefault(parts[0], parts[1])
    for key in keys:
        try:
            return int(values[key])
        except (KeyError, ValueError):
            continue
    return None


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """``mount``/``path`` and each of its ancestors up to ``mount`` itself, the process's own cgroup first. The mount
    root is always there: in a container /proc/self/cgroup may name the host's path, which does not exist inside,
    while the mount root is the container's own cgroup."""
    parts = [p for p in path.strip().split("/") if p and p != "."]
    if ".." in parts:  # a cgroup outside this namespace's root: only the root is ours to read
        parts = []
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _memory_of(directory: Path, v2: bool) -> tuple[int, int, str] | None:
    """(limit, headroom, file name) of one cgroup directory, or None if it sets no memory limit. v2's
    ``memory.high`` counts as a limit too (systemd's MemoryHigh=): above it the kernel throttles the cgroup and
    reclaims hard, which a model's weights and KV cache would not survive at any useful speed."""
    inactive_keys: tuple[str, ...]
    names: tuple[str, ...]
    if v2:
        names, usage_name, inactive_keys = ("memory.max", "memory.high"), "memory.current", ("inactive_file",)
    else:  # v1's total_ counts the sub-cgroups too, as its usage does
        names, usage_name = ("memory.limit_in_bytes",), "memory.usage_in_bytes"
        inactive_keys = ("total_inactive_file", "inactive_file")
    found = [  # v2's "max" is no number: no limit
        (value, name) for name in names if (value := _int_in(directory / name)) is not None and 0 < value < V1_UNLIMITED
    ]
    if not found:
        return None
    limit, name = min(found)
    usage = _int_in(directory / usage_name)
    if usage is None or usage < 0:
        return limit, limit, name
    inactive = _stat_in(directory / "memory.stat", *inactive_keys) or 0
    return limit, max(0, limit - max(0, usage - max(0, inactive))), name


def _cpu_of(directory: Path, v2: bool) -> tuple[float, str] | None:
    """(CPUs, file name) of one cgroup directory's CFS quota, or None if it sets none."""
    if v2:
        fields = (_read_small(directory / "cpu.max") or "").split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        try:
            quota, period = int(fields[0]), int(fields[1])
        except ValueError:
            return None
        name = "cpu.max"
    else:
        q, p = _int_in(directory / "cpu.cfs_quota_us"), _int_in(directory / "cpu.cfs_period_us")
        if q is None or p is None:
            return None
        quota, period, name = q, p, "cpu.cfs_quota_us"
    if quota <= 0 or period <= 0:  # -1: no quota
        return None
    return quota / period, name


def read_cgroup_limits(cgroup_root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = PROC_CGROUP) -> CgroupLimits:
    """This process's memory and CPU limits from its cgroups, v2 (``0::/path``) and v1 (``4:memory:/path``, the
    ``memory`` and ``cpu``/``cpu,cpuacct`` controllers), each cgroup and its ancestors read; the smallest limit and
    the smallest headroom win. Never raises: a missing, unreadable or garbled file sets no limit, and where there
    are no cgroups (macOS, Windows, no /proc) there are no limits."""
    root = Path(cgroup_root)
    text = _read_small(Path(proc_cgroup))
    if not text:
        return CgroupLimits()
    # (directories, v2?) per controller
    memory_dirs: list[tuple[Path, bool]] = []
    cpu_dirs: list[tuple[Path, bool]] = []
    for line in text.splitlines():
        fields = line.strip().split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            # hybrid systems mount v2 under unified/, beside the v1 controllers (usually with none of its own)
            hybrid = not (root / "cgroup.controllers").exists() and (root / "unified").is_dir()
            dirs = _cgroup_dirs(root / "unified" if hybrid else root, path)
            memory_dirs += [(d, True) for d in dirs]
            cpu_dirs += [(d, True) for d in dirs]
            continue
        names = controllers.split(",")
        if "memory" in names:
            memory_dirs += [(d, False) for d in _cgroup_dirs(root / "memory", path)]
        if "cpu" in names:
            candidates = [controllers, "cpu,cpuacct", "cpu", "cpuacct,cpu"]
            mount = next((root / c for c in candidates if (root / c).is_dir()), root / controllers)
            cpu_dirs += [(d, False) for d in _cgroup_dirs(mount, path)]
    mem_max: tuple[int, str] | None = None
    headroom: tuple[int, str] | None = None
    for d, v2 in memory_dirs:
        got = _memory_of(d, v2)
        if got is None:
            continue
        limit, room, name = got
        if mem_max is None or limit < mem_max[0]:
            mem_max = (limit, f"{name} ({d})")
        if headroom is None or room < headroom[0]:
            headroom = (room, f"{name} ({d})")
    cpu: tuple[float, str] | None = None
    for d, v2 in cpu_dirs:
        got_cpu = _cpu_of(d, v2)
        if got_cpu is not None and (cpu is None or got_cpu[0] < cpu[0]):
            cpu = (got_cpu[0], f"{got_cpu[1]} ({d})")
    return CgroupLimits(
        memory_max=mem_max[0] if mem_max else None,
        memory_max_source=mem_max[1] if mem_max else "",
        memory_headroom=headroom[0] if headroom else None,
        memory_headroom_source=headroom[1] if headroom else "",
        cpu_quota=cpu[0] if cpu else None,
        cpu_quota_source=cpu[1] if cpu else "",
    )


def cpu_affinity() -> int | None:
    """How many CPUs this process may run on (``taskset``, a cpuset), or None where the OS cannot say (macOS)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return len(getaffinity(0)) or None
    except OSError:
        return None


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _capped_memory(total: int, available: int, lim: CgroupLimits) -> tuple[int, int, list[str]]:
    """(total, available) RAM under the cgroup limits, and a line for each limit that lowered one."""
    lines: list[str] = []
    if lim.memory_max is not None and lim.memory_max < total:
        total = lim.memory_max
        name, _, where = lim.memory_max_source.partition(" ")
        lines.append(f"cgroup {name} {_gib(lim.memory_max)} {where}".rstrip())
    if lim.memory_headroom is not None and lim.memory_headroom < available:
        available = lim.memory_headroom
        name, _, where = lim.memory_headroom_source.partition(" ")
        lines.append(
            f"cgroup memory free {_gib(available)} ({name} less the cgroup's usage, reclaimable page cache not "
            f"counted) {where}".rstrip()
        )
    return total, max(0, available), lines


def _capped_cores(physical: int, logical: int, lim: CgroupLimits, affinity: int | None) -> tuple[int, int, list[str]]:
    """(physical, logical) cores under the CPU affinity and the cgroup CPU quota, and a line for each that lowered
    the logical count."""
    lines: list[str] = []
    machine = logical
    if affinity is not None and affinity < logical:
        logical = affinity
        lines.append(f"CPU affinity {affinity} of {machine}")
    if lim.cpu_quota is not None and math.ceil(lim.cpu_quota) < logical:
        logical = max(1, math.ceil(lim.cpu_quota))
        name, _, where = lim.cpu_quota_source.partition(" ")
        lines.append(f"{name} quota {lim.cpu_quota:.1f} CPUs {where}".rstrip())
    return max(1, min(physical, logical)), max(1, logical), lines


# -- putting it together ---------------------------------------------------------------------------------------
def _devices(probe: dict[str, Any], available_ram: int) -> tuple[Device, ...]:
    out: list[Device] = []
    for d in probe.get("devices") or []:
        kind = str(d.get("type") or "")
        free = int(d.get("memory_free") or 0)
        if kind == "cpu":
            free = available_ram  # llama.cpp's CPU device reports its total as free; psutil knows better
        out.append(
            Device(
                index=int(d.get("index", len(out))),
                name=str(d.get("name") or ""),
                description=str(d.get("description") or ""),
                backend=str(d.get("backend") or ""),
                type=kind,
                memory_total=int(d.get("memory_total") or 0),
                memory_free=free,
                device_id=str(d.get("device_id") or ""),
            )
        )
    return tuple(out)


def offload_devices(devices: tuple[Device, ...]) -> list[Device]:
    """The devices llama.cpp spreads a model over, in its order (``llama_prepare_model_devices``): GPUs (one per
    PCI id, RPC excluded), then integrated GPUs of one backend only if there is no discrete GPU."""
    gpus: list[Device] = []
    igpus: list[Device] = []
    for d in devices:
        if d.type == "gpu" and d.backend != "RPC":
            if d.device_id and any(g.device_id == d.device_id for g in gpus):
                continue
            gpus.append(d)
        elif d.type == "igpu" and (not igpus or igpus[-1].backend == d.backend):
            igpus.append(d)
    return gpus or igpus


def shares_system_memory(gpu: GPU, system: tuple[str, str] | None = None) -> bool:
    """Whether ``gpu``'s memory is the system's RAM: an integrated GPU (llama.cpp's IGPU device type), or the Metal
    GPU of an Apple Silicon Mac. ``system`` is ``(sys.platform, platform.machine())``, replaceable (tests)."""
    os_name, machine = system or (sys.platform, platform.machine())
    if gpu.type == "igpu":
        return True
    return gpu.backend == "Metal" and os_name == "darwin" and machine.lower() in ("arm64", "aarch64")


def _hidden(environ: Mapping[str, str]) -> set[str]:
    return {b for var, backends in EMPTY_HIDES.items() if environ.get(var) == "" for b in backends}


def _merge_nvml(devs: list[Device], nvml: tuple[GPU, ...], nvml_all: tuple[GPU, ...] = ()) -> list[GPU | None]:
    """The NVML entry of each CUDA device: by PCI bus id among all NVML's GPUs (right whatever order CUDA
    counted CUDA_VISIBLE_DEVICES in), else by order among the visible ones when the counts agree."""
    cuda = [d for d in devs if d.backend == "CUDA"]
    by_pci = {_pci_key(g.pci_bus_id): g for g in (*nvml_all, *nvml) if _pci_key(g.pci_bus_id)}
    out: list[GPU | None] = []
    k = 0
    for d in devs:
        match: GPU | None = None
        if d.backend == "CUDA":
            key = _pci_key(d.device_id)
            if key is not None and key in by_pci and sum(_pci_key(c.device_id) == key for c in cuda) == 1:
                match = by_pci[key]
            elif len(cuda) == len(nvml):
                match = nvml[k]
            k += 1
        out.append(match)
    return out


def _gpus(
    devices: tuple[Device, ...], nvml: tuple[GPU, ...], hidden: set[str], nvml_all: tuple[GPU, ...] = ()
) -> tuple[GPU, ...]:
    devs = [d for d in offload_devices(devices) if d.backend not in hidden]
    gpus = []
    for i, (d, nv) in enumerate(zip(devs, _merge_nvml(devs, nvml, nvml_all), strict=True)):
        total = nv.total_vram if nv else d.memory_total
        free = nv.free_vram if nv else d.memory_free
        gpus.append(
            GPU(
                index=i,
                name=nv.name if nv else d.description or d.name,
                uuid=nv.uuid if nv else "",
                total_vram=total,
                free_vram=free,
                driver=nv.driver if nv else "",
                compute_capability=nv.compute_capability if nv else "",
                backend=d.backend,
                description=d.description,
                type=d.type,
                device=d.name,
                pci_bus_id=d.device_id or (nv.pci_bus_id if nv else ""),
            )
        )
    return tuple(gpus)


def _needs_fresh_probe(
    probe: dict[str, Any], age: float, nvml: tuple[GPU, ...], hidden: set[str], nvml_all: tuple[GPU, ...] = ()
) -> bool:
    """Whether a cached probe is too old to vouch for some GPU's free memory, or NVML disagrees with it."""
    devices = _devices(probe, 0)
    devs = [d for d in offload_devices(devices) if d.backend not in hidden]
    cuda_registered = any(b.get("name") == "CUDA" for b in probe.get("backends") or [] if isinstance(b, dict))
    if cuda_registered and nvml and len([d for d in devs if d.backend == "CUDA"]) != len(nvml):
        return True  # a GPU came or went under the same libraries and variables
    for d, nv in zip(devs, _merge_nvml(devs, nvml, nvml_all), strict=True):
        if nv is None and d.backend != "Metal" and age > FREE_MAX_AGE:
            return True
    return False


def detect(
    *,
    check_offload: bool = True,
    environ: Mapping[str, str] | None = None,
    nvml: Callable[[], tuple[tuple[GPU, ...], str]] | None = None,
    probe: Callable[[Mapping[str, str]], tuple[dict[str, Any] | None, str]] | None = None,
    cache_dir: Path | None = None,
    use_cache: bool = True,
    system: tuple[str, str] | None = None,
    cgroup_root: str | Path = CGROUP_ROOT,
    proc_cgroup: str | Path = PROC_CGROUP,
    affinity: Callable[[], int | None] = cpu_affinity,
) -> Hardware:
    """The machine as llama.cpp will see it. ``check_offload=False`` never starts the probe child (a cached answer
    is still used). RAM and cores are the machine's as far as this process's cgroup limits and CPU affinity allow
    (:func:`read_cgroup_limits`; :attr:`Hardware.limits` says what lowered them). ``nvml``, ``probe``,
    ``cache_dir``, ``system`` (``(sys.platform, platform.machine())``), ``cgroup_root``, ``proc_cgroup`` and
    ``affinity`` can be replaced (tests)."""
    env = os.environ if environ is None else environ
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    cgroup = read_cgroup_limits(cgroup_root, proc_cgroup)
    total_ram, available_ram, limits = _capped_memory(int(vm.total), int(vm.available), cgroup)
    physical, logical, cpu_limits = _capped_cores(physical, logical, cgroup, affinity())
    limits += cpu_limits
    nv_all, nv_raw_reason = (nvml or read_nvml)()
    nv_gpus, nv_reason = _visible(nv_all, nv_raw_reason, env)
    hidden = _hidden(env)

    key = cache_key(env) if use_cache else None
    path = _cache_file(cache_dir or default_cache_dir(), key) if key else None
    cached = _read_cache(path, key) if path and key else None
    data: dict[str, Any] | None = None
    source, failure = "", ""
    if cached is not None:
        age = max(0.0, time.time() - cached[1])
        if not (check_offload and _needs_fresh_probe(cached[0], age, nv_gpus, hidden, nv_all)):
            data, source = cached[0], f"cached {age:.0f}s ago"
    if data is None and check_offload:
        data, failure = (probe or run_probe)(env)
        if data is not None:
            source = "ran"
            if path and key:
                _write_cache(path, key, data)
        else:
            source = f"failed: {failure}"
            log.warning("hardware: %s; running on the CPU only", failure)
    elif data is None:
        source, failure = "not run", "llama.cpp was not asked (check_offload=False)"

    devices = _devices(data, available_ram) if data else ()
    gpus = _gpus(devices, nv_gpus, hidden, nv_all) if data else ()
    offload = bool(gpus) and bool(data and data.get("gpu_offload", True))
    reason = ""
    if not gpus:
        hid = [f"{v} is set and empty" for v in EMPTY_HIDES if env.get(v) == ""]
        gpu_backends = [
            str(b.get("name"))
            for b in (data or {}).get("backends") or []
            if isinstance(b, dict) and b.get("name") not in CPU_BACKENDS
        ]
        if failure:
            reason = failure
        elif hid:
            reason = "no GPU visible: " + ", ".join(hid)
        elif gpu_backends:
            reason = (
                f"llama.cpp's {', '.join(gpu_backends)} backend sees no GPU "
                "(no driver, or a visible-devices variable names none)"
            )
        else:
            reason = (
                "this llama-cpp-python build has no GPU backend (it was built for the CPU only); "
                "see README 'GPU backends'"
            )
        if nv_gpus and not failure:
            reason += f"; NVML sees {len(nv_gpus)} NVIDIA GPU(s) ({', '.join(g.name for g in nv_gpus)})"
        elif nv_reason and not hid:
            reason += f"; {nv_reason}"
    return Hardware(
        physical_cores=physical,
        logical_cores=logical,
        total_ram=total_ram,
        available_ram=available_ram,
        gpus=gpus,
        gpu_offload=offload,
        gpu_reason=reason,
        backends=tuple(str(b.get("name") if isinstance(b, dict) else b) for b in (data or {}).get("backends") or []),
        devices=devices,
        cpu_features=tuple(str(f) for f in (data or {}).get("cpu_features") or []),
        system_info=str((data or {}).get("system_info") or ""),
        probe=source,
        visible_devices=tuple((k, env.get(k)) for k in VISIBLE_ENV if k in env),
        unified_memory=offload and any(shares_system_memory(g, system) for g in gpus),
        limits=tuple(limits),
    )


class MemoryProbe(Protocol):
    def free_ram(self) -> int: ...

    def free_vram(self) -> int: ...


class SystemMemoryProbe:
    """Free memory now. RAM: psutil's available RAM, no more than the headroom of this process's cgroups (read
    afresh at each call: a few small files). VRAM: NVML's visible GPUs (CUDA_VISIBLE_DEVICES applied); given the
    detected hardware, its usable GPUs, each with NVML's fresh number where NVML knows it and the detected one
    otherwise."""

    def __init__(
        self,
        hardware: Hardware | None = None,
        environ: Mapping[str, str] | None = None,
        nvml: Callable[[], tuple[tuple[GPU, ...], str]] | None = None,
        cgroup_root: str | Path = CGROUP_ROOT,
        proc_cgroup: str | Path = PROC_CGROUP,
    ) -> None:
        self.hardware, self.environ, self.nvml = hardware, environ, nvml
        self.cgroup_root, self.proc_cgroup = cgroup_root, proc_cgroup

    def free_ram(self) -> int:
        available = int(psutil.virtual_memory().available)
        return _capped_memory(available, available, read_cgroup_limits(self.cgroup_root, self.proc_cgroup))[1]

    def free_vram(self) -> int:
        visible, _ = nvml_visible(self.environ, self.nvml)
        if self.hardware is None:
            return sum(g.free_vram for g in visible)
        fresh = {g.uuid: g.free_vram for g in visible if g.uuid}
        usable = self.hardware.gpus if self.hardware.gpu_offload else ()
        return sum(fresh.get(g.uuid, g.free_vram) if g.uuid else g.free_vram for g in usable)


@dataclass(frozen=True)
class Budgets:
    ram: int
    vram: int
    ram_source: str = "default"
    vram_source: str = "default"
    notes: tuple[str, ...] = field(default=())
    gpu_budgets: tuple[int, ...] = ()  # per usable GPU, in llama.cpp's order (GPU.index); sums to ``vram``
    shared: bool = False  # the GPUs' memory is the RAM: what a model puts on them counts against ``ram`` too


def _share(total: int, weights: list[int]) -> tuple[int, ...]:
    """``total`` split in proportion to ``weights`` (equal parts when they are all zero), summing exactly."""
    if not weights:
        return ()
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    parts = [total * w // sum(weights) for w in weights]
    parts[max(range(len(parts)), key=lambda i: weights[i])] += total - sum(parts)
    return tuple(parts)


def gpu_reserve(g: GPU) -> int:
    return max(512 * MiB, g.total_vram // 20)


def budgets(hw: Hardware, ram_budget: int | None, vram_budget: int | None) -> Budgets:
    """Explicit budgets win; otherwise what is free less a reserve (RAM: max(1 GiB, 10%); VRAM: max(512 MiB, 5%)
    per GPU). An explicit VRAM budget is shared among the GPUs in proportion to what each has free."""
    if ram_budget is not None:
        ram, ram_src = ram_budget, "CORRAL_RAM_BUDGET"
    else:
        ram, ram_src = max(0, hw.available_ram - max(GiB, hw.total_ram // 10)), "free RAM less a reserve"
    usable = hw.gpus if hw.gpu_offload else ()
    per = [max(0, g.free_vram - gpu_reserve(g)) for g in usable]
    if vram_budget is not None:
        vram, vram_src = (vram_budget if usable else 0), "CORRAL_VRAM_BUDGET"
        per_gpu = _share(vram, per if any(per) else [g.free_vram for g in usable])
    else:
        vram, vram_src = sum(per), "free VRAM less a reserve"
        per_gpu = tuple(per)
    shared = bool(usable) and hw.unified_memory
    notes: tuple[str, ...] = ()
    if shared:  # one memory: the GPU can have no more of it than the RAM budget allows (Ollama: the smaller one)
        if vram > ram:
            per_gpu = _share(ram, list(per_gpu))
            vram, vram_src = ram, vram_src + ", capped at the RAM budget (unified memory)"
        notes = (
            "unified memory: the GPU's memory is the system's RAM, so a model counts once, against the RAM budget",
        )
    return Budgets(
        ram=ram,
        vram=vram,
        ram_source=ram_src,
        vram_source=vram_src,
        gpu_budgets=per_gpu,
        notes=notes,
        shared=shared,
    )


def describe(hw: Hardware, b: Budgets) -> list[str]:
    lines = [
        f"cpu physical_cores={hw.physical_cores} logical_cores={hw.logical_cores} "
        f"ram_total={hw.total_ram} ram_available={hw.available_ram} "
        f"features={','.join(hw.cpu_features) or '?'}"
    ]
    if hw.limits:
        lines.append("limits " + "; ".join(hw.limits))
    lines.append(f"llama.cpp backends={','.join(hw.backends) or 'none'} source={hw.probe or '?'}")
    for d in hw.devices:
        lines.append(
            f"device index={d.index} name={d.name} type={d.type} backend={d.backend} "
            f'description="{d.description}" memory_total={d.memory_total} memory_free={d.memory_free}'
        )
    for g in hw.gpus:
        lines.append(
            f'gpu index={g.index} name="{g.name}" backend={g.backend} vram_total={g.total_vram} '
            f"vram_free={g.free_vram} driver={g.driver or '-'} compute={g.compute_capability or '-'}"
        )
    if not hw.gpus or not hw.gpu_offload:
        lines.append(f"gpu none usable: {hw.gpu_reason or 'no GPU'}; running on the CPU")
    per = " per_gpu=" + ",".join(str(x) for x in b.gpu_budgets) if len(b.gpu_budgets) > 1 else ""
    lines.append(f"budgets ram={b.ram} ({b.ram_source}) vram={b.vram} ({b.vram_source}){per}")
    lines.extend(b.notes)
    return lines
