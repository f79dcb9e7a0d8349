"""Saved slots at the runner (llama-server's ``/slots/{id}?action=save|restore|erase``; the ops ``SlotSaveOp``,
``SlotRestoreOp``, ``SlotEraseOp``; the files ``daemon/llama/kvdisk.py`` ``SlotFiles``), with real llama.cpp, a tiny
random GGUF and real files: a slot saved by one runner and restored into another slot of a fresh runner serves the
same prompt by prefix, evaluating only its last token, and answers (greedy) as the cold run did; a missing,
damaged, truncated or foreign file, a busy slot, a slot that does not exist and a state llama.cpp refuses are each
refused with the words that say why, and leave the slot as it was; saved slots count against the bound, evict blocks
to make room and are never evicted by them."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.llama.kvdisk import LAYOUT_BLOCK, SLOTS_DIR
from daemon.llama.runner import Runner
from daemon.runners.kvstore import BLOCK_TOKENS, KVStore, chain_hashes, usage
from daemon.runners.protocol import (
    LoadSpec,
    Op,
    SampleParams,
    SlotEraseOp,
    SlotRestoreOp,
    SlotSaveOp,
    check_slot_name,
)
from tests.models import write_tiny_gguf
from tests.runners.test_compute_thread import _KEEP, Chan


def key_of(model: str) -> str:
    return json.dumps(
        {"model": model, "adapters": [], "projector": "", "kv_type": "f16", "flash_attn": "auto"},
        sort_keys=True,
        separators=(",", ":"),
    )


KEY = key_of("sha256:" + "ab" * 32)
OTHER_KEY = key_of("sha256:" + "cd" * 32)
GREEDY = SampleParams(num_predict=8, temperature=0, repeat_penalty=1.0, seed=1)
PROMPT_LEN = 120


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("slots") / "tiny.gguf", context_length=1024)


@pytest.fixture(scope="module")
def endless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose greedy generation only a limit or a cancel ends: a slot that stays busy."""
    return write_tiny_gguf(tmp_path_factory.mktemp("slots") / "endless.gguf", context_length=1024, never_ends=True)


def start(path: Path, disk: Path | None, *, key: str = KEY, limit: int = 1 << 30, parallel: int = 2) -> Runner:
    runner = Runner(Chan())  # type: ignore[arg-type]
    _KEEP.append(runner)  # its log callback must outlive any later llama.cpp call in this process
    extra: dict[str, Any] = {"kv_disk_dir": str(disk), "kv_disk_bytes": limit, "kv_key": key} if disk else {}
    runner.load(LoadSpec(model_path=str(path), num_ctx=512, num_parallel=parallel, num_batch=512, **extra))
    return runner


def chan(runner: Runner) -> Chan:
    got: Chan = runner.chan  # type: ignore[assignment]
    return got


def ask(runner: Runner, rid: int, prompt: list[int], params: SampleParams = GREEDY) -> tuple[str, dict[str, Any]]:
    runner.engine.submit(rid, prompt, params)
    end = time.monotonic() + 120
    msgs = chan(runner).msgs
    while not (done := [m for m in list(msgs) if m.get("id") == rid and m.get("type") in ("done", "error")]):
        assert time.monotonic() < end, "the request did not finish"
        time.sleep(0.01)
    assert done[0]["type"] == "done", done[0]
    return "".join(m["text"] for m in msgs if m.get("id") == rid and m.get("type") == "token"), done[0]


def call(runner: Runner, op: Op) -> dict[str, Any]:
    """The reply to a slot op, as it goes over the pipe."""
    msgs = chan(runner).msgs
    before = len(msgs)
    runner.handle(op)
    (reply,) = [m for m in msgs[before:] if m.get("id") == getattr(op, "id", None)]
    return reply


def held(runner: Runner) -> list[int]:
    return [s.cached_tokens for s in runner.engine.slots_info()]


