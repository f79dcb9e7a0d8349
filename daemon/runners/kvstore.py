"""The prompt cache on disk: blocks of KV state that outlive the runner (standard library only: the runner child
and the daemon both import it).

A prompt's token ids are cut into blocks of ``BLOCK_TOKENS``; block i is named by a chain hash,
``h_i = sha256(h_{i-1} || the block's token ids as little-endian int32)``, where ``h_{i-1}`` is the previous
block's hex digest as ASCII and ``h_{-1}`` is the cache key (a string that binds everything that makes KV state
valid: model, adapters, projector, KV type, llama.cpp build...). So a block's name stands for the whole prefix up to
its end, and two prompts that share a prefix share its blocks.

One file per block, ``<root>/<key>/<hh>/<hash>.kvb`` (``hh``: the hash's first two hex digits), next to
``<root>/<key>/meta.json`` (the model digest ``prune`` reads). A file is a header and the payload (the bytes the
runner stores, opaque here)::

    magic "CKV1" | u16 version | u32 block index | u32 token count | u64 payload length | 32 bytes sha256(payload)
    | u16 len + key | u16 len + block hash | u16 len + parent hash (the key for block 0)
    | token count x i32 token ids | payload

all little-endian. A file is written to a temporary file in its own directory, fsync'd and renamed over its name
(``os.replace``), so a reader sees a whole file or none, whatever other threads or processes do. Reading checks
everything (magic, version, index, key, hash, parent, that the hash is the chain hash of parent and tokens, the
tokens against the prompt's, the length and the checksum); a file that fails is removed with one log line and counts
as absent. Every failure to write (ENOSPC, EDQUOT, a read-only directory, any ``OSError``) removes the temporary
file, logs once and leaves the block unstored: the cache degrades to no cache, never to an exception.

The whole root (every key, every process) is bounded by ``limit_bytes``. Writers take turns on an ``flock`` of
``<root>/.lock`` and keep a ledger of the root's usage in ``<root>/.usage``; a write first reserves its size there,
and when the reservation would pass the bound the root is scanned and the least recently used block files (by
mtime, which a hit refreshes) are removed until usage is at most 90% of the bound (the ledger is also rebuilt by a
scan every minute, which repairs what a killed writer left uncounted). Readers take no lock. Mtimes are set so that
within a chain an ancestor is always newer than its descendants (a hit or a write stamps block k with ``now - k``
ms), and a block is only written when its parent is on disk, so eviction takes a chain's tail before its head and
the disk never holds the unreachable tail of a chain whose head is gone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

__all__ = [
    "BLOCK_TOKENS",
    "SLOTS",
    "KVStats",
    "KVStore",
    "SavedSlot",
    "chain_hashes",
    "prune",
    "remove_saved_slot",
    "saved_slots",
    "usage",
]

BLOCK_TOKENS = 256
MAGIC = b"CKV1"
VERSION = 1
SUFFIX = ".kvb"
META = "meta.json"
SLOTS = "slots"  # <root>/<key>/slots/<name>: saved slots (daemon/llama/kvdisk.py SlotFiles), pruned with their key
LOCK = ".lock"  # <root>/.lock: writers' cross-process lock
LEDGER = ".usage"  # <root>/.usage: the root's usage in bytes (see _Ledger)
# magic, version, block index, token count, payload length, sha256 of the payload, lengths of key, hash and parent
_PREFIX = struct.Struct("<4sHIIQ32sHHH")
_MAX_NAME = 256  # longest key / hash accepted in a header (a corrupt length must not make us read much)
_KEY = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
_HASH = re.compile(r"[0-9a-f]{64}")
_LOW_WATER = 0.9  # eviction goes down to this share of the bound, so a full cache does not rescan on every write
_RESCAN_S = 60.0  # trust the ledger this long, then scan again (repairs what a killed writer left uncounted)
_STALE_TEMP_S = 15 * 60  # a temporary file this old is a crashed writer's
READERS = 4  # threads one lookup reads and checks blocks with
_STEP_NS = 1_000_000  # the mtime step between a chain's blocks (1 ms: finer than every common filesystem's)

log = logging.getLogger("daemon.kvstore")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def _chain(parent: str, tokens: Sequence[int]) -> str:
    return hashlib.sha256(parent.encode("utf-8") + _token_bytes(tokens)).hexdigest()


def chain_hashes(key: str, tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list[str]:
    """The chain hashes (hex) of the FULL blocks of ``tokens``; a prompt's part from its first negative entry (an
    image in the engine's prompt keys) on is never hashed, so a block never ends inside or after an image."""
    if block <= 0:
        raise ValueError(f"block must be positive, not {block}")
    usable = len(tokens)
    for i, t in enumerate(tokens):
        if t < 0:
            usable = i
            break
    out: list[str] = []
    parent = key
    for start in range(0, usable - usable % block, block):
        parent = _chain(parent, tokens[start : start + block])
        out.append(parent)
    return out


