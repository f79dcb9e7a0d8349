"""Pull a model from an OCI registry into the store, reporting Ollama's progress objects.

    {"status": "pulling manifest"}
    {"status": "pulling <12 hex>", "digest": "sha256:…", "total": N, "completed": M}   per blob, repeatedly
    {"status": "verifying sha256 digest"}
    {"status": "writing manifest"}
    {"status": "removing unused layers"}     only when the tag's previous version left blobs unused
    {"status": "success"}

The manifest is fetched (and validated: every digest, the sizes, no duplicates) before the first object, so a
missing model or a bad name is an HTTP error rather than a line in a stream. Blobs are fetched by
:mod:`registry.download`, which verifies each one's SHA-256 before it enters ``blobs/``; the "verifying" step
then only confirms that every blob is in place. The manifest is written last, byte for byte as the registry sent
it, under the catalog lock: until then nothing of the pull is visible as a model.
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from errors import (
    BlobNotFound,
    InsecureRegistry,
    InsufficientSpace,
    InvalidManifest,
    RegistryProtocolError,
    StoreError,
)
from registry.digest import Digest
from registry.download import Download, Downloads, Tuning
from registry.manifest import Layer, Manifest, layer_progress
from registry.names import ModelName
from registry.remote import RegistryClient
from registry.store import Store, disk_bytes

log = logging.getLogger(__name__)

#: Kept free on the models filesystem beyond what a pull needs.
SPACE_RESERVE = 64 * 1024 * 1024
#: How long a failed pull waits for the downloads it cancels to save their progress before it reports.
CANCEL_WAIT = 10.0
#: How long the first progress line of a blob waits for its download to read what an earlier attempt left.
PREPARE_WAIT = 5.0


def format_bytes(n: int) -> str:
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_manifest(raw: bytes, name: ModelName) -> Manifest:
    """Parse a registry's manifest with the checks a hostile registry calls for; clear errors otherwise."""
    try:
        manifest = Manifest.parse(raw)
    except InvalidManifest as exc:
        raise RegistryProtocolError(
            f"registry {name.host} sent an invalid manifest for {name.short()}: {exc}"
        ) from None
    if not manifest.layers:
        raise RegistryProtocolError(f"the manifest of {name.short()} has no layers")
    seen: set[Digest] = set()
    for layer in (*manifest.layers, manifest.config):
        if layer.digest in seen:
            raise RegistryProtocolError(f"the manifest of {name.short()} lists blob {layer.digest} more than once")
        seen.add(layer.digest)
    return manifest


