"""``GET/POST /api/export`` and ``POST /api/import``: a model as an OCI image layout in a tar (``registry/oci.py``).

Export builds the archive on the fly from the store's blobs (no temp copy), with an exact ``Content-Length``.
The blob files are opened before the first byte is sent, so a model deleted meanwhile still exports whole.

Import reads the request body as a tar stream (``tarfile`` in ``r|`` mode; members' bytes are only read, never
extracted) in a worker thread. Every member is checked (``registry.oci.classify``) before a byte of it is used;
each blob goes through the store's verified writer (temp file, sha256, rename) and must hash to its name; the
manifest must match its descriptor in ``index.json``, every blob it names must have arrived with the size it
declares, and the model layer must be a GGUF whose header reads. Only then is the manifest written, last. On any
failure the temp file in flight is removed, the blobs this import added that no model references are deleted
again, and the rest of the body is read and dropped so the client gets the answer (a 400 before the first
progress line, else a final ``{"error": ...}`` line, as for create and pull). An existing model of the same name
is replaced, as Ollama's create and pull do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import shutil
import tarfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from daemon.api.bodies import read_model
from daemon.api.errors import error_response
from daemon.api.schemas import NamedRequest
from daemon.api.streaming import NDJSON
from daemon.models.catalog import Catalog
from errors import (
    CorralError,
    DigestMismatch,
    InsufficientSpace,
    InvalidGGUF,
    InvalidRequest,
    RequestCanceled,
    StoreError,
)
from registry import oci
from registry.digest import Digest
from registry.manifest import MAX_MANIFEST_BYTES, MEDIA_ADAPTER, MEDIA_MODEL, Manifest
from registry.names import ModelName
from registry.pull import SPACE_RESERVE, format_bytes

log = logging.getLogger(__name__)

router = APIRouter()

CHUNK = 1024 * 1024
#: An upload that sends nothing for this long is abandoned.
BODY_IDLE_TIMEOUT = 300.0
#: Small blobs seen before the archive's manifest (other tools write blobs first) wait in memory up to this much.
HELD_BYTES = 16 * 1024 * 1024
#: Bytes accepted after the tar's end-of-archive marker (record padding).
MAX_TRAILING = 1024 * 1024
#: Pax and GNU long-name headers are read into memory by tarfile: bound them.
MAX_EXTENDED_HEADER = 64 * 1024
PROGRESS_INTERVAL = 0.5

_jobs: set[asyncio.Future[Any]] = set()  # running imports (a strong reference, so none is collected mid-way)


# -- export --------------------------------------------------------------------------------------------------
class _ExportFiles:
    """The blob files of one export, opened up front and checked against the manifest's sizes."""

    def __init__(self, catalog: Catalog, raw_name: str) -> None:
        with catalog.lock:
            stored = catalog.get(raw_name)
            self.name = stored.name
            self.entries = oci.export_entries(stored.name, stored.manifest)
            self.files: dict[Digest, BinaryIO] = {}
            try:
                for e in self.entries:
                    if e.digest is None:
                        continue
                    f = catalog.store.open_blob(e.digest)
                    self.files[e.digest] = f
                    size = _fsize(f)
                    if size != e.size:
                        raise StoreError(
                            f"blob {e.digest} is {size} bytes but the manifest of "
                            f"{stored.name.short()} says {e.size}; the store is damaged"
                        )
            except BaseException:
                self.close()
                raise
        self.size = oci.archive_size(self.entries)

    def close(self) -> None:
        for f in self.files.values():
            with contextlib.suppress(OSError):
                f.close()
        self.files = {}

    async def body(self) -> AsyncIterator[bytes]:
        written = 0
        try:
            for e in self.entries:
                header = oci.tar_header(e)
                yield header
                written += len(header)
                if e.is_dir:
                    continue
                if e.data is not None:
                    yield e.data
                else:
                    assert e.digest is not None
                    f, left = self.files[e.digest], e.size
                    while left:
                        chunk = await run_in_threadpool(f.read, min(CHUNK, left))
                        if not chunk:
                            raise StoreError(f"blob {e.digest} ended {left} bytes early")
                        left -= len(chunk)
                        yield chunk
                pad = oci.padding(e.size)
                yield pad
                written += e.size + len(pad)
            yield oci.trailer(written)
        finally:
            self.close()


