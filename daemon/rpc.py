"""One model over several hosts: llama.cpp's RPC backend, the daemon's side (CORRAL_RPC_SERVERS, issue 30).

Each host that lends its memory and compute runs llama.cpp's ``rpc-server`` (``scripts/build-rpc.sh`` builds it
from the sources of the pinned llama-cpp-python); ``CORRAL_RPC_SERVERS=host:port,host:port`` makes every runner
register those servers as llama.cpp devices and offload layers to them, as ``llama-server --rpc`` does. This
module never imports llama_cpp (the runner's half is ``daemon/llama/rpc.py``):

* :func:`probe` speaks the first messages of llama.cpp's RPC protocol itself (a TCP connect, ``HELLO`` with the
  version check, ``DEVICE_COUNT`` and ``GET_DEVICE_MEMORY``), each step bounded by a short timeout, so a host that
  is down, a port where something else listens, a server of another protocol version or one busy with another
  client (an rpc-server serves one client at a time) is found out before llama.cpp touches it: llama.cpp aborts
  the process on an RPC failure, and waits forever on a server that accepts but does not answer.
* :class:`RpcPool` holds the servers, what each reported (its devices' free and total memory) and their budgets
  (free memory less a reserve): the offload budget of the memory estimate is the local GPUs' VRAM budget plus
  these, and a load's offloaded layers are spread over the servers and the local GPUs in proportion to their
  budgets (:func:`split`; llama.cpp puts RPC devices first in its device list). A server that does not answer
  when the daemon starts (down, not started yet: a compose file or a cluster starts hosts in any order, or busy)
  is probed again every ``RETRY_INTERVAL`` seconds (:meth:`RpcPool.watch`) and joins when it answers: its memory is
  added to the budget and the next loads offload to it.
* At each load (:func:`check_load`, from ``ProcessRunner.start``) every server of the spec is probed again; one
  that does not answer is left out of that load with a warning naming it and why, and its share of the layers
  stays on this host (the load's ``rpc`` facts in ``/api/ps`` say so): never a hang, never a failed load because
  a remote host is down.
* The libraries: the venv's llama-cpp-python is built without the RPC backend unless it was built with
  ``CMAKE_ARGS="-DGGML_RPC=on"``; then runners load the RPC-enabled libllama/libggml that build-rpc.sh put in its
  cache (or those in ``CORRAL_LLAMA_LIB_PATH``) through llama-cpp-python's ``LLAMA_CPP_LIB_PATH`` (and
  ``MTMD_CPP_LIB`` for the vision library), set in the runner's environment only (:func:`lib_dir`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30

# ggml/include/ggml-rpc.h and ggml/src/ggml-rpc/ggml-rpc.cpp of llama-cpp-python 0.3.36's llama.cpp
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24  # ggml/src/ggml-rpc/transport.h: all zero = plain TCP (no RDMA)
MAX_DEVICES = 16  # GGML_RPC_MAX_SERVERS; and llama.cpp's LLAMA_MAX_DEVICES bounds tensor_split

PROBE_TIMEOUT = 3.0  # seconds for each server's whole probe (connect, hello, device count and memory)
RETRY_INTERVAL = 5.0  # seconds between two probes of the configured servers that have not answered yet
RESERVE_SHARE = 0.10  # of each server device's total memory kept free (with at least RESERVE_MIN)
RESERVE_MIN = 512 * MiB

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")


class RpcSetupError(ValueError):
    """CORRAL_RPC_SERVERS or CORRAL_LLAMA_LIB_PATH cannot be used (the message says what to do)."""


def parse_servers(raw: str) -> tuple[str, ...]:
    """``CORRAL_RPC_SERVERS``: ``host:port`` entries, comma-separated (spaces ignored, duplicates once);
    ``[v6addr]:port`` for IPv6. A bad entry is an :class:`RpcSetupError` naming it."""
    out: list[str] = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        m = _ENDPOINT.match(entry)
        if m is None or not 0 < int(m.group("port")) < 65536:
            raise RpcSetupError(
                f"CORRAL_RPC_SERVERS: {entry!r} is not host:port (for example 192.168.1.20:50052; an IPv6 address "
                "in brackets: [fd00::2]:50052); separate servers with commas"
            )
        if entry not in out:
            out.append(entry)
    if len(out) > MAX_DEVICES:
        raise RpcSetupError(f"CORRAL_RPC_SERVERS names {len(out)} servers; llama.cpp takes at most {MAX_DEVICES}")
    return tuple(out)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


# -- the probe ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RpcDevice:
    index: int  # the device's number on its server
    free: int
    total: int


@dataclass(frozen=True)
class RpcServer:
    """What one server answered (``ok``), or why it did not (``error``)."""

    endpoint: str
    ok: bool
    error: str = ""
    version: str = ""
    devices: tuple[RpcDevice, ...] = ()
    seconds: float = 0.0  # how long the probe took

    @property
    def free(self) -> int:
        return sum(d.free for d in self.devices)

    @property
    def total(self) -> int:
        return sum(d.total for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoint": self.endpoint, "ok": self.ok}
        if self.ok:
            out["version"] = self.version
            out["devices"] = [dataclasses.asdict(d) for d in self.devices]
            out["memory_free"], out["memory_total"] = self.free, self.total
        else:
            out["error"] = self.error
        return out


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


def _recv_exact(sock: socket.socket, n: int, deadline: _Deadline) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(deadline.left())
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def _command(sock: socket.socket, cmd: int, payload: bytes, want: int, deadline: _Deadline) -> bytes:
    """One request (``cmd`` byte, u64 size, payload) and its answer (u64 size, that many bytes), which must be
    ``want`` bytes long."""
    sock.settimeout(deadline.left())
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8, deadline))
    if size != want:
        raise ValueError(f"answered {size} bytes where llama.cpp's RPC protocol v{RPC_PROTO_MAJOR} has {want}")
    return _recv_exact(sock, size, deadline)


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> RpcServer:
    """Ask the rpc-server at ``endpoint`` who it is and what memory it has, in at most ``timeout`` seconds."""
    started = time.monotonic()
    deadline = _Deadline(timeout)
    step = "connect"

    def done(**kw: Any) -> RpcServer:
        return RpcServer(endpoint=endpoint, seconds=round(time.monotonic() - started, 3), **kw)

    try:
        host, port = _host_port(endpoint)
        with socket.create_connection((host, port), timeout=deadline.left()) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            step = "hello"
            rsp = _command(sock, CMD_HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE, deadline)
            major, minor, patch = rsp[0], rsp[1], rsp[2]
            version = f"{major}.{minor}.{patch}"
            if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
                return done(
                    ok=False,
                    version=version,
                    error=f"speaks llama.cpp RPC protocol {version}, this llama.cpp speaks "
                    f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x: run the rpc-server that scripts/build-rpc.sh builds",
                )
            step = "device count"
            (count,) = struct.unpack("<I", _command(sock, CMD_DEVICE_COUNT, b"", 4, deadline))
            if count == 0:
                return done(ok=False, version=version, error="reports no devices")
            devices = []
            step = "device memory"
            for i in range(min(count, MAX_DEVICES)):
                free, total = struct.unpack(
                    "<QQ", _command(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16, deadline)
                )
                devices.append(RpcDevice(index=i, free=int(free), total=int(total)))
            return done(ok=True, version=version, devices=tuple(devices))
    except TimeoutError:
        why = (
            "did not accept a connection"
            if step == "connect"
            else "accepted the connection but did not answer the RPC hello (busy serving another client: an "
            "rpc-server serves one client at a time; or not an rpc-server)"
            if step == "hello"
            else f"stopped answering ({step})"
        )
        return done(ok=False, error=f"{why} within {timeout:g}s")
    except (OSError, ValueError) as exc:
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        return done(ok=False, error=f"{step}: {text}")


def probe_all(endpoints: Sequence[str], timeout: float = PROBE_TIMEOUT) -> tuple[RpcServer, ...]:
    """:func:`probe` of every server at once (in threads): at most ``timeout`` seconds in all."""
    if not endpoints:
        return ()
    with ThreadPoolExecutor(max_workers=min(len(endpoints), MAX_DEVICES)) as pool:
        return tuple(pool.map(lambda e: probe(e, timeout), endpoints))


# -- budgets and placement ---------------------------------------------------------------------------------------
def reserve(total: int) -> int:
    return max(RESERVE_MIN, int(total * RESERVE_SHARE))


def budget_of(server: RpcServer) -> int:
    """What a model may put on ``server``: each device's free memory less a reserve (0 when it did not answer)."""
    if not server.ok:
        return 0
    return sum(max(0, d.free - reserve(d.total)) for d in server.devices)