@dataclasses.dataclass(frozen=True)
class KVStats:
    entries: int  # block files of this store's key on disk
    bytes: int  # their size
    hits: int  # lookups (``load``) that returned at least one block
    misses: int  # lookups of at least one full block that returned none
    restored_tokens: int  # tokens in the blocks lookups returned


class _Bad(Exception):
    """A block file that fails a check (the message says which)."""


def _encode(key: str, index: int, block_hash: str, parent: str, tokens: Sequence[int], payload: bytes) -> bytes:
    """A block file's header (the payload follows it)."""
    k, h, p = key.encode("ascii"), block_hash.encode("ascii"), parent.encode("ascii")
    prefix = _PREFIX.pack(
        MAGIC, VERSION, index, len(tokens), len(payload), hashlib.sha256(payload).digest(), len(k), len(h), len(p)
    )
    return prefix + k + h + p + _token_bytes(tokens)


def _decode(
    fd: int,
    size: int,
    key: str,
    index: int,
    block_hash: str,
    parent: str,
    tokens: Sequence[int],
) -> bytes:
    """Read and check one block file open at ``fd`` (``size`` bytes); its payload, or ``_Bad``."""

    def read(n: int) -> bytes:
        chunks: list[bytes] = []
        left = n
        while left:
            chunk = os.read(fd, min(left, 1 << 30))
            if not chunk:
                raise _Bad("truncated")
            chunks.append(chunk)
            left -= len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    if size < _PREFIX.size:
        raise _Bad("truncated header")
    magic, version, f_index, count, length, digest, klen, hlen, plen = _PREFIX.unpack(read(_PREFIX.size))
    if magic != MAGIC:
        raise _Bad("not a corral KV block (bad magic)")
    if version != VERSION:
        raise _Bad(f"format version {version}, not {VERSION}")
    if max(klen, hlen, plen) > _MAX_NAME or count != len(tokens):
        raise _Bad(f"header of another shape ({count} tokens, not {len(tokens)})")
    head = _PREFIX.size + klen + hlen + plen + 4 * count
    if size != head + length:
        raise _Bad(f"length {size} bytes, the header says {head + length}")
    names = read(klen + hlen + plen)
    f_key, f_hash, f_parent = names[:klen], names[klen : klen + hlen], names[klen + hlen :]
    if f_key != key.encode("ascii"):
        raise _Bad("written for another cache key (another model, build or KV layout)")
    if f_hash != block_hash.encode("ascii"):
        raise _Bad("holds another block (its hash is not its name)")
    if f_index != index or f_parent != parent.encode("ascii"):
        raise _Bad("holds a block of another chain (index or parent differ)")
    f_tokens = read(4 * count)
    if f_tokens != _token_bytes(tokens):
        raise _Bad("holds other token ids than the prompt's")
    if hashlib.sha256(f_parent + f_tokens).hexdigest() != block_hash:
        raise _Bad("its hash is not the chain hash of its parent and tokens")
    payload = read(length)
    if hashlib.sha256(payload).digest() != digest:
        raise _Bad("checksum mismatch (corrupt payload)")
    return payload


def _walk(root: str) -> Iterator[os.DirEntry[str]]:
    """Every regular file under ``root`` but the writers' lock and ledger (symlinks are neither followed nor
    counted)."""
    try:
        it = os.scandir(root)
    except OSError:
        return
    with it:
        for entry in it:
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield from _walk(entry.path)
                elif entry.is_file(follow_symlinks=False) and entry.name not in (LOCK, LEDGER):
                    yield entry
            except OSError:
                continue


