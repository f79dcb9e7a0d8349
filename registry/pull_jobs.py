"""Pulls that run in the daemon on their own, whoever watches them: the web page starts one, and a reload of the page
(or a second tab) finds it again in the table and follows its progress.

A job runs :meth:`registry.pull.Puller.run` to the end in a thread and keeps the last state of every layer (bytes,
total, speed over the last seconds, ETA). Finished jobs stay listed for :data:`KEEP_FINISHED` seconds so a page
that comes back sees how they ended. ``POST /api/pull`` is unchanged: its pull stops when its client goes away.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from errors import CorralError

log = logging.getLogger(__name__)

#: How long a finished job (success, error or cancelled) stays in the table.
KEEP_FINISHED = 600.0
#: At most this many finished jobs are kept (the oldest go first).
MAX_FINISHED = 50
#: The speed of a layer is measured over this many seconds.
SPEED_WINDOW = 5.0


@dataclass
class _Layer:
    digest: str
    total: int
    completed: int = 0
    samples: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=64))

    def update(self, completed: int, now: float) -> None:
        self.completed = completed
        self.samples.append((now, completed))
        while len(self.samples) > 2 and now - self.samples[0][0] > SPEED_WINDOW:
            self.samples.popleft()

    def speed(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    def to_json(self) -> dict[str, Any]:
        speed = self.speed()
        left = max(0, self.total - self.completed)
        return {
            "digest": self.digest,
            "total": self.total,
            "completed": self.completed,
            "bytes_per_second": round(speed, 1),
            "eta_seconds": round(left / speed, 1) if speed > 0 and left else (0.0 if not left else None),
        }


class PullJob:
    """One background pull: ``model`` as it was typed; ``status`` the last Ollama progress status."""

    def __init__(self, model: str, insecure: bool) -> None:
        self.model = model
        self.insecure = insecure
        self.started_at = time.time()
        self.finished_at: float | None = None
        self.status = "starting"
        self.error: str | None = None
        self.layers: dict[str, _Layer] = {}
        self.cancelled = threading.Event()
        self.lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def apply(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        with self.lock:
            self.status = str(event.get("status", self.status))
            digest = event.get("digest")
            if isinstance(digest, str) and isinstance(event.get("total"), int):
                layer = self.layers.get(digest)
                if layer is None:
                    layer = self.layers[digest] = _Layer(digest, int(event["total"]))
                layer.update(int(event.get("completed") or 0), now)

    def to_json(self) -> dict[str, Any]:
        with self.lock:
            layers = [layer.to_json() for layer in self.layers.values()]
            total = sum(x["total"] for x in layers)
            completed = sum(x["completed"] for x in layers)
            speed = sum(x["bytes_per_second"] for x in layers)
            out: dict[str, Any] = {
                "model": self.model,
                "status": self.status,
                "done": self.done,
                "started_at": self.started_at,
                "total": total,
                "completed": completed,
                "bytes_per_second": round(speed, 1),
                "eta_seconds": round((total - completed) / speed, 1) if speed > 0 else None,
                "layers": layers,
            }
            if self.error is not None:
                out["error"] = self.error
            if self.finished_at is not None:
                out["finished_at"] = self.finished_at
            return out


class PullJobs:
    """The daemon's table of background pulls, by the name as typed (one running job per name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, PullJob] = {}

    def start(self, model: str, insecure: bool, run: Callable[[threading.Event], Iterator[dict[str, Any]]]) -> PullJob:
        """Start ``run(cancelled)`` or return the job already running under this name. Blocking: the name is
        checked and the manifest fetched here, so a bad name, a registry that needs ``insecure`` or a missing model
        raise (and the job is listed with that error); the blobs are then fetched by a thread of the job's own.
        ``cancelled`` is set by :meth:`cancel`: the pull then gives a line soon even when stalled (Puller.run's
        ``stop``), and the job closes it at that line."""
        with self._lock:
            self._expire()
            current = self._jobs.get(model)
            if current is not None and not current.done:
                return current
            job = PullJob(model, insecure)
            job.status = "pulling manifest"
            self._jobs[model] = job
        try:
            it = run(job.cancelled)
            first = next(it, None)
        except BaseException as exc:
            with job.lock:
                job.error = str(exc) or type(exc).__name__
                job.finished_at = time.time()
            raise
        if first is not None:
            job.apply(first)
        threading.Thread(target=self._run, args=(job, it), name=f"pull-job {model}", daemon=True).start()
        return job

    def _run(self, job: PullJob, it: Iterator[dict[str, Any]]) -> None:
        try:
            for event in it:
                job.apply(event)
                if job.cancelled.is_set():
                    close = getattr(it, "close", None)
                    if close is not None:
                        close()
                    with job.lock:
                        job.status = "cancelled"
                        job.error = "the pull was cancelled"
                    break
        except CorralError as exc:
            with job.lock:
                job.error = str(exc)
        except Exception as exc:  # a background pull reports its failure, never kills the daemon
            log.exception("background pull failed model=%s", job.model)
            with job.lock:
                job.error = f"internal error: {exc}"
        finally:
            with job.lock:
                job.finished_at = time.time()

    def cancel(self, model: str) -> PullJob | None:
        with self._lock:
            job = self._jobs.get(model)
        if job is not None and not job.done:
            job.cancelled.set()
        return job

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            self._expire()
            jobs = list(self._jobs.values())
        return [j.to_json() for j in sorted(jobs, key=lambda j: j.started_at)]

    def _expire(self) -> None:
        now = time.time()
        finished = sorted(
            (j for j in self._jobs.values() if j.finished_at is not None), key=lambda j: j.finished_at or 0.0
        )
        for i, job in enumerate(finished):
            if now - (job.finished_at or now) > KEEP_FINISHED or i < len(finished) - MAX_FINISHED:
                del self._jobs[job.model]
