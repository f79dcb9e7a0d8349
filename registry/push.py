"""Push a model from the store to an OCI registry, reporting Ollama's progress objects.

    {"status": "retrieving manifest"}
    {"status": "pushing <12 hex>", "digest": "sha256:…", "total": N, "completed": M}   per blob, repeatedly
    {"status": "pushing manifest"}
    {"status": "success"}

Each blob is checked with ``HEAD`` first and uploaded only if the registry lacks it: ``POST …/blobs/uploads/``,
then ``PATCH`` chunks of ``chunk_size`` bytes in order (each to the location the previous answer named), then
``PUT <location>?digest=…``. A chunk that fails is resumed from the offset the registry reports holding. The
manifest goes last, byte for byte as stored, so the registry's copy has the same digest as ours.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from errors import CorralError, InsecureRegistry, RegistryError, RegistryUnreachable
from registry.digest import Digest
from registry.manifest import MANIFEST_MEDIA_TYPE, Layer, Manifest, layer_progress
from registry.names import ModelName
from registry.remote import RegistryClient, backoff
from registry.store import Store

log = logging.getLogger(__name__)

CHUNK = 64 * 1024 * 1024
PIECE = 1024 * 1024
MAX_CHUNK_RETRIES = 4


class _Stop(Exception):
    """Internal: the pushing client went away."""


def media_type(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return MANIFEST_MEDIA_TYPE
    value = doc.get("mediaType") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else MANIFEST_MEDIA_TYPE


class Upload:
    """One blob's upload, run in a thread so that the pusher can report progress meanwhile."""

    def __init__(
        self, remote: RegistryClient, store: Store, digest: Digest, size: int, *, chunk: int, retry_wait: float
    ) -> None:
        self.remote, self.store, self.digest, self.size = remote, store, digest, size
        self.chunk = chunk
        self.retry_wait = retry_wait
        self.sent = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"upload-{digest.short}", daemon=True)

    def _run(self) -> None:
        try:
            self._upload()
        except BaseException as exc:  # noqa: BLE001 - reported by the pusher
            self.error = exc

    def _pieces(self, offset: int, length: int) -> Iterator[bytes]:
        with self.store.open_blob(self.digest) as f:
            f.seek(offset)
            left = length
            while left > 0:
                if self.stop.is_set():
                    raise _Stop()
                data = f.read(min(PIECE, left))
                if not data:
                    raise CorralError(f"blob {self.digest} is shorter than its manifest says")
                left -= len(data)
                self.sent += len(data)
                yield data

    def _upload(self) -> None:
        location = self.remote.start_upload()
        offset, retries = 0, 0
        while offset < self.size:
            n = min(self.chunk, self.size - offset)
            self.sent = offset
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Length": str(n),
                "Content-Range": f"{offset}-{offset + n - 1}",
            }
            failure: RegistryUnreachable | None
            try:
                reply = self.remote.request(
                    "PATCH",
                    str(location),
                    headers=headers,
                    follow=False,
                    content=functools.partial(self._pieces, offset, n),
                )
            except RegistryUnreachable as exc:
                reply, failure = None, exc
            else:
                failure = None
            if reply is not None and reply.status == 202:
                location = self.remote.upload_location(reply)
                offset += n
                retries = 0
                continue
            if reply is not None and reply.status < 500 and reply.status not in (408, 429):
                raise self.remote.fail(reply, f"upload blob {self.digest.short}")
            retries += 1
            if retries > MAX_CHUNK_RETRIES:
                raise failure or self.remote.fail(reply, f"upload blob {self.digest.short}")  # type: ignore[arg-type]
            log.info("upload chunk failed, resuming digest=%s offset=%d attempt=%d", self.digest.short, offset, retries)
            if self.stop.wait(backoff(retries, self.retry_wait)):
                raise _Stop()
            offset = self.remote.upload_offset(location)
        self.sent = self.size
        done = location.copy_merge_params({"digest": str(self.digest)})
        reply = self.remote.request("PUT", str(done), headers={"Content-Length": "0"}, content=b"", follow=False)
        if reply.status not in (201, 204):
            raise self.remote.fail(reply, f"finish upload of blob {self.digest.short}")


class Pusher:
    def __init__(
        self,
        store: Store,
        *,
        auth_files: Iterable[Path] = (),
        chunk: int = CHUNK,
        interval: float = 0.1,
        retry_wait: float = 1.0,
    ) -> None:
        self.store = store
        self.auth_files = list(auth_files)
        self.chunk = chunk
        self.interval = interval
        self.retry_wait = retry_wait

    def run(self, raw_name: str, *, insecure: bool = False) -> Iterator[dict[str, Any]]:
        """Validate the name and find the model now; the returned iterator does the pushing."""
        name = ModelName.parse(raw_name)
        if name.scheme == "http" and not insecure:
            raise InsecureRegistry("insecure protocol http")
        stored = self.store.resolve(name, given=raw_name)
        manifest = self.store.read_manifest(stored)
        return self._push(name, manifest, insecure)

    def _push(self, name: ModelName, manifest: Manifest, insecure: bool) -> Iterator[dict[str, Any]]:
        yield {"status": "retrieving manifest"}
        remote = RegistryClient(name, insecure=insecure, auth_files=self.auth_files, push=True)
        try:
            seen: set[Digest] = set()
            for layer in (*manifest.layers, manifest.config):
                if layer.digest in seen:
                    continue
                seen.add(layer.digest)
                yield from self._blob(remote, layer)
            yield {"status": "pushing manifest"}
            raw = manifest.raw or manifest.to_bytes()
            remote.put_manifest(raw, media_type(raw))
            log.info("pushed model=%s layers=%d size=%d", name.short(), len(manifest.layers), manifest.size)
            yield {"status": "success"}
        finally:
            remote.release()

    def _blob(self, remote: RegistryClient, layer: Layer) -> Iterator[dict[str, Any]]:
        yield layer_progress("pushing", layer, 0)
        if remote.has_blob(layer.digest):
            yield layer_progress("pushing", layer, layer.size)
            return
        upload = Upload(remote, self.store, layer.digest, layer.size, chunk=self.chunk, retry_wait=self.retry_wait)
        upload.thread.start()
        shown = 0
        try:
            while upload.thread.is_alive():
                upload.thread.join(self.interval)
                if upload.sent != shown and upload.error is None:
                    shown = upload.sent
                    yield layer_progress("pushing", layer, shown)
        finally:
            upload.stop.set()  # if the client went away, the upload stops at its next piece
        if upload.error is not None:
            if isinstance(upload.error, CorralError):
                raise upload.error
            if isinstance(upload.error, httpx.HTTPError):
                raise RegistryError(f"upload of blob {layer.digest.short} failed: {upload.error}") from upload.error
            raise upload.error
        if shown != layer.size:
            yield layer_progress("pushing", layer, layer.size)
