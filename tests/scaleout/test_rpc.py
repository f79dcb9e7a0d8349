"""One model over several hosts (issue 30): llama.cpp's RPC backend with real rpc-servers on 127.0.0.1.

The rpc-server and the RPC-enabled libraries come from scripts/build-rpc.sh (built by .ci/run before the suite;
the fixture runs it too, which does nothing once built). Every test starts and stops what it uses; the probes and
loads are bounded (daemon/rpc.py's PROBE_TIMEOUT), so a server that is down or silent costs seconds, never a hang.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from daemon import rpc
from daemon.runners.base import GenerateRequest, LoadSpec, SampleParams, Token
from daemon.runners.process import ProcessRunner, parse_llama_log
from tests.conftest import REPO, free_port, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

GREEDY = SampleParams(temperature=0, num_predict=24, repeat_penalty=1.0, seed=42)


# -- without servers: the protocol probe, the split, leaving a server out --------------------------------------------
def test_parse_servers() -> None:
    assert rpc.parse_servers(" 10.0.0.2:50052, host-b:1,[fd00::2]:50052,10.0.0.2:50052") == (
        "10.0.0.2:50052",
        "host-b:1",
        "[fd00::2]:50052",
    )
    for bad in ("10.0.0.2", "h:0", "h:99999", "h:p", "a b:1"):
        with pytest.raises(rpc.RpcSetupError, match="host:port"):
            rpc.parse_servers(bad)


def test_settings_refuse_a_bad_server() -> None:
    from daemon.settings import Settings, SettingsError

    assert Settings.from_env({"CORRAL_RPC_SERVERS": "127.0.0.1:50052"}).rpc_servers == ("127.0.0.1:50052",)
    with pytest.raises(SettingsError, match="CORRAL_RPC_SERVERS: '127.0.0.1' is not host:port"):
        Settings.from_env({"CORRAL_RPC_SERVERS": "127.0.0.1"})


def test_split_and_leaving_a_server_out() -> None:
    assert rpc.split([3, 1], []) == (0.75, 0.25)
    assert rpc.split([1, 1], [2]) == (0.25, 0.25, 0.5)
    assert rpc.split([0, 0], []) == (0.5, 0.5)
    spec = LoadSpec(model_path="m", num_gpu=9, rpc_servers=("a:1", "b:2"), tensor_split=(0.5, 0.5))
    one = rpc.without(spec, {"b:2"})
    assert one.rpc_servers == ("a:1",) and one.tensor_split == (0.5,) and one.num_gpu == 4  # b's half stays here
    none = rpc.without(spec, {"a:1", "b:2"})
    assert none.rpc_servers == () and none.tensor_split == () and none.num_gpu == 0
    with_gpu = LoadSpec(model_path="m", num_gpu=8, rpc_servers=("a:1",), tensor_split=(0.5, 0.5))
    gpu_only = rpc.without(with_gpu, {"a:1"})
    assert gpu_only.tensor_split == (0.5,) and gpu_only.num_gpu == 4  # the local GPU keeps its share
    assert rpc.without(spec, {"c:3"}) is spec


def test_device_split_spreads_a_server_over_its_devices() -> None:
    from daemon.llama.rpc import device_split

    assert device_split((0.5, 0.25, 0.25), [2, 1]) == (0.25, 0.25, 0.25, 0.25)
    assert device_split((), [1, 1]) == ()


def test_rpc_buffers_count_as_offloaded_memory() -> None:
    lines = [
        "load_tensors:   CPU_Mapped model buffer size =     2.00 MiB",
        "load_tensors: RPC0[127.0.0.1:5001] model buffer size =     3.00 MiB",
        "load_tensors: RPC0[127.0.0.1:5002] model buffer size =     1.50 MiB",
        "llama_kv_cache: RPC0[127.0.0.1:5001] KV buffer size =     1.00 MiB",
    ]
    assert rpc.placement(lines) == {"127.0.0.1:5001": 4 << 20, "127.0.0.1:5002": 3 << 19}
    use = parse_llama_log(lines)
    assert use.ram == 2 << 20 and use.vram == (4 << 20) + (3 << 19)


def test_probe_of_a_closed_port_is_quick_and_says_why() -> None:
    port = free_port()
    started = time.monotonic()
    r = rpc.probe(f"127.0.0.1:{port}", timeout=2.0)
    assert not r.ok and "connect" in r.error and "refused" in r.error.lower()
    assert time.monotonic() - started < 2.5


def test_probe_of_a_silent_server_is_bounded() -> None:
    """A port that accepts but never answers (a busy rpc-server serves one client at a time): the hello times out."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        started = time.monotonic()
        r = rpc.probe(f"127.0.0.1:{port}", timeout=1.0)
        took = time.monotonic() - started
    assert not r.ok and "did not answer the RPC hello" in r.error and "within 1s" in r.error
    assert took < 3.0