def _size(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


def usage(root: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``root`` (all keys; 0 when it does not exist)."""
    return sum(_size(e) for e in _walk(os.fspath(root)))


def _only_blocks(path: str) -> bool:
    """Whether a directory without a readable meta.json holds nothing but this store's files (``hh/`` folders of
    block files and temp files, a damaged meta.json): only such a directory is a cache that prune may remove."""
    try:
        for entry in os.scandir(path):
            if entry.name == META:
                continue
            if not (entry.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", entry.name)):
                return False
            for inner in os.scandir(entry.path):
                name = inner.name
                if not inner.is_file(follow_symlinks=False):
                    return False
                if not (name.endswith(SUFFIX) or (name.startswith(".") and name.endswith(".tmp"))):
                    return False
    except OSError:
        return False
    return True


def prune(root: str | os.PathLike[str], keep: Collection[str]) -> int:
    """Remove every key directory under ``root`` whose meta.json names a model digest not in ``keep`` (or that has
    no readable meta.json); the bytes freed."""
    freed = 0
    try:
        entries = list(os.scandir(os.fspath(root)))
    except OSError:
        return 0
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not _KEY.fullmatch(entry.name):
            continue
        try:
            meta = json.loads(Path(entry.path, META).read_text(encoding="utf-8"))
            model = meta.get("model") if isinstance(meta, dict) else None
        except (OSError, ValueError):
            model = None
            if not _only_blocks(entry.path):
                continue  # not a cache directory (CORRAL_KV_DISK_DIR may be shared): never removed
        if isinstance(model, str) and model in keep:
            continue
        size = usage(entry.path)
        shutil.rmtree(entry.path, ignore_errors=True)
        freed += size - usage(entry.path)
    return freed


@dataclasses.dataclass(frozen=True)
class SavedSlot:
    """A saved slot file (``/slots/{id}?action=save``) of a model: its name, bytes, when it was written, and the
    cache key it was saved under (one per llama.cpp build, KV cache type, offload)."""

    name: str
    bytes: int
    modified: float
    key: str


def _slot_dirs(root: str | os.PathLike[str], model: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """(key, its slots folder) of every key directory whose meta.json names ``model`` (its "model", "adapters" and
    "projector" entries, as the runner writes them)."""
    try:
        entries = list(os.scandir(os.fspath(root)))
    except OSError:
        return
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not _KEY.fullmatch(entry.name):
            continue
        try:
            meta = json.loads(Path(entry.path, META).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and all(meta.get(k) == v for k, v in model.items()):
            yield entry.name, os.path.join(entry.path, SLOTS)


def saved_slots(root: str | os.PathLike[str], model: Mapping[str, str]) -> list[SavedSlot]:
    """The saved slots of ``model`` under ``root`` (see :func:`_slot_dirs`), newest first."""
    out = []
    for key, folder in _slot_dirs(root, model):
        try:
            files = list(os.scandir(folder))
        except OSError:
            continue
        for f in files:
            if f.name.startswith(".") or not f.is_file(follow_symlinks=False):
                continue  # a writer's temporary file
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append(SavedSlot(f.name, st.st_size, st.st_mtime, key))
    return sorted(out, key=lambda s: (-s.modified, s.name))


def remove_saved_slot(root: str | os.PathLike[str], model: Mapping[str, str], name: str) -> int:
    """Remove the saved slot ``name`` (a plain name, checked by the caller) of ``model`` under every key it was
    saved under; the bytes freed (0: there was none). The ledger is corrected under the writers' lock."""
    if not name or name.startswith(".") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"not a saved slot's name: {name!r}")
    if not os.path.isdir(os.fspath(root)):
        return 0
    freed = 0
    lock = _RootLock(os.fspath(root))
    try:
        for _key, folder in _slot_dirs(root, model):
            path = os.path.join(folder, name)
            try:
                st = os.stat(path, follow_symlinks=False)
                os.unlink(path)
            except OSError:
                continue
            freed += st.st_size
        if freed:
            _Ledger(os.fspath(root)).add(-freed)
    finally:
        lock.release()
    return freed


