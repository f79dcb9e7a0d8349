"""Helpers for the scale-out tests: corral replicas on fixed loopback ports (a replica restarted keeps its port, as a
pod behind a Service keeps its name), Debian's HAProxy in front of them with the configuration that
``packaging/haproxy/haproxy_cfg.py`` writes, and HAProxy's view of its servers (its CSV statistics)."""

from __future__ import annotations

import csv
import importlib.util
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, free_port

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
#: a chat template of few tokens (the tiny test model spells text byte by byte): turns stay cheap on a busy machine
TERSE_TEMPLATE = "{% for m in messages %}{{ m['role'][0] + ':' + m['content'] + '\n' }}{% endfor %}a:"


def haproxy_cfg() -> ModuleType:
    """packaging/haproxy/haproxy_cfg.py (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("haproxy_cfg", REPO / "packaging" / "haproxy" / "haproxy_cfg.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def need_haproxy() -> None:
    if not Path(HAPROXY).is_file():
        pytest.skip("haproxy is not installed (apt-get install haproxy; .ci/run installs it)")


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@dataclass
class Replica:
    name: str
    port: int
    models: Path
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        """Start ``corral serve`` on this replica's port and store (again, after a stop); returns once it answers
        (``wait``; else call :meth:`wait_up`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update(
            {
                "CORRAL_HOST": f"127.0.0.1:{self.port}",
                "CORRAL_MODELS": str(self.models),
                "CORRAL_KV_DISK_DIR": str(self.models.parent / f"kv-{self.name}"),
                "CORRAL_INSTANCE": self.name,
                "PYTHONPATH": str(REPO),
                **self.env,
            }
        )
        log = self.log.with_name(f"{self.log.stem}-{len(self.logs)}{self.log.suffix}")
        self.logs.append(log)
        out = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, stdout=out, stderr=out)
        if wait:
            self.wait_up()

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited with {self.proc.returncode}:\n{self.text()}")
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(f"replica {self.name} to answer", up, timeout=60)

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())


def stop_all(replicas: list[Replica]) -> None:
    """SIGTERM to all at once (each drains on its own), then wait for each."""
    for r in replicas:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.terminate()
    for r in replicas:
        r.stop()


@dataclass
class Balancer:
    port: int
    stats_port: int
    config: Path
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def servers(self) -> dict[str, str]:
        """Each replica's state as HAProxy sees it (UP, DOWN, ...), from its CSV statistics."""
        r = httpx.get(f"http://127.0.0.1:{self.stats_port}/;csv", timeout=5)
        r.raise_for_status()
        rows = csv.DictReader(io.StringIO(r.text.lstrip("# ")))
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == "corral_replicas" and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_state(self, name: str, state: str, timeout: float = 60) -> None:
        wait_for(f"HAProxy to see {name} {state}", lambda: self.servers().get(name, "").startswith(state), timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_balancer(tmp: Path, replicas: list[Replica], **options: Any) -> Balancer:
    """HAProxy with the reference configuration's rules, listening on ephemeral loopback ports."""
    need_haproxy()
    port, stats_port = free_port(), free_port()
    text = haproxy_cfg().render(
        [(r.name, f"127.0.0.1:{r.port}") for r in replicas],
        bind=f"127.0.0.1:{port}",
        stats=f"127.0.0.1:{stats_port}",
        **options,
    )
    config = tmp / "haproxy.cfg"
    config.write_text(text)
    log = tmp / "haproxy.log"
    out = open(log, "wb")  # noqa: SIM115
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=out, stderr=out)
    balancer = Balancer(port=port, stats_port=stats_port, config=config, proc=proc, log=log)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"haproxy exited with {proc.returncode}:\n{log.read_text()}")
        try:
            balancer.servers()
            return True
        except httpx.HTTPError:
            return False

    wait_for("haproxy to start", up, timeout=20)
    return balancer
