"""A watch on a daemon under attack: another client's /api/version must answer within 2 s throughout, and the
daemon's resident memory is followed (sampled, and its kernel-kept peak), for the hardening tests."""

from __future__ import annotations

import threading
import time

import httpx
import psutil

from tests.conftest import Daemon

MB = 1 << 20


def high_water_mark(pid: int) -> int:
    """The peak resident memory of ``pid`` (VmHWM) in bytes, 0 where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Watch(threading.Thread):
    """Polls /api/version (each answer must come within 2 s) and follows the daemon's resident memory: sampled,
    and its kernel-kept peak (VmHWM, reset when the watch starts), so a short spike between samples counts too."""

    def __init__(self, d: Daemon) -> None:
        super().__init__(daemon=True)
        self.url = d.url + "/api/version"
        self.proc = psutil.Process(d.proc.pid)
        try:
            with open(f"/proc/{d.proc.pid}/clear_refs", "w") as f:
                f.write("5")  # reset the peak to the current resident size
        except OSError:
            pass
        self.base_rss = self.proc.memory_info().rss
        self.peak_rss = self.base_rss
        self.worst = 0.0
        self.failures: list[str] = []
        self.polls = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=2.0) as c:
            while not self._halt.is_set():
                t0 = time.monotonic()
                try:
                    if c.get(self.url).status_code != 200:
                        self.failures.append("status")
                except httpx.HTTPError as exc:
                    self.failures.append(type(exc).__name__)
                self.worst = max(self.worst, time.monotonic() - t0)
                self.polls += 1
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.peak_rss = max(self.peak_rss, high_water_mark(self.proc.pid))

    @property
    def grown_mb(self) -> float:
        return (self.peak_rss - self.base_rss) / MB
