"""Blob downloads: parallel ranged parts, progress persisted for resuming, a streaming hash, shared by pulls.

A blob of N bytes is cut into parts (N/64, between 16 MiB and 256 MiB) and up to ``streams`` parts are fetched at
once, in order, each with its own ``Range`` GET, written with ``pwrite`` at its offset into the pre-sized file
``blobs/sha256-<hex>-partial``. How far every part got is saved (at most every ``save_interval`` seconds, and
when the download stops) in ``blobs/sha256-<hex>-partial.json``, after the bytes it counts were written, so a
download stopped in any way (the daemon killed, a client gone, the network down) resumes where it stopped.

While parts arrive, a hasher thread follows the contiguous prefix of the file (through a memory map, without
copying it) and feeds it to SHA-256, so the digest is known moments after the last byte. Only if it matches does
the file move into ``blobs/``; otherwise it is deleted and the pull fails with "digest mismatch". The pull
fsyncs the blob once it has answered (see ``registry/pull.py``). A part that fails is retried
with exponential backoff; one that receives nothing for ``read_timeout`` seconds ("stalled"), or crawls at a tenth
of the median rate of the others (the "stuck at 99%" tail), is restarted from where it got to without counting
as a retry. A server that answers a range with the whole blob (200) makes the download start again from byte 0
as one part, with a fresh hasher (again if that whole-blob answer is cut off, up to ``max_retries`` times). An
answer whose body is not what its headers promised ends the download with a ``RegistryProtocolError``; the bytes
it brought are not counted in the saved progress, so the next pull fetches them again.

:class:`Downloads` is the daemon's table of downloads in flight: two pulls that need the same blob share one
:class:`Download`, and when every pull waiting on a download has gone, it is cancelled (its progress kept).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from errors import (
    BlobDigestMismatch,
    CorralError,
    RegistryProtocolError,
    RegistryUnreachable,
    StoreError,
)
from registry.digest import Digest
from registry.fetch import (
    RangeIgnored,
    RangeReader,
    Rejected,
    Stalled,
    Transient,
    WriteFailed,
    open_range,
)
from registry.remote import RegistryClient, backoff
from registry.store import Store

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class Tuning:
    """Knobs of a download (tests shrink the parts and the waits)."""

    streams: int = 8
    part_size: int | None = None  # None: total/target_parts within [min_part, max_part]
    target_parts: int = 64
    min_part: int = 16 * MiB
    max_part: int = 256 * MiB
    read_timeout: float = 30.0
    laggard_after: float = 10.0  # a part may be judged slow once it has run this long...
    laggard_ratio: float = 0.1  # ...and is below this fraction of the median rate of the parts running
    max_retries: int = 6
    max_stalls: int = 10
    backoff: float = 1.0
    save_interval: float = 0.5
    buffer: int = 1 * MiB
    hash_buffer: int = 8 * MiB


@dataclass
class Part:
    offset: int
    size: int
    completed: int = 0

    @property
    def end(self) -> int:
        """The last byte (inclusive), as a Range header wants it."""
        return self.offset + self.size - 1

    @property
    def done(self) -> bool:
        return self.completed >= self.size


def plan_parts(total: int, tuning: Tuning) -> list[Part]:
    size = tuning.part_size or min(tuning.max_part, max(tuning.min_part, -(-total // tuning.target_parts)))
    return [Part(offset, min(size, total - offset)) for offset in range(0, total, size)]


class Bandwidth:
    """A token bucket shared by every part of every pull: at most ``rate`` bytes per second in all
    (``CORRAL_PULL_BANDWIDTH``). A reader takes tokens for the bytes it just received and sleeps off any debt, so
    waiting readers are served in the order they came; unused allowance is saved up for at most ``burst`` seconds."""

    def __init__(self, rate: int, *, burst: float = 0.25) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.capacity = rate * burst
        self._tokens = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def chunk(self, size: int) -> int:
        """How much one read may ask for: small enough (an eighth of a second's allowance, at least 16 KiB) that
        the bytes arrive evenly rather than in bursts a second apart."""
        return max(16 * 1024, min(size, self.rate // 8))

    def take(self, n: int, stop: threading.Event | None = None) -> None:
        """Account for ``n`` bytes; wait until the rate allows them (or ``stop`` is set)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)


