"""The content-addressed model store, in Ollama's layout.

    <root>/blobs/sha256-<hex>                          immutable, digest-verified
    <root>/manifests/<host>/<namespace>/<model>/<tag>  Docker v2 JSON, replaced atomically
    <root>/blobs/sha256-<hex>-partial                  a download in progress (sparse, pre-sized)
    <root>/blobs/sha256-<hex>-partial.json             its parts and how far each got (registry/download.py)
    <root>/blobs/sha256-<hex>-partial-<N>              Ollama's own per-part state files (pruned like partials)

Every path comes from :meth:`Store._path`, which only accepts validated :class:`Digest` and :class:`ModelName`
values and checks that the result lies inside the store. Blobs are written to a temp file in ``blobs/`` while
hashing, verified, fsync'd and renamed; manifests are written the same way and always last.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from errors import (
    BlobNotFound,
    CorralError,
    DigestMismatch,
    InvalidManifest,
    ModelNotFound,
    StoreError,
    StoreLocked,
)
from registry.digest import Digest
from registry.manifest import Manifest
from registry.names import ModelName

log = logging.getLogger(__name__)

TEMP_PREFIX = "sha256-tmp-"
LOCK_NAME = ".corral.lock"
RUNNER_STATE_NAME = ".corral-runners.json"  # the runner configurations that worked, per model and machine
MAX_RUNNER_STATE = 1 << 20
PRUNE_GRACE_SECONDS = 3600.0
PARTIAL_SUFFIX = "-partial"
PARTIAL_STATE_SUFFIX = "-partial.json"
#: A partial download untouched this long is removed by the startup prune (``corral prune`` removes any that is
#: not downloading now). Long enough that a pull interrupted on Friday still resumes on Monday.
PARTIAL_GRACE_SECONDS = 7 * 24 * 3600.0
MAX_PARTIAL_STATE = 4 * 1024 * 1024
#: Ollama's downloads keep one JSON state file per part next to the data: ``sha256-<hex>-partial-<N>``
_OLLAMA_PART = re.compile(r"(sha256-[0-9a-f]{64})-partial-[0-9]{1,6}\Z")


@dataclass(frozen=True)
class StoredModel:
    name: ModelName
    manifest: Manifest
    modified_at: float  # mtime of the manifest file


@dataclass(frozen=True)
class PrunePlan:
    blobs: tuple[Path, ...]
    bytes_freed: int
    skipped_reason: str | None = None
    partials: tuple[Path, ...] = ()  # partial downloads (data and state files)


def partial_digest(filename: str) -> Digest | None:
    """``sha256-<hex>-partial``, ``sha256-<hex>-partial.json`` or Ollama's part file ``sha256-<hex>-partial-<N>``
    -> Digest; anything else -> None."""
    for suffix in (PARTIAL_STATE_SUFFIX, PARTIAL_SUFFIX):
        if filename.endswith(suffix):
            return Digest.from_filename(filename[: -len(suffix)])
    m = _OLLAMA_PART.match(filename)
    if m is not None:
        return Digest.from_filename(m.group(1))
    return None


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file really occupies (a sparse partial download is smaller than its length)."""
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else min(st.st_size, blocks * 512)