def _fake_server(major: int, devices: list[tuple[int, int]]) -> tuple[socket.socket, threading.Thread]:
    """A one-connection server speaking the probe's part of llama.cpp's RPC protocol."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def recv(c: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = c.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return buf

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            try:
                while True:
                    cmd, size = struct.unpack("<BQ", recv(c, 9))
                    payload = recv(c, size)
                    if cmd == rpc.CMD_HELLO:
                        out = bytes([major, 0, 0, 0]) + bytes(rpc.CONN_CAPS_SIZE)
                    elif cmd == rpc.CMD_DEVICE_COUNT:
                        out = struct.pack("<I", len(devices))
                    elif cmd == rpc.CMD_GET_DEVICE_MEMORY:
                        free, total = devices[struct.unpack("<I", payload)[0]]
                        out = struct.pack("<QQ", free, total)
                    else:
                        return
                    c.sendall(struct.pack("<Q", len(out)) + out)
            except ConnectionError:
                return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


def test_probe_reads_devices_and_memory() -> None:
    gib = 1 << 30
    srv, t = _fake_server(rpc.RPC_PROTO_MAJOR, [(6 * gib, 8 * gib), (2 * gib, 4 * gib)])
    with srv:
        r = rpc.probe(f"127.0.0.1:{srv.getsockname()[1]}", timeout=2.0)
        t.join(2)
    assert r.ok and r.version == f"{rpc.RPC_PROTO_MAJOR}.0.0"
    assert [(d.index, d.free, d.total) for d in r.devices] == [(0, 6 * gib, 8 * gib), (1, 2 * gib, 4 * gib)]
    assert rpc.budget_of(r) == (6 * gib - int(0.8 * gib)) + (2 * gib - 512 * (1 << 20))


def test_probe_refuses_another_protocol_version() -> None:
    srv, t = _fake_server(rpc.RPC_PROTO_MAJOR - 1, [(1, 1)])
    with srv:
        r = rpc.probe(f"127.0.0.1:{srv.getsockname()[1]}", timeout=2.0)
        t.join(2)
    assert not r.ok and "protocol" in r.error and "scripts/build-rpc.sh" in r.error


@pytest.mark.anyio
async def test_the_pool_takes_in_a_server_that_answers_later(tmp_path: Path) -> None:
    """RpcPool.watch probes the servers that did not answer again and takes in one that does; the others are
    waited for still, and the servers in use are not probed (an rpc-server serves one client at a time)."""
    import asyncio

    gib = 1 << 30
    srv, t = _fake_server(rpc.RPC_PROTO_MAJOR, [(6 * gib, 8 * gib)])  # answers one connection
    later, closed = f"127.0.0.1:{srv.getsockname()[1]}", f"127.0.0.1:{free_port()}"
    down = tuple(rpc.RpcServer(e, ok=False, error="connect: refused") for e in (later, closed))
    pool = rpc.RpcPool(endpoints=(later, closed), servers=down, libs=tmp_path)
    assert pool.active == () and pool.budget == 0
    assert pool.env() is not None and pool.env()["LLAMA_CPP_LIB_PATH"] == str(tmp_path)  # type: ignore[index]
    watching = asyncio.ensure_future(pool.watch(interval=0.05, timeout=1.0))
    try:
        deadline = time.monotonic() + 10
        while not pool.active:
            assert time.monotonic() < deadline, pool.servers
            await asyncio.sleep(0.02)
        assert [s.endpoint for s in pool.active] == [later]
        assert pool.budget == 6 * gib - int(0.8 * gib)
        await asyncio.sleep(0.3)  # more rounds: the closed one is still tried, the joined one left alone
        assert not watching.done() and [s.endpoint for s in pool.active] == [later]
    finally:
        watching.cancel()
        srv.close()
        t.join(2)
    assert rpc.RpcPool(endpoints=(closed,), servers=down[1:], libs=None).env() is None  # RPC off: nothing to wait


def test_missing_libraries_say_how_to_build_them(tmp_path: Path) -> None:
    if rpc.package_lib_dir() is not None and rpc._has_rpc(rpc.package_lib_dir()):  # type: ignore[arg-type]
        pytest.skip("this venv's llama-cpp-python was built with the RPC backend")
    with pytest.raises(rpc.RpcSetupError, match="scripts/build-rpc.sh") as info:
        rpc.lib_dir("", {"CORRAL_RPC_CACHE": str(tmp_path)})
    assert "GGML_RPC=on" in str(info.value)
    with pytest.raises(rpc.RpcSetupError, match="CORRAL_LLAMA_LIB_PATH"):
        rpc.lib_dir(str(tmp_path))
    pool = rpc.RpcPool.start(("127.0.0.1:1",), str(tmp_path))  # never fails: RPC off, with the reason
    assert pool.error and not pool.active and pool.to_json()["servers"][0]["ok"] is False


# -- real rpc-servers --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Build:
    server: Path
    lib: Path


@pytest.fixture(scope="module")
def build() -> Build:
    """scripts/build-rpc.sh's outputs (it returns at once when they exist; .ci/run builds them before the suite)."""
    try:
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "build-rpc.sh")], capture_output=True, text=True, timeout=3600
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"llama.cpp's rpc-server could not be built: {exc}")
    if done.returncode != 0:
        pytest.skip(f"llama.cpp's rpc-server could not be built (scripts/build-rpc.sh): {done.stderr[-800:]}")
    paths = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    return Build(server=Path(paths["rpc-server"]), lib=Path(paths["lib"]))