def split(rpc_budgets: Sequence[int], gpu_budgets: Sequence[int]) -> tuple[float, ...]:
    """``LoadSpec.tensor_split`` with RPC servers: one share per server (in CORRAL_RPC_SERVERS order), then one per
    local GPU, each in proportion to its budget (the runner spreads a server's share over that server's devices).
    All zero budgets: equal shares."""
    weights = [max(0, int(b)) for b in (*rpc_budgets, *gpu_budgets)]
    if not weights:
        return ()
    total = sum(weights)
    if total <= 0:
        return tuple(round(1 / len(weights), 6) for _ in weights)
    return tuple(round(w / total, 6) for w in weights)


def without(spec: Any, gone: Iterable[str]) -> Any:
    """``spec`` (a LoadSpec with ``rpc_servers``) without the servers in ``gone``: their entries leave
    ``tensor_split`` and their share of the offloaded layers (``num_gpu``) stays on this host (the CPU, as
    llama.cpp keeps layers that are not offloaded). With no server left and no local GPU share, nothing is
    offloaded."""
    gone = set(gone)
    servers = tuple(spec.rpc_servers)
    if not gone & set(servers):
        return spec
    shares = list(spec.tensor_split)
    if len(shares) < len(servers):  # no split given: llama.cpp's own (by free memory); count servers as equal
        shares = [1.0] * len(servers)
    total = sum(shares) or 1.0
    lost = sum(shares[i] for i, s in enumerate(servers) if s in gone) / total
    kept_servers = tuple(s for s in servers if s not in gone)
    kept_split = tuple(x for i, x in enumerate(shares) if i >= len(servers) or servers[i] not in gone)
    if lost >= 1 or not any(kept_split):
        kept_split, num_gpu = (), 0
    else:
        num_gpu = int(round(max(0, spec.num_gpu) * (1 - lost)))
    draft_gpu = spec.draft_num_gpu if num_gpu else 0
    return dataclasses.replace(
        spec, rpc_servers=kept_servers, tensor_split=kept_split, num_gpu=num_gpu, draft_num_gpu=draft_gpu
    )


