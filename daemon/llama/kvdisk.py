"""The engine's prompt cache on disk (issue 27): KV state that outlives the runner.

A prompt's token ids are cut into blocks of ``BLOCK_TOKENS``, each named by a chain hash that starts from the cache
key (``daemon/runners/kvstore.py``); a block's payload is its positions' slice of llama.cpp's per-sequence state
(``daemon/llama/kvblocks.py``). Only text before a prompt's first image is stored or looked up, only whole blocks,
and never a prompt's last token (its logits are needed).

The engine thread does the llama.cpp part only: ``llama_state_seq_get_data`` into a buffer (``Engine._persist``) and
``llama_state_seq_set_data`` of a joined blob (``Engine._restore_disk``). Splitting and writing happen on this
module's writer thread, reading and joining on its prefetch thread, so a slow disk never stalls decoding: a
snapshot that finds the writer more than ``QUEUE_BYTES`` behind is dropped, and a request whose lookup is still
reading waits at most ``LOOKUP_WAIT`` seconds before it is admitted without it. Nothing here raises into a request:
a block that cannot be written is left out, one that cannot be read or joined is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.llama.kvblocks import Unsplittable, join, split
from daemon.runners.kvstore import BLOCK_TOKENS, KVStore, chain_hashes
from daemon.runners.protocol import KVDiskInfo

# Snapshots waiting for the writer may hold this many bytes (a larger one is taken only when none waits): a disk
# slower than the requests drops snapshots instead of filling the runner's memory
QUEUE_BYTES = 512 << 20
# A request whose blocks are still being read is admitted without them after this long (a hung disk)
LOOKUP_WAIT = 10.0


def log(line: str) -> None:
    """One line to the runner's stderr (the daemon keeps its tail, and logs it when the runner fails)."""
    sys.stderr.write(f"corral kv-disk: {line}\n")
    sys.stderr.flush()


def text_prefix(tokens: Sequence[int]) -> int:
    """How many leading entries are text: image positions are negative keys (engine.split_at_image)."""
    for i, t in enumerate(tokens):
        if t < 0:
            return i
    return len(tokens)


def build_id(lc: Any) -> str:
    """The llama.cpp build a KV state is valid for: the binding's version, the sha256 of the loaded libllama
    shared library file (and the name and size of the ggml libraries beside it: the kernels that computed the
    values) and llama.cpp's system info (the CPU features and backends it uses)."""
    parts = [f"llama_cpp {getattr(lc, '__version__', '?')}"]
    path = ""
    with contextlib.suppress(Exception):
        import llama_cpp.llama_cpp as low  # the runner child only

        path = str(low._lib._name)
    if path and os.path.isfile(path):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        parts.append(f"libllama sha256:{digest.hexdigest()}")
        folder = os.path.dirname(os.path.realpath(path))
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder)):
                if name.startswith("libggml") and not os.path.islink(os.path.join(folder, name)):
                    parts.append(f"{name}:{os.path.getsize(os.path.join(folder, name))}")
    else:
        parts.append(f"libllama {path or 'unknown'}")
    with contextlib.suppress(Exception):
        info = lc.llama_print_system_info()
        parts.append(info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info))
    return "\n".join(parts)


def cache_key(daemon_key: str, build: str, runner_part: str) -> str:
    """The key every block of this model hangs from: sha256 over the daemon's part (model, adapters, projector,
    KV type, flash attention, rope/context parameters), the llama.cpp build and the runner's own part (offload)."""
    text = "corral kv v1\n" + daemon_key + "\n--\n" + build + "\n--\n" + runner_part
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Lookup:
    """A request's stored prefix, read (and verified, and joined) by the prefetch thread. ``tokens``: how many
    prompt tokens ``blob`` holds (0: nothing to restore)."""

    def __init__(self, prompt: list[int], n_blocks: int) -> None:
        self.prompt = prompt
        self.n_blocks = n_blocks
        self.tokens = 0
        self.blob: bytes | None = None
        self.started = time.monotonic()
        self._done = threading.Event()

    def ready(self) -> bool:
        return self._done.is_set() or time.monotonic() - self.started > LOOKUP_WAIT

    def result(self) -> tuple[int, bytes | None]:
        """(tokens, blob): nothing until the read finished."""
        if not self._done.is_set():
            return 0, None
        return self.tokens, self.blob

    def drop(self) -> None:
        self.blob = None


