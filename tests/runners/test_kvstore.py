"""The prompt cache's store on disk (daemon/runners/kvstore.py), against real files: the chain hashes, the checked
block files (a truncated, corrupt, swapped, foreign or wrong-token file is refused, removed and logged once), atomic
writes under concurrent writers and readers (threads and processes), the LRU bound over the whole root, a failing
disk degrading to "not stored", stats, prune and usage."""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.runners import kvstore
from daemon.runners.kvstore import BLOCK_TOKENS, KVStats, KVStore, chain_hashes, prune, usage

B = 16  # tokens per block in these tests (the store takes any block size; the runner uses BLOCK_TOKENS)
KEY = "k" + "0" * 63
META = {"model": "sha256:" + "a" * 64, "build": "test"}


class Lines(logging.Handler):
    """A logger of its own (``logger``, so nothing else's lines count) and the records it got."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.guard = threading.Lock()
        self.logger = logging.getLogger(f"test.kvstore.{name}")
        self.logger.propagate = False
        self.logger.setLevel(logging.DEBUG)
        for h in list(self.logger.handlers):
            self.logger.removeHandler(h)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        with self.guard:
            self.records.append(record)

    def messages(self) -> list[str]:
        with self.guard:
            return [r.getMessage() for r in self.records]


@pytest.fixture
def lines(request: pytest.FixtureRequest) -> Lines:
    return Lines(request.node.name)


def store(
    root: Path, lines: Lines | None = None, *, key: str = KEY, limit: int = 1 << 30, meta: dict[str, str] | None = None
) -> KVStore:
    logger = None if lines is None else lines.logger
    return KVStore(root, key, limit, META if meta is None else meta, block=B, logger=logger)


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(blocks * B)]


def payload(seed: int, size: int = 4096) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32)


def save_all(s: KVStore, tokens: list[int], seed: int = 0, size: int = 4096) -> list[str]:
    hashes = chain_hashes(s.key, tokens, B)
    for i in range(len(hashes)):
        assert s.save(i, hashes, tokens, payload(seed * 1000 + i, size))
    return hashes


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*.tmp"))


# -- chain hashes


def test_chain_hashes_name_full_blocks_by_their_whole_prefix() -> None:
    tokens = list(range(3 * B + 5))
    hashes = chain_hashes(KEY, tokens, B)
    assert len(hashes) == 3  # the partial fourth block is not named
    parent = KEY
    for i, h in enumerate(hashes):
        ids = struct.pack(f"<{B}i", *tokens[i * B : (i + 1) * B])
        parent = hashlib.sha256(parent.encode() + ids).hexdigest()
        assert h == parent
    other = tokens[:B] + [t + 1 for t in tokens[B:]]
    assert chain_hashes(KEY, other, B)[0] == hashes[0]  # a shared first block shares its name
    assert chain_hashes(KEY, other, B)[1:] != hashes[1:]
    assert chain_hashes("k" + "1" * 63, tokens, B)[0] != hashes[0]  # another key names every block differently
    # a block that differs only in its first block changes every later name (the chain)
    changed = [tokens[0] + 1] + tokens[1:]
    assert all(a != b for a, b in zip(chain_hashes(KEY, changed, B), hashes, strict=True))
    assert len(chain_hashes(KEY, list(range(BLOCK_TOKENS * 2)))) == 2  # the default block is BLOCK_TOKENS


def test_chain_hashes_stop_at_the_first_image() -> None:
    tokens = list(range(2 * B)) + [-1] * 8 + list(range(3 * B))
    assert chain_hashes(KEY, tokens, B) == chain_hashes(KEY, tokens[: 2 * B], B)
    assert chain_hashes(KEY, list(range(B - 1)) + [-5] + list(range(4 * B)), B) == []


# -- save, present, load


def test_save_then_load_round_trips_and_counts(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 3)
    hashes = save_all(s, tokens, seed=1)
    assert s.present(hashes) == 3
    assert s.load(hashes, tokens) == [payload(1000 + i) for i in range(3)]
    # a longer prompt that shares the prefix finds its stored blocks and stops at the first missing one
    longer = tokens + prompt(2, 2)
    more = chain_hashes(KEY, longer, B)
    assert more[:3] == hashes
    assert s.present(more) == 3
    assert len(s.load(more, longer)) == 3
    # a prompt that shares nothing is a miss
    assert s.load(chain_hashes(KEY, prompt(9, 2), B), prompt(9, 2)) == []
    st = s.stats()
    assert st == KVStats(entries=3, bytes=st.bytes, hits=2, misses=1, restored_tokens=6 * B)
    assert st.bytes == sum(p.stat().st_size for p in block_files(tmp_path)) > 3 * 4096
    meta = (tmp_path / KEY / "meta.json").read_text()
    assert '"model": "sha256:' in meta and f'"key": "{KEY}"' in meta and '"created"' in meta
    assert lines.messages() == []
    assert temp_files(tmp_path) == []
    # the layout: <root>/<key>/<hh>/<hash>.kvb
    assert [p.relative_to(tmp_path).as_posix() for p in block_files(tmp_path)] == sorted(
        f"{KEY}/{h[:2]}/{h}.kvb" for h in hashes
    )


def test_nothing_is_created_before_the_first_write(tmp_path: Path) -> None:
    s = store(tmp_path / "kv")
    tokens = prompt(1, 2)
    hashes = chain_hashes(KEY, tokens, B)
    assert s.present(hashes) == 0 and s.load(hashes, tokens) == []
    assert not (tmp_path / "kv").exists()
    assert s.stats().entries == 0


def test_a_block_already_present_is_not_written_again(tmp_path: Path) -> None:
    s = store(tmp_path)
    tokens = prompt(1, 1)
    hashes = save_all(s, tokens, seed=1)
    (path,) = block_files(tmp_path)
    before = path.stat().st_ino
    assert s.save(0, hashes, tokens, b"another payload")
    assert path.stat().st_ino == before
    assert s.load(hashes, tokens) == [payload(1000)]


def test_save_refuses_hashes_that_are_not_the_tokens_chain(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 2)
    hashes = chain_hashes(KEY, tokens, B)
    assert not s.save(1, [hashes[1], hashes[0]], tokens, b"x")
    assert not s.save(0, chain_hashes("k" + "2" * 63, tokens, B), tokens, b"x")
    assert not s.save(2, hashes, tokens, b"x")  # no block 2
    assert not s.save(1, hashes, tokens[: B + 3], b"x")  # block 1 is not full
    assert block_files(tmp_path) == []
    assert len(lines.messages()) == 1


def test_a_lookup_whose_hashes_do_not_match_its_tokens_removes_nothing(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 2)
    hashes = save_all(s, tokens)
    assert s.load(hashes, prompt(2, 2)) == []
    assert len(block_files(tmp_path)) == 2
    assert s.load(hashes, tokens) != []


@pytest.mark.parametrize("readers", [1, 4])
def test_a_lookup_stops_at_the_first_missing_or_bad_block(
    tmp_path: Path, lines: Lines, monkeypatch: pytest.MonkeyPatch, readers: int
) -> None:
    monkeypatch.setattr(kvstore, "READERS", readers)  # one block at a time, or several at once
    s = store(tmp_path, lines)
    tokens = prompt(1, 6)
    hashes = save_all(s, tokens)
    files = [tmp_path / KEY / h[:2] / f"{h}.kvb" for h in hashes]
    files[3].unlink()
    assert s.load(hashes, tokens) == [payload(i) for i in range(3)]
    _flip(files[1], -1)
    assert s.load(hashes, tokens) == [payload(0)]
    assert not files[1].exists() and files[2].exists() and files[5].exists()
    assert len(lines.messages()) == 1
    assert s.stats().hits == 2 and s.stats().restored_tokens == 4 * B


# -- refused files


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_truncated_file_is_refused_removed_and_logged(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 3)
    hashes = save_all(s, tokens)
    path = tmp_path / KEY / hashes[1][:2] / f"{hashes[1]}.kvb"
    path.write_bytes(path.read_bytes()[:-100])
    assert s.load(hashes, tokens) == [payload(0)]  # stops at the bad block
    assert not path.exists()
    (msg,) = lines.messages()
    assert "removed" in msg and hashes[1] in msg and "length" in msg
    # stored again, it is found again
    assert s.save(1, hashes, tokens, payload(1))
    assert len(s.load(hashes, tokens)) == 3


@pytest.mark.parametrize(
    ("where", "why"),
    [
        (0, "magic"),  # the magic
        (4, "version"),  # the format version
        (-1, "checksum"),  # the payload's last byte
        (-3000, "checksum"),  # inside the payload
        ("token", "token ids"),  # a token id in the header
        ("key", "another cache key"),  # the key in the header
    ],
)
def test_a_corrupt_file_is_refused_removed_and_logged(tmp_path: Path, lines: Lines, where: object, why: str) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 2)
    hashes = save_all(s, tokens)
    path = tmp_path / KEY / hashes[0][:2] / f"{hashes[0]}.kvb"
    size = path.stat().st_size
    head = kvstore._PREFIX.size
    if where == "token":
        offset = head + len(KEY) + 64 + len(KEY) + 5 * 4
    elif where == "key":
        offset = head + 3
    else:
        assert isinstance(where, int)
        offset = where % size
    _flip(path, offset)
    assert s.load(hashes, tokens) == []
    assert not path.exists()
    (msg,) = lines.messages()
    assert why in msg and str(path) in msg
    assert s.stats().misses == 1


def test_an_empty_file_is_refused(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 1)
    hashes = save_all(s, tokens)
    (path,) = block_files(tmp_path)
    path.write_bytes(b"")
    assert s.load(hashes, tokens) == []
    assert not path.exists()
    assert len(lines.messages()) == 1


def test_a_swapped_file_is_refused(tmp_path: Path, lines: Lines) -> None:
    """Block A's file renamed to block B's name is never restored as B."""
    s = store(tmp_path, lines)
    a, b = prompt(1, 1), prompt(2, 1)
    ha, hb = save_all(s, a, seed=1), save_all(s, b, seed=2)
    path_a = tmp_path / KEY / ha[0][:2] / f"{ha[0]}.kvb"
    path_b = tmp_path / KEY / hb[0][:2] / f"{hb[0]}.kvb"
    os.replace(path_a, path_b)
    assert s.present(hb) == 1  # present() does not read
    assert s.load(hb, b) == []
    assert not path_b.exists()
    (msg,) = lines.messages()
    assert "removed" in msg and "another block" in msg


def test_a_later_block_of_the_same_chain_under_an_earlier_name_is_refused(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 2)
    hashes = save_all(s, tokens)
    p0 = tmp_path / KEY / hashes[0][:2] / f"{hashes[0]}.kvb"
    p1 = tmp_path / KEY / hashes[1][:2] / f"{hashes[1]}.kvb"
    os.replace(p1, p0)
    assert s.load(hashes, tokens) == []
    assert len(lines.messages()) == 1


def test_a_file_of_another_key_is_refused(tmp_path: Path, lines: Lines) -> None:
    """A file written for another model / build / KV type (another key) and copied under this key's name."""
    other = store(tmp_path, key="k" + "9" * 63)
    s = store(tmp_path, lines)
    tokens = prompt(1, 1)
    (h_other,) = save_all(other, tokens, seed=5)
    (h_mine,) = chain_hashes(KEY, tokens, B)
    target = tmp_path / KEY / h_mine[:2] / f"{h_mine}.kvb"
    target.parent.mkdir(parents=True)
    target.write_bytes((tmp_path / other.key / h_other[:2] / f"{h_other}.kvb").read_bytes())
    assert s.load([h_mine], tokens) == []
    assert not target.exists()
    (msg,) = lines.messages()
    assert "another cache key" in msg


