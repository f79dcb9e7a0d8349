"""The prompt cache on disk, at the runner (issue 27; daemon/llama/kvdisk.py and the engine's ``_persist`` /
``_restore_disk``), with real llama.cpp, SmolLM2 and real files: a finished sequence's whole blocks reach the disk
without a shutdown, a fresh runner restores them and answers (greedy) exactly as a cold run does with the restored
tokens counted as cached; a corrupted block, a state llama.cpp refuses, a bound too small for a block and a
directory that cannot be written all leave the answer as it was, without the cache."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.llama.kvdisk import DiskCache, text_prefix
from daemon.llama.runner import Runner
from daemon.runners.kvstore import BLOCK_TOKENS, KVStore, chain_hashes
from daemon.runners.process import ProcessRunner
from daemon.runners.protocol import Done, GenerateRequest, LoadSpec, SampleParams, Token
from tests.models import smollm2_path, write_tiny_gguf
from tests.runners.test_compute_thread import _KEEP, Chan

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (scripts/fetch_smollm2.py)")
KEY = json.dumps(
    {"model": "sha256:" + "ab" * 32, "adapters": [], "projector": "", "kv_type": "f16", "flash_attn": "auto"},
    sort_keys=True,
    separators=(",", ":"),
)
GREEDY = SampleParams(num_predict=12, temperature=0, repeat_penalty=1.0, seed=1)
# two whole blocks and a tail: a restore takes the blocks and evaluates the tail as one chunk (n_batch 512), as the
# cold run's second chunk was, so the KV cache is the same bit for bit
PROMPT_LEN = 2 * BLOCK_TOKENS + 90


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def start(disk: Path | str | None, limit: int = 1 << 30, **spec: Any) -> tuple[Runner, Chan]:
    chan = Chan()
    runner = Runner(chan)  # type: ignore[arg-type]
    _KEEP.append(runner)  # its log callback must outlive any later llama.cpp call in this process
    assert SMOL is not None
    extra: dict[str, Any] = {"kv_disk_dir": str(disk), "kv_disk_bytes": limit, "kv_key": KEY} if disk else {}
    spec = {"num_parallel": 1, **spec}
    runner.load(LoadSpec(model_path=str(SMOL), num_ctx=2048, num_batch=512, **extra, **spec))
    return runner, chan


def ask(runner: Runner, chan: Chan, rid: int, prompt: list[int]) -> tuple[str, dict[str, Any]]:
    runner.engine.submit(rid, prompt, GREEDY)
    end = time.monotonic() + 120
    while True:
        done = [m for m in list(chan.msgs) if m.get("id") == rid and m.get("type") in ("done", "error")]
        if done:
            break
        assert time.monotonic() < end, "the request did not finish"
        time.sleep(0.01)
    assert done[0]["type"] == "done", done[0]
    text = "".join(m["text"] for m in chan.msgs if m.get("id") == rid and m.get("type") == "token")
    return text, done[0]


def blocks(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def wait_blocks(root: Path, n: int) -> list[Path]:
    end = time.monotonic() + 30
    while len(found := blocks(root)) < n:
        assert time.monotonic() < end, f"{len(found)} blocks on disk, not {n}"
        time.sleep(0.02)
    return found


@pytest.fixture(scope="module")
def cold() -> str:
    """The answer with no cache at all."""
    runner, chan = start(None)
    try:
        text, done = ask(runner, chan, 1, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == 0
        return text
    finally:
        runner.close()


@pytest.fixture
def stored(tmp_path: Path, cold: str) -> Iterator[Path]:
    """A disk cache that holds the prompt's blocks: written by a runner that answered it and was then closed."""
    root = tmp_path / "kv"
    runner, chan = start(root)
    try:
        text, done = ask(runner, chan, 1, prompt_of(PROMPT_LEN))
        assert text == cold and done["prompt_cached"] == 0
        # written when the sequence ended, without waiting for a shutdown: a kill -9 now would lose nothing
        wait_blocks(root, 2)
        info = runner.kv_disk_info()
        assert info.enabled and info.entries >= 2 and info.bytes > 0 and info.dir == str(root)
    finally:
        runner.close()
    yield root


