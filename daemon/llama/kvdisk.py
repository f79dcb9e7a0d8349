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
import errno
import hashlib
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.llama.kvblocks import Blob, Unsplittable, join, split
from daemon.runners.kvstore import (
    BLOCK_TOKENS,
    SLOTS,
    KVStore,
    _Ledger,
    _RootLock,
    _write_atomic,
    chain_hashes,
    evict_lru,
)
from daemon.runners.protocol import KVDiskInfo, check_slot_name

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
        self.blob: Blob | None = None  # kvblocks.join's
        self.started = time.monotonic()
        self._done = threading.Event()

    def ready(self) -> bool:
        return self._done.is_set() or time.monotonic() - self.started > LOOKUP_WAIT

    def result(self) -> tuple[int, Blob | None]:
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


# -- saved slots (llama-server's /slots/{id}?action=save|restore) ------------------------------------------------------
SLOTS_DIR = SLOTS  # <root>/<key>/slots/<filename>: beside the key's blocks, so `corral prune` keeps them with it
SLOT_MAGIC = b"CSLT"
SLOT_VERSION = 1
LAYOUT_BLOCK = 1  # the payload is one kvblocks block of every position: restored into any stream layout (join)
LAYOUT_RAW = 2  # the payload is llama.cpp's state as written (a memory kvblocks cannot cut): the same layout only
# magic, version, layout, n_stream, token count, shifted_at (-1: never shifted), payload length, sha256 of the token
# ids and the payload, key length
_SLOT_HEAD = struct.Struct("<4sHHIIqQ32sH")
MAX_SLOT_FILE = 1 << 40  # a length in a header beyond this is damage, not a file to read