# RPC buffers in a runner's load log: "RPC0[127.0.0.1:50052] model buffer size =   12.34 MiB"
_RPC_BUFFER = re.compile(r"RPC\d+\[([^\]]+)\]\s+(model|KV|compute|output|RS) buffer size\s*=\s*([\d.]+)\s*MiB")


def placement(log_lines: Iterable[str]) -> dict[str, int]:
    """Bytes each RPC server holds for a runner (weights, KV cache, compute buffer), from llama.cpp's load log."""
    out: dict[str, int] = {}
    for line in log_lines:
        m = _RPC_BUFFER.search(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + int(float(m.group(3)) * MiB)
    return out


@dataclass
class RpcLoad:
    """One load's RPC facts (``/api/ps``): the servers it uses, those left out and why, and the bytes each holds."""

    servers: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    num_gpu: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"servers": list(self.servers), "num_gpu": self.num_gpu}
        if self.bytes:
            out["bytes"] = dict(self.bytes)
        if self.skipped:
            out["skipped"] = dict(self.skipped)
        return out


async def check_load(
    spec: Any, logger: logging.Logger | None = None, timeout: float = PROBE_TIMEOUT
) -> tuple[Any, RpcLoad]:
    """Probe the servers of ``spec`` (a LoadSpec) before its runner starts: those that do not answer within
    ``timeout`` are left out (:func:`without`), with a warning naming each and why."""
    import asyncio

    lg = logger or log
    servers = tuple(spec.rpc_servers)
    results = await asyncio.to_thread(probe_all, servers, timeout)
    bad = {r.endpoint: r.error for r in results if not r.ok}
    for endpoint, why in bad.items():
        lg.warning(
            "RPC server %s is left out of this load of %s: %s; its share of the layers stays on this host",
            endpoint,
            spec.model_path,
            why,
        )
    effective = without(spec, bad) if bad else spec
    return effective, RpcLoad(servers=tuple(effective.rpc_servers), skipped=bad, num_gpu=effective.num_gpu)