def test_a_file_with_other_tokens_under_the_right_name_is_refused(tmp_path: Path, lines: Lines) -> None:
    """A well-formed file with the right key, name and parent whose token ids differ from the prompt's (what a hash
    collision or a forged file would look like) is refused: KV state never reaches a prompt it was not built for."""
    s = store(tmp_path, lines)
    tokens = prompt(1, 1)
    (h,) = chain_hashes(KEY, tokens, B)
    forged = prompt(2, 1)
    body = payload(3)
    path = tmp_path / KEY / h[:2] / f"{h}.kvb"
    path.parent.mkdir(parents=True)
    path.write_bytes(kvstore._encode(KEY, 0, h, KEY, forged, body) + body)
    assert s.load([h], tokens) == []
    assert not path.exists()
    (msg,) = lines.messages()
    assert "token ids" in msg
    # and with the prompt's tokens in it, the same bytes are accepted
    path.write_bytes(kvstore._encode(KEY, 0, h, KEY, tokens, body) + body)
    assert s.load([h], tokens) == [body]


def test_a_file_from_another_format_version_is_refused(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines)
    tokens = prompt(1, 1)
    (h,) = save_all(s, tokens)
    (path,) = block_files(tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, kvstore.VERSION + 1)
    path.write_bytes(bytes(data))
    assert s.load([h], tokens) == []
    assert "version" in lines.messages()[0]


