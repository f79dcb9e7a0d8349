"""Hardware through llama.cpp's device registry: the probe child, its cache, visible-device filtering (NVML and
llama.cpp), per-GPU budgets, main_gpu and tensor_split, and /api/info and ``corral info`` on a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from daemon import hardware
from daemon.generation.inference import Inference
from daemon.hardware import (
    GPU,
    Device,
    Hardware,
    SystemMemoryProbe,
    budgets,
    detect,
    filter_cuda_visible,
    nvml_visible,
    offload_devices,
    run_probe,
)
from daemon.llama.probe import cpu_features, parse_system_info
from daemon.settings import Settings
from errors import InvalidRequest
from tests.conftest import REPO, start_daemon, stop_daemon
from tests.models import write_tiny_gguf

GiB = 1 << 30


# -- the probe on this (CPU-only) build -------------------------------------------------------------------------
def test_probe_child_prints_only_json_listing_the_cpu() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "daemon.llama.probe"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1  # nothing but the JSON object on stdout
    data = json.loads(lines[0])
    assert [d["type"] for d in data["devices"]] == ["cpu"]
    cpu = data["devices"][0]
    assert cpu["backend"] == "CPU" and cpu["name"] == "CPU" and cpu["memory_total"] > 0
    assert "CPU" in [b["name"] for b in data["backends"]]
    assert data["gpu_offload"] is False and data["max_devices"] >= 1
    assert data["system_info"].startswith("CPU :") and data["cpu_features"]
    assert set(data["cpu_features"]) <= set(parse_system_info(data["system_info"])["CPU"])
    assert not data["errors"]


def test_run_probe_and_detect_on_this_machine(tmp_path: Path) -> None:
    data, why = run_probe(os.environ)
    assert data is not None, why
    hw = detect(cache_dir=tmp_path)
    assert hw.probe == "ran"
    assert [(d.name, d.type, d.backend) for d in hw.devices] == [("CPU", "cpu", "CPU")]
    assert "CPU" in hw.backends and hw.cpu_features and hw.system_info
    assert hw.gpus == () and not hw.gpu_offload and hw.gpu_reason
    assert budgets(hw, None, None).vram == 0 and budgets(hw, None, None).gpu_budgets == ()


def test_detect_never_imports_llama_cpp_in_the_daemon(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from daemon.hardware import detect; "
        "hw = detect(cache_dir=Path(sys.argv[1])); hw2 = detect(cache_dir=Path(sys.argv[1])); "
        "assert hw.devices and hw2.probe.startswith('cached'), (hw.probe, hw2.probe); "
        "assert 'llama_cpp' not in sys.modules"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr


def test_parse_system_info_sections() -> None:
    text = (
        "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX = 1 | "
        "AVX512 = 0 | AMX_INT8 = 1 | REPACK = 1 | "
    )
    sections = parse_system_info(text)
    assert sections["CUDA"] == {"ARCHS": "890", "USE_GRAPHS": "1", "PEER_MAX_BATCH_SIZE": "128"}
    assert cpu_features(text) == ["SSE3", "AVX", "AMX_INT8", "REPACK"]  # only the CPU's "= 1" entries
    assert cpu_features("") == []


# -- failures never raise --------------------------------------------------------------------------------------
def _fake_python(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    monkeypatch.setattr(hardware.sys, "executable", str(script))


def test_a_crashing_probe_means_cpu_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_python(tmp_path, "echo 'ggml: fatal' >&2; kill -SEGV $$", monkeypatch)
    hw = detect(cache_dir=tmp_path / "cache", nvml=lambda: ((), "no NVML"))
    assert hw.gpus == () and not hw.gpu_offload
    assert "crashed (SIGSEGV)" in hw.gpu_reason and "ggml: fatal" in hw.gpu_reason
    assert hw.probe.startswith("failed:") and hw.devices == ()
    assert not list((tmp_path / "cache").glob("hardware-*.json"))  # a failure is not cached


def test_a_hanging_or_garbled_probe_means_cpu_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_python(tmp_path, "sleep 30", monkeypatch)
    data, why = run_probe(os.environ, timeout=0.5)
    assert data is None and "did not answer within 0.5s" in why
    _fake_python(tmp_path, "echo 'not json'; exit 0", monkeypatch)
    data, why = run_probe(os.environ)
    assert data is None and "probe failed" in why
    _fake_python(tmp_path, 'echo \'{"error": "ImportError: no llama_cpp"}\'; exit 2', monkeypatch)
    assert run_probe(os.environ) == (None, "the llama.cpp probe failed: ImportError: no llama_cpp")


# -- the cache ------------------------------------------------------------------------------------------------
def _probe_of(*devices: dict[str, Any], backends: tuple[str, ...] = ("CPU",)) -> dict[str, Any]:
    cpu = {
        "index": 0,
        "name": "CPU",
        "description": "Test CPU",
        "backend": "CPU",
        "type": "cpu",
        "memory_total": 64 * GiB,
        "memory_free": 64 * GiB,
        "device_id": "",
    }
    devs = [cpu, *({"index": i + 1, **d} for i, d in enumerate(devices))]
    return {
        "backends": [{"name": b, "devices": 1} for b in backends],
        "devices": devs,
        "gpu_offload": bool(devices),
        "max_devices": 16,
        "system_info": "CPU : AVX2 = 1 | AVX512 = 0 |",
        "cpu_features": ["AVX2"],
        "errors": [],
    }


class CountingProbe:
    def __init__(self, data: dict[str, Any] | None) -> None:
        self.data, self.calls, self.envs = data, 0, []  # type: ignore[var-annotated]

    def __call__(self, env: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
        self.calls += 1
        self.envs.append(dict(env))
        return (self.data, "") if self.data else (None, "boom")


def test_probe_result_is_cached_per_libraries_and_visible_devices(tmp_path: Path) -> None:
    probe = CountingProbe(_probe_of())
    env = {k: v for k, v in os.environ.items() if k not in hardware.VISIBLE_ENV}
    first = detect(environ=env, probe=probe, nvml=lambda: ((), "no NVML"), cache_dir=tmp_path)
    second = detect(environ=env, probe=probe, nvml=lambda: ((), "no NVML"), cache_dir=tmp_path)
    assert probe.calls == 1 and first.probe == "ran" and second.probe.startswith("cached")
    assert second.devices[0].description == "Test CPU" and second.cpu_features == ("AVX2",)
    detect(environ={**env, "CUDA_VISIBLE_DEVICES": ""}, probe=probe, nvml=lambda: ((), ""), cache_dir=tmp_path)
    assert probe.calls == 2  # another visible-devices value is another entry
    assert probe.envs[1]["CUDA_VISIBLE_DEVICES"] == ""  # the child inherits it: llama.cpp applies it too
    detect(environ=env, probe=probe, nvml=lambda: ((), ""), cache_dir=tmp_path, use_cache=False)
    assert probe.calls == 3
    key = hardware.cache_key(env)
    assert key is not None and key["libs"] and key["python"] == sys.executable


def test_cached_free_memory_of_a_non_nvidia_gpu_goes_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vulkan = {
        "name": "Vulkan0",
        "description": "AMD Radeon",
        "backend": "Vulkan",
        "type": "gpu",
        "memory_total": 16 * GiB,
        "memory_free": 12 * GiB,
        "device_id": "0000:03:00.0",
    }
    probe = CountingProbe(_probe_of(vulkan, backends=("CPU", "Vulkan")))
    env = {k: v for k, v in os.environ.items() if k not in hardware.VISIBLE_ENV}
    kw: dict[str, Any] = {"environ": env, "probe": probe, "nvml": lambda: ((), "no NVML"), "cache_dir": tmp_path}
    hw = detect(**kw)
    assert [(g.backend, g.name, g.free_vram) for g in hw.gpus] == [("Vulkan", "AMD Radeon", 12 * GiB)]
    detect(**kw)
    assert probe.calls == 1  # fresh enough
    monkeypatch.setattr(hardware, "FREE_MAX_AGE", -1.0)
    detect(**kw)
    assert probe.calls == 2  # too old to vouch for the GPU's free memory: asked again


# -- visible devices: NVML ---------------------------------------------------------------------------------------
NV = (
    GPU(
        0, "NVIDIA A", "GPU-aaaa1111", 24 * GiB, 20 * GiB, "550.1", "8.9", backend="CUDA", pci_bus_id="00000000:01:00.0"
    ),
    GPU(
        1, "NVIDIA B", "GPU-bbbb2222", 48 * GiB, 40 * GiB, "550.1", "8.6", backend="CUDA", pci_bus_id="00000000:41:00.0"
    ),
)


def fake_nvml() -> tuple[tuple[GPU, ...], str]:
    return NV, ""


def test_cuda_visible_devices_filters_nvml_by_index_and_uuid() -> None:
    names = lambda gpus: [(g.index, g.name) for g in gpus]  # noqa: E731
    assert names(filter_cuda_visible(NV, None)) == [(0, "NVIDIA A"), (1, "NVIDIA B")]
    assert filter_cuda_visible(NV, "") == ()
    assert names(filter_cuda_visible(NV, "1")) == [(0, "NVIDIA B")]  # renumbered, as CUDA does
    assert names(filter_cuda_visible(NV, "1,0")) == [(0, "NVIDIA B"), (1, "NVIDIA A")]
    assert names(filter_cuda_visible(NV, "GPU-bbbb2222")) == [(0, "NVIDIA B")]
    assert names(filter_cuda_visible(NV, " gpu-BBBB ,GPU-aaaa")) == [(0, "NVIDIA B"), (1, "NVIDIA A")]  # prefixes
    assert names(filter_cuda_visible(NV, "0,7,1")) == [(0, "NVIDIA A")]  # an invalid entry ends the list
    assert filter_cuda_visible(NV, "GPU-ffff") == ()
    assert filter_cuda_visible(NV, "-1") == ()


def test_empty_cuda_visible_devices_hides_nvml_gpus_and_free_vram() -> None:
    visible, why = nvml_visible({"CUDA_VISIBLE_DEVICES": ""}, fake_nvml)
    assert visible == () and "set and empty" in why
    assert nvml_visible({}, fake_nvml)[0] == NV
    assert SystemMemoryProbe(environ={}, nvml=fake_nvml).free_vram() == 60 * GiB
    assert SystemMemoryProbe(environ={"CUDA_VISIBLE_DEVICES": ""}, nvml=fake_nvml).free_vram() == 0
    assert SystemMemoryProbe(environ={"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}, nvml=fake_nvml).free_vram() == 40 * GiB


# -- visible devices: detect() with llama.cpp's devices ------------------------------------------------------------
CUDA_DEVS = (
    {
        "name": "CUDA0",
        "description": "NVIDIA A",
        "backend": "CUDA",
        "type": "gpu",
        "memory_total": 24 * GiB,
        "memory_free": 19 * GiB,
        "device_id": "0000:01:00.0",
    },
    {
        "name": "CUDA1",
        "description": "NVIDIA B",
        "backend": "CUDA",
        "type": "gpu",
        "memory_total": 48 * GiB,
        "memory_free": 39 * GiB,
        "device_id": "0000:41:00.0",
    },
)


def _detect(env: dict[str, str], devices: tuple[dict[str, Any], ...], tmp_path: Path) -> Hardware:
    probe = CountingProbe(_probe_of(*devices, backends=("CPU", "CUDA")))
    return detect(environ=env, probe=probe, nvml=fake_nvml, cache_dir=tmp_path, use_cache=False)


def test_detect_merges_nvml_into_llama_cpp_gpus(tmp_path: Path) -> None:
    hw = _detect({}, CUDA_DEVS, tmp_path)
    assert hw.gpu_offload
    assert [(g.index, g.device, g.name, g.uuid, g.compute_capability, g.free_vram) for g in hw.gpus] == [
        (0, "CUDA0", "NVIDIA A", "GPU-aaaa1111", "8.9", 20 * GiB),  # NVML's numbers win for NVIDIA
        (1, "CUDA1", "NVIDIA B", "GPU-bbbb2222", "8.6", 40 * GiB),
    ]
    b = budgets(hw, None, None)
    assert b.gpu_budgets == (20 * GiB - (24 * GiB // 20), 40 * GiB - (48 * GiB // 20))
    assert b.vram == sum(b.gpu_budgets)
    shared = budgets(hw, None, 30 * GiB)
    assert shared.vram == 30 * GiB and sum(shared.gpu_budgets) == 30 * GiB
    assert shared.gpu_budgets[1] > shared.gpu_budgets[0]


def test_detect_by_index_and_uuid(tmp_path: Path) -> None:
    # llama.cpp applies CUDA_VISIBLE_DEVICES itself (it shows only CUDA0 = the second card); NVML is filtered alike
    only_b = ({**CUDA_DEVS[1], "name": "CUDA0"},)
    for value in ("1", "GPU-bbbb2222"):
        hw = _detect({"CUDA_VISIBLE_DEVICES": value}, only_b, tmp_path)
        assert [(g.index, g.name, g.uuid) for g in hw.gpus] == [(0, "NVIDIA B", "GPU-bbbb2222")]
        assert dict(hw.visible_devices) == {"CUDA_VISIBLE_DEVICES": value}


def test_nvidia_details_follow_the_pci_id_whatever_order_cuda_counted_in(tmp_path: Path) -> None:
    # CUDA's default order (fastest first) made index 0 the second card in NVML's PCI order
    hw = _detect({"CUDA_VISIBLE_DEVICES": "0"}, ({**CUDA_DEVS[1], "name": "CUDA0"},), tmp_path)
    assert [(g.name, g.uuid, g.free_vram) for g in hw.gpus] == [("NVIDIA B", "GPU-bbbb2222", 40 * GiB)]


def test_empty_cuda_visible_devices_hides_every_cuda_gpu(tmp_path: Path) -> None:
    # even if a backend ignored the variable, corral hides those GPUs from detection and from the VRAM budget
    hw = _detect({"CUDA_VISIBLE_DEVICES": ""}, CUDA_DEVS, tmp_path)
    assert hw.gpus == () and not hw.gpu_offload
    assert "CUDA_VISIBLE_DEVICES is set and empty" in hw.gpu_reason
    assert budgets(hw, None, None).vram == 0 and budgets(hw, None, 8 * GiB).vram == 0
    assert len(hw.devices) == 3  # the registry is still shown as llama.cpp reported it


def test_other_backends_are_gpus_too_and_their_empty_variables_hide_them(tmp_path: Path) -> None:
    rocm = {
        "name": "ROCm0",
        "description": "AMD Instinct MI300X",
        "backend": "ROCm",
        "type": "gpu",
        "memory_total": 192 * GiB,
        "memory_free": 190 * GiB,
        "device_id": "0000:05:00.0",
    }
    hw = _detect({}, (rocm,), tmp_path)
    assert [(g.backend, g.name, g.free_vram, g.uuid) for g in hw.gpus] == [
        ("ROCm", "AMD Instinct MI300X", 190 * GiB, "")
    ]
    assert budgets(hw, None, None).vram > 180 * GiB
    assert _detect({"HIP_VISIBLE_DEVICES": ""}, (rocm,), tmp_path).gpus == ()
    vk = {**rocm, "name": "Vulkan0", "backend": "Vulkan"}
    assert _detect({"GGML_VK_VISIBLE_DEVICES": ""}, (vk,), tmp_path).gpus == ()


def test_offload_devices_follow_llama_cpp() -> None:
    def dev(i: int, name: str, kind: str, backend: str, pci: str = "") -> Device:
        return Device(i, name, name, backend, kind, GiB, GiB, pci)

    cpu, blas = dev(0, "CPU", "cpu", "CPU"), dev(1, "BLAS", "accel", "BLAS")
    igpu = dev(2, "Vulkan0", "igpu", "Vulkan")
    cuda, vk_same = dev(3, "CUDA0", "gpu", "CUDA", "0000:01:00.0"), dev(4, "Vulkan1", "gpu", "Vulkan", "0000:01:00.0")
    assert offload_devices((cpu, blas, igpu, cuda, vk_same)) == [cuda]  # one per PCI id; iGPUs only without a GPU
    assert offload_devices((cpu, igpu)) == [igpu]
    assert offload_devices((cpu, blas)) == []


# -- main_gpu and tensor_split ------------------------------------------------------------------------------------
def test_tensor_split_in_proportion_to_free_memory() -> None:
    place = Inference.gpu_placement
    budgets2 = (10 * GiB, 30 * GiB)
    assert place(budgets2, 35 * GiB) == (0, (0.25, 0.75))  # too big for one GPU: split by free memory
    assert place(budgets2, 5 * GiB) == (0, (1.0, 0.0))  # fits the main GPU: it alone holds the model
    assert place((), 5 * GiB) == (0, ()) and place((8 * GiB,), 5 * GiB) == (0, ())  # no split with one GPU or none
    assert place(budgets2, 0) == (0, ())  # nothing offloaded


def test_main_gpu_option_is_honoured() -> None:
    place = Inference.gpu_placement
    budgets2 = (10 * GiB, 30 * GiB)
    assert place(budgets2, 20 * GiB, 1) == (1, (0.0, 1.0))
    assert place(budgets2, 35 * GiB, 1) == (1, (0.25, 0.75))  # split, the small tensors on GPU 1
    assert place(budgets2, 20 * GiB, 5) == (0, (0.25, 0.75))
    assert place(budgets2, 5 * GiB, 5) == (0, (1.0, 0.0))  # beyond the visible GPUs: GPU 0
    with pytest.raises(InvalidRequest, match="main_gpu"):
        place(budgets2, 5 * GiB, -1)


def test_load_spec_fills_main_gpu_and_tensor_split(tmp_path: Path) -> None:
    from registry.gguf import read_gguf_file

    path = write_tiny_gguf(tmp_path / "t.gguf", context_length=512)
    inf = Inference(
        None,
        None,
        Settings.from_env({}),  # type: ignore[arg-type]
        vram_budget=20 * GiB,
        ram_budget=1 << 34,
        gpu_budgets=(8 * GiB, 12 * GiB),
    )
    ctx: Any = SimpleNamespace(
        params={},
        info=read_gguf_file(str(path)),
        model_path=path,
        adapters=(),
        stored=SimpleNamespace(manifest=SimpleNamespace(first=lambda media: None)),
    )
    spec = inf.load_spec(ctx, inf.options(ctx, {}))
    assert spec.num_gpu > 0 and (spec.main_gpu, spec.tensor_split) == (0, (1.0, 0.0))  # tiny: fits GPU 0
    spec = inf.load_spec(ctx, inf.options(ctx, {"main_gpu": 1}))
    assert (spec.main_gpu, spec.tensor_split) == (1, (0.0, 1.0))
    tight = Inference(
        None,
        None,
        Settings.from_env({}),  # type: ignore[arg-type]
        vram_budget=20 * GiB,
        ram_budget=1 << 34,
        gpu_budgets=(1000, 3000),
    )
    assert tight.gpu_placement(tight.gpu_budgets, 1 << 20) == (0, (0.25, 0.75))
    cpu = Inference(None, None, Settings.from_env({}), ram_budget=1 << 34)  # type: ignore[arg-type]
    spec = cpu.load_spec(ctx, cpu.options(ctx, {"main_gpu": 3}))
    assert (spec.num_gpu, spec.main_gpu, spec.tensor_split) == (0, 0, ())


# -- a real daemon ----------------------------------------------------------------------------------------------
def test_daemon_with_empty_cuda_visible_devices_shows_no_gpu(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CUDA_VISIBLE_DEVICES": ""})
    try:
        data = httpx.get(d.url + "/api/info", timeout=30).json()
        hw = data["hardware"]
        assert hw["gpus"] == [] and hw["gpu_offload"] is False
        assert data["budgets"]["vram"] == 0 and data["budgets"]["gpus"] == []
        assert hw["visible_devices"] == {"CUDA_VISIBLE_DEVICES": ""}
        assert [(x["name"], x["type"]) for x in hw["devices"]] == [("CPU", "cpu")]
        assert "CPU" in hw["backends"] and hw["cpu_features"] and hw["system_info"]
        settings = data["settings"]
        assert settings["num_parallel"] == 0 and settings["max_loaded_models"] == 0
        assert settings["ram_budget"] is None and "keep_alive" in settings
        text = d.cli("info")
        assert text.returncode == 0, text.stderr
        out = text.stdout
        assert "Device 0" in out and "CPU (cpu, CPU)" in out and "GiB total" in out
        assert "CPU features" in out and hw["cpu_features"][0] in out
        assert 'CUDA_VISIBLE_DEVICES=""' in out and "CORRAL_NUM_PARALLEL" in out and "VRAM budget" in out
    finally:
        stop_daemon(d)