# -- the libraries -----------------------------------------------------------------------------------------------
LIB_NAMES = ("libggml-rpc.so", "libggml-rpc.dylib", "ggml-rpc.dll")


def _has_rpc(directory: Path) -> bool:
    return any((directory / n).exists() for n in LIB_NAMES)


def llama_cpp_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama-cpp-python")
    except Exception:  # noqa: BLE001 - not installed: the pin's
        return "0.3.36"


def package_lib_dir() -> Path | None:
    """llama-cpp-python's own library directory, found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def build_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where scripts/build-rpc.sh puts its build: ``${CORRAL_RPC_CACHE:-~/.cache/corral-rpc}/<version>``."""
    env = os.environ if environ is None else environ
    root = env.get("CORRAL_RPC_CACHE") or str(Path.home() / ".cache" / "corral-rpc")
    return Path(root).expanduser() / llama_cpp_version()


def lib_dir(configured: str = "", environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory runners must load llama.cpp from to have the RPC backend: ``configured``
    (CORRAL_LLAMA_LIB_PATH) when set; None when the venv's llama-cpp-python has it already; else build-rpc.sh's
    cache. :class:`RpcSetupError` saying how to get one when none has it."""
    if configured:
        path = Path(configured).expanduser()
        if not path.is_dir() or not (path / "libllama.so").exists() and not (path / "libllama.dylib").exists():
            raise RpcSetupError(f"CORRAL_LLAMA_LIB_PATH={configured} is not a directory with libllama")
        if not _has_rpc(path):
            raise RpcSetupError(
                f"CORRAL_LLAMA_LIB_PATH={configured} has no libggml-rpc: build llama.cpp with -DGGML_RPC=ON "
                "(scripts/build-rpc.sh)"
            )
        return path
    own = package_lib_dir()
    if own is not None and _has_rpc(own):
        return None
    cache = build_cache_dir(environ) / "lib"
    if _has_rpc(cache) and (cache / "libllama.so").exists():
        return cache
    raise RpcSetupError(
        "CORRAL_RPC_SERVERS is set, but this llama-cpp-python was built without llama.cpp's RPC backend and no "
        f"RPC build was found in {cache}: run scripts/build-rpc.sh (it builds rpc-server and the libraries there), "
        'or rebuild llama-cpp-python with CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-binary '
        f"llama-cpp-python llama-cpp-python=={llama_cpp_version()}, or set CORRAL_LLAMA_LIB_PATH to a directory "
        "with RPC-enabled libllama and libggml"
    )


def runner_env(base: Mapping[str, str], libs: Path | None) -> dict[str, str]:
    """A runner's environment loading llama.cpp from ``libs`` (None: unchanged)."""
    env = dict(base)
    if libs is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(libs)
        env["MTMD_CPP_LIB"] = str(libs)  # llama-cpp-python's variable for libmtmd (the vision projector)
    return env


# -- the daemon's view -------------------------------------------------------------------------------------------
@dataclass
class RpcPool:
    """The configured servers, as they last answered (at startup, or since: :meth:`watch`), and the libraries
    runners that offload to them use."""

    endpoints: tuple[str, ...] = ()
    servers: tuple[RpcServer, ...] = ()
    libs: Path | None = None
    error: str = ""  # why RPC is off although servers are configured

    @classmethod
    def start(cls, endpoints: Sequence[str], lib_path: str = "", timeout: float = PROBE_TIMEOUT) -> RpcPool:
        """Check the libraries and probe every server (at most ``timeout`` seconds in all); nothing here fails:
        what is wrong is logged and shown in /api/info, and the daemon runs without the servers concerned."""
        endpoints = tuple(endpoints)
        if not endpoints:
            return cls()
        try:
            libs = lib_dir(lib_path)
        except RpcSetupError as exc:
            log.error("RPC off: %s", exc)
            return cls(endpoints=endpoints, error=str(exc))
        servers = probe_all(endpoints, timeout)
        for s in servers:
            if s.ok:
                _log_answer(s)
            else:
                log.warning(
                    "RPC server %s is not used yet: %s (probed again every %.0f s)", s.endpoint, s.error, RETRY_INTERVAL
                )
        return cls(endpoints=endpoints, servers=servers, libs=libs)

    async def watch(self, interval: float = RETRY_INTERVAL, timeout: float = PROBE_TIMEOUT) -> None:
        """Probe the servers that have not answered (or had no memory to lend) every ``interval`` seconds until
        each has; one that answers joins the pool (the budget and the next loads' split count it). The servers in
        use are not probed here: an rpc-server serves one client at a time, so a probe would find it busy with a
        runner; each load probes its own servers first (:func:`check_load`). Ends when every server is in."""
        import asyncio

        if self.libs is None:  # RPC is off (the libraries are missing): nothing to wait for
            return
        while waiting := [s.endpoint for s in self.servers if s not in self.active]:
            await asyncio.sleep(interval)
            fresh = {s.endpoint: s for s in await asyncio.to_thread(probe_all, waiting, timeout)}
            self.servers = tuple(fresh.get(s.endpoint, s) for s in self.servers)
            for s in fresh.values():
                if s in self.active:
                    _log_answer(s, " answers now", "; the next loads offload to it")

    @property
    def active(self) -> tuple[RpcServer, ...]:
        """The servers loads offload to: those that answered (at startup, or since) with memory to lend."""
        return tuple(s for s in self.servers if s.ok and budget_of(s) > 0)

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(budget_of(s) for s in self.active)

    @property
    def budget(self) -> int:
        return sum(self.budgets)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """The environment of a runner that offloads to the servers (its spec names them): the RPC-enabled
        libraries. None (the daemon's own) when RPC is off; a runner without servers is started with the daemon's
        own too (:func:`daemon.api.app.default_runner_factory`)."""
        if self.libs is None:
            return None
        return runner_env(os.environ if base is None else base, self.libs)

    def to_json(self) -> dict[str, Any]:
        return {
            "servers": [s.to_json() for s in self.servers]
            or [{"endpoint": e, "ok": False, "error": self.error} for e in self.endpoints],
            "active": [s.endpoint for s in self.active],
            "budget": self.budget,
            "lib_dir": "" if self.libs is None else str(self.libs),
            **({"error": self.error} if self.error else {}),
        }


def _log_answer(s: RpcServer, now: str = "", then: str = "") -> None:
    log.info(
        "RPC server %s%s: protocol %s, %d device(s), memory free=%d total=%d budget=%d%s",
        s.endpoint,
        now,
        s.version,
        len(s.devices),
        s.free,
        s.total,
        budget_of(s),
        then,
    )


def rpc_budgets(b: Any, pool: RpcPool) -> Any:
    """The daemon's budgets (``hardware.Budgets``) with the servers' memory added to the offload (VRAM) budget:
    what a model offloads may go to the local GPUs or the servers. ``gpu_budgets`` stays the local GPUs'."""
    extra = pool.budget
    if extra <= 0:
        return b
    return dataclasses.replace(
        b,
        vram=b.vram + extra,
        vram_source=f"{b.vram_source} + {len(pool.active)} llama.cpp RPC server(s) ({extra} bytes)",
        notes=(*b.notes, f"RPC servers {', '.join(s.endpoint for s in pool.active)} lend {extra} bytes to offloads"),
    )