class SlotFileError(Exception):
    """A saved slot that cannot be written or read: ``status`` is what the daemon answers (400 the request's or
    the file's fault, 404 no such file, 507 no room under the bound, 500 the disk failed)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SlotFile:
    """A saved slot as read back: its tokens, where its KV was shifted (None: never), llama.cpp's state in the
    file's layout, and the file's size."""

    tokens: list[int]
    shifted_at: int | None
    layout: int
    n_stream: int
    payload: bytes
    size: int


class SlotFiles:
    """The saved slots of one cache key: ``<root>/<key>/slots/<filename>``. A file is a header (magic, version,
    layout, the stream count, token count, shift, payload length, sha256 of the token ids and payload, the cache
    key), the token ids (i32) and the payload, written atomically (a temporary file in the folder, fsync, rename).
    Saved slots count against the bound of the whole root (CORRAL_KV_DISK) like blocks, but are never evicted by
    them: a save evicts the least recently used blocks to make room, and is refused (507) when even that is not
    enough. Reading checks the magic, version, key, lengths and checksum before anything is restored."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.key = store.key
        self.dir = os.path.join(store.dir, SLOTS_DIR)

    def path(self, name: str) -> str:
        reason = check_slot_name(name)
        if reason is not None:
            raise SlotFileError(reason)
        return os.path.join(self.dir, name)

    def write(
        self, name: str, tokens: Sequence[int], shifted_at: int | None, layout: int, n_stream: int, payload: bytes
    ) -> int:
        """Save a slot under ``name`` (replacing a file of that name); the bytes written."""
        path = self.path(name)
        token_bytes = struct.pack(f"<{len(tokens)}i", *tokens)
        key = self.key.encode("ascii")
        digest = hashlib.sha256(token_bytes + payload).digest()
        shift = -1 if shifted_at is None else shifted_at
        head = _SLOT_HEAD.pack(
            SLOT_MAGIC, SLOT_VERSION, layout, n_stream, len(tokens), shift, len(payload), digest, len(key)
        )
        parts = (head, key, token_bytes, payload)
        size = sum(len(p) for p in parts)
        limit = self.store.limit_bytes
        if size > limit:
            raise SlotFileError(
                f"the slot's state is {size} bytes, more than the prompt cache's whole bound of {limit} bytes "
                "(CORRAL_KV_DISK): raise CORRAL_KV_DISK to save it",
                507,
            )
        try:
            lock = _RootLock(self.store.root)
        except OSError as exc:
            raise _disk_error(exc) from None
        try:
            self.store._write_meta()  # the key's meta.json: what `corral prune` reads to keep the folder
            self._make_room(path, size)
            try:
                old = os.stat(path).st_size if os.path.isfile(path) else 0
                _write_atomic(self.dir, path, parts)
            except OSError as exc:
                _Ledger(self.store.root).add(-size)
                raise _disk_error(exc) from None
            if old:
                _Ledger(self.store.root).add(-old)
        except OSError as exc:
            raise _disk_error(exc) from None
        finally:
            lock.release()
        return size

    def _make_room(self, path: str, size: int) -> None:
        """Reserve ``size`` bytes in the root's ledger (the root lock is held): the least recently used blocks of
        every key are removed until the root's usage with the new file (less the file it replaces) is within the
        bound. Saved slots are never removed to make room: SlotFileError 507 when blocks alone cannot free it."""
        files, total = self.store._scan()
        old = os.stat(path).st_size if os.path.isfile(path) else 0
        limit = self.store.limit_bytes
        if total - old + size - sum(vsize for _, _, vsize in files) > limit:  # not even with every block gone
            _Ledger(self.store.root).write(total, time.time())
            raise SlotFileError(
                f"the slot's state ({size} bytes) does not fit the prompt cache's bound of {limit} bytes "
                "(CORRAL_KV_DISK) beside the saved slots there: remove saved slots from the models' slots/ folders "
                "under CORRAL_KV_DISK_DIR or raise CORRAL_KV_DISK",
                507,
            )
        if total - old + size > limit:
            total, _ = evict_lru(files, total, int(limit * 0.9), size - old)
        if total - old + size > limit:  # a block that could not be removed
            _Ledger(self.store.root).write(total, time.time())
            raise SlotFileError(
                f"the slot's state ({size} bytes) does not fit the prompt cache's bound of {limit} bytes "
                "(CORRAL_KV_DISK): blocks under CORRAL_KV_DISK_DIR could not be removed to make room",
                507,
            )
        _Ledger(self.store.root).write(total + size, time.time())

    def read(self, name: str) -> SlotFile:
        """The saved slot ``name``, checked whole; SlotFileError (404 missing, 400 not a file this model can
        restore) says what is wrong."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise SlotFileError(self._missing(name), 404) from None
        except OSError as exc:
            raise _disk_error(exc) from None
        try:
            return self._decode(fd, name)
        except OSError as exc:
            raise _disk_error(exc) from None
        finally:
            os.close(fd)

    def _missing(self, name: str) -> str:
        elsewhere = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.store.root):
                if entry.name != self.key and os.path.isfile(os.path.join(entry.path, SLOTS_DIR, name)):
                    elsewhere.append(entry.name)
        if elsewhere:
            return (
                f"no saved slot named {name!r} for this model: one of that name was saved by another model or "
                "another llama.cpp build, whose KV state this model cannot use"
            )
        return f"no saved slot named {name!r} for this model: save one first (action=save)"

    def _decode(self, fd: int, name: str) -> SlotFile:
        size = os.fstat(fd).st_size

        def read(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = os.read(fd, min(n - len(data), 1 << 24))
                if not chunk:
                    raise SlotFileError(f"the saved slot {name!r} is truncated ({size} bytes); it cannot be restored")
                data += chunk
            return data

        bad = f"the saved slot {name!r}"
        if size < _SLOT_HEAD.size:
            raise SlotFileError(f"{bad} is not a saved slot file (too short); it cannot be restored")
        magic, version, layout, n_stream, n_tokens, shift, length, digest, key_len = _SLOT_HEAD.unpack(
            read(_SLOT_HEAD.size)
        )
        if magic != SLOT_MAGIC:
            raise SlotFileError(f"{bad} is not a saved slot file; it cannot be restored")
        if version != SLOT_VERSION:
            raise SlotFileError(f"{bad} was written by another version of corral (format {version}); save it again")
        if layout not in (LAYOUT_BLOCK, LAYOUT_RAW) or key_len > 256 or length > MAX_SLOT_FILE:
            raise SlotFileError(f"{bad} is damaged (its header is out of range); it cannot be restored")
        key = read(key_len).decode("ascii", "replace")
        if key != self.key:
            raise SlotFileError(
                f"{bad} was saved by another model or another llama.cpp build (its cache key differs from this "
                "model's), so its KV state cannot be used here: restore it with the model that saved it"
            )
        if size != _SLOT_HEAD.size + key_len + 4 * n_tokens + length:
            raise SlotFileError(f"{bad} is truncated or damaged ({size} bytes); it cannot be restored")
        token_bytes = read(4 * n_tokens)
        payload = read(length)
        if hashlib.sha256(token_bytes + payload).digest() != digest:
            raise SlotFileError(f"{bad} is damaged (checksum mismatch); it cannot be restored")
        tokens = list(struct.unpack(f"<{n_tokens}i", token_bytes))
        return SlotFile(tokens, None if shift < 0 else int(shift), layout, n_stream, payload, size)


def pack_slot(state: bytes, n_tokens: int) -> tuple[int, bytes]:
    """(layout, payload) of a slot's state for its file: one block of all its positions where kvblocks can cut
    it (restored into any stream layout), else llama.cpp's state as it is."""
    try:
        return LAYOUT_BLOCK, split(state, 1, n_tokens)[0]
    except ValueError:  # Unsplittable: another memory, or positions that are not 0..n-1
        return LAYOUT_RAW, state


def unpack_slot(saved: SlotFile, n_stream: int) -> Blob:
    """The state for ``llama_state_seq_set_data`` of a context whose states start with ``n_stream`` (0: unknown)."""
    if saved.layout == LAYOUT_BLOCK:
        if n_stream <= 0:
            raise SlotFileError("the saved slot's state cannot be put in this model's KV cache (another memory type)")
        try:
            return join([saved.payload], n_stream)
        except ValueError as exc:
            raise SlotFileError(f"the saved slot's state is damaged ({exc}); it cannot be restored") from None
    if saved.n_stream and n_stream and saved.n_stream != n_stream:
        raise SlotFileError(
            f"the saved slot was saved with {saved.n_stream} KV streams and this runner has {n_stream} "
            "(num_parallel differs): load the model as it was when the slot was saved"
        )
    return saved.payload


def _disk_error(exc: OSError) -> SlotFileError:
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return SlotFileError(f"the disk is full: {exc.strerror}; the slot was not saved", 507)
    return SlotFileError(f"the saved slot's file cannot be written or read: {exc.strerror or exc}", 500)
