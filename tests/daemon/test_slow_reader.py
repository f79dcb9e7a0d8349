"""A client that stops reading its answer is cut after a bound, and its generation is cancelled (issue 25).

A real daemon (with its write timeout lowered from 60 s to 2 s: nothing else differs) streams an endless
generation to a real socket that never reads, with a small receive buffer. Once the daemon's socket and transport
buffers are full, the client has 2 s to take bytes; it takes none, so the daemon must abort the connection, and
its runner slot must be free again (``/api/ps``), with the model still answering other clients.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import REPO, Daemon, free_port, stop_daemon
from tests.daemon.test_hardening_work import ENDLESS, busy_slots, create_endless

WRITE_TIMEOUT = 2.0
# `corral serve` with only Limits.write_timeout changed
LAUNCH = f"""
import dataclasses
from daemon.api import server
base = server.Limits.for_open_files.__func__
server.Limits.for_open_files = classmethod(
    lambda cls, nofile: dataclasses.replace(base(cls, nofile), write_timeout={WRITE_TIMEOUT})
)
from cli.main import main
raise SystemExit(main(["serve"]))
"""


def start_daemon_with_short_write_timeout(tmp: Path) -> Daemon:
    host = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    env.update({"CORRAL_HOST": host, "CORRAL_MODELS": str(tmp / "models"), "PYTHONPATH": str(REPO)})
    env["CORRAL_NUM_PARALLEL"] = "1"
    env["CORRAL_KV_DISK_DIR"] = str(tmp / "kv")  # never the user's own cache folder
    log = tmp / "daemon.log"
    logf = open(log, "wb")  # noqa: SIM115 - the daemon's, closed with it
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH], env=env, cwd=REPO, stdout=logf, stderr=logf)
    d = Daemon(url=f"http://{host}", host=host, models=tmp / "models", env=env, proc=proc, log=log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(d.url + "/api/version", timeout=1).status_code == 200:
                return d
        except httpx.HTTPError:
            time.sleep(0.1)
    stop_daemon(d)
    raise RuntimeError(f"daemon did not start:\n{log.read_text()}")


def daemon_holds(d: Daemon, client: socket.socket) -> bool:
    """Whether the daemon still has its end of ``client``'s connection open (its own view: the client is not
    told of a cut until it next sends)."""
    port = client.getsockname()[1]
    return any(c.raddr and c.raddr.port == port for c in psutil.Process(d.proc.pid).net_connections(kind="tcp"))


def test_a_client_that_stops_reading_is_cut_and_its_slot_freed(tmp_path: Path) -> None:
    d = start_daemon_with_short_write_timeout(tmp_path)
    try:
        create_endless(d, tmp_path)
        host, port = d.host.split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it announces
        s.connect((host, int(port)))
        # top_logprobs make each token's line ~1.3 KB, so the buffers fill within seconds even on a busy machine
        body = json.dumps(
            {"model": "endless", "prompt": "a b c", "logprobs": True, "top_logprobs": 20, "options": ENDLESS}
        ).encode()
        s.sendall(
            b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 20
        while not busy_slots(d) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy_slots(d) == 1  # generating for a client that reads nothing
        # the buffers fill (seconds), then 2 s without a byte taken: generous, since this bound is the property
        deadline = time.monotonic() + 90
        while daemon_holds(d, s) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not daemon_holds(d, s), "the daemon kept a connection whose client reads nothing"
        s.close()
        deadline = time.monotonic() + 10
        while busy_slots(d) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert busy_slots(d) == 0  # the generation was cancelled, its slot is free
        r = httpx.post(
            d.url + "/api/generate",
            timeout=60,
            json={"model": "endless", "prompt": "a", "stream": False, "options": {**ENDLESS, "num_predict": 3}},
        )
        assert r.status_code == 200 and r.json()["eval_count"] == 3
        assert "stopped reading its answer" in d.log.read_text()
    finally:
        stop_daemon(d)


# -- the daemon's own clock, where the kernel has none (no TCP_USER_TIMEOUT: macOS, Windows) --------------------
BIG = 64 * 1024 * 1024


async def big_answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app answering every request with BIG bytes, as fast as the connection takes them."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await receive()
    headers = [(b"content-length", str(BIG).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    chunk = b"x" * (1 << 20)
    for _ in range(BIG // len(chunk)):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def test_without_the_kernel_clock_a_full_buffer_starts_the_daemons(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from daemon.api import server as srv

    monkeypatch.delattr(socket, "TCP_USER_TIMEOUT", raising=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    s = srv.make_server(big_answer, limits=srv.Limits(write_timeout=1.0))
    t = threading.Thread(target=s.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog.set_level(logging.INFO, logger="daemon.api.server")
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not s.started and time.monotonic() < deadline:
            time.sleep(0.01)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(sock.getsockname())
        client.sendall(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        deadline = time.monotonic() + 30  # the buffers fill at once; then 1 s
        while not any("stopped reading" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("stopped reading" in r.getMessage() for r in caplog.records)
        assert s.gate.open == set()  # the connection is gone from the daemon's side
        client.settimeout(10)
        got = 0
        with pytest.raises(ConnectionResetError):  # a reset, not the rest of the answer
            while chunk := client.recv(1 << 20):
                got += len(chunk)
        assert got < BIG
        client.close()
    finally:
        s.should_exit = True
        t.join(15)
        sock.close()