class Cancelled(CorralError):
    """Every pull waiting on the download went away."""

    def __init__(self) -> None:
        super().__init__("download cancelled")


class _Restart(Exception):
    """Internal: start the download again as one part (the server ignores ranges)."""


class Download:
    """One blob being fetched into the store. Thread-safe; :meth:`start` runs it in a thread of its own."""

    def __init__(
        self,
        store: Store,
        digest: Digest,
        size: int,
        remote: RegistryClient,
        *,
        tuning: Tuning | None = None,
        on_bytes: Callable[[int], None] | None = None,
        limiter: Bandwidth | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter  # CORRAL_PULL_BANDWIDTH, shared with every other download; None: no limit
        self.digest = digest
        self.total = size
        self.remote = remote.retain()
        self.tuning = tuning or Tuning()
        self.on_bytes = on_bytes
        self.blob_url = remote.blob_url(digest)
        self.cond = threading.Condition()
        self.parts: list[Part] = []
        self.completed = 0  # bytes present in the partial file (resumed plus fetched)
        self.fetched = 0  # bytes received by this download
        self.resumed = 0  # bytes found from an earlier attempt
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.prepared = threading.Event()  # set once ``completed`` counts what an earlier attempt left
        self.cancelled = threading.Event()
        self.waiters = 0
        self._stop = threading.Event()  # cancelled, or a part failed for good
        self._failure: BaseException | None = None
        self._url = self.blob_url
        self._resolved = threading.Event()
        self._workers_done = threading.Event()  # no worker can add bytes any more (the hasher may then give up)
        self._readers: set[RangeReader] = set()
        self._rates: collections.deque[float] = collections.deque(maxlen=16)  # of the last responses finished
        self._next = 0
        self._fd = -1
        self._last_save = 0.0
        self._save_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- control -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"download-{self.digest.short}", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Stop soon: open connections are shut down; progress so far is saved for the next attempt."""
        self.cancelled.set()
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        with self.cond:
            readers = list(self._readers)
            self.cond.notify_all()
        for reader in readers:
            reader.abort()

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    # -- the download ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        started = time.monotonic()
        try:
            self._download()
            log.info(
                "blob downloaded digest=%s bytes=%d fetched=%d resumed=%d seconds=%.2f",
                self.digest,
                self.total,
                self.fetched,
                self.resumed,
                time.monotonic() - started,
            )
        except BaseException as exc:  # noqa: BLE001 - every outcome is reported to the waiting pulls
            self.error = exc
            if self.completed == 0:
                self.store.remove_partial(self.digest)  # nothing worth resuming
            if not isinstance(exc, Cancelled):
                log.warning("blob download failed digest=%s error=%s", self.digest, exc)
        finally:
            self.remote.release()
            self.prepared.set()
            self.finished.set()
            with self.cond:
                self.cond.notify_all()

    def _download(self) -> None:
        self._prepare()
        try:
            streams: int | None = None
            restarts = 0
            while True:
                try:
                    self._fetch_all(streams)
                    return
                except _Restart:
                    if self.cancelled.is_set():
                        raise Cancelled() from None
                    restarts += 1
                    if restarts > self.tuning.max_retries:
                        raise RegistryUnreachable(
                            f"downloading blob {self.digest.short} failed: the registry ignores Range requests and "
                            f"its answers with the whole blob were cut off {restarts - 1} times"
                        ) from None
                    self._restart_whole()
                    streams = 1
        finally:
            os.close(self._fd)

    def _restart_whole(self) -> None:
        """The server answered a range with the whole blob: start again from byte 0, as one part.

        What the file holds is discarded (its bytes are overwritten from the start and hashed by a new hasher), and
        the state saying so is written before the first new byte, so a pull stopped now starts from 0 too."""
        log.warning(
            "registry ignores Range requests; downloading blob %s again from byte 0 in one stream", self.digest.short
        )
        with self.cond:
            self.parts = [Part(0, self.total)] if self.total else []
            self.completed = self.resumed = 0
            self._next = 0
        self._stop.clear()
        self._failure = None
        self._save(force=True)

    def _prepare(self) -> None:
        """Resume from the saved state if it is sound, else start afresh with a pre-sized sparse file."""
        parts = self._load_state()
        path = self.store.partial_path(self.digest)
        if parts is None:
            self.store.remove_partial(self.digest)
            parts = plan_parts(self.total, self.tuning)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if os.fstat(self._fd).st_size != self.total:
                os.ftruncate(self._fd, self.total)
        except OSError as exc:
            if self._fd >= 0:
                os.close(self._fd)
            raise StoreError(f"cannot create {path}: {exc.strerror or exc}") from exc
        self.parts = parts
        self.completed = self.resumed = sum(p.completed for p in parts)
        self.prepared.set()
        self._save(force=True)

    def _load_state(self) -> list[Part] | None:
        raw = self.store.read_partial_state(self.digest)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            parts = [Part(int(o), int(s), int(c)) for o, s, c in doc["parts"]]
            sound = doc["digest"] == str(self.digest) and doc["total"] == self.total
        except (ValueError, KeyError, TypeError):
            sound, parts = False, []
        offset = 0
        for p in parts:
            sound = sound and p.offset == offset and p.size > 0 and 0 <= p.completed <= p.size
            offset += p.size
        try:
            data_size = self.store.partial_path(self.digest).stat().st_size
        except FileNotFoundError:
            data_size = -1
        if not (sound and offset == self.total and data_size == self.total):
            log.warning("discarding unusable partial download digest=%s", self.digest)
            return None
        log.info("resuming download digest=%s have=%d of %d", self.digest, sum(p.completed for p in parts), self.total)
        return parts

    def _save(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_save < self.tuning.save_interval:
            return
        if not self._save_lock.acquire(blocking=force):
            return  # another thread is saving right now
        try:
            with self.cond:
                doc = {
                    "digest": str(self.digest),
                    "total": self.total,
                    "parts": [[p.offset, p.size, p.completed] for p in self.parts],
                }
            self.store.write_partial_state(self.digest, json.dumps(doc, separators=(",", ":")).encode())
            self._last_save = now
        finally:
            self._save_lock.release()

    def _fetch_all(self, streams: int | None = None) -> None:
        pending = sum(1 for p in self.parts if not p.done)
        n = max(1, min(streams or self.tuning.streams, pending))
        self._resolved.clear()
        self._workers_done.clear()
        result: dict[str, str | None] = {}
        hasher = threading.Thread(target=self._hash, args=(result,), name=f"hash-{self.digest.short}", daemon=True)
        hasher.start()
        workers = [
            threading.Thread(target=self._worker, args=(i == 0,), name=f"part-{self.digest.short}-{i}", daemon=True)
            for i in range(n if pending else 0)
        ]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            next(w for w in workers if w.is_alive()).join(1.0)
            self._drop_laggards()
        with self.cond:
            self._workers_done.set()
            self.cond.notify_all()
        if self._failure is not None or (self._stop.is_set() and not all(p.done for p in self.parts)):
            self._halt()
        hasher.join()
        self._save(force=True)
        if isinstance(self._failure, _Restart):
            raise self._failure
        if self._failure is not None:
            raise self._failure
        if self.cancelled.is_set() and not all(p.done for p in self.parts):
            raise Cancelled()
        actual = result.get("digest")
        if actual is None:  # pragma: no cover - the hasher only stops early when the download stopped
            raise StoreError(f"could not hash the download of {self.digest}")
        if actual != self.digest.hex:
            self.store.remove_partial(self.digest)
            raise BlobDigestMismatch(str(self.digest), f"sha256:{actual}")
        self.store.commit_partial(self.digest)

    def _drop_laggards(self) -> None:
        """Restart a part far slower than the others (the cure for a pull "stuck at 99%" on one bad connection).

        A part that has run ``laggard_after`` seconds below ``laggard_ratio`` of the median rate of the parts
        running and the last ones finished is cut off; its worker opens a new connection from where it got to
        (counted as a stall)."""
        if self.limiter is not None:
            return  # rates under a bandwidth cap say nothing about a connection
        now = time.monotonic()
        with self.cond:
            readers = list(self._readers)
            rates = sorted([*self._rates, *(r.rate(now) for r in readers)])
        if not readers or len(rates) < 3:
            return
        median = rates[len(rates) // 2]
        for r in readers:
            if (
                not r.laggard
                and now - r.opened >= self.tuning.laggard_after
                and r.rate(now) < self.tuning.laggard_ratio * median
            ):
                log.info(
                    "restarting a slow part digest=%s rate=%.0f median=%.0f", self.digest.short, r.rate(now), median
                )
                r.drop_as_laggard()

    # -- workers ------------------------------------------------------------------------------------------------
    def _take(self) -> Part | None:
        with self.cond:
            while self._next < len(self.parts) and self.parts[self._next].done:
                self._next += 1
            if self._stop.is_set() or self._next >= len(self.parts):
                return None
            part = self.parts[self._next]
            self._next += 1
            return part

    def _worker(self, first: bool) -> None:
        if not first:
            # the first request finds out where the registry redirects; the others then go straight there
            while not self._resolved.wait(0.2):
                if self._stop.is_set():
                    return
        view = memoryview(bytearray(self.tuning.buffer))
        try:
            while (part := self._take()) is not None:
                self._fetch_part(part, view)
                self._resolved.set()
        except BaseException as exc:  # noqa: BLE001 - the first failure stops the whole download
            with self.cond:
                if self._failure is None:
                    self._failure = exc
            self._halt()
        finally:
            self._resolved.set()

    def _fetch_part(self, part: Part, view: memoryview) -> None:
        retries = stalls = 0
        t = self.tuning
        limiter = self.limiter
        if limiter is not None:
            view = view[: limiter.chunk(len(view))]
        while not part.done and not self._stop.is_set():
            progressed = False
            try:
                reader = open_range(
                    self.remote,
                    self._url,
                    self.digest,
                    part.offset + part.completed,
                    part.end,
                    self.total,
                    timeout=t.read_timeout,
                )
                if reader.url != self._url:
                    self._url = str(reader.url)
                self._resolved.set()
                with self.cond:
                    self._readers.add(reader)
                before = part.completed
                try:
                    while reader.remaining and not self._stop.is_set():
                        n = reader.transfer(self._fd, part.offset + part.completed, view)
                        progressed = True
                        self._advance(part, n)
                        if limiter is not None:
                            limiter.take(n, self._stop)
                    reader.finish()
                except RegistryProtocolError:
                    # the answer was not what its headers said: none of its bytes count (the next pull fetches
                    # them again), so the saved progress holds only bytes from answers that were well-formed
                    self._rewind(part, before)
                    raise
                finally:
                    with self.cond:
                        self._readers.discard(reader)
                        if not reader.laggard and reader.received:
                            self._rates.append(reader.rate(time.monotonic()))
                    reader.close()
            except Stalled as exc:
                stalls += 1
                if self._stop.is_set():
                    return
                if stalls > t.max_stalls:
                    raise RegistryUnreachable(
                        f"downloading blob {self.digest.short} stalled {stalls} times: {exc}"
                    ) from exc
                log.info("part stalled, restarting digest=%s offset=%d", self.digest.short, part.offset)
            except (Transient, Rejected) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, Rejected):
                    self._url = self.blob_url  # an expired redirect: ask the registry again
                retries = 1 if progressed else retries + 1
                if retries > t.max_retries:
                    raise RegistryUnreachable(
                        f"downloading blob {self.digest.short} failed after {t.max_retries} retries: {exc}"
                    ) from exc
                log.info(
                    "part failed, retrying digest=%s offset=%d attempt=%d error=%s",
                    self.digest.short,
                    part.offset,
                    retries,
                    exc,
                )
                if self._stop.wait(backoff(retries, t.backoff)):
                    return
            except RangeIgnored as exc:
                raise _Restart() from exc
            except WriteFailed as exc:
                if exc.error.errno == errno.ENOSPC:
                    raise StoreError(
                        f"disk full while downloading blob {self.digest.short} into {self.store.blobs_dir}"
                    ) from exc
                raise StoreError(
                    f"cannot write {self.store.partial_path(self.digest)}: {exc.error.strerror or exc.error}"
                ) from exc

    def _rewind(self, part: Part, to: int) -> None:
        with self.cond:
            back = max(0, part.completed - to)
            part.completed -= back
            self.completed -= back

    def _advance(self, part: Part, n: int) -> None:
        with self.cond:
            part.completed += n
            self.completed += n
            self.fetched += n
            self.cond.notify_all()
        if self.on_bytes is not None:
            self.on_bytes(n)
        self._save()

    # -- hashing ------------------------------------------------------------------------------------------------
    def _available(self, pos: int, index: int) -> tuple[int, int]:
        """Bytes ready to hash at ``pos`` within its part, and that part's index (call with the lock held)."""
        parts = self.parts
        while index < len(parts) and pos >= parts[index].offset + parts[index].size:
            index += 1
        if index >= len(parts):
            return 0, index
        p = parts[index]
        return max(0, p.offset + p.completed - pos), index

    def _hash(self, result: dict[str, str | None]) -> None:
        """Hash the file's contiguous prefix as it grows, reading it through a memory map (no copies)."""
        h = hashlib.sha256()
        step = self.tuning.hash_buffer
        pos, index = 0, 0
        try:
            with contextlib.ExitStack() as stack:
                if self.total:
                    mapped = stack.enter_context(mmap.mmap(self._fd, self.total, access=mmap.ACCESS_READ))
                    with contextlib.suppress(AttributeError, OSError):
                        mapped.madvise(mmap.MADV_SEQUENTIAL)
                    view = stack.enter_context(memoryview(mapped))
                while pos < self.total:
                    with self.cond:
                        while True:
                            ready, index = self._available(pos, index)
                            # Stopped, the hasher still waits for the workers: a part may finish as it stops.
                            if ready or (self._stop.is_set() and self._workers_done.is_set()):
                                break
                            self.cond.wait(0.5)
                    if not ready:
                        return  # the download stopped
                    n = min(ready, step)
                    h.update(view[pos : pos + n])
                    pos += n
            result["digest"] = h.hexdigest()
        except (OSError, ValueError) as exc:
            with self.cond:
                if self._failure is None:
                    self._failure = StoreError(f"could not read back the download of {self.digest}: {exc}")
            self._halt()


class Downloads:
    """The daemon's downloads in flight, by digest (one per blob, shared by every pull that needs it)."""

    def __init__(self, bandwidth: int = 0) -> None:
        self._lock = threading.Lock()
        #: CORRAL_PULL_BANDWIDTH: one bucket for all downloads (None: unlimited)
        self.limiter = Bandwidth(bandwidth) if bandwidth > 0 else None
        self._active: dict[Digest, Download] = {}
        self._pins: dict[Digest, int] = {}

    def join(self, digest: Digest, make: Callable[[], Download]) -> Download:
        """The running download of ``digest``, or a new one from ``make()``; the caller must :meth:`leave` it."""
        while True:
            with self._lock:
                for d in [d for d, dl in self._active.items() if dl.finished.is_set()]:
                    del self._active[d]
                current = self._active.get(digest)
                if current is None:
                    current = make()
                    current.waiters = 1
                    self._active[digest] = current
                    current.start()
                    return current
                if not current.cancelled.is_set():
                    current.waiters += 1
                    return current
            current.finished.wait()  # a cancelled download is winding down: let it save its progress first

    def leave(self, download: Download) -> None:
        """A pull stops waiting; the last one to leave cancels an unfinished download."""
        with self._lock:
            download.waiters -= 1
            if download.waiters <= 0 and not download.finished.is_set():
                download.cancel()

    def pin(self, digests: set[Digest]) -> None:
        """Keep ``digests`` from being pruned while a pull that needs them is running."""
        with self._lock:
            for d in digests:
                self._pins[d] = self._pins.get(d, 0) + 1

    def unpin(self, digests: set[Digest]) -> None:
        with self._lock:
            for d in digests:
                left = self._pins.get(d, 0) - 1
                if left > 0:
                    self._pins[d] = left
                else:
                    self._pins.pop(d, None)

    def busy(self) -> frozenset[Digest]:
        """Digests a prune must leave alone: downloads running and blobs pinned by pulls."""
        with self._lock:
            running = {d for d, dl in self._active.items() if not dl.finished.is_set()}
            return frozenset(running | set(self._pins))