# -- atomic writes under concurrency


def _hammer(root: str, role: str, rounds: int, stop: Any, out: Any) -> None:
    """A writer replaces one block's file ``rounds`` times (every fourth time removing it and saving it through the
    store); a reader loads it over and over until ``stop`` is set (and at least ``rounds`` times). Puts (role, whole
    payloads seen, absent, refused-file log lines)."""
    lines = Lines(f"hammer.{role}.{os.getpid()}.{threading.get_ident()}")
    s = KVStore(root, KEY, 1 << 30, META, block=B, logger=lines.logger)
    tokens = prompt(1, 1)
    hashes = chain_hashes(KEY, tokens, B)
    body = payload(7, 1 << 20)
    path = os.path.join(root, KEY, hashes[0][:2], hashes[0] + ".kvb")
    seen = absent = n = 0
    while n < rounds or (role == "reader" and not stop.is_set()):
        if role == "writer":
            if n % 4:
                kvstore._write_atomic(
                    os.path.dirname(path), path, (kvstore._encode(KEY, 0, hashes[0], KEY, tokens, body), body)
                )
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                assert s.save(0, hashes, tokens, body)
        else:
            got = s.load(hashes, tokens)
            if got:
                assert got == [body]
                seen += 1
            else:
                absent += 1
        n += 1
    out.put((role, seen, absent, sum("removed" in m for m in lines.messages())))


