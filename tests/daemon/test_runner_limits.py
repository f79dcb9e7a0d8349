"""Runners' own limits and a clamped num_thread (issue 25).

The daemon raises its open-file limit to the hard limit (many connections); a runner gets the limit the daemon was
started with instead, and no core dumps (its memory holds users' prompts). A ``num_thread`` above this machine's
bound (4 per logical CPU: a model made on a bigger machine, or a request asking for more) is lowered to it when the
model loads, and the log says so, where it used to be refused with a 400 on every request.

Through a real daemon started with a lowered soft open-file limit, and a real llama.cpp runner: its
``/proc/<pid>/limits`` are read.
"""

from __future__ import annotations

import hashlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from modelfile.params import max_num_thread
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/limits")
STARTING_NOFILE = 777  # an odd number the daemon would never pick itself


def proc_limits(pid: int) -> dict[str, tuple[str, str]]:
    """``/proc/<pid>/limits`` as {name: (soft, hard)}."""
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        parts = line[26:].split()
        out[line[:26].strip()] = (parts[0], parts[1])
    return out


def runner_of(d: Daemon) -> psutil.Process:
    kids = [
        p for p in psutil.Process(d.proc.pid).children(recursive=True) if "daemon.llama.runner" in " ".join(p.cmdline())
    ]
    assert len(kids) == 1, [p.cmdline() for p in kids]
    return kids[0]


@pytest.fixture(scope="module")
def low_nofile_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= STARTING_NOFILE:
        pytest.skip(f"the hard open-file limit ({hard}) leaves the daemon nothing to raise")
    tmp = tmp_path_factory.mktemp("limits")
    resource.setrlimit(resource.RLIMIT_NOFILE, (STARTING_NOFILE, hard))  # what the daemon inherits
    try:
        d = start_daemon(tmp / "models", tmp / "daemon.log")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        data = write_tiny_gguf(tmp / "tiny.gguf").read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with httpx.Client(base_url=d.url, timeout=120) as h:
            assert h.post(f"/api/blobs/{digest}", content=data).status_code in (200, 201)
            r = h.post("/api/create", json={"model": "tiny", "files": {"tiny.gguf": digest}, "stream": False})
            assert r.status_code == 200, r.text
        yield d
    finally:
        stop_daemon(d)


def generate(d: Daemon, **options: object) -> httpx.Response:
    return httpx.post(
        d.url + "/api/generate",
        timeout=120,
        json={"model": "tiny", "prompt": "a", "stream": False, "options": {"num_predict": 2, **options}},
    )


def test_runner_gets_the_daemons_starting_open_file_limit_and_no_core_dumps(low_nofile_daemon: Daemon) -> None:
    d = low_nofile_daemon
    r = generate(d)
    assert r.status_code == 200, r.text
    daemon_nofile = proc_limits(d.proc.pid)["Max open files"]
    assert int(daemon_nofile[0]) > STARTING_NOFILE, daemon_nofile  # the daemon raised its own
    runner = proc_limits(runner_of(d).pid)
    print(f"daemon open files {daemon_nofile}; runner {runner['Max open files']}, core {runner['Max core file size']}")
    assert runner["Max open files"] == (str(STARTING_NOFILE), str(STARTING_NOFILE))
    assert runner["Max core file size"] == ("0", "0")
    assert "daemon.llama.runner" in " ".join(runner_of(d).cmdline())  # still found by its command line


def test_num_thread_above_the_machines_bound_runs_clamped_and_says_so(low_nofile_daemon: Daemon) -> None:
    d = low_nofile_daemon
    top = max_num_thread()
    for big in (top + 1, 1024):
        r = generate(d, num_thread=big)
        assert r.status_code == 200, r.text
    assert runner_of(d).num_threads() < top + 64  # llama.cpp's pool is `top` threads, not 1024
    deadline = time.monotonic() + 5
    while "asks for num_thread=1024" not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in d.log.read_text().splitlines() if "asks for num_thread=1024" in x)
    assert f"so it runs with {top}" in line, line
    # a negative count is still nonsense, refused naming the option
    r = generate(d, num_thread=-1)
    assert r.status_code == 400 and "num_thread" in r.json()["error"], r.text
