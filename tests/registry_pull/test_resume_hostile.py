"""Resuming a pull from a registry that ignores ``Range`` or answers it with the wrong length.

A resumed pull (a partial download left by an earlier attempt) asks for the bytes it lacks. The registry may:

* ignore ``Range`` and answer ``200`` with the whole blob: the blob starts again from byte 0 (the partial bytes are
  discarded and hashing starts from the first byte), also when that whole-blob answer is itself cut off;
* answer with a body that is not what its headers promise (a ``206`` longer or shorter than its
  ``Content-Range``, a ``200`` whose ``Content-Length`` is not the blob's size): a clear
  :class:`RegistryProtocolError` (502), never a 500. What the earlier attempt saved is kept (the bytes of the bad
  answer are not counted), so the next pull from an honest registry resumes where the earlier attempt stopped; a
  pull that had nothing saved leaves no partial files.

Nothing unverified is ever visible: no manifest, and no blob that does not hash to its name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from daemon.api.errors import status_for
from errors import CorralError, RegistryProtocolError, RegistryUnreachable
from registry.digest import Digest
from registry.download import Tuning
from registry.store import Store
from tests.registry_pull.fake_registry import MODEL_TYPE, FakeRegistry, ServerThread, digest_of
from tests.registry_pull.test_hostile import CONFIG, FAST, assert_nothing_visible, pull

PART = 64 * 1024  # FAST's part size
SIZE = 300_000  # five parts
ONE_STREAM = Tuning(streams=1, part_size=PART, backoff=0.01, read_timeout=2.0, save_interval=0.05, buffer=16 * 1024)

Reply = tuple[int, dict[str, str], bytes]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def asked(range_header: str | None, total: int) -> tuple[int, int]:
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header or "")
    if not m:
        return 0, total - 1
    return int(m.group(1)), int(m.group(2)) if m.group(2) else total - 1


def seed_partial(store: Store, data: bytes, *, garbage: bool = False) -> int:
    """What an interrupted earlier pull leaves: part 0 whole, part 1 up to 30 000 bytes, the rest not begun.
    Returns the bytes saved. With ``garbage``, the saved bytes are wrong (a restart must not keep them)."""
    digest = Digest.parse(digest_of(data))
    done = [PART, 30_000] + [0] * (-(-len(data) // PART) - 2)
    parts = [[off, min(PART, len(data) - off), done[i]] for i, off in enumerate(range(0, len(data), PART))]
    body = bytearray(len(data))
    for off, _size, got in parts:
        body[off : off + got] = os.urandom(got) if garbage else data[off : off + got]
    store.partial_path(digest).write_bytes(bytes(body))
    store.partial_state_path(digest).write_text(json.dumps({"digest": str(digest), "total": len(data), "parts": parts}))
    return sum(p[2] for p in parts)


def saved_progress(store: Store, data: bytes) -> int:
    state = json.loads(store.partial_state_path(Digest.parse(digest_of(data))).read_bytes())
    return sum(p[2] for p in state["parts"])


def no_partials(store: Store) -> bool:
    return not list(store.blobs_dir.glob("*partial*"))


# -- a registry that ignores Range ---------------------------------------------------------------------------------
@pytest.mark.parametrize("garbage", [False, True], ids=["good-partial", "garbage-partial"])
def test_resume_from_a_registry_that_ignores_ranges(
    fake: tuple[FakeRegistry, ServerThread], store: Store, garbage: bool
) -> None:
    """The resumed request gets a 200 with the whole blob: start again from byte 0. The first whole-blob answer is
    cut off half-way; its retry (a ranged request, answered 200 again) starts the blob once more from byte 0."""
    registry, server = fake
    data = os.urandom(SIZE)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    seed_partial(store, data, garbage=garbage)
    ranges: list[str | None] = []

    def reply(blob: bytes, range_header: str | None) -> Reply | None:
        if blob != data:
            return None
        ranges.append(range_header)
        if len(ranges) == 2:  # the first whole-blob answer: the connection drops half-way
            return 200, {"content-length": str(len(blob))}, blob[: len(blob) // 2]
        return 200, {"content-length": str(len(blob))}, blob

    registry.blob_reply = reply
    lines = pull(store, f"{server.host}/ns/m")
    assert lines[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    assert no_partials(store)
    assert ranges[0] == f"bytes={PART + 30_000}-{2 * PART - 1}"  # it did try to resume
    assert ranges[1] == f"bytes=0-{SIZE - 1}"  # then the whole blob, from byte 0
    assert len(ranges) == 4 and ranges[2] != ranges[1]  # cut off: a retry from where it got to, answered 200...
    assert ranges[3] == f"bytes=0-{SIZE - 1}"  # ...so once more from byte 0
    # progress never claimed more than the blob
    assert all(line.get("completed", 0) <= SIZE for line in lines)


def test_a_registry_that_ignores_ranges_and_keeps_dropping_gives_a_clear_error(
    fake: tuple[FakeRegistry, ServerThread], store: Store
) -> None:
    registry, server = fake
    data = os.urandom(SIZE)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    seed_partial(store, data)

    def reply(blob: bytes, range_header: str | None) -> Reply | None:
        if blob != data:
            return None
        return 200, {"content-length": str(len(blob))}, blob[: len(blob) // 2]  # never finishes

    registry.blob_reply = reply
    tuning = Tuning(streams=4, part_size=PART, backoff=0.01, read_timeout=2.0, max_retries=2, buffer=16 * 1024)
    with pytest.raises(RegistryUnreachable, match="ignores Range requests") as info:
        pull(store, f"{server.host}/ns/m", tuning=tuning)
    assert status_for(info.value) == 502
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}), partials=True)


# -- answers of the wrong length ------------------------------------------------------------------------------------
def longer_206(blob: bytes, range_header: str | None) -> Reply:
    start, end = asked(range_header, len(blob))  # chunked: the body's length is whatever the server sends
    return 206, {"content-range": f"bytes {start}-{end}/{len(blob)}"}, blob[start : end + 1] + b"trailing junk"


def shorter_206(blob: bytes, range_header: str | None) -> Reply:
    start, end = asked(range_header, len(blob))  # chunked, and properly ended: the server says that was all
    return 206, {"content-range": f"bytes {start}-{end}/{len(blob)}"}, blob[start : end + 1 - 1000]


def wrong_length_200(blob: bytes, range_header: str | None) -> Reply:
    return 200, {"content-length": str(len(blob) + 7)}, blob + b"1234567"


def other_bytes_206(blob: bytes, range_header: str | None) -> Reply:
    start, end = asked(range_header, len(blob))  # one byte off
    return 206, {"content-range": f"bytes {start + 1}-{end + 1}/{len(blob)}"}, blob[start + 1 : end + 2]


BAD_ANSWERS = {
    "206-longer-than-its-range": (longer_206, "longer than"),
    "206-shorter-than-its-range": (shorter_206, "ended .* bytes early"),
    "200-with-the-wrong-length": (wrong_length_200, "Content-Length '300007' for a 300000-byte blob"),
    "206-for-other-bytes": (other_bytes_206, "Content-Range"),
}


@pytest.mark.parametrize("answer", list(BAD_ANSWERS))
def test_wrong_length_on_resume_is_a_protocol_error_and_the_next_pull_resumes(
    fake: tuple[FakeRegistry, ServerThread], store: Store, answer: str
) -> None:
    registry, server = fake
    data = os.urandom(SIZE)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    saved = seed_partial(store, data)
    bad, message = BAD_ANSWERS[answer]
    registry.blob_reply = lambda blob, rng: bad(blob, rng) if blob == data else None
    with pytest.raises(RegistryProtocolError, match=message) as info:
        pull(store, f"{server.host}/ns/m", tuning=ONE_STREAM)
    assert status_for(info.value) == 502
    # nothing visible; the partial download is kept as the earlier attempt left it (the bad bytes not counted)
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}), partials=True)
    assert saved_progress(store, data) == saved

    registry.blob_reply = None  # an honest registry: the next pull fetches only what is missing
    registry.seen.clear()
    assert pull(store, f"{server.host}/ns/m", tuning=FAST)[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    assert sum(s.sent for s in registry.requests("GET", digest_of(data))) == SIZE - saved
    assert no_partials(store)


@pytest.mark.parametrize("answer", list(BAD_ANSWERS))
def test_wrong_length_on_a_fresh_pull_leaves_nothing(
    fake: tuple[FakeRegistry, ServerThread], store: Store, answer: str
) -> None:
    registry, server = fake
    data = os.urandom(SIZE)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    bad, message = BAD_ANSWERS[answer]
    registry.blob_reply = lambda blob, rng: bad(blob, rng) if blob == data else None
    with pytest.raises(CorralError, match=message) as info:
        pull(store, f"{server.host}/ns/m", tuning=ONE_STREAM)
    assert isinstance(info.value, RegistryProtocolError)
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}))  # no partial files either
