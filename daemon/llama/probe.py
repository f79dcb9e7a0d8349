"""The hardware probe child: asks the installed llama.cpp which backends and devices it can use.

Run as ``python -m daemon.llama.probe``; it prints one JSON object on stdout and nothing else (llama.cpp's
logging is silenced and anything a backend writes to fd 1 is sent to stderr). The daemon never imports llama_cpp
itself (``daemon/hardware.py`` runs this with a timeout): a GPU driver that hangs or crashes while a backend
initialises costs a failed probe, never the daemon.

What it reports: the ggml backend registry (``CPU``, ``CUDA``, ``Metal``, ``ROCm``, ``Vulkan``, ``SYCL``...), every
device with its type, backend and memory, ``llama_supports_gpu_offload()``, ``llama_max_devices()``, and the CPU's
instruction sets as llama.cpp's system info lists them. Visible-device variables (``CUDA_VISIBLE_DEVICES``,
``HIP_VISIBLE_DEVICES``, ``GGML_VK_VISIBLE_DEVICES``...) are inherited, so llama.cpp applies them itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

# enum ggml_backend_dev_type (ggml/include/ggml-backend.h in llama-cpp-python 0.3.36's vendored llama.cpp)
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """``llama_print_system_info()`` as sections: ``"CUDA : ARCHS = 890 | CPU : SSE3 = 1 | AVX = 1 |"`` ->
    ``{"CUDA": {"ARCHS": "890"}, "CPU": {"SSE3": "1", "AVX": "1"}}``. A ``NAME : `` prefix starts a section."""
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for raw in text.split("|"):
        item = raw.strip()
        if not item:
            continue
        if " : " in item or item.endswith(" :"):
            head, _, item = item.partition(":")
            current = head.strip()
            sections.setdefault(current, {})
            item = item.strip()
            if not item:
                continue
        key, eq, value = item.partition("=")
        sections.setdefault(current, {})[key.strip()] = value.strip() if eq else ""
    return sections


def cpu_features(text: str) -> list[str]:
    """The CPU section's entries that are ``= 1`` (instruction sets such as AVX2, AVX512, AMX_INT8, and build
    features such as OPENMP, REPACK), in llama.cpp's order."""
    return [k for k, v in parse_system_info(text).get("CPU", {}).items() if v == "1"]


class _Caps(ctypes.Structure):
    _fields_ = [
        ("async_", ctypes.c_bool),
        ("host_buffer", ctypes.c_bool),
        ("buffer_from_host_ptr", ctypes.c_bool),
        ("events", ctypes.c_bool),
        ("mmap_support", ctypes.c_bool),
    ]


