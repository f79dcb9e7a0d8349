"""The runner's half of llama.cpp's RPC backend (CORRAL_RPC_SERVERS; the daemon's half is ``daemon/rpc.py``).

Before the model is loaded, each server of ``LoadSpec.rpc_servers`` (already probed by the daemon, so each
answered a moment ago) is added as llama-server's ``--rpc`` does (``common/arg.cpp``: ``add_rpc_devices``): the
``RPC`` backend's ``ggml_backend_rpc_add_server`` (found with ``ggml_backend_reg_get_proc_address``) makes a
backend registry holding that server's devices, and ``ggml_backend_register`` adds it, so llama.cpp counts them
among the devices it offloads to: first in its list, before local GPUs (``llama_model_load``). The spec's
``tensor_split`` has one share per server, then one per local GPU; each server's share is spread over its devices
here, giving llama.cpp one entry per device.
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any

from daemon.llama.probe import bind
from daemon.runners.protocol import LoadSpec


class RpcUnavailable(RuntimeError):
    """This llama.cpp has no RPC backend, or a server could not be added."""


class _Ggml:
    """The few registry functions this needs, bound on the libraries llama-cpp-python loaded."""

    def __init__(self, lc: Any) -> None:
        low = lc.llama_cpp
        base = Path(str(getattr(low, "_base_path", "") or ""))
        self.lib_dir = str(base)
        libs: list[Any] = []
        for name in ("libggml.so", "libggml-base.so", "libggml.dylib", "libggml-base.dylib"):
            if (base / name).is_file():
                try:
                    libs.append(ctypes.CDLL(str(base / name)))  # the same handle llama-cpp-python's libllama uses
                except OSError:
                    pass
        libs.append(low._lib)
        self._libs = libs
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.reg_by_name = self._bind("ggml_backend_reg_by_name", vp, [ctypes.c_char_p])
        self.get_proc_address = self._bind("ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p])
        self.register = self._bind("ggml_backend_register", None, [vp])
        self.reg_dev_count = self._bind("ggml_backend_reg_dev_count", sz, [vp])

    def _bind(self, name: str, restype: Any, argtypes: list[Any]) -> Any:
        fn = bind(self._libs, name, restype, argtypes)
        if fn is None:
            raise RpcUnavailable(f"{name} is not exported by the llama.cpp libraries in {self.lib_dir}")
        return fn


_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_added: dict[str, int] = {}  # endpoint -> its device count, once per process (a second add would list them twice)


def add_servers(lc: Any, endpoints: tuple[str, ...]) -> list[int]:
    """Register every server's devices with llama.cpp; the device count of each, in order."""
    g = _Ggml(lc)
    reg = g.reg_by_name(b"RPC")
    if not reg:
        raise RpcUnavailable(
            f"the llama.cpp libraries in {g.lib_dir} have no RPC backend: run scripts/build-rpc.sh, or rebuild "
            'llama-cpp-python with CMAKE_ARGS="-DGGML_RPC=on", or set CORRAL_LLAMA_LIB_PATH'
        )
    address = g.get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not address:
        raise RpcUnavailable("llama.cpp's RPC backend does not offer ggml_backend_rpc_add_server")
    add = _ADD_SERVER(address)
    counts = []
    for endpoint in endpoints:
        if endpoint not in _added:
            server_reg = add(endpoint.encode())
            if not server_reg:
                raise RpcUnavailable(f"llama.cpp could not add the RPC server {endpoint} (it reports no devices)")
            g.register(server_reg)
            _added[endpoint] = int(g.reg_dev_count(server_reg))
        counts.append(_added[endpoint])
    return counts


def device_split(shares: tuple[float, ...], counts: list[int]) -> tuple[float, ...]:
    """llama.cpp's per-device ``tensor_split`` from one share per server (then one per local GPU): a server's
    share divided evenly among its devices. No shares: none (llama.cpp splits by free memory)."""
    if not shares:
        return ()
    out: list[float] = []
    for i, n in enumerate(counts):
        share = shares[i] if i < len(shares) else 0.0
        out.extend([share / max(1, n)] * max(1, n))
    out.extend(shares[len(counts) :])
    return tuple(out)


def prepare(lc: Any, spec: LoadSpec) -> LoadSpec:
    """Add ``spec``'s RPC servers to llama.cpp and return the spec whose ``tensor_split`` counts devices."""
    if not spec.rpc_servers:
        return spec
    counts = add_servers(lc, spec.rpc_servers)
    return dataclasses.replace(spec, tensor_split=device_split(spec.tensor_split, counts))