@dataclass
class _Write:
    hashes: list[str]
    tokens: list[int]
    buffer: np.ndarray  # its first ``size`` bytes are the sequence's state
    size: int


class DiskCache:
    """The store of one loaded model, with its writer and prefetch threads. ``local(prompt)``: how long a prefix of
    the prompt the engine already holds in a slot or in RAM (read from the prefetch thread: a hint, so a prefix the
    engine holds is not read from disk again). ``wake()``: tell the engine a lookup finished."""

    def __init__(
        self,
        store: KVStore,
        *,
        key: str,
        n_stream: int,
        root: str,
        limit_bytes: int,
        local: Callable[[list[int]], int] | None = None,
        wake: Callable[[], None] | None = None,
        min_gain: int = 16,
        block: int = BLOCK_TOKENS,
    ) -> None:
        self.store, self.key, self.n_stream, self.block = store, key, n_stream, block
        self.root, self.limit_bytes = root, limit_bytes
        self.local = local
        self.wake = wake
        self.min_gain = min_gain
        self.enabled = True
        self.reason = ""
        self.restored_tokens = 0
        self._known: set[str] = set()  # block hashes this process wrote or read: not written again
        self._lock = threading.Lock()
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._queued = 0  # bytes of snapshots queued or being written
        self._idle = threading.Condition(self._lock)
        self._spare: list[np.ndarray] = []  # snapshot buffers written already (their pages are touched: fast)
        self._lookups: queue.Queue[Lookup | None] = queue.Queue()
        self._restore_failed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # -- stats -----------------------------------------------------------------------------------------------------
    def info(self) -> KVDiskInfo:
        stats = self.store.stats()
        return KVDiskInfo(
            dir=self.root,
            limit_bytes=self.limit_bytes,
            entries=stats.entries,
            bytes=stats.bytes,
            hits=stats.hits,
            misses=stats.misses,
            restored_tokens=self.restored_tokens,
            enabled=self.enabled,
            reason=self.reason,
        )

    def disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled, self.reason = False, reason
            log(f"off for this model: {reason}")

    # -- lookups (any thread) ----------------------------------------------------------------------------------------
    def lookup(self, prompt: list[int]) -> Lookup | None:
        """Start reading the stored prefix of ``prompt`` (None: it has no whole block to look up)."""
        if not self.enabled:
            return None
        usable = min(text_prefix(prompt), len(prompt) - 1)
        n_blocks = usable // self.block
        if n_blocks <= 0:
            return None
        found = Lookup(prompt, n_blocks)
        self._lookups.put(found)
        return found

    def _read_loop(self) -> None:
        while True:
            found = self._lookups.get()
            if found is None:
                return
            try:
                self._read(found)
            except Exception as exc:  # noqa: BLE001 - a lookup that fails is a miss
                log(f"a lookup failed: {exc!r}")
            finally:
                found._done.set()
                if self.wake is not None:
                    self.wake()

    def _read(self, found: Lookup) -> None:
        if not self.enabled or time.monotonic() - found.started > LOOKUP_WAIT:
            return
        span = found.n_blocks * self.block
        tokens = found.prompt[:span]
        hashes = chain_hashes(self.key, tokens, self.block)
        n = self.store.present(hashes)
        if n == 0:
            self.store.load(hashes[:1], tokens)  # counted as a miss
            return
        if self.local is not None and n * self.block < self.local(found.prompt) + self.min_gain:
            return  # the engine holds as much in a slot or in RAM
        payloads = self.store.load(hashes[:n], tokens)
        if not payloads:
            return
        try:
            blob = join(payloads, self.n_stream)
        except ValueError as exc:
            log(f"stored blocks do not fit together ({exc}); not restored")
            return
        with self._lock:
            self._known.update(hashes[: len(payloads)])
        found.blob, found.tokens = blob, len(payloads) * self.block

    def note_restored(self, tokens: int) -> None:
        self.restored_tokens += tokens

    def restore_failed(self, tokens: int) -> None:
        """llama.cpp refused a joined blob: one log line for this runner (the request evaluates its prompt)."""
        if not self._restore_failed:
            self._restore_failed = True
            log(f"llama.cpp refused a restored prefix of {tokens} tokens; evaluating it instead")

    # -- writes (engine thread, then the writer) --------------------------------------------------------------------
    def wanted(self, tokens: list[int], exact: int) -> tuple[list[str], int]:
        """(chain hashes, blocks) of what ``tokens`` (a slot's, whose first ``exact`` have the KV a cold evaluation
        gives) may store; no hashes when every block is known to be on disk already."""
        n_blocks = min(text_prefix(tokens), exact, len(tokens)) // self.block
        if n_blocks <= 0 or not self.enabled:
            return [], 0
        hashes = chain_hashes(self.key, tokens[: n_blocks * self.block], self.block)
        with self._lock:
            if all(h in self._known for h in hashes):
                return [], n_blocks
        return hashes, n_blocks

    def buffer(self, size: int) -> np.ndarray | None:
        """A buffer for a snapshot of ``size`` bytes, or None when the writer is too far behind to take one."""
        with self._lock:
            if self._queued and self._queued + size > QUEUE_BYTES:
                return None
            self._queued += size
            fits = [b for b in self._spare if size <= b.nbytes <= 2 * size]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._spare = [b for b in self._spare if b is not buf]
                return buf
        return np.empty(size + size // 4, dtype=np.uint8)

    def give_back(self, buffer: np.ndarray, size: int) -> None:
        """A buffer from ``buffer`` that was not queued after all."""
        with self._lock:
            self._queued -= size
            self._keep(buffer)
            self._idle.notify_all()

    def _keep(self, buffer: np.ndarray) -> None:
        self._spare.append(buffer)
        while sum(b.nbytes for b in self._spare) > QUEUE_BYTES and self._spare:
            self._spare.pop(0)

    def put(self, hashes: list[str], tokens: list[int], buffer: np.ndarray, size: int) -> None:
        self._writes.put(_Write(hashes, tokens, buffer, size))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            try:
                self._write(item)
            except Exception as exc:  # noqa: BLE001 - a snapshot that cannot be written is left out
                log(f"writing blocks failed: {exc!r}")
            finally:
                with self._lock:
                    self._queued -= item.size
                    self._keep(item.buffer)
                    self._idle.notify_all()

    def _write(self, item: _Write) -> None:
        if not self.enabled:
            return
        n = len(item.hashes)
        blob = item.buffer[: item.size]  # a view: the buffer goes back to the spares only after the split
        try:
            payloads = split(blob, n, self.block)
        except Unsplittable as exc:
            self.disable(f"llama.cpp's state of this model cannot be cut into blocks ({exc})")
            return
        for i in range(n):
            with self._lock:
                if item.hashes[i] in self._known:
                    continue
            if self.store.save(i, item.hashes, item.tokens, payloads[i]):
                with self._lock:
                    self._known.add(item.hashes[i])
            else:
                return  # the store said why (a full disk, say); the next snapshot tries again

    def flush(self, timeout: float) -> bool:
        """Wait until every queued snapshot is written (at most ``timeout`` seconds); whether it got there."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._queued > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 0.0) -> None:
        if timeout > 0:
            self.flush(timeout)
        self._writes.put(None)
        self._lookups.put(None)