def _check_hammered(root: Path, results: list[tuple[str, int, int, int]]) -> None:
    assert sum(r[3] for r in results) == 0, "a reader saw a half-written file"
    readers = [r for r in results if r[0] == "reader"]
    assert len(readers) == 2 and all(r[1] > 0 for r in readers), readers  # readers did read whole files
    assert temp_files(root) == []
    s = store(root)
    tokens = prompt(1, 1)
    assert s.load(chain_hashes(KEY, tokens, B), tokens) == [payload(7, 1 << 20)]


def test_concurrent_writers_and_readers_of_one_block_threads(tmp_path: Path) -> None:
    import queue

    out: queue.Queue[tuple[str, int, int, int]] = queue.Queue()
    stop = threading.Event()
    s = store(tmp_path)
    tokens = prompt(1, 1)
    assert s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(7, 1 << 20))
    writers = [threading.Thread(target=_hammer, args=(str(tmp_path), "writer", 40, stop, out)) for _ in range(2)]
    readers = [threading.Thread(target=_hammer, args=(str(tmp_path), "reader", 40, stop, out)) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    _check_hammered(tmp_path, [out.get_nowait() for _ in writers + readers])


@pytest.mark.slow
def test_concurrent_writers_and_readers_of_one_block_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    s = store(tmp_path)
    tokens = prompt(1, 1)
    assert s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(7, 1 << 20))
    writers = [ctx.Process(target=_hammer, args=(str(tmp_path), "writer", 60, stop, out)) for _ in range(2)]
    readers = [ctx.Process(target=_hammer, args=(str(tmp_path), "reader", 60, stop, out)) for _ in range(2)]
    for p in writers + readers:
        p.start()
    results = [out.get(timeout=120) for _ in writers]
    stop.set()
    results += [out.get(timeout=120) for _ in readers]
    for p in writers + readers:
        p.join(timeout=60)
        assert p.exitcode == 0
    _check_hammered(tmp_path, results)