class Puller:
    """Runs pulls against one store. ``lock`` is the catalog's: the manifest write and the removal of the old
    version's blobs happen under it."""

    def __init__(
        self,
        store: Store,
        downloads: Downloads,
        lock: threading.RLock,
        *,
        prune: bool,
        auth_files: Iterable[Path] = (),
        tuning: Tuning | None = None,
        on_bytes: Callable[[int], None] | None = None,
        interval: float = 0.1,
        free_space: Callable[[Path], int] | None = None,
    ) -> None:
        self.store = store
        self.downloads = downloads
        self.lock = lock
        self.prune = prune
        self.auth_files = list(auth_files)
        self.tuning = tuning
        self.on_bytes = on_bytes
        self.interval = interval
        self.free_space = free_space or (lambda path: shutil.disk_usage(path).free)

    def run(
        self, raw_name: str, *, insecure: bool = False, stop: threading.Event | None = None
    ) -> Iterator[dict[str, Any]]:
        """Validate the name now; the returned iterator fetches the manifest on its first step. Once ``stop`` is
        set, the iterator gives a line within ``interval`` even when no byte arrives (a stalled download), so its
        consumer can close it (a background pull cancelled: registry/pull_jobs.py)."""
        name = ModelName.parse(raw_name)
        if name.scheme == "http" and not insecure:
            raise InsecureRegistry("insecure protocol http")
        return self._pull(name, insecure, stop)

    def _pull(self, name: ModelName, insecure: bool, stop: threading.Event | None = None) -> Iterator[dict[str, Any]]:
        started = time.monotonic()
        remote = RegistryClient(name, insecure=insecure, auth_files=self.auth_files)
        joined: list[Download] = []
        pinned: set[Digest] = set()
        failed = False
        try:
            manifest = check_manifest(remote.get_manifest(), name)
            yield {"status": "pulling manifest"}
            blobs = [*manifest.layers, manifest.config]
            pinned = {b.digest for b in blobs}
            self.downloads.pin(pinned)
            missing = [b for b in blobs if not self._present(b)]
            self._check_space(name, missing)
            active: dict[Digest, Download] = {}
            for layer in missing:
                d = self.downloads.join(layer.digest, functools.partial(self._download, remote, layer))
                joined.append(d)
                active[layer.digest] = d
            yield from self._progress(blobs, active, stop)
            for d in active.values():
                if d.error is not None:
                    raise d.error
            yield {"status": "verifying sha256 digest"}
            absent = [str(b.digest) for b in blobs if not self.store.has_blob(b.digest)]
            if absent:
                raise StoreError(f"blobs vanished from the store during the pull: {', '.join(absent)}")
            yield {"status": "writing manifest"}
            removed = self._write(name, manifest)
            if removed:
                yield {"status": "removing unused layers"}
            log.info(
                "pulled model=%s layers=%d size=%d fetched=%d seconds=%.2f",
                name.short(),
                len(manifest.layers),
                manifest.size,
                sum(d.fetched for d in active.values()),
                time.monotonic() - started,
            )
            self._sync_later([d.digest for d in active.values()])
            yield {"status": "success"}
        except GeneratorExit:  # the client went away: leave at once, the downloads wind down by themselves
            raise
        except BaseException:
            failed = True
            raise
        finally:
            for d in joined:
                self.downloads.leave(d)
            if failed:  # report the error once the downloads this pull alone needed have stopped
                for d in joined:
                    if d.waiters <= 0:
                        d.wait(CANCEL_WAIT)
            self.downloads.unpin(pinned)
            remote.release()

    def _present(self, layer: Layer) -> bool:
        """Is the blob here, whole? One of the wrong size (cut short by a crash before it reached the disk) is
        downloaded again; it is replaced only once the new copy verifies, so a lying manifest cannot destroy it."""
        try:
            size = self.store.blob_size(layer.digest)
        except BlobNotFound:
            return False
        if size != layer.size:
            log.warning(
                "blob has %d bytes, the manifest says %d; downloading it again digest=%s",
                size,
                layer.size,
                layer.digest,
            )
            return False
        return True

    def _sync_later(self, digests: list[Digest]) -> None:
        """fsync the blobs this pull fetched, in the background.

        Waiting for gigabytes to reach the disk would cost a fast pull more than the download itself (and on
        ext4, fsyncing the blob before the manifest makes the manifest's own fsync wait for it), so the pull
        answers first. Until the kernel or this thread has written a blob back (about a second per GB), a power
        loss could leave it damaged under a verified name; ``corral rm`` and pulling again repairs that.
        """
        if digests:
            threading.Thread(target=self._sync_blobs, args=(digests,), name="sync-blobs", daemon=True).start()

    def _sync_blobs(self, digests: list[Digest]) -> None:
        for d in digests:
            self.store.sync_blob(d)

    def _download(self, remote: RegistryClient, layer: Layer) -> Download:
        return Download(
            self.store,
            layer.digest,
            layer.size,
            remote,
            tuning=self.tuning,
            on_bytes=self.on_bytes,
            limiter=getattr(self.downloads, "limiter", None),
        )  # CORRAL_PULL_BANDWIDTH

    def _check_space(self, name: ModelName, missing: list[Layer]) -> None:
        need = 0
        for layer in missing:
            try:
                have = disk_bytes(self.store.partial_path(layer.digest).stat())
            except FileNotFoundError:
                have = 0
            need += max(0, layer.size - have)
        if not need:
            return
        free = self.free_space(self.store.blobs_dir)
        if need + SPACE_RESERVE > free:
            raise InsufficientSpace(
                f"not enough disk space to pull {name.short()}: it needs {format_bytes(need)} more and "
                f"{format_bytes(free)} is free in {self.store.blobs_dir}; free some space (corral prune removes "
                "unused blobs) or set CORRAL_MODELS to a larger disk"
            )

    def _progress(
        self, blobs: list[Layer], active: dict[Digest, Download], stop: threading.Event | None = None
    ) -> Iterator[dict[str, Any]]:
        """A line per blob at once (complete for blobs already here), then a line whenever one has moved on, and
        one at every ``interval`` once ``stop`` is set (its consumer closes the pull then)."""
        shown: dict[Digest, int] = {}
        for layer in blobs:
            d = active.get(layer.digest)
            if d is not None:
                d.prepared.wait(PREPARE_WAIT)
            shown[layer.digest] = layer.size if d is None else d.completed
            yield layer_progress("pulling", layer, shown[layer.digest])
        while True:
            running = [d for d in active.values() if not d.finished.is_set()]
            if running:
                running[0].finished.wait(self.interval)
            moved = False
            for layer in blobs:
                d = active.get(layer.digest)
                if d is None:
                    continue
                done = layer.size if d.finished.is_set() and d.error is None else d.completed
                if done != shown[layer.digest]:
                    shown[layer.digest] = done
                    moved = True
                    yield layer_progress("pulling", layer, done)
            if stop is not None and stop.is_set() and not moved and running:
                layer = next(b for b in blobs if b.digest == running[0].digest)
                yield layer_progress("pulling", layer, shown[layer.digest])
            if not running:
                return
            if any(d.error is not None for d in active.values()):
                return

    def _write(self, name: ModelName, manifest: Manifest) -> list[Digest]:
        """Write the manifest (atomically, last); remove the blobs only the tag's old version used."""
        with self.lock:
            target = self.store.canonical(name)
            old: set[Digest] = set()
            if self.store.manifest_path(target).is_file():
                try:
                    old = self.store.read_manifest(target).blobs()
                except (InvalidManifest, StoreError):
                    old = set()
            self.store.write_manifest(target, manifest)
            if not self.prune:
                return []
            return self.store.remove_unreferenced(old - manifest.blobs())