def _fsize(f: BinaryIO) -> int:
    import os

    return os.fstat(f.fileno()).st_size


async def _export(request: Request, raw_name: str) -> Response:
    if not raw_name:
        raise InvalidRequest("model is required")
    catalog: Catalog = request.app.state.catalog
    files = await run_in_threadpool(_ExportFiles, catalog, raw_name)
    filename = f"{files.name.model}-{files.name.tag}.tar"  # the name grammar allows no quote or separator
    log.info("export model=%s size=%d", files.name.short(), files.size)
    return StreamingResponse(
        files.body(),
        media_type="application/x-tar",
        headers={"Content-Length": str(files.size), "Content-Disposition": f'attachment; filename="{filename}"'},
    )


@router.get("/api/export")
async def export_get(request: Request) -> Response:
    return await _export(request, request.query_params.get("model") or request.query_params.get("name") or "")


@router.post("/api/export")
async def export_post(request: Request) -> Response:
    req = await read_model(request, NamedRequest)
    return await _export(request, req.model_name)


# -- import: the request body as a blocking file for a worker thread -----------------------------------------
class BodyReader:
    """``read(n)`` over the request body, for a worker thread: each chunk is fetched on the event loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self._chunks = request.stream().__aiter__()
        self._loop = loop
        self._buf = b""
        self.eof = False
        self.received = 0

    def _fetch(self) -> None:
        async def next_chunk() -> bytes | None:
            try:
                return await self._chunks.__anext__()
            except StopAsyncIteration:
                return None

        future = asyncio.run_coroutine_threadsafe(next_chunk(), self._loop)
        try:
            chunk = future.result(timeout=BODY_IDLE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise InvalidRequest(f"the upload sent nothing for {BODY_IDLE_TIMEOUT:.0f} seconds") from None
        except ClientDisconnect:
            raise RequestCanceled() from None
        if chunk is None:
            self.eof = True
        else:
            self.received += len(chunk)
            self._buf += chunk

    def read(self, n: int = -1) -> bytes:
        while not self._buf and not self.eof:
            self._fetch()
        if n is None or n < 0:
            n = len(self._buf)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def drain(self, limit: int | None = None) -> int:
        """Read and drop the rest of the body; returns the bytes dropped (stops past ``limit``)."""
        dropped = 0
        while True:
            dropped += len(self._buf)
            self._buf = b""
            if self.eof or (limit is not None and dropped > limit):
                return dropped
            self._fetch()


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads pax and GNU long-name headers into memory whole: refuse big ones (and sparse files)."""

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_EXTENDED_HEADER:
            raise oci.InvalidArchive(f"a long-name header of {self.size} bytes")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        if self.size > MAX_EXTENDED_HEADER:
            raise oci.InvalidArchive(f"a pax header of {self.size} bytes")
        return super()._proc_pax(tarfile)  # type: ignore[misc]

    def _proc_sparse(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:
        raise oci.InvalidArchive(f"member {self.name!r} is a sparse file")


# -- import: the work ----------------------------------------------------------------------------------------
class Importer:
    """One import, run in a worker thread. ``emit`` takes progress objects (the first one means the archive's
    index and manifest were read and checked)."""

    def __init__(
        self,
        catalog: Catalog,
        body: BodyReader,
        *,
        name: str | None,
        prune: bool,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.catalog = catalog
        self.store = catalog.store
        self.body = body
        self.raw_name = name
        self.prune = prune
        self.emit = emit
        self.override: ModelName | None = None
        self.name: ModelName = ModelName.parse("unnamed")  # set from index.json (or the override)
        self.layout_seen = False
        self.index: oci.IndexEntry | None = None
        self.manifest: Manifest | None = None
        self.sizes: dict[Digest, int] = {}  # what the manifest declares
        self.seen: dict[Digest, int] = {}  # blobs read from the archive (verified) and their sizes
        self.held: dict[Digest, bytes] = {}  # small verified blobs kept in memory (not in the store yet)
        self.new_blobs: set[Digest] = set()  # blobs this import added to the store
        self.names: set[str] = set()
        self.entries = 0
        self.started = False

    # -- the whole job -------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.raw_name:
                self.override = ModelName.parse(self.raw_name)
            self._read_archive()
            self._finish()
        except BaseException as exc:
            self._cleanup()
            if not isinstance(exc, RequestCanceled):
                with contextlib.suppress(Exception):
                    self.body.drain()  # so the client, still sending, gets the answer
            raise

    def _cleanup(self) -> None:
        if not self.new_blobs:
            return
        with self.catalog.lock:
            removed = self.store.remove_unreferenced(self.new_blobs)
        log.info("import failed; removed %d blobs it had added", len(removed))

    # -- reading -------------------------------------------------------------------------------------------
    def _read_archive(self) -> None:
        try:
            tf = tarfile.open(  # noqa: SIM115 - closed in the finally below, once the open error is mapped
                fileobj=self.body,
                mode="r|",
                bufsize=CHUNK,  # type: ignore[call-overload]
                tarinfo=_BoundedTarInfo,
            )
        except tarfile.TarError as exc:
            raise oci.InvalidArchive(
                f"not a tar archive ({exc}); corral imports the .tar that corral export writes (uncompressed)"
            ) from None
        try:
            while True:
                try:
                    info = tf.next()
                except tarfile.TarError as exc:
                    raise oci.InvalidArchive(f"unreadable tar header: {exc}") from None
                if info is None:
                    break
                self.entries += 1
                if self.entries > oci.MAX_ENTRIES:
                    raise oci.InvalidArchive(f"more than {oci.MAX_ENTRIES} entries")
                member = oci.classify(info)
                if member.name in self.names:
                    raise oci.InvalidArchive(f"duplicate entry {member.name!r}")
                self.names.add(member.name)
                if member.kind == "dir":
                    continue
                try:
                    self._member(tf, info, member)
                except tarfile.TarError as exc:
                    raise oci.InvalidArchive(f"{member.name}: truncated or unreadable ({exc})") from None
                tf.members.clear()  # tarfile keeps every TarInfo otherwise
        finally:
            with contextlib.suppress(Exception):
                tf.close()
        if self.body.drain(MAX_TRAILING) > MAX_TRAILING:
            raise oci.InvalidArchive("more than 1 MiB of data after the end of the archive")

    def _read_small(self, tf: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
        f = tf.extractfile(info)
        assert f is not None
        data = f.read(info.size + 1)
        if len(data) != info.size:
            raise oci.InvalidArchive(f"{info.name}: truncated ({len(data)} of {info.size} bytes)")
        return data

    def _member(self, tf: tarfile.TarFile, info: tarfile.TarInfo, member: oci.Member) -> None:
        if member.kind == "layout":
            oci.parse_layout(self._read_small(tf, info))
            self.layout_seen = True
            return
        if member.kind == "index":
            self.index = oci.parse_index(self._read_small(tf, info))
            self.name = oci.model_name_for(self.index, self.override)
            if self.index.digest in self.held:
                self._got_manifest(self.held.pop(self.index.digest))
            return
        digest = member.digest
        assert digest is not None
        if self.index is not None and digest == self.index.digest:
            if info.size > MAX_MANIFEST_BYTES:
                raise oci.InvalidArchive(
                    f"the manifest is {info.size} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
                )
            self._got_manifest(self._read_small(tf, info))
            self.seen[digest] = info.size
            return
        if self.manifest is not None:
            if digest not in self.sizes:
                log.info("import: skipping blob %s that the manifest does not name", digest)
                return  # tarfile skips its bytes
            if info.size != self.sizes[digest]:
                raise oci.InvalidArchive(f"blob {digest} is {info.size} bytes, the manifest says {self.sizes[digest]}")
        self._blob(tf, info, digest)

    def _got_manifest(self, raw: bytes) -> None:
        assert self.index is not None
        manifest = oci.parse_manifest(raw, self.index)
        if not manifest.first(MEDIA_MODEL):
            raise oci.InvalidArchive("the manifest has no model layer (application/vnd.ollama.image.model)")
        self.manifest = manifest
        self.sizes = {manifest.config.digest: manifest.config.size}
        for layer in manifest.layers:
            if self.sizes.setdefault(layer.digest, layer.size) != layer.size:
                raise oci.InvalidArchive(f"the manifest gives blob {layer.digest} two sizes")
        for digest, size in self.seen.items():
            if digest in self.sizes and self.sizes[digest] != size:
                raise oci.InvalidArchive(f"blob {digest} is {size} bytes, the manifest says {self.sizes[digest]}")
        self._check_space()
        self.started = True
        self.emit({"status": f"importing {self.name.short()}"})
        for digest, size in self.seen.items():
            if digest in self.sizes:
                self.emit(self._progress(digest, size, size))

    def _check_space(self) -> None:
        need = sum(size for d, size in self.sizes.items() if d not in self.seen and not self.store.has_blob(d))
        if not need:
            return
        free = shutil.disk_usage(self.store.blobs_dir).free
        if need + SPACE_RESERVE > free:
            raise InsufficientSpace(
                f"not enough disk space to import {self.name.short()}: it needs {format_bytes(need)} and "
                f"{format_bytes(free)} is free in {self.store.blobs_dir}; free some space (corral prune removes "
                "unused blobs) or set CORRAL_MODELS to a larger disk"
            )

    @staticmethod
    def _progress(digest: Digest, total: int, completed: int) -> dict[str, Any]:
        line: dict[str, Any] = {"status": f"importing {digest.short}", "digest": str(digest), "total": total}
        if completed:
            line["completed"] = completed
        return line

    def _blob(self, tf: tarfile.TarFile, info: tarfile.TarInfo, digest: Digest) -> None:
        """Read one blob, hash it, and keep it: in memory (small, manifest unknown yet) or in the store."""
        f = tf.extractfile(info)
        assert f is not None
        size = info.size
        show = self.started
        if show:
            self.emit(self._progress(digest, size, 0))
        hold = (
            self.manifest is None
            and size <= MAX_MANIFEST_BYTES
            and sum(map(len, self.held.values())) + size <= HELD_BYTES
        )
        exists = not hold and self.store.has_blob(digest)
        writer = None if hold or exists else self.store.writer()
        h = hashlib.sha256()
        parts: list[bytes] = []
        done, last = 0, time.monotonic()
        try:
            while done < size:
                chunk = f.read(min(CHUNK, size - done))
                if not chunk:
                    raise oci.InvalidArchive(f"blob {digest} is truncated ({done} of {size} bytes)")
                done += len(chunk)
                if writer is not None:
                    writer.write(chunk)
                else:
                    h.update(chunk)
                    if hold:
                        parts.append(chunk)
                if show and time.monotonic() - last >= PROGRESS_INTERVAL:
                    last = time.monotonic()
                    self.emit(self._progress(digest, size, done))
            if writer is not None:
                try:
                    writer.commit(digest)
                except DigestMismatch as exc:
                    raise oci.InvalidArchive(
                        f"blob {digest} does not match its digest (it hashes to {exc.actual}); the archive is corrupt"
                    ) from None
                self.new_blobs.add(digest)
            elif h.hexdigest() != digest.hex:
                raise oci.InvalidArchive(
                    f"blob {digest} does not match its digest (it hashes to "
                    f"sha256:{h.hexdigest()}); the archive is corrupt"
                )
        finally:
            if writer is not None:
                writer.abort()  # no-op once committed
        if hold:
            self.held[digest] = b"".join(parts)
        elif exists:
            self.store.touch_blob(digest)
        self.seen[digest] = size
        if show:
            self.emit(self._progress(digest, size, size))

    # -- finishing -----------------------------------------------------------------------------------------
    def _finish(self) -> None:
        if not self.layout_seen:
            raise oci.InvalidArchive(f"no {oci.LAYOUT_FILE} file: not an OCI image layout")
        if self.index is None:
            raise oci.InvalidArchive(f"no {oci.INDEX_FILE}")
        if self.manifest is None:
            raise oci.InvalidArchive(f"the manifest {self.index.digest} named by {oci.INDEX_FILE} is missing")
        manifest = self.manifest
        missing = [str(d) for d in self.sizes if d not in self.seen]
        if missing:
            raise oci.InvalidArchive(f"blobs the manifest names are missing: {', '.join(missing)}")
        self.emit({"status": "verifying model"})
        with self.catalog.lock:
            for digest, data in self.held.items():
                if digest in self.sizes:
                    if not self.store.has_blob(digest):
                        self.new_blobs.add(digest)
                    self.store.put_bytes(data)
        for layer in manifest.layers:
            if layer.media_type in (MEDIA_MODEL, MEDIA_ADAPTER):
                try:
                    self.catalog.gguf(layer.digest)
                except InvalidGGUF as exc:
                    raise InvalidGGUF(
                        f"invalid archive: layer {layer.digest} is not a usable GGUF file: {exc}"
                    ) from None
        self.emit({"status": "writing manifest"})
        with self.catalog.lock:
            target = self.store.canonical(self.name)
            old_blobs: set[Digest] = set()
            if self.store.manifest_path(target).is_file():
                with contextlib.suppress(CorralError):
                    old_blobs = self.store.read_manifest(target).blobs()
            self.store.write_manifest(target, manifest)
            stale = (old_blobs - manifest.blobs()) if self.prune else set()
            removed = self.store.remove_unreferenced(stale | (self.new_blobs - manifest.blobs()))
            self.new_blobs = set()
        log.info("imported model=%s layers=%d size=%d", target.short(), len(manifest.layers), manifest.size)
        if stale & set(removed):
            self.emit({"status": "removing unused layers"})
        self.emit({"status": "success"})


# -- import: the endpoint ------------------------------------------------------------------------------------
_DONE = object()


class _BodyReadingResponse(StreamingResponse):
    """A streaming response that leaves ``receive`` alone: the import worker is still reading the request body
    from it (Starlette's own would consume it, looking for a disconnect; the worker notices one itself)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.stream_response(send)


def _line(obj: dict[str, Any]) -> bytes:
    import json

    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


@router.post("/api/import")
async def import_model(request: Request) -> Response:
    params = request.query_params
    stream = params.get("stream", "true").strip().lower() not in ("false", "0", "no", "off")
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
            loop.call_soon_threadsafe(events.put_nowait, item)

    app = request.app.state
    importer = Importer(
        app.catalog,
        BodyReader(request, loop),
        name=params.get("name") or None,
        prune=not app.settings.noprune,
        emit=post,
    )

    def work() -> None:
        try:
            importer.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the response
            post(exc)
        finally:
            post(_DONE)

    job = asyncio.ensure_future(run_in_threadpool(work))
    _jobs.add(job)
    job.add_done_callback(_jobs.discard)

    first = await events.get()
    if isinstance(first, BaseException) or first is _DONE:
        await asyncio.shield(job)
        if isinstance(first, CorralError):
            return error_response(first)
        if isinstance(first, BaseException):
            raise first
        return JSONResponse({})
    if not stream:
        last = first
        while (item := await events.get()) is not _DONE:
            if isinstance(item, CorralError):
                await asyncio.shield(job)
                return error_response(item)
            if isinstance(item, BaseException):
                raise item
            last = item
        return JSONResponse(last)

    async def body() -> AsyncIterator[bytes]:
        yield _line(first)
        while (item := await events.get()) is not _DONE:
            if isinstance(item, CorralError):
                yield _line({"error": str(item)})
            elif isinstance(item, BaseException):
                log.error("import failed: %r", item)
                yield _line({"error": f"internal error: {item}"})
            else:
                yield _line(item)

    return _BodyReadingResponse(body(), media_type=NDJSON)