# -- the bound


def _flood(root: str, key: str, seeds: range, limit: int, out: Any) -> None:
    """Saves a block per seed under ``key``; after each, measures the root under the writers' lock. Puts (blocks
    stored, the largest usage seen)."""
    s = KVStore(root, key, limit, META, block=B)
    stored = worst = 0
    for seed in seeds:
        tokens = prompt(seed, 2)
        hashes = chain_hashes(key, tokens, B)
        for i in range(2):
            stored += s.save(i, hashes, tokens, payload(seed, 3000))
            lock = kvstore._RootLock(root)
            try:
                worst = max(worst, usage(root))
            finally:
                lock.release()
    out.put((stored, worst))


def test_the_bound_holds_under_a_flood_of_distinct_blocks(tmp_path: Path, lines: Lines) -> None:
    limit = 40_000
    a = store(tmp_path, lines, limit=limit)
    b = store(tmp_path, lines, key="k" + "3" * 63, limit=limit)  # another key under the same root shares the bound
    stored = 0
    for seed in range(120):
        s = a if seed % 2 else b
        tokens = prompt(seed, 2)
        hashes = chain_hashes(s.key, tokens, B)
        for i in range(2):
            stored += s.save(i, hashes, tokens, payload(seed, 3000))
            assert usage(tmp_path) <= limit
    assert stored > 100
    assert usage(tmp_path) > limit // 2  # evicted to the low-water mark, not emptied
    assert a.stats().entries + b.stats().entries == len(block_files(tmp_path))
    assert lines.messages() == []