def evict_lru(
    files: Iterable[tuple[int, str, int]], total: int, target: int, extra: int, new: str | None = None
) -> tuple[int, bool]:
    """Remove files (mtime, path, size), least recently used first, until ``total + extra`` is within ``target``
    (the root lock is held); a file that cannot be removed is passed over. ``new``: the path standing for the file
    about to be written, sorted among the others: reached, it is not written and ``extra`` no longer counts.
    Returns the bytes left and whether the new file is still to be written."""
    write = True
    for _mtime, victim, vsize in sorted(files):
        if total + (extra if write else 0) <= target:
            break
        if victim == new:
            write = False
            continue
        try:
            os.unlink(victim)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        total -= vsize
    return total, write


class KVStore:
    """The blocks of one cache key under ``root`` (shared with other keys and processes), bounded together with
    them by ``limit_bytes``. Thread-safe; ``save`` and ``load`` never raise for anything the disk does."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        key: str,
        limit_bytes: int,
        meta: Mapping[str, str],
        *,
        block: int = BLOCK_TOKENS,
        logger: logging.Logger | None = None,
    ) -> None:
        if not _KEY.fullmatch(key):
            raise ValueError(f"a cache key must be 1-128 letters, digits, '_', '.' or '-', not {key!r}")
        if block <= 0:
            raise ValueError(f"block must be positive, not {block}")
        self.root = os.path.abspath(os.fspath(root))
        self.key = key
        self.dir = os.path.join(self.root, key)
        self.limit_bytes = limit_bytes
        self.block = block
        self._meta = dict(meta)
        self._log = logger or log
        self._lock = threading.Lock()  # writers take turns (readers never wait for a write)
        self._count_lock = threading.Lock()
        self._hits = self._misses = self._restored = 0
        self._warned: set[str] = set()  # kinds of failure logged since the last successful write
        self._warn_lock = threading.Lock()

    # -- names

    def _path(self, block_hash: str) -> str:
        return os.path.join(self.dir, block_hash[:2], block_hash + SUFFIX)

    def _parent(self, index: int, hashes: Sequence[str]) -> str:
        return hashes[index - 1] if index else self.key

    def _valid(self, hashes: Sequence[str], tokens: Sequence[int], n: int) -> int:
        """How many of the leading ``n`` hashes are well-formed and the chain hashes of ``tokens``."""
        b = self.block
        for i in range(n):
            block = tokens[i * b : (i + 1) * b]
            if (
                not _HASH.fullmatch(hashes[i])
                or len(block) != b
                or min(block) < 0
                or _chain(self._parent(i, hashes), block) != hashes[i]
            ):
                return i
        return n

    # -- lookups

    def present(self, hashes: Sequence[str]) -> int:
        """How many leading blocks have a file on disk (nothing is read or checked)."""
        n = 0
        for h in hashes:
            if not _HASH.fullmatch(h) or not os.path.isfile(self._path(h)):
                break
            n += 1
        return n

    def load(self, hashes: Sequence[str], tokens: Sequence[int]) -> list[bytes]:
        """The checked payloads of the leading blocks, up to the first missing or bad one (a bad file is removed
        with one log line). Counts a hit (and the tokens returned) or a miss."""
        want = self._valid(hashes, tokens, len(hashes))
        if want < len(hashes):
            self._warn_once("lookup", "kv disk cache: a lookup's block hashes do not match its tokens (block %d)", want)
        out: list[bytes] = []
        if want <= 1 or READERS <= 1:
            for i in range(want):
                payload = self._read(i, hashes, tokens)
                if payload is None:
                    break
                out.append(payload)
        else:
            # several blocks read and checked at once: os.read and sha256 release the GIL, and checking a block
            # costs about as much as reading it
            with concurrent.futures.ThreadPoolExecutor(min(READERS, want), thread_name_prefix="kv-read") as pool:
                futures = [pool.submit(self._read, i, hashes, tokens) for i in range(want)]
                for future in futures:
                    payload = future.result()
                    if payload is None:
                        break
                    out.append(payload)
                pool.shutdown(cancel_futures=True)
        if out:
            self._stamp(hashes[: len(out)])
        if want:
            with self._count_lock:
                if out:
                    self._hits += 1
                    self._restored += len(out) * self.block
                else:
                    self._misses += 1
        return out

    def _read(self, index: int, hashes: Sequence[str], tokens: Sequence[int]) -> bytes | None:
        path = self._path(hashes[index])
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._warn_once(f"read:{exc.errno}", "kv disk cache: cannot read %s: %s", path, exc)
            return None
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            self._warn_once(f"read:{exc.errno}", "kv disk cache: cannot read %s: %s", path, exc)
            return None
        try:
            b = self.block
            return _decode(
                fd,
                st.st_size,
                self.key,
                index,
                hashes[index],
                self._parent(index, hashes),
                tokens[index * b : (index + 1) * b],
            )
        except _Bad as exc:
            self._remove_bad(path, st, str(exc))
            return None
        except OSError as exc:
            self._warn_once(f"read:{exc.errno}", "kv disk cache: cannot read %s: %s", path, exc)
            return None
        finally:
            os.close(fd)

    def _remove_bad(self, path: str, st: os.stat_result, why: str) -> None:
        """Remove a file that failed a check, unless another writer has replaced it meanwhile."""
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except OSError:
            pass
        self._log.warning("kv disk cache: removed %s: %s", path, why)

    def _stamp(self, hashes: Sequence[str], now: int | None = None) -> None:
        """Mark a chain's leading blocks used ``now`` (ns), each ancestor newer than its descendants."""
        now = time.time_ns() if now is None else now
        for k, h in enumerate(hashes):
            t = now - k * _STEP_NS
            try:
                os.utime(self._path(h), ns=(t, t))
            except OSError:
                pass

    # -- writes

    def save(self, index: int, hashes: Sequence[str], tokens: Sequence[int], payload: bytes) -> bool:
        """Write block ``index`` (the tokens ``tokens[index*B:(index+1)*B]``, its parent ``hashes[index-1]`` or the
        key) unless it is on disk already, making room under the bound first. True when the block is on disk
        afterwards. False, never an exception, when it is not: the disk failed (logged once per kind of failure
        until a write succeeds again), the block alone exceeds the bound (logged once), its parent is not on disk
        (a block is only useful after its whole prefix, so blocks are saved in order), or it is the least recently
        used block itself (the tail of a chain longer than the bound)."""
        if not 0 <= index < len(hashes) or self._valid(hashes, tokens, index + 1) <= index:
            self._warn_once("args", "kv disk cache: not storing block %d: its hashes do not match its tokens", index)
            return False
        b = self.block
        block_hash, parent = hashes[index], self._parent(index, hashes)
        path = self._path(block_hash)
        with self._lock:
            if os.path.isfile(path):
                self._stamp(hashes[: index + 1])
                return True
            if index and not os.path.isfile(self._path(parent)):
                return False
            header = _encode(self.key, index, block_hash, parent, tokens[index * b : (index + 1) * b], payload)
            size = len(header) + len(payload)
            if size > self.limit_bytes:
                self._warn_once(
                    "limit",
                    "kv disk cache: a block of %d bytes does not fit the bound of %d bytes (CORRAL_KV_DISK); "
                    "going on without the disk cache",
                    size,
                    self.limit_bytes,
                )
                return False
            try:
                lock = _RootLock(self.root)
            except OSError as exc:
                self._write_failed(exc)
                return False
            try:
                return self._save_locked(index, hashes, path, (header, payload), size)
            finally:
                lock.release()

    def _save_locked(self, index: int, hashes: Sequence[str], path: str, parts: tuple[bytes, bytes], size: int) -> bool:
        """``save`` holding both locks: reserve the room, write, stamp."""
        try:
            self._write_meta()
        except OSError as exc:
            self._write_failed(exc)
            return False
        now = time.time_ns()
        self._stamp(hashes[:index], now)  # the prefix is in use: evict others before it
        mtime = now - index * _STEP_NS  # and the new block before its prefix
        if not self._make_room(size, mtime):
            return False
        try:
            _write_atomic(os.path.dirname(path), path, parts)
        except OSError as exc:
            _Ledger(self.root).add(-size)
            self._write_failed(exc)
            return False
        try:
            os.utime(path, ns=(mtime, mtime))
        except OSError:
            pass
        with self._warn_lock:
            self._warned.clear()
        return True

    def _write_failed(self, exc: OSError) -> None:
        self._warn_once(
            f"write:{exc.errno}",
            "kv disk cache: could not store a block under %s (%s); going on without it",
            self.dir,
            _describe(exc),
        )

    def _write_meta(self) -> None:
        """Write meta.json unless it is there (the root lock is held)."""
        target = os.path.join(self.dir, META)
        if os.path.isfile(target):
            return
        os.makedirs(self.dir, exist_ok=True)
        meta = dict(self._meta)
        meta.setdefault("key", self.key)
        meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        data = json.dumps(meta, indent=2, sort_keys=True).encode("utf-8")
        _write_atomic(self.dir, target, (data,))
        _Ledger(self.root).add(len(data))

    def _make_room(self, size: int, mtime: int) -> bool:
        """Reserve ``size`` bytes in the root's ledger (the root lock is held), evicting the least recently used
        files down to the low-water mark when the reservation would pass the bound. The ledger is trusted while it
        is younger than ``_RESCAN_S``; else, or when the bound would be passed, the root is scanned. False when the
        new block (with ``mtime``) is itself among the least recently used (nothing reserved)."""
        ledger = _Ledger(self.root)
        known = ledger.read()
        if known is not None and known[0] + size <= self.limit_bytes and time.time() - known[1] < _RESCAN_S:
            ledger.write(known[0] + size, known[1])
            return True
        files, total = self._scan()
        write = True
        if total + size > self.limit_bytes:
            # "" sorts before every path: an equal mtime evicts the new block first
            total, write = evict_lru([*files, (mtime, "", size)], total, int(self.limit_bytes * _LOW_WATER), size, "")
        ledger.write(total + (size if write else 0), time.time())
        return write

    def _scan(self) -> tuple[list[tuple[int, str, int]], int]:
        """Every block file under the root (mtime ns, path, size) and the bytes of all files; removes the
        temporary files of crashed writers."""
        files: list[tuple[int, str, int]] = []
        total = 0
        now = time.time()
        for entry in _walk(self.root):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.endswith(SUFFIX):
                files.append((st.st_mtime_ns, entry.path, st.st_size))
            elif entry.name.startswith(".") and entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TEMP_S:
                try:
                    os.unlink(entry.path)
                    continue
                except OSError:
                    pass
            total += st.st_size
        return files, total

    def _warn_once(self, kind: str, msg: str, *args: object) -> None:
        with self._warn_lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        self._log.warning(msg, *args)

    # -- accounting

    def stats(self) -> KVStats:
        """This key's block files and their bytes (counted on disk now: a scan of the key's directory, so for
        status, not for every request) and its lookups."""
        files = [e for e in _walk(self.dir) if e.name.endswith(SUFFIX)]
        nbytes = sum(_size(e) for e in files)
        with self._count_lock:
            return KVStats(len(files), nbytes, self._hits, self._misses, self._restored)


