"""Fixtures for the registry tests: Debian's real ``docker-registry`` (CNCF distribution) on 127.0.0.1 with a
temporary storage directory, a counting and throttling TCP proxy in front of it, the fake registry, and daemons
whose credentials file is a temporary one (never the machine's ``~/.docker/config.json``)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, free_port, start_daemon, stop_daemon
from tests.registry_pull.fake_registry import FakeRegistry, Holder, ServerThread

DOCKER_REGISTRY = shutil.which("docker-registry") or "/usr/bin/docker-registry"


@dataclass
class RealRegistry:
    host: str
    url: str
    root: Path
    proc: subprocess.Popen[bytes]


def start_registry(root: Path, *, htpasswd: Path | None = None) -> RealRegistry:
    if not Path(DOCKER_REGISTRY).is_file():
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    port = free_port()
    auth = ""
    if htpasswd is not None:
        auth = f"auth:\n  htpasswd:\n    realm: corral-test\n    path: {htpasswd}\n"
    config = root / "config.yml"
    root.mkdir(parents=True, exist_ok=True)
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n" + auth
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([DOCKER_REGISTRY, "serve", str(config)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited:\n{(root / 'registry.log').read_text()}")
        try:
            if httpx.get(url + "/v2/", timeout=1).status_code in (200, 401):
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("docker-registry did not start")
    return RealRegistry(host=f"127.0.0.1:{port}", url=url, root=root, proc=proc)


def stop_registry(r: RealRegistry) -> None:
    r.proc.terminate()
    try:
        r.proc.wait(10)
    except subprocess.TimeoutExpired:
        r.proc.kill()
        r.proc.wait(5)


@pytest.fixture(scope="module")
def docker_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRegistry]:
    """A real CNCF distribution registry (Debian's docker-registry) on an ephemeral 127.0.0.1 port."""
    r = start_registry(tmp_path_factory.mktemp("registry"))
    try:
        yield r
    finally:
        stop_registry(r)


class TCPProxy:
    """Forwards 127.0.0.1:<port> to an upstream port, counting bytes each way; ``rate`` throttles what flows
    back to the client (bytes per second per connection)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.host = f"127.0.0.1:{self.port}"
        self.rate: float | None = None
        self.down = 0  # upstream -> client
        self.up = 0  # client -> upstream
        self.lock = threading.Lock()
        self.closed = False
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.down = self.up = 0

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        began, sent = time.monotonic(), 0
        try:
            while data := src.recv(256 * 1024 if not self.rate else 16 * 1024):
                dst.sendall(data)
                sent += len(data)
                with self.lock:
                    if downstream:
                        self.down += len(data)
                    else:
                        self.up += len(data)
                rate = self.rate if downstream else None
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(min(ahead, 1.0))
                else:
                    began, sent = time.monotonic(), 0
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ServerThread]:
    with ServerThread(Holder()) as server:
        yield server


@pytest.fixture
def fake(fake_server: ServerThread) -> tuple[FakeRegistry, ServerThread]:
    """A fresh fake registry (served on the module's ephemeral port)."""
    registry = FakeRegistry()
    fake_server.app.app = registry
    return registry, fake_server


def registry_daemon(tmp_path: Path, name: str = "d", extra_env: dict[str, str] | None = None) -> Daemon:
    """A daemon whose credentials come from ``tmp_path/auth.json`` only."""
    env = {"CORRAL_REGISTRY_AUTH": str(tmp_path / "auth.json"), **(extra_env or {})}
    return start_daemon(tmp_path / f"models-{name}", tmp_path / f"daemon-{name}.log", env)


@pytest.fixture
def rdaemon(tmp_path: Path) -> Iterator[Daemon]:
    d = registry_daemon(tmp_path)
    try:
        yield d
    finally:
        stop_daemon(d)