def test_the_bound_holds_for_threads_flooding_one_store(tmp_path: Path) -> None:
    limit = 60_000
    s = store(tmp_path, limit=limit)
    over: list[int] = []

    def flood(worker: int) -> None:
        for seed in range(worker * 1000, worker * 1000 + 40):
            tokens = prompt(seed, 1)
            s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(seed, 2500))
            with s._lock:
                used = usage(tmp_path)
            if used > limit:
                over.append(used)

    threads = [threading.Thread(target=flood, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert over == []
    assert usage(tmp_path) <= limit
    assert temp_files(tmp_path) == []


@pytest.mark.slow
def test_the_bound_holds_for_processes_flooding_one_root(tmp_path: Path) -> None:
    """Two runners (two keys) writing under one root keep it under the bound together."""
    limit = 50_000
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    keys = ["k" + "7" * 63, "k" + "8" * 63]
    procs = [
        ctx.Process(target=_flood, args=(str(tmp_path), key, range(n * 1000, n * 1000 + 80), limit, out))
        for n, key in enumerate(keys)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(stored > 100 for stored, _ in results)
    assert max(worst for _, worst in results) <= limit
    assert usage(tmp_path) <= limit
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == set(keys)


def test_eviction_takes_the_least_recently_used_first(tmp_path: Path) -> None:
    size = 3000
    s = store(tmp_path, limit=1 << 30)
    used, old, new = prompt(1, 1), prompt(2, 1), prompt(3, 1)
    written = [save_all(s, t, seed=i, size=size) for i, t in enumerate((used, old, new))]
    for age, hashes in enumerate(written):  # written long ago, ``used`` first
        path = tmp_path / KEY / hashes[0][:2] / f"{hashes[0]}.kvb"
        os.utime(path, ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    h_used, h_old, h_new = written
    assert s.load(h_used, used)  # a hit makes the oldest the most recently used
    one = block_files(tmp_path)[0].stat().st_size
    meta = (tmp_path / KEY / "meta.json").stat().st_size
    tight = store(tmp_path, limit=int(3.5 * one) + meta)
    extra = prompt(4, 1)
    assert tight.save(0, chain_hashes(KEY, extra, B), extra, payload(9, size))
    assert tight.present(h_old) == 0  # the least recently used went
    assert tight.present(h_used) == 1 and tight.present(h_new) == 1
    assert usage(tmp_path) <= tight.limit_bytes


def test_eviction_takes_a_chains_tail_before_its_head(tmp_path: Path) -> None:
    """Blocks are written head first; evicting by write time alone would remove block 0 and strand the rest."""
    s = store(tmp_path)
    tokens = prompt(1, 4)
    hashes = chain_hashes(KEY, tokens, B)
    assert s.save(0, hashes, tokens, payload(0, 3000))
    one = block_files(tmp_path)[0].stat().st_size
    meta = (tmp_path / KEY / "meta.json").stat().st_size
    s = store(tmp_path, limit=int(3.6 * one) + meta)
    for i in range(1, 4):
        s.save(i, hashes, tokens, payload(i, 3000))
    assert usage(tmp_path) <= s.limit_bytes
    assert s.present(hashes) == 3  # blocks 0..2 kept, the tail (3) evicted
    assert len(s.load(hashes, tokens)) == 3


def test_a_block_whose_parent_is_not_on_disk_is_not_stored(tmp_path: Path, lines: Lines) -> None:
    """A block is only reachable through its whole prefix: without its parent it would be dead weight."""
    s = store(tmp_path, lines)
    tokens = prompt(1, 3)
    hashes = chain_hashes(KEY, tokens, B)
    assert not s.save(1, hashes, tokens, payload(1))
    assert block_files(tmp_path) == []
    assert s.save(0, hashes, tokens, payload(0)) and s.save(1, hashes, tokens, payload(1))
    assert s.present(hashes) == 2
    assert lines.messages() == []


def test_a_bound_smaller_than_one_block_stores_nothing_and_logs_once(tmp_path: Path, lines: Lines) -> None:
    s = store(tmp_path, lines, limit=1000)
    for seed in range(3):
        tokens = prompt(seed, 1)
        assert not s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(seed, 4096))
    assert usage(tmp_path) == 0
    (msg,) = lines.messages()
    assert "does not fit" in msg
    off = store(tmp_path, limit=0)  # 0: nothing is ever stored
    tokens = prompt(1, 1)
    assert not off.save(0, chain_hashes(KEY, tokens, B), tokens, b"x")


# -- a failing disk


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_full_disk_degrades_to_not_stored(
    tmp_path: Path, lines: Lines, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    s = store(tmp_path, lines)
    first = prompt(0, 1)
    save_all(s, first)  # the directory exists already: the failure is in writing the block
    real_write = os.write
    calls = [0]

    def full(fd: int, data: bytes) -> int:
        calls[0] += 1
        if calls[0] > 1:  # a partial write first, then the disk is full
            raise OSError(code, os.strerror(code))
        return real_write(fd, bytes(memoryview(data)[:100]))

    monkeypatch.setattr(os, "write", full)
    for seed in range(1, 4):
        calls[0] = 0
        tokens = prompt(seed, 2)
        hashes = chain_hashes(KEY, tokens, B)
        assert not s.save(0, hashes, tokens, payload(seed))
        assert s.present(hashes) == 0
    assert temp_files(tmp_path) == []
    (msg,) = lines.messages()
    assert "could not store" in msg and os.strerror(code) in msg
    if code == errno.ENOSPC:
        assert "full" in msg
    monkeypatch.undo()
    tokens = prompt(5, 1)
    hashes = chain_hashes(KEY, tokens, B)
    assert s.save(0, hashes, tokens, payload(5))  # the disk has room again
    assert s.load(hashes, tokens) == [payload(5)]
    assert s.load(chain_hashes(KEY, first, B), first)  # what was stored before is intact


def test_a_failing_fsync_degrades_to_not_stored(tmp_path: Path, lines: Lines, monkeypatch: pytest.MonkeyPatch) -> None:
    s = store(tmp_path, lines)
    save_all(s, prompt(0, 1))

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    tokens = prompt(1, 1)
    assert not s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(1))
    assert temp_files(tmp_path) == [] and len(block_files(tmp_path)) == 1
    assert len(lines.messages()) == 1


def test_an_unwritable_location_degrades_to_not_stored(tmp_path: Path, lines: Lines) -> None:
    blocker = tmp_path / "kv"
    blocker.write_text("a file where the cache directory should be")
    s = store(blocker, lines)
    for seed in range(3):
        tokens = prompt(seed, 1)
        hashes = chain_hashes(KEY, tokens, B)
        assert not s.save(0, hashes, tokens, payload(seed))
        assert s.load(hashes, tokens) == []
    assert len(lines.messages()) == 1
    assert s.stats().entries == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_degrades_to_not_stored(tmp_path: Path, lines: Lines) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o555)
    try:
        s = store(root, lines)
        tokens = prompt(1, 1)
        assert not s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(1))
        assert len(lines.messages()) == 1
    finally:
        root.chmod(0o755)


# -- prune and usage


def test_prune_removes_the_caches_of_models_that_are_gone(tmp_path: Path) -> None:
    keep = "sha256:" + "a" * 64
    gone = "sha256:" + "b" * 64
    kept = store(tmp_path, meta={"model": keep})
    dropped = store(tmp_path, key="k" + "4" * 63, meta={"model": gone})
    save_all(kept, prompt(1, 2))
    save_all(dropped, prompt(2, 3))
    stray = tmp_path / ("k" + "5" * 63)  # no meta.json
    (stray / "ab").mkdir(parents=True)
    (stray / "ab" / "x.kvb").write_bytes(b"z" * 100)
    broken = tmp_path / ("k" + "6" * 63)
    broken.mkdir()
    (broken / "meta.json").write_text("{not json")
    before = usage(tmp_path)
    kept_bytes = usage(tmp_path / KEY)
    freed = prune(tmp_path, {keep})
    assert freed == before - kept_bytes
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [KEY]
    assert usage(tmp_path) == kept_bytes
    assert prune(tmp_path, {keep}) == 0
    assert prune(tmp_path / "missing", {keep}) == 0
    assert usage(tmp_path / "missing") == 0


def test_a_store_writes_its_meta_again_after_a_prune(tmp_path: Path) -> None:
    s = store(tmp_path)
    save_all(s, prompt(1, 1))
    prune(tmp_path, set())
    tokens = prompt(2, 1)
    hashes = chain_hashes(KEY, tokens, B)
    assert s.save(0, hashes, tokens, payload(2))
    assert (tmp_path / KEY / "meta.json").is_file()
    assert prune(tmp_path, {META["model"]}) == 0


def test_a_crashed_writers_temporary_file_is_cleaned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = store(tmp_path, limit=1 << 20)
    save_all(s, prompt(1, 1))
    stale = tmp_path / KEY / "00" / ".dead.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"x" * 5000)
    os.utime(stale, (1, 1))
    assert usage(tmp_path) >= 5000
    monkeypatch.setattr(kvstore, "_RESCAN_S", 0.0)  # as a minute later: the next write scans the root
    tokens = prompt(2, 1)
    assert s.save(0, chain_hashes(KEY, tokens, B), tokens, payload(2))
    assert not stale.exists()


def test_a_bad_key_is_refused() -> None:
    for bad in ("", "../x", ".hidden", "a/b", "x" * 200):
        with pytest.raises(ValueError):
            KVStore("/tmp/never", bad, 1, {})


def test_prune_leaves_what_is_not_a_cache_alone(tmp_path: Path) -> None:
    """CORRAL_KV_DISK_DIR may be a folder the user shares with other things (~/.cache): prune removes only caches
    (a readable meta.json naming a model that is gone, or nothing but this store's block files), never other
    folders, whatever their names."""
    gone = "sha256:" + "b" * 64
    dropped = store(tmp_path, key="k" + "4" * 63, meta={"model": gone})
    save_all(dropped, prompt(2, 3))
    other = tmp_path / "pip"  # somebody else's cache
    (other / "http").mkdir(parents=True)
    (other / "http" / "wheel.bin").write_bytes(b"w" * 100)
    lookalike = tmp_path / ("k" + "7" * 63)  # a cache's name, but a user's file in it
    (lookalike / "ab").mkdir(parents=True)
    (lookalike / "ab" / "notes.txt").write_text("mine")
    prune(tmp_path, set())
    assert not (tmp_path / ("k" + "4" * 63)).exists()
    assert (other / "http" / "wheel.bin").read_bytes() == b"w" * 100
    assert (lookalike / "ab" / "notes.txt").read_text() == "mine"