class _RootLock:
    """An exclusive ``flock`` on ``<root>/.lock``, taken on creation (``OSError`` when it cannot be): writers of
    every process that shares the root take turns, so the ledger and eviction see each other's writes. Readers never
    take it."""

    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise

    def release(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(self.fd)


class _Ledger:
    """``<root>/.usage``: the bytes under the root as of the last scan plus the reservations since, and when that
    scan was (fixed width, so rewriting it does not change the usage it counts). Read and written only under the
    root lock; a missing or garbled ledger means "scan"."""

    WIDTH = 20

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LEDGER)

    def read(self) -> tuple[int, float] | None:
        try:
            with open(self.path, "rb") as f:
                used, when = f.read(2 * self.WIDTH + 2).split()
            return int(used), int(when) / 1e9
        except (OSError, ValueError):
            return None

    def write(self, used: int, when: float) -> None:
        text = f"{max(0, used):0{self.WIDTH}d} {int(when * 1e9):0{self.WIDTH}d}\n".encode("ascii")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, text, 0)
            finally:
                os.close(fd)
        except OSError:
            pass  # the next write scans

    def add(self, delta: int) -> None:
        known = self.read()
        if known is not None:
            self.write(known[0] + delta, known[1])


def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return f"the disk is full: {exc}"
    return str(exc)


def _write_atomic(directory: str, target: str, parts: Sequence[bytes]) -> None:
    """Write ``parts`` to a temporary file in ``directory``, fsync it and rename it to ``target``: a reader sees the
    old file, the whole new one or none. On any error the temporary file is removed and the error raised."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
    try:
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    n = os.write(fd, view)
                    if n <= 0:
                        raise OSError(errno.EIO, "write returned 0")
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
