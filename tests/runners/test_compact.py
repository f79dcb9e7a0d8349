"""Busy slots are kept together (engine._compact): llama.cpp runs a step over several KV streams in passes of
consecutive sequence ids, so a gap between busy slots costs a pass every step. A decoding sequence moved into the
gap goes on exactly as it would have (greedy output equal to the same request alone)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from daemon.llama.engine import COMPACT_MIN_LEFT
from daemon.runners.protocol import GenerateOp, GenerateRequest, LoadSpec, SampleParams
from tests.runners.test_compute_thread import Chan, load


def request(runner: Any, rid: int, prompt: str, tokens: int) -> None:
    runner.handle(GenerateOp(rid, GenerateRequest(prompt, SampleParams(num_predict=tokens, temperature=0))))


def tokens_of(chan: Chan, rid: int) -> tuple[str, str]:
    """The request's text (its pieces joined: how it is split into messages depends on timing) and end."""
    text = "".join(m["text"] for m in chan.msgs if m.get("id") == rid and m.get("type") == "token")
    done = [m for m in chan.msgs if m.get("id") == rid and m.get("type") == "done"]
    return text, done[0].get("done_reason", "") if done else ""


def wait_done(chan: Chan, rid: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not any(m.get("id") == rid and m.get("type") in ("done", "error") for m in chan.msgs):
        assert time.monotonic() < end, f"request {rid} did not finish"
        time.sleep(0.01)


def test_a_gap_is_closed_and_the_moved_sequence_is_unchanged(tiny_gguf: Path) -> None:
    long = 6 * COMPACT_MIN_LEFT
    alone_chan = Chan()
    alone, _ = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=512, num_parallel=3), alone_chan)
    try:
        request(alone, 1, "the third one", long)
        wait_done(alone_chan, 1)
    finally:
        alone.close()
    expected = tokens_of(alone_chan, 1)

    chan = Chan()
    runner, _ = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=512, num_parallel=3), chan)
    engine = runner.engine
    assert engine is not None
    try:
        engine.call(lambda: None)  # the engine is up; the three are admitted together, in slots 0, 1 and 2
        with engine._cv:
            request(runner, 1, "the first one", long)
            request(runner, 2, "the short one", 2)
            request(runner, 3, "the third one", long)
        for rid in (1, 2, 3):
            wait_done(chan, rid)
        slots = {s.id: s.cached_tokens for s in engine.slots_info()}
        # the third request went on in slot 1 once the short one left it: slot 1 holds all of it, slot 2 what it
        # held when it moved (without the move, slot 1 would hold the short request and slot 2 the third)
        assert slots[1] > slots[2] > slots[1] - long
        assert tokens_of(chan, 3) == expected
    finally:
        runner.close()