class BlobWriter:
    """Streams bytes into a temp file in ``blobs/`` while hashing; :meth:`commit` verifies and renames."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._tmp = store.blobs_dir / f"{TEMP_PREFIX}{secrets.token_hex(16)}"
        self._file: BinaryIO | None = open(self._tmp, "xb")  # noqa: SIM115
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        assert self._file is not None, "writer already closed"
        try:
            self._file.write(chunk)
        except OSError as exc:
            self.abort()
            raise StoreError(f"could not write blob: {exc.strerror or exc}") from exc
        self._hash.update(chunk)
        self.size += len(chunk)

    def commit(self, expected: Digest | None = None, *, expected_text: str | None = None) -> Digest:
        """Verify against ``expected`` (if given), fsync and move into place. Returns the digest."""
        assert self._file is not None, "writer already closed"
        actual = Digest(self._hash.hexdigest())
        if expected is not None and actual != expected:
            self.abort()
            raise DigestMismatch(expected_text or str(expected), str(actual))
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            final = self._store.blob_path(actual)
            os.chmod(self._tmp, 0o644)
            os.replace(self._tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            self.abort()
            raise StoreError(f"could not store blob {actual}: {exc.strerror or exc}") from exc
        return actual

    def abort(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class Store:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().absolute()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self._lock_file: BinaryIO | None = None
        #: bumped by every manifest this store writes or removes: a cache of what a name resolves to (the daemon's
        #: model lookups) is stale once it moves
        self.generation = 0
        try:
            self.blobs_dir.mkdir(parents=True, exist_ok=True)
            self.manifests_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the models directory {self.root}: {exc.strerror or exc}") from exc

    # -- the one place paths are built -------------------------------------------------------------------------
    def _path(self, item: Digest | ModelName, suffix: str = "") -> Path:
        if suffix not in ("", PARTIAL_SUFFIX, PARTIAL_STATE_SUFFIX):  # pragma: no cover - internal misuse
            raise ValueError(f"unknown blob suffix {suffix!r}")
        if isinstance(item, Digest):
            path = self.blobs_dir / (item.filename + suffix)
        elif isinstance(item, ModelName):
            path = self.manifests_dir.joinpath(*item.parts())
        else:  # pragma: no cover - guarded by types
            raise TypeError(f"cannot build a store path from {type(item).__name__}")
        base = self.blobs_dir if isinstance(item, Digest) else self.manifests_dir
        if os.path.commonpath([os.path.normpath(path), base]) != str(base) or ".." in path.parts:
            raise StoreError(f"refusing a path outside the store: {path}")
        return path

    def blob_path(self, digest: Digest) -> Path:
        return self._path(digest)

    def partial_path(self, digest: Digest) -> Path:
        """The data file of a download in progress."""
        return self._path(digest, PARTIAL_SUFFIX)

    def partial_state_path(self, digest: Digest) -> Path:
        """The JSON state (parts and their progress) of a download in progress."""
        return self._path(digest, PARTIAL_STATE_SUFFIX)

    def manifest_path(self, name: ModelName) -> Path:
        return self._path(name)

    # -- lock ----------------------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the one-daemon-per-directory lock, or raise StoreLocked naming the holder."""
        import fcntl

        path = self.root / LOCK_NAME
        f = open(path, "a+b")  # noqa: SIM115
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().decode(errors="replace").strip() or "another process"
            f.close()
            raise StoreLocked(
                f"the models directory {self.root} is already in use by corral ({holder}); "
                "stop that daemon, or set CORRAL_MODELS to another directory"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}".encode())
        f.flush()
        self._lock_file = f

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- blobs -------------------------------------------------------------------------------------------------
    def has_blob(self, digest: Digest) -> bool:
        return self.blob_path(digest).is_file()

    def blob_size(self, digest: Digest) -> int:
        try:
            return self.blob_path(digest).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(str(digest)) from None

    def open_blob(self, digest: Digest) -> BinaryIO:
        try:
            return open(self.blob_path(digest), "rb")
        except FileNotFoundError:
            raise BlobNotFound(str(digest)) from None

    def read_blob(self, digest: Digest, limit: int = 64 * 1024 * 1024) -> bytes:
        with self.open_blob(digest) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise StoreError(f"blob {digest} is larger than {limit} bytes")
        return data

    def writer(self) -> BlobWriter:
        return BlobWriter(self)

    def put_bytes(self, data: bytes) -> Digest:
        digest = Digest.of_bytes(data)
        if self.has_blob(digest):
            self.touch_blob(digest)
            return digest
        with self.writer() as w:
            w.write(data)
            return w.commit(digest)

    def touch_blob(self, digest: Digest) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.blob_path(digest))

    def iter_blob_files(self) -> Iterator[Path]:
        with os.scandir(self.blobs_dir) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    yield Path(entry.path)

    # -- partial downloads -------------------------------------------------------------------------------------
    def read_partial_state(self, digest: Digest) -> bytes | None:
        try:
            with open(self.partial_state_path(digest), "rb") as f:
                data = f.read(MAX_PARTIAL_STATE + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read partial download state digest=%s error=%s", digest, exc)
            return None
        return data if len(data) <= MAX_PARTIAL_STATE else None

    def write_partial_state(self, digest: Digest, data: bytes) -> None:
        """Replace the state file atomically (temp file + rename; a crash leaves the old or the new one)."""
        path = self.partial_state_path(digest)
        tmp = self.blobs_dir / f"{TEMP_PREFIX}{secrets.token_hex(16)}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"could not save download progress {path}: {exc.strerror or exc}") from exc

    def remove_partial(self, digest: Digest) -> None:
        for path in (self.partial_state_path(digest), self.partial_path(digest)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def commit_partial(self, digest: Digest) -> None:
        """Move a finished, verified download into place as the blob (mode 0644), without waiting for the disk:
        the puller calls :meth:`sync_blob` once it has answered, so a pull need not wait for gigabytes to reach
        it."""
        src, final = self.partial_path(digest), self.blob_path(digest)
        try:
            os.chmod(src, 0o644)
            os.replace(src, final)
        except OSError as exc:
            raise StoreError(f"could not store blob {digest}: {exc.strerror or exc}") from exc
        with contextlib.suppress(FileNotFoundError):
            self.partial_state_path(digest).unlink()

    def sync_blob(self, digest: Digest) -> None:
        """fsync a blob and the blobs directory (errors are logged: the data is already verified and in place)."""
        path = self.blob_path(digest)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("could not fsync blob digest=%s error=%s", digest, exc)
        _fsync_dir(path.parent)

    def partial_digests(self) -> set[Digest]:
        """Digests that have partial download files."""
        out = set()
        for path in self.iter_blob_files():
            d = partial_digest(path.name)
            if d is not None:
                out.add(d)
        return out

    # -- manifests ---------------------------------------------------------------------------------------------
    def canonical(self, name: ModelName) -> ModelName:
        """Rewrite each part to the casing already on disk (case-insensitive match), as Ollama does."""
        parts = list(name.parts())
        directory = self.manifests_dir
        for i, part in enumerate(parts):
            match = None
            try:
                with os.scandir(directory) as it:
                    for entry in it:
                        if entry.name.lower() == part.lower():
                            match = entry.name
                            if entry.name == part:
                                break
            except (FileNotFoundError, NotADirectoryError):
                break
            if match is None:
                break
            parts[i] = match
            directory = directory / match
        return name.with_parts((parts[0], parts[1], parts[2], parts[3]))

    def resolve(self, name: ModelName, *, given: str | None = None) -> ModelName:
        """The stored name for ``name``, or ModelNotFound."""
        canonical = self.canonical(name)
        if not self.manifest_path(canonical).is_file():
            raise ModelNotFound(given if given is not None else name.short())
        return canonical

    def manifest_stamp(self, name: ModelName) -> tuple[int, int, int] | None:
        """The manifest file's inode, size and modification time (a rewrite or a replacement changes it); None when
        it is gone."""
        try:
            st = self.manifest_path(name).stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def read_manifest(self, name: ModelName) -> Manifest:
        path = self.manifest_path(name)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ModelNotFound(name.short()) from None
        return Manifest.parse(raw)

    def get(self, name: ModelName) -> StoredModel:
        path = self.manifest_path(name)
        manifest = self.read_manifest(name)
        return StoredModel(name=name, manifest=manifest, modified_at=path.stat().st_mtime)

    def write_manifest(self, name: ModelName, manifest: Manifest) -> None:
        """Atomically replace the manifest; every blob it names must already be present."""
        missing = [d for d in manifest.blobs() if not self.has_blob(d)]
        if missing:
            raise StoreError(f"refusing to write a manifest whose blobs are missing: {', '.join(map(str, missing))}")
        self._write_file_atomic(self.manifest_path(name), manifest.raw or manifest.to_bytes())
        self.generation += 1

    def read_runner_state(self) -> bytes | None:
        """The daemon's remembered runner configurations (``daemon/scheduling/fallback.py``), or None."""
        try:
            with open(self.root / RUNNER_STATE_NAME, "rb") as f:
                data = f.read(MAX_RUNNER_STATE + 1)
        except OSError:
            return None
        return data if len(data) <= MAX_RUNNER_STATE else None

    def write_runner_state(self, data: bytes) -> None:
        self._write_file_atomic(self.root / RUNNER_STATE_NAME, data, what="runner state")

    def _write_file_atomic(self, path: Path, data: bytes, what: str = "manifest") -> None:
        tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(8)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"could not write {what} {path}: {exc.strerror or exc}") from exc

    def iter_manifests(self) -> Iterator[tuple[ModelName, Path]]:
        """Every manifest file whose path is a valid model name (others are ignored)."""
        root = self.manifests_dir
        for dirpath, dirnames, filenames in os.walk(root):
            rel = Path(dirpath).relative_to(root).parts
            if len(rel) > 3:
                dirnames[:] = []
                continue
            if len(rel) != 3:
                continue
            for fn in filenames:
                if fn.startswith("."):
                    continue
                host, namespace, model = rel
                try:
                    name = ModelName.parse(f"{host}/{namespace}/{model}:{fn}")
                except CorralError:
                    continue
                if name.parts() != (host, namespace, model, fn):
                    continue
                yield name, Path(dirpath) / fn

    def list_models(self) -> list[StoredModel]:
        out = []
        for name, path in self.iter_manifests():
            try:
                manifest = Manifest.parse(path.read_bytes())
                out.append(StoredModel(name=name, manifest=manifest, modified_at=path.stat().st_mtime))
            except (CorralError, OSError) as exc:
                log.warning("skipping unreadable manifest path=%s error=%s", path, exc)
        out.sort(key=lambda m: m.modified_at, reverse=True)
        return out

    def referenced_blobs(self, *, strict: bool = False) -> set[Digest]:
        refs: set[Digest] = set()
        for _name, path in self.iter_manifests():
            try:
                refs |= Manifest.parse(path.read_bytes()).blobs()
            except (InvalidManifest, OSError) as exc:
                if strict:
                    raise InvalidManifest(f"corrupt manifest {path}: {exc}") from exc
        return refs

    def copy(self, src: ModelName, dst: ModelName) -> None:
        src_path, dst_path = self.manifest_path(src), self.manifest_path(dst)
        if src_path == dst_path:
            return
        raw = src_path.read_bytes()
        Manifest.parse(raw)
        self._write_file_atomic(dst_path, raw)
        self.generation += 1

    def delete(self, name: ModelName) -> list[Digest]:
        """Remove a manifest, then the blobs no other manifest references. Returns the blobs removed."""
        manifest = self.read_manifest(name)
        path = self.manifest_path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ModelNotFound(name.short()) from None
        finally:
            self.generation += 1
        self._remove_empty_dirs(path.parent)
        return self.remove_unreferenced(manifest.blobs())

    def remove_unreferenced(self, candidates: set[Digest]) -> list[Digest]:
        refs = self.referenced_blobs()
        removed = []
        for digest in sorted(candidates - refs, key=str):
            with contextlib.suppress(FileNotFoundError):
                self.blob_path(digest).unlink()
                removed.append(digest)
        return removed

    def _remove_empty_dirs(self, directory: Path) -> None:
        while directory != self.manifests_dir and self.manifests_dir in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    # -- pruning -----------------------------------------------------------------------------------------------
    def plan_prune(
        self,
        *,
        grace_seconds: float = PRUNE_GRACE_SECONDS,
        partial_grace_seconds: float = PARTIAL_GRACE_SECONDS,
        keep: frozenset[Digest] = frozenset(),
        now: float | None = None,
    ) -> PrunePlan:
        """What a prune would remove: unreferenced blobs and stale temp files older than ``grace_seconds``, and
        partial downloads untouched for ``partial_grace_seconds``. Digests in ``keep`` (downloads in flight) are
        never touched. Nothing at all if a manifest is corrupt."""
        try:
            refs = self.referenced_blobs(strict=True)
        except InvalidManifest as exc:
            return PrunePlan(blobs=(), bytes_freed=0, skipped_reason=str(exc))
        now = time.time() if now is None else now
        victims, total = [], 0
        downloads: dict[Digest, list[tuple[Path, os.stat_result]]] = {}
        for path in self.iter_blob_files():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            partial = partial_digest(path.name)
            if partial is not None:
                downloads.setdefault(partial, []).append((path, st))
                continue
            if now - st.st_mtime < grace_seconds:
                continue
            digest = Digest.from_filename(path.name)
            if digest is not None and (digest in refs or digest in keep):
                continue
            if digest is None and not path.name.startswith(TEMP_PREFIX):
                continue  # not ours
            victims.append(path)
            total += disk_bytes(st)
        partials = []
        for digest, files in sorted(downloads.items(), key=lambda item: str(item[0])):
            newest = max(st.st_mtime for _path, st in files)
            if digest in keep or now - newest < partial_grace_seconds:
                continue  # the data and its state go together, judged by the newer of the two
            for path, st in files:
                partials.append(path)
                total += disk_bytes(st)
        return PrunePlan(blobs=tuple(victims), bytes_freed=total, partials=tuple(partials))

    def prune(self, plan: PrunePlan) -> int:
        freed = 0
        for path in (*plan.blobs, *plan.partials):
            with contextlib.suppress(FileNotFoundError):
                size = disk_bytes(path.stat())
                path.unlink()
                freed += size
        for dirpath, _dirs, _files in sorted(os.walk(self.manifests_dir), key=lambda t: -len(t[0])):
            if Path(dirpath) != self.manifests_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        return freed


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
