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


def test_responses_are_not_held_back_by_nagle(daemon: Daemon) -> None:
    """On a kept-alive connection a response's body follows its headers at once. With Nagle's algorithm on the
    daemon's sockets the body waits for the client's delayed ACK (~40 ms on Linux) on every request after the
    first, and streamed tokens arrive in bursts."""
    import socket

    host, port = daemon.host.rsplit(":", 1)
    times = []
    with socket.create_connection((host, int(port))) as s:
        for _ in range(6):
            start = time.perf_counter()
            s.sendall(f"GET /api/version HTTP/1.1\r\nHost: {daemon.host}\r\n\r\n".encode())
            got = b""
            while b"}" not in got:
                chunk = s.recv(65536)
                assert chunk, "the daemon closed the connection"
                got += chunk
            times.append(time.perf_counter() - start)
    assert min(times[1:]) < 0.025, f"kept-alive responses took {[round(t * 1000) for t in times]} ms"
