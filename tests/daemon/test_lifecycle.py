"""Daemon lifecycle: one daemon per store, and no runner outlives the daemon (SIGTERM or SIGKILL)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import REPO, Daemon, start_daemon


def load_tiny(d: Daemon, gguf: Path) -> int:
    import hashlib

    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=d.url, timeout=60) as h:
        h.post(f"/api/blobs/{digest}", content=data)
        h.post("/api/create", json={"model": "t", "files": {"t.gguf": digest}, "stream": False})
        assert h.post("/api/generate", json={"model": "t"}).json()["done_reason"] == "load"
    children = psutil.Process(d.proc.pid).children(recursive=True)
    assert len(children) == 1
    return children[0].pid


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_runner_outlives_the_daemon(tmp_path: Path, tiny_gguf: Path, sig: signal.Signals) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "log")
    try:
        runner = load_tiny(d, tiny_gguf)
        d.proc.send_signal(sig)
        code = d.proc.wait(20)
        if sig == signal.SIGTERM:
            assert code == 0, (tmp_path / "log").read_text()[-2000:]
        assert gone(runner, 5)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()


def test_second_daemon_on_same_store_refuses(daemon: Daemon) -> None:
    env = dict(daemon.env)
    env["CORRAL_HOST"] = "127.0.0.1:0"
    r = subprocess.run(
        [sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "already in use by corral (pid" in r.stderr and "CORRAL_MODELS" in r.stderr


def test_responses_are_not_held_back_by_nagle(tmp_path: Path) -> None:
    """On a kept-alive connection a response's body follows its headers at once. With Nagle's algorithm on the
    daemon's sockets the body waits for the client's delayed ACK (~40 ms on Linux) on every request after the
    first, and streamed tokens arrive in bursts. What prevents it is checked where it lives, without a clock: the
    socket the daemon listens on (``daemon.api.server.bind``), served by the event loop as uvicorn serves it,
    hands out connections with TCP_NODELAY set."""
    import asyncio
    import socket

    from daemon.api.server import bind
    from daemon.settings import Settings

    settings = Settings.from_env({"CORRAL_HOST": "127.0.0.1:0", "CORRAL_MODELS": str(tmp_path)})
    listener = bind(settings)
    seen: list[int] = []

    async def serve() -> None:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.05)
            writer.close()

    asyncio.run(serve())
    assert seen and seen[0] != 0, "the daemon's accepted connections have Nagle's algorithm on"