class Servers:
    def __init__(self, build: Build, n: int, log_dir: Path, ports: list[int] | None = None) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.endpoints: list[str] = []
        for i in range(n):
            port = ports[i] if ports else free_port()
            log = open(log_dir / f"rpc-server-{i}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen(
                [str(build.server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            self.procs.append(proc)
            self.endpoints.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        for endpoint, proc in zip(self.endpoints, self.procs, strict=True):
            while not rpc.probe(endpoint, timeout=1.0).ok:
                assert proc.poll() is None, f"rpc-server {endpoint} exited: {proc.returncode}"
                assert time.monotonic() < deadline, f"rpc-server {endpoint} did not come up"
                time.sleep(0.1)

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.stop(i)


@pytest.fixture
def servers(build: Build, tmp_path: Path) -> Iterator[Servers]:
    s = Servers(build, 2, tmp_path)
    try:
        yield s
    finally:
        s.close()


def _env(build: Build) -> dict[str, str]:
    return rpc.runner_env(os.environ, build.lib)


async def _run(spec: LoadSpec, env: dict[str, str] | None, prompt: str) -> tuple[str, ProcessRunner]:
    r = ProcessRunner(spec, env=env)
    await r.start()
    try:
        parts = []
        async for ev in r.generate(GenerateRequest(prompt=prompt, params=GREEDY)):
            if isinstance(ev, Token):
                parts.append(ev.text)
        return "".join(parts), r
    finally:
        await r.close()


@pytest.mark.anyio
async def test_a_runner_over_two_rpc_servers_answers_as_the_local_one(
    build: Build, servers: Servers, tmp_path: Path
) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    local, _ = await _run(LoadSpec(model_path=str(model), num_ctx=256), None, "a b c")
    spec = LoadSpec(
        model_path=str(model),
        num_ctx=256,
        num_gpu=5,  # every layer and the output: spread over the two servers
        rpc_servers=tuple(servers.endpoints),
        tensor_split=(0.5, 0.5),
    )
    remote, runner = await _run(spec, _env(build), "a b c")
    assert remote == local and local
    assert runner.rpc is not None and runner.rpc.servers == tuple(servers.endpoints) and not runner.rpc.skipped
    assert set(runner.rpc.bytes) == set(servers.endpoints) and all(b > 0 for b in runner.rpc.bytes.values())
    assert runner.memory.vram == sum(runner.rpc.bytes.values())


@pytest.mark.anyio
@pytest.mark.real_model
@pytest.mark.slow
async def test_smollm2_over_two_rpc_servers_answers_as_the_local_one(build: Build, servers: Servers) -> None:
    smol = smollm2_path()
    if smol is None:
        pytest.skip("SmolLM2 is not cached (scripts/fetch_smollm2.py)")
    prompt = "The capital of France is"
    local, _ = await _run(LoadSpec(model_path=str(smol), num_ctx=256, extra_bufts=False), None, prompt)
    spec = LoadSpec(
        model_path=str(smol),
        num_ctx=256,
        num_gpu=99,
        rpc_servers=tuple(servers.endpoints),
        tensor_split=(0.5, 0.5),
        extra_bufts=False,
    )
    remote, runner = await _run(spec, _env(build), prompt)
    assert remote == local and local.strip()
    assert runner.rpc is not None and set(runner.rpc.bytes) == set(servers.endpoints)


@pytest.mark.anyio
async def test_a_server_stopped_before_load_is_left_out_within_a_bound(
    build: Build, servers: Servers, tmp_path: Path
) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    local, _ = await _run(LoadSpec(model_path=str(model), num_ctx=256), None, "a b c")
    servers.stop(1)
    up, down = servers.endpoints
    spec = LoadSpec(model_path=str(model), num_ctx=256, num_gpu=5, rpc_servers=(up, down), tensor_split=(0.5, 0.5))
    started = time.monotonic()
    remote, runner = await _run(spec, _env(build), "a b c")
    assert time.monotonic() - started < 60  # the probe is bounded (3 s); the rest is a tiny model's load
    assert remote == local
    assert runner.rpc is not None and runner.rpc.servers == (up,)
    assert down in runner.rpc.skipped and "connect" in runner.rpc.skipped[down]
    assert set(runner.rpc.bytes) == {up}
    assert runner.spec.num_gpu == 2  # the stopped server's half of the layers stayed here


def _create(d: object, name: str, gguf: Path) -> None:
    import ollama

    client = ollama.Client(host=d.url)  # type: ignore[attr-defined]
    digest = client.create_blob(gguf)
    client.create(model=name, files={gguf.name: digest}, stream=False)


def _generate(h: httpx.Client, model: str) -> str:
    r = h.post(
        "/api/generate",
        json={
            "model": model,
            "prompt": "a b c",
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.0, "seed": 42},
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


def test_the_daemon_offloads_to_rpc_servers_and_shows_them(build: Build, servers: Servers, tmp_path: Path) -> None:
    """CORRAL_RPC_SERVERS end to end: the servers' memory in the budget, the model's layers on both servers (its
    answer the same as a daemon without them), /api/info and /api/ps say where; then a server stopped before the
    next load is left out, named, and the model still answers."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    plain = start_daemon(tmp_path / "plain", tmp_path / "plain.log")
    try:
        _create(plain, "tiny", model)
        with plain.client() as h:
            expected = _generate(h, "tiny")
    finally:
        stop_daemon(plain)
    d = start_daemon(
        tmp_path / "models",
        tmp_path / "daemon.log",
        {"CORRAL_RPC_SERVERS": ",".join(servers.endpoints), "CORRAL_LLAMA_LIB_PATH": str(build.lib)},
    )
    try:
        _create(d, "tiny", model)
        with d.client() as h:
            info = h.get("/api/info").json()
            assert info["rpc"]["active"] == servers.endpoints
            assert all(s["ok"] and s["memory_total"] > 0 for s in info["rpc"]["servers"])
            assert info["budgets"]["vram"] >= info["rpc"]["budget"] > 0
            shown = d.cli("info")
            assert shown.returncode == 0 and all(f"RPC server {e}" in shown.stdout for e in servers.endpoints)
            assert _generate(h, "tiny") == expected
            (loaded,) = h.get("/api/ps").json()["models"]
            assert loaded["rpc"]["servers"] == servers.endpoints
            assert set(loaded["rpc"]["bytes"]) == set(servers.endpoints)
            assert loaded["size_vram"] >= sum(loaded["rpc"]["bytes"].values()) > 0
            listed = d.cli("ps")
            assert (
                listed.returncode == 0
                and "tiny:latest has layers on RPC servers " + servers.endpoints[0] in listed.stdout
            )
            assert h.post("/api/generate", json={"model": "tiny", "keep_alive": 0}).status_code == 200
            deadline = time.monotonic() + 30
            while h.get("/api/ps").json()["models"]:
                assert time.monotonic() < deadline, "the model was not unloaded"
                time.sleep(0.1)
            servers.stop(1)
            started = time.monotonic()
            assert _generate(h, "tiny") == expected
            assert time.monotonic() - started < 60
            (loaded,) = h.get("/api/ps").json()["models"]
            assert loaded["rpc"]["servers"] == servers.endpoints[:1]
            assert servers.endpoints[1] in loaded["rpc"]["skipped"]
            assert f"left out (its layers stay here): {servers.endpoints[1]}: connect" in d.cli("ps").stdout
        log = (tmp_path / "daemon.log").read_text()
        assert f"RPC server {servers.endpoints[1]} is left out of this load" in log
    finally:
        stop_daemon(d)


def test_a_server_started_after_the_daemon_joins_and_the_next_load_uses_it(build: Build, tmp_path: Path) -> None:
    """Hosts start in any order (a compose file, a cluster): a server that is not up when the daemon starts is
    shown as such, probed again in the background, and joins when it answers; its memory is then in the budget and
    the next load offloads to it."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    d = start_daemon(
        tmp_path / "models",
        tmp_path / "daemon.log",
        {"CORRAL_RPC_SERVERS": endpoint, "CORRAL_LLAMA_LIB_PATH": str(build.lib)},
    )
    late: Servers | None = None
    try:
        _create(d, "tiny", model)
        with d.client() as h:
            info = h.get("/api/info").json()
            assert info["rpc"]["active"] == [] and not info["rpc"]["servers"][0]["ok"]
            assert info["rpc"]["budget"] == 0
            late = Servers(build, 1, tmp_path, ports=[port])
            deadline = time.monotonic() + 60  # probed again every rpc.RETRY_INTERVAL seconds
            while not (info := h.get("/api/info").json())["rpc"]["active"]:
                assert time.monotonic() < deadline, f"the server did not join: {info['rpc']}"
                time.sleep(0.2)
            assert info["rpc"]["active"] == [endpoint] and info["budgets"]["vram"] >= info["rpc"]["budget"] > 0
            _generate(h, "tiny")
            (loaded,) = h.get("/api/ps").json()["models"]
            assert loaded["rpc"]["servers"] == [endpoint] and loaded["rpc"]["bytes"][endpoint] > 0
        log = (tmp_path / "daemon.log").read_text()
        assert f"RPC server {endpoint} is not used yet" in log
        assert f"RPC server {endpoint} answers now" in log
    finally:
        stop_daemon(d)
        if late is not None:
            late.close()


@pytest.mark.anyio
async def test_a_second_runner_finds_the_servers_busy_and_stays_local(
    build: Build, servers: Servers, tmp_path: Path
) -> None:
    """An rpc-server serves one client at a time: a second model loaded while the first holds the servers finds
    them busy (the hello unanswered), is told so within the probe's bound and runs locally instead of waiting."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    local, _ = await _run(LoadSpec(model_path=str(model), num_ctx=256), None, "a b c")
    spec = LoadSpec(
        model_path=str(model), num_ctx=256, num_gpu=5, rpc_servers=tuple(servers.endpoints), tensor_split=(0.5, 0.5)
    )
    first = ProcessRunner(spec, env=_env(build))
    await first.start()
    try:
        assert first.rpc is not None and first.rpc.servers == tuple(servers.endpoints)
        started = time.monotonic()
        text, second = await _run(spec, _env(build), "a b c")
        assert time.monotonic() - started < 60
        assert text == local
        assert second.rpc is not None and second.rpc.servers == () and second.spec.num_gpu == 0
        assert all("busy" in second.rpc.skipped[e] for e in servers.endpoints)
    finally:
        await first.close()


@pytest.mark.anyio
async def test_an_embedding_runner_over_two_rpc_servers_gives_the_local_vectors(
    build: Build, servers: Servers, tmp_path: Path
) -> None:
    """Embedding runners go through llama.cpp's high-level API (its own tensor_split): the same vectors."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    vectors = []
    for spec, env in (
        (LoadSpec(model_path=str(model), num_ctx=256, embedding=True), None),
        (
            LoadSpec(
                model_path=str(model),
                num_ctx=256,
                embedding=True,
                num_gpu=5,
                rpc_servers=tuple(servers.endpoints),
                tensor_split=(0.5, 0.5),
            ),
            _env(build),
        ),
    ):
        r = ProcessRunner(spec, env=env)
        await r.start()
        try:
            vectors.append((await r.embed(["a b c"])).vectors[0])
        finally:
            await r.close()
    assert r.rpc is not None and set(r.rpc.bytes) == set(servers.endpoints)
    assert vectors[0] == pytest.approx(vectors[1], abs=1e-6)


@pytest.mark.anyio
async def test_a_server_lost_while_serving_ends_the_runner_without_a_native_fault(
    build: Build, servers: Servers, tmp_path: Path
) -> None:
    """llama.cpp aborts a process whose RPC server stops answering: the request gets an error naming the servers,
    not a native crash (no signal, so no safer configuration is learnt from it), and the next load leaves the dead
    server out."""
    from daemon.runners.base import RunnerCrashed

    model = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=4)
    spec = LoadSpec(
        model_path=str(model), num_ctx=256, num_gpu=5, rpc_servers=tuple(servers.endpoints), tensor_split=(0.5, 0.5)
    )
    env = {**_env(build), "GGML_NO_BACKTRACE": "1"}  # no gdb backtrace of the abort (seconds)
    r = ProcessRunner(spec, env=env)
    await r.start()
    try:
        servers.stop(1)
        with pytest.raises(RunnerCrashed, match="lost an RPC server") as info:
            async for _ev in r.generate(GenerateRequest(prompt="a b c", params=GREEDY)):
                pass
        assert info.value.signal is None and servers.endpoints[1] in str(info.value)
    finally:
        await r.close()
    again = ProcessRunner(spec, env=env)
    await again.start()
    try:
        assert again.rpc is not None and again.rpc.servers == (servers.endpoints[0],)
    finally:
        await again.close()