@needs_smol
def test_a_fresh_runner_restores_the_prefix_and_answers_as_a_cold_run(stored: Path, cold: str) -> None:
    runner, chan = start(stored)
    try:
        text, done = ask(runner, chan, 1, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == 2 * BLOCK_TOKENS
        assert done["prompt_eval_count"] == PROMPT_LEN
        assert text == cold
        info = runner.kv_disk_info()
        assert info.hits == 1 and info.restored_tokens == 2 * BLOCK_TOKENS
        # a prompt that shares only the first block restores that one
        other = prompt_of(PROMPT_LEN)[:BLOCK_TOKENS] + prompt_of(200, seed=5)
        _, done = ask(runner, chan, 2, other)
        assert done["prompt_cached"] == BLOCK_TOKENS
    finally:
        runner.close()


@needs_smol
def test_a_corrupted_block_is_refused_logged_and_the_answer_stays(
    stored: Path, cold: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompt_of(PROMPT_LEN)
    key_dirs = [p for p in stored.iterdir() if p.is_dir()]
    assert len(key_dirs) == 1
    hashes = chain_hashes(key_dirs[0].name, prompt[: 2 * BLOCK_TOKENS])
    second = next(p for p in blocks(stored) if p.stem == hashes[1])
    data = bytearray(second.read_bytes())
    data[-100] ^= 0xFF  # a bit flipped in its payload
    second.write_bytes(bytes(data))
    runner, chan = start(stored)
    try:
        with caplog.at_level(logging.WARNING):
            text, done = ask(runner, chan, 1, prompt)
        assert text == cold
        assert done["prompt_cached"] == BLOCK_TOKENS  # the first block still holds
        assert not second.exists()  # removed
        removed = [r.getMessage() for r in caplog.records if str(second) in r.getMessage()]
        assert len(removed) == 1, [r.getMessage() for r in caplog.records]
    finally:
        runner.close()


class Refusing:
    """The ``llama_cpp`` module, with ``llama_state_seq_set_data`` refusing every state (as for one it finds of
    another shape)."""

    def __init__(self, lc: Any) -> None:
        self._lc = lc
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lc, name)

    def llama_state_seq_set_data(self, ctx: Any, src: Any, size: int, seq_id: int) -> int:
        self.refused += 1
        return 0


@needs_smol
def test_a_state_llama_cpp_refuses_is_evaluated_instead(
    stored: Path, cold: str, capfd: pytest.CaptureFixture[str]
) -> None:
    runner, chan = start(stored)
    refusing = Refusing(runner.lc)
    runner.engine.lc = refusing
    try:
        text, done = ask(runner, chan, 1, prompt_of(PROMPT_LEN))
        assert refusing.refused == 1
        assert text == cold and done["prompt_cached"] == 0
        assert runner.kv_disk_info().restored_tokens == 0
        assert "evaluating it instead" in capfd.readouterr().err
    finally:
        runner.close()


@needs_smol
def test_a_bound_too_small_for_a_block_means_no_cache(tmp_path: Path, cold: str) -> None:
    root = tmp_path / "kv"
    runner, chan = start(root, limit=4096)
    try:
        assert ask(runner, chan, 1, prompt_of(PROMPT_LEN))[0] == cold
        runner.flush_disk(10)
        assert blocks(root) == []
        _, done = ask(runner, chan, 2, prompt_of(PROMPT_LEN))  # from its slot, as without a disk cache
        assert done["prompt_cached"] == PROMPT_LEN - 1
    finally:
        runner.close()
    assert blocks(root) == []


@needs_smol
def test_a_directory_that_cannot_be_written_means_no_cache(tmp_path: Path, cold: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    runner, chan = start(blocker / "kv")  # every write fails (ENOTDIR), as on a read-only or full disk
    try:
        for rid in (1, 2):
            text, done = ask(runner, chan, rid, prompt_of(PROMPT_LEN, seed=rid))
            assert done["type"] == "done" and text
        runner.flush_disk(10)
        text, done = ask(runner, chan, 3, prompt_of(PROMPT_LEN))
        assert text == cold and done["prompt_cached"] == 0
        assert runner.kv_disk_info().entries == 0
    finally:
        runner.close()


def test_only_text_before_the_first_image_is_stored_or_looked_up(tmp_path: Path) -> None:
    """Image positions are negative keys: a slot's tokens store whole blocks of the text before the first one only,
    and a lookup asks for no more (a prefix that ends inside an image is never stored or restored)."""
    store = KVStore(tmp_path, "k" * 64, 1 << 30, {"model": "m"})
    disk = DiskCache(store, key="k" * 64, n_stream=1, root=str(tmp_path), limit_bytes=1 << 30)
    try:
        text = prompt_of(BLOCK_TOKENS + 100)
        with_image = text + [-7] * 600 + prompt_of(2 * BLOCK_TOKENS, seed=3)
        assert text_prefix(with_image) == len(text)
        hashes, n = disk.wanted(with_image, exact=len(with_image))
        assert n == 1 and hashes == chain_hashes("k" * 64, text[:BLOCK_TOKENS])
        found = disk.lookup(with_image)
        assert found is not None and found.n_blocks == 1
        # an image at position 10: nothing whole before it
        assert disk.wanted(text[:10] + [-1] + text, exact=10**6) == ([], 0)
        assert disk.lookup(text[:10] + [-1] + text) is None
        # a context shift at position 300 of a 600-token slot: only the block before it
        assert disk.wanted(text + text, exact=300)[1] == 1
    finally:
        disk.close()


def tiny_context(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(10, 290) for _ in range(n))


async def first_answer(r: ProcessRunner, context: tuple[int, ...]) -> tuple[str, Done]:
    text: list[str] = []
    req = GenerateRequest(prompt="a", params=GREEDY, context=context)
    async for ev in r.generate(req):
        if isinstance(ev, Token):
            text.append(ev.text)
        elif isinstance(ev, Done):
            return "".join(text), ev
    raise AssertionError("no end")


@pytest.mark.anyio
async def test_a_runner_shut_down_mid_generation_stores_its_prompt_for_the_next(tmp_path: Path) -> None:
    """A shutdown (an unload) stores what the slots hold before the process exits, a sequence still generating
    included; a new runner process restores it."""
    model = write_tiny_gguf(tmp_path / "tiny.gguf", context_length=2048, never_ends=True)
    root = tmp_path / "kv"
    plain = LoadSpec(model_path=str(model), num_ctx=1024, num_batch=512)
    spec = dataclasses.replace(plain, kv_disk_dir=str(root), kv_disk_bytes=1 << 30, kv_key=KEY)
    context = tiny_context(PROMPT_LEN)
    cold = ProcessRunner(plain)
    await cold.start()
    try:
        expected, done = await first_answer(cold, context)
        assert done.prompt_cached == 0
    finally:
        await cold.close()
    r = ProcessRunner(spec)
    await r.start()
    gen = r.generate(GenerateRequest(prompt="a", params=SampleParams(num_predict=400, temperature=0), context=context))
    try:
        async for _ev in gen:
            break  # its prompt is evaluated: it generates until the shutdown
        assert blocks(root) == []  # nothing has ended yet
        await r.close()
    finally:
        with contextlib.suppress(Exception):
            await gen.aclose()  # type: ignore[attr-defined]
    assert len(blocks(root)) >= 2
    again = ProcessRunner(spec)
    await again.start()
    try:
        text, done = await first_answer(again, context)
        assert done.prompt_cached == 2 * BLOCK_TOKENS
        assert text == expected
        await again.slots()  # the stats come with the slots' reply
        info = again.kv_disk
        assert info is not None and info.enabled and info.dir == str(root)
        assert info.hits == 1 and info.restored_tokens == 2 * BLOCK_TOKENS and info.entries >= 2
    finally:
        await again.close()


@needs_smol
def test_an_ended_sequence_is_stored_when_the_engine_is_idle_not_while_others_decode(tmp_path: Path) -> None:
    """Copying a long sequence's state out of llama.cpp stops the engine (on a GPU, ~0.9 s for 16k tokens of an
    8B model, docs/benchmarks.md): while another request decodes, an ended one's blocks wait for a quiet moment."""
    root = tmp_path / "kv"
    runner, chan = start(root, num_parallel=2)
    try:
        endless = SampleParams(num_predict=100_000, temperature=0, repeat_penalty=1.0, seed=1)
        runner.engine.submit(1, prompt_of(40, seed=9), endless)
        end = time.monotonic() + 60
        while not any(m.get("id") == 1 and m.get("type") == "token" for m in list(chan.msgs)):
            assert time.monotonic() < end, "the first request did not start"
            time.sleep(0.01)
        _, done = ask(runner, chan, 2, prompt_of(PROMPT_LEN))
        assert done["prompt_cached"] == 0
        time.sleep(1.0)  # many steps of the first request: none of them stored the second's blocks
        assert blocks(root) == []
        runner.engine.cancel(1)
        wait_blocks(root, 2)  # idle now: stored
    finally:
        runner.close()