class _Props(ctypes.Structure):
    """struct ggml_backend_dev_props, with spare room at the end in case a later version grows it."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", _Caps),
        ("_spare", ctypes.c_char * 256),
    ]


def bind(libs: list[Any], name: str, restype: Any, argtypes: list[Any]) -> Any:
    """The C function ``name`` from the first of ``libs`` that exports it, typed; None when none does."""
    for lib in libs:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        fn.restype, fn.argtypes = restype, argtypes
        return fn
    return None


class _Ggml:
    """The ggml backend-registry functions, bound with ctypes on the libraries llama-cpp-python loaded (the
    registry enumeration lives in libggml, the device accessors in libggml-base; a dlsym on libggml's handle
    finds both, and libllama is tried too)."""

    def __init__(self, llama_cpp: Any) -> None:
        libs: list[Any] = []
        try:
            from llama_cpp import _ggml

            libs.append(_ggml.libggml)
        except Exception:  # noqa: BLE001 - an older or newer layout: fall back to libllama
            pass
        libs.append(llama_cpp.llama_cpp._lib)
        self.lib_dir = str(Path(getattr(llama_cpp.llama_cpp, "_base_path", "") or ""))
        base = Path(self.lib_dir)
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            if (base / name).is_file():
                try:
                    libs.append(ctypes.CDLL(str(base / name)))
                except OSError:
                    pass
                break
        self._libs = libs
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.reg_count = self._bind("ggml_backend_reg_count", sz, [])
        self.reg_get = self._bind("ggml_backend_reg_get", vp, [sz])
        self.reg_name = self._bind("ggml_backend_reg_name", ctypes.c_char_p, [vp])
        self.reg_dev_count = self._bind("ggml_backend_reg_dev_count", sz, [vp])
        self.dev_count = self._bind("ggml_backend_dev_count", sz, [])
        self.dev_get = self._bind("ggml_backend_dev_get", vp, [sz])
        self.dev_name = self._bind("ggml_backend_dev_name", ctypes.c_char_p, [vp])
        self.dev_description = self._bind("ggml_backend_dev_description", ctypes.c_char_p, [vp])
        self.dev_memory = self._bind("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self.dev_type = self._bind("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_backend_reg = self._bind("ggml_backend_dev_backend_reg", vp, [vp])
        self.dev_get_props = self._bind("ggml_backend_dev_get_props", None, [vp, ctypes.POINTER(_Props)], True)
        self.load_all_from_path = self._bind("ggml_backend_load_all_from_path", None, [ctypes.c_char_p], True)
        self.load_all = self._bind("ggml_backend_load_all", None, [], True)

    def _bind(self, name: str, restype: Any, argtypes: list[Any], optional: bool = False) -> Any:
        fn = bind(self._libs, name, restype, argtypes)
        if fn is None and not optional:
            raise RuntimeError(f"{name} is not exported by the llama.cpp libraries llama-cpp-python loaded")
        return fn

    def ensure_loaded(self) -> bool:
        """Builds with dynamically loaded backends (GGML_BACKEND_DL) register nothing until asked, as
        ``llama_supports_gpu_offload`` does; this build links its backends in, so this is usually a no-op."""
        if self.reg_count() > 0:
            return False
        if self.load_all_from_path is not None and self.lib_dir:
            self.load_all_from_path(self.lib_dir.encode())
        if self.reg_count() == 0 and self.load_all is not None:
            self.load_all()
        return True


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def probe() -> dict[str, Any]:
    import llama_cpp

    quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))  # also ggml's log (llama_log_set forwards it)
    g = _Ggml(llama_cpp)
    out: dict[str, Any] = {
        "llama_cpp_version": getattr(llama_cpp, "__version__", ""),
        "lib_dir": g.lib_dir,
        "errors": [],
    }
    out["dynamic_backends"] = g.ensure_loaded()
    backends = []
    for i in range(int(g.reg_count())):
        reg = g.reg_get(i)
        backends.append({"name": _text(g.reg_name(reg)), "devices": int(g.reg_dev_count(reg))})
    out["backends"] = backends
    devices = []
    for i in range(int(g.dev_count())):
        dev = g.dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        try:
            g.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        except Exception as exc:  # noqa: BLE001 - a device whose memory cannot be read still counts
            out["errors"].append(f"device {i}: memory: {exc}")
        kind = int(g.dev_type(dev))
        device_id = ""
        if g.dev_get_props is not None:
            props = _Props()
            try:
                g.dev_get_props(dev, ctypes.byref(props))
                device_id = _text(props.device_id)
            except Exception as exc:  # noqa: BLE001
                out["errors"].append(f"device {i}: props: {exc}")
        devices.append(
            {
                "index": i,
                "name": _text(g.dev_name(dev)),
                "description": _text(g.dev_description(dev)),
                "backend": _text(g.reg_name(g.dev_backend_reg(dev))),
                "type": DEVICE_TYPES.get(kind, f"unknown({kind})"),
                "memory_total": int(total.value),
                "memory_free": int(free.value),
                "device_id": device_id,
            }
        )
    out["devices"] = devices
    out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    out["max_devices"] = int(llama_cpp.llama_max_devices())
    info = _text(llama_cpp.llama_print_system_info())
    out["system_info"] = info.strip()
    out["cpu_features"] = cpu_features(info)
    return out


def main() -> int:
    # Keep the real stdout for the JSON; anything else written to fd 1 (a backend's printf) goes to stderr.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        result = probe()
        code = 0
    except Exception as exc:  # noqa: BLE001 - reported to the daemon as a failed probe
        result, code = {"error": f"{type(exc).__name__}: {exc}"}, 2
    out.write(json.dumps(result) + "\n")
    out.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
