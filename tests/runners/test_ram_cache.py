"""The sequences a runner keeps in host RAM when a slot is reused (engine._save / _find_saved / _restore): a chat that
lost its slot comes back from RAM even when a busy or reused slot holds all of it but its last few tokens (sixteen
chats with one system prompt, after sixteen other requests: issue 25's cold bursts), and a prompt asked again in
the slot that answered it is not copied out first (its old answer is what the new one replaces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.runners.protocol import SampleParams
from tests.runners.test_shared_prompt import prompt_of, start, text_of, wait_done


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("ram") / "tiny.gguf", context_length=2048, never_ends=True)


def greedy(n: int = 70) -> SampleParams:
    return SampleParams(num_predict=n, temperature=0, repeat_penalty=1.0)


def test_a_chat_comes_back_from_ram_when_a_slot_holds_all_but_its_last_tokens(tiny: Path) -> None:
    system = prompt_of(40, seed=1)
    a, c, b = system + prompt_of(10, seed=2), system + prompt_of(10, seed=3), prompt_of(50, seed=4)
    r, chan, counted = start(tiny, num_ctx=512, num_parallel=2, prompt_cache=64 << 20)
    try:
        r.engine.submit(1, a, greedy())
        wait_done(chan, [1])
        cold = text_of(chan, 1)
        # c takes a's slot (they share the system prompt), b the other: a's answer goes to RAM
        r.engine.call(lambda: None)
        with r.engine._cv:
            r.engine.submit(2, c, greedy())
            r.engine.submit(3, b, greedy())
        wait_done(chan, [2, 3])
        assert len(r.engine.saved) >= 1
        counted.tokens = 0
        r.engine.submit(4, a, greedy())
        done = wait_done(chan, [4])[4]
        # all but its last token restored from RAM, not the 40 tokens of system prompt copied from c's slot and
        # the other 9 evaluated again
        assert done["prompt_cached"] == len(a) - 1
        assert text_of(chan, 4) == cold
    finally:
        r.close()


def test_the_same_prompt_again_is_not_copied_to_ram_first(tiny: Path) -> None:
    prompt = prompt_of(30, seed=5)
    r, chan, _ = start(tiny, num_ctx=512, num_parallel=1, prompt_cache=64 << 20)
    try:
        r.engine.submit(1, prompt, greedy())
        wait_done(chan, [1])
        r.engine.submit(2, prompt, greedy())
        done = wait_done(chan, [2])[2]
        assert done["prompt_cached"] == len(prompt) - 1
        assert r.engine.saved == []  # its first answer (70 tokens) was not saved before being replaced
        assert text_of(chan, 2) == text_of(chan, 1)
        # another prompt in that slot still saves what it held
        r.engine.submit(3, prompt_of(30, seed=6), greedy())
        wait_done(chan, [3])
        assert len(r.engine.saved) == 1
    finally:
        r.close()