def slot_files(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/{SLOTS_DIR}/*"))


# -- names -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["chat-42.bin", "a", "x" * 128, "session_7", "A.B-c_d"])
def test_a_plain_name_is_a_filename(name: str) -> None:
    assert check_slot_name(name) is None


@pytest.mark.parametrize(
    "name",
    ["", "../x", "a/b", "a\\b", ".hidden", "..", ".", "x" * 129, "a\n", "a b", "ä", "/etc/passwd", "a\x00b", None, 5],
)
def test_anything_else_is_refused_with_the_rule(name: object) -> None:
    reason = check_slot_name(name)
    assert reason is not None and "letters, digits, '_', '-' and '.'" in reason and "no folders" in reason


# -- save and restore --------------------------------------------------------------------------------------------------
def test_a_saved_slot_restored_into_a_fresh_runner_serves_its_prefix_as_a_cold_run(model: Path, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    prompt = prompt_of(PROMPT_LEN)
    first = start(model, root)
    try:
        cold, done = ask(first, 1, prompt)
        assert done["prompt_cached"] == 0 and cold
        (n_held,) = [n for n in held(first) if n]
        saved = call(first, SlotSaveOp(2, 0, "chat-1.bin"))
        assert saved["type"] == "slot_saved", saved
        assert (saved["slot"], saved["filename"], saved["n_saved"]) == (0, "chat-1.bin", n_held)
        (path,) = slot_files(root)
        assert path.name == "chat-1.bin" and saved["n_written"] == path.stat().st_size
        assert saved["save_ms"] >= 0
        assert (path.parent.parent / "meta.json").is_file()  # what `corral prune` reads to keep the folder
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
    finally:
        first.close()

    second = start(model, root)
    try:
        restored = call(second, SlotRestoreOp(3, 1, "chat-1.bin"))  # into the other slot
        assert restored["type"] == "slot_restored", restored
        assert (restored["slot"], restored["n_restored"], restored["n_read"]) == (1, n_held, saved["n_written"])
        assert held(second) == [0, n_held]
        text, done = ask(second, 4, prompt)
        assert done["prompt_cached"] == PROMPT_LEN - 1  # picked by prefix: only the last prompt token evaluated
        assert text == cold
        assert held(second)[1] >= PROMPT_LEN  # it was slot 1 that served it
    finally:
        second.close()


def test_save_erase_and_their_refusals(model: Path, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    runner = start(model, root)
    try:
        empty = call(runner, SlotSaveOp(1, 0, "nothing.bin"))
        assert empty["type"] == "error" and empty["status"] == 400 and "holds no tokens" in empty["message"]
        no_slot = call(runner, SlotSaveOp(2, 7, "x.bin"))
        assert no_slot["status"] == 400 and "there is no slot 7: this model has slots 0 to 1" in no_slot["message"]
        bad = call(runner, SlotSaveOp(3, 0, "../escape"))
        assert bad["status"] == 400 and "not allowed" in bad["message"]
        assert slot_files(root) == [] and not list(tmp_path.glob("escape*"))

        ask(runner, 4, prompt_of(PROMPT_LEN))
        n = max(held(runner))
        erased = call(runner, SlotEraseOp(5, 0))
        assert erased == {"type": "slot_erased", "id": 5, "slot": 0, "n_erased": n}
        assert held(runner) == [0, 0]
        # the erased slot evaluates its prompt again
        _, done = ask(runner, 6, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == 0
    finally:
        runner.close()


def test_without_a_prompt_cache_on_disk_saving_is_not_supported(model: Path) -> None:
    runner = start(model, None)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN))
        got = call(runner, SlotSaveOp(2, 0, "x.bin"))
        assert got["status"] == 501 and "CORRAL_KV_DISK" in got["message"]
        got = call(runner, SlotRestoreOp(3, 0, "x.bin"))
        assert got["status"] == 501
    finally:
        runner.close()


def test_a_busy_slot_is_refused_and_left_alone(endless: Path, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    runner = start(endless, root, parallel=1)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN), SampleParams(num_predict=4, temperature=0))
        assert call(runner, SlotSaveOp(2, 0, "s.bin"))["type"] == "slot_saved"
        runner.engine.submit(3, prompt_of(50, seed=9), SampleParams(num_predict=-1, temperature=0))
        end = time.monotonic() + 60
        while not any(m.get("id") == 3 and m.get("type") == "token" for m in chan(runner).msgs):
            assert time.monotonic() < end
            time.sleep(0.01)
        for op in (SlotSaveOp(4, 0, "s.bin"), SlotRestoreOp(5, 0, "s.bin"), SlotEraseOp(6, 0)):
            got = call(runner, op)
            assert got["type"] == "error" and got["status"] == 409, got
            assert "slot 0 is serving a request; try again when it is idle" in got["message"]
        runner.cancel(3)
        end = time.monotonic() + 60
        while not any(m.get("id") == 3 and m.get("type") == "done" for m in chan(runner).msgs):
            assert time.monotonic() < end
            time.sleep(0.01)
        assert call(runner, SlotRestoreOp(7, 0, "s.bin"))["type"] == "slot_restored"  # idle again: taken
    finally:
        runner.close()


def test_missing_damaged_truncated_and_foreign_files_are_refused_and_change_nothing(
    model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    runner = start(model, root)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN))
        assert call(runner, SlotSaveOp(2, 0, "good.bin"))["type"] == "slot_saved"
        (good,) = slot_files(root)
        data = good.read_bytes()
        (good.parent / "flipped.bin").write_bytes(data[:-50] + bytes([data[-50] ^ 0xFF]) + data[-49:])
        (good.parent / "short.bin").write_bytes(data[:-10])
        (good.parent / "junk.bin").write_bytes(b"not a slot at all, just some words" * 4)
        before = held(runner)

        missing = call(runner, SlotRestoreOp(3, 0, "nope.bin"))
        assert missing["status"] == 404 and "no saved slot named 'nope.bin' for this model" in missing["message"]
        for name, words in (
            ("flipped.bin", "is damaged (checksum mismatch)"),
            ("short.bin", "is truncated"),
            ("junk.bin", "is not a saved slot file"),
        ):
            got = call(runner, SlotRestoreOp(4, 0, name))
            assert got["type"] == "error" and got["status"] == 400 and words in got["message"], got
        no_slot = call(runner, SlotRestoreOp(5, 9, "good.bin"))
        assert no_slot["status"] == 400 and "there is no slot 9" in no_slot["message"]
        bad_name = call(runner, SlotRestoreOp(6, 0, "/etc/passwd"))
        assert bad_name["status"] == 400 and "not allowed" in bad_name["message"]
        assert held(runner) == before  # nothing changed
        _, done = ask(runner, 7, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == PROMPT_LEN - 1
    finally:
        runner.close()

    # another model (another cache key) under the same root: its own folder, and a copied file is refused
    other = start(model, root, key=OTHER_KEY)
    try:
        got = call(other, SlotRestoreOp(1, 0, "good.bin"))
        assert got["status"] == 404 and "saved by another model or another llama.cpp build" in got["message"]
        theirs = Path(other.slot_files.dir)
        assert theirs.parent.name != good.parent.parent.name and theirs.name == SLOTS_DIR
        theirs.mkdir(parents=True)
        (theirs / "copied.bin").write_bytes(data)
        got = call(other, SlotRestoreOp(2, 0, "copied.bin"))
        assert got["status"] == 400 and "was saved by another model or another llama.cpp build" in got["message"]
        assert held(other) == [0, 0]
    finally:
        other.close()


class RefusingOnce:
    """The ``llama_cpp`` module, with ``llama_state_seq_set_data`` refusing the first state it is given."""

    def __init__(self, lc: Any) -> None:
        self._lc = lc
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lc, name)

    def llama_state_seq_set_data(self, ctx: Any, src: Any, size: int, seq_id: int) -> int:
        self.calls += 1
        if self.calls == 1:
            return 0
        return int(self._lc.llama_state_seq_set_data(ctx, src, size, seq_id))


def test_a_state_llama_cpp_refuses_leaves_the_slot_as_it_was(model: Path, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    runner = start(model, root, parallel=1)
    try:
        cold, _ = ask(runner, 1, prompt_of(PROMPT_LEN))
        assert call(runner, SlotSaveOp(2, 0, "a.bin"))["type"] == "slot_saved"
        ask(runner, 3, prompt_of(PROMPT_LEN, seed=4))  # the slot now holds another prompt
        before = held(runner)
        refusing = RefusingOnce(runner.lc)
        runner.engine.lc = refusing
        got = call(runner, SlotRestoreOp(4, 0, "a.bin"))
        assert got["status"] == 400 and "llama.cpp refused the saved slot's state" in got["message"]
        assert refusing.calls == 2  # refused, then the slot's own state put back
        assert held(runner) == before
        _, done = ask(runner, 5, prompt_of(PROMPT_LEN, seed=4))
        assert done["prompt_cached"] == PROMPT_LEN - 1  # what it held still serves
        runner.engine.lc = refusing._lc
        assert call(runner, SlotRestoreOp(6, 0, "a.bin"))["type"] == "slot_restored"
        text, done = ask(runner, 7, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == PROMPT_LEN - 1 and text == cold
    finally:
        runner.close()


# -- the bound ---------------------------------------------------------------------------------------------------------
def test_saved_slots_count_against_the_bound_evict_blocks_and_are_never_evicted(model: Path, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    runner = start(model, root, parallel=1)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN))
        saved = call(runner, SlotSaveOp(2, 0, "keep.bin"))
        size = saved["n_written"]
    finally:
        runner.close()
    (keep,) = slot_files(root)

    # another key's blocks flood a bound of three slot files: the oldest blocks go, the saved slot stays
    limit = 3 * size
    store = KVStore(root, "other", limit, {"model": "sha256:" + "ee" * 32})
    payload = os.urandom(size // 2)
    for seed in range(12):
        tokens = prompt_of(BLOCK_TOKENS, seed=100 + seed)
        assert store.save(0, chain_hashes("other", tokens), tokens, payload) in (True, False)
    assert keep.is_file() and usage(root) <= limit
    blocks = len(list(root.glob("other/*/*.kvb")))
    assert blocks >= 1

    # a save that does not fit even with every block evicted is refused (507) and leaves the files as they were
    runner = start(model, root, parallel=1, limit=size + size // 2)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN, seed=3))
        got = call(runner, SlotSaveOp(2, 0, "second.bin"))
        assert got["type"] == "error" and got["status"] == 507 and "CORRAL_KV_DISK" in got["message"], got
        assert [p.name for p in slot_files(root)] == ["keep.bin"]
        assert len(list(root.glob("other/*/*.kvb"))) == blocks  # nothing evicted for a save that cannot fit
    finally:
        runner.close()
    runner = start(model, root, parallel=1, limit=3 * size)
    try:
        ask(runner, 1, prompt_of(PROMPT_LEN, seed=3))
        assert call(runner, SlotSaveOp(2, 0, "second.bin"))["type"] == "slot_saved"
        assert sorted(p.name for p in slot_files(root)) == ["keep.bin", "second.bin"]
        assert usage(root) <= 3 * size
        assert len(list(root.glob("other/*/*.kvb"))) < blocks  # blocks made room for it
    finally:
        runner.close()


def test_the_file_holds_a_block_of_every_position(model: Path, tmp_path: Path) -> None:
    """The state is stored position-ordered (kvblocks), so it restores into a runner of another stream layout: a
    slot saved by a runner of one slot restores into a runner of four."""
    root = tmp_path / "kv"
    runner = start(model, root, parallel=1)
    try:
        cold, _ = ask(runner, 1, prompt_of(PROMPT_LEN))
        assert call(runner, SlotSaveOp(2, 0, "one.bin"))["type"] == "slot_saved"
    finally:
        runner.close()
    (path,) = slot_files(root)
    assert int.from_bytes(path.read_bytes()[6:8], "little") == LAYOUT_BLOCK
    four = start(model, root, parallel=4)
    try:
        assert call(four, SlotRestoreOp(1, 3, "one.bin"))["type"] == "slot_restored"
        text, done = ask(four, 2, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == PROMPT_LEN - 1 and text == cold
    finally:
        four.close()
