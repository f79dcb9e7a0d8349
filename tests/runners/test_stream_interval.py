"""When llama.cpp's threads take every core, a running sequence's tokens go to the daemon in groups, at most once per
``stream_interval`` (each frame wakes the daemon, which takes a core from the decode in progress). What must not
change: a stream's first text goes at once (its time to first token), an end goes at once, and the text, its order
and the final counts are those of the same request sent one frame per step. A stream's plain pieces held together
travel as one message (one line for the daemon to forward); pieces with logprobs stay one per token."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from daemon.llama.engine import merge_pieces
from daemon.runners.protocol import (
    Done,
    DoneReply,
    ErrorReply,
    GenerateOp,
    GenerateRequest,
    JSONObject,
    LoadSpec,
    Reply,
    SampleParams,
    Token,
    TokenReply,
    wire,
)
from tests.runners.test_compute_thread import Chan, load


class Frames(Chan):
    """A channel that also keeps each frame (one ``send_many``) whole."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[list[dict[str, Any]]] = []

    def send_many(self, replies: list[Reply]) -> None:
        self.frames.append([wire(r) for r in replies])
        super().send_many(replies)


def run(tiny_gguf: Path, interval: float, tokens: int) -> Frames:
    chan = Frames()
    runner, _ = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=512, num_parallel=2), chan)
    engine = runner.engine
    assert engine is not None
    try:
        engine.call(lambda: setattr(engine, "stream_interval", interval))
        chan.frames.clear()
        chan.msgs.clear()
        chan.done.clear()
        params = SampleParams(num_predict=tokens, temperature=0)
        runner.handle(GenerateOp(1, GenerateRequest("tell me a story", params)))
        assert chan.done.wait(60)
        time.sleep(0.05)  # nothing else may follow the end
    finally:
        runner.close()
    return chan


def texts(chan: Chan) -> list[str]:
    return [m["text"] for m in chan.msgs if m.get("type") == "token"]


def text(chan: Chan) -> str:
    return "".join(texts(chan))


def test_tokens_are_grouped_but_the_first_and_the_end_go_at_once(tiny_gguf: Path) -> None:
    tokens = 48
    each_step = run(tiny_gguf, 0.0, tokens)
    grouped = run(tiny_gguf, 5.0, tokens)  # far longer than the whole generation of the tiny model takes

    assert text(grouped) == text(each_step) and len(texts(each_step)) > 2
    done = [m for m in grouped.msgs if m.get("type") == "done"]
    assert len(done) == 1 and done[0]["eval_count"] == tokens
    assert done[0]["eval_count"] == [m for m in each_step.msgs if m.get("type") == "done"][0]["eval_count"]
    # the first frame carries the first text alone; everything after it was held and went with the end, as one
    # piece of text
    assert [m["type"] for m in grouped.frames[0]] == ["token"]
    assert len(grouped.frames) == 2 and [m["type"] for m in grouped.frames[-1]] == ["token", "done"]
    assert texts(grouped) == [texts(each_step)[0], "".join(texts(each_step)[1:])]
    # without an interval, a frame per step
    assert len(each_step.frames) >= len(texts(each_step))


def test_a_short_interval_still_sends_while_the_sequence_runs(tiny_gguf: Path) -> None:
    grouped = run(tiny_gguf, 0.002, 120)
    token_frames = [f for f in grouped.frames if any(m["type"] == "token" for m in f)]
    assert len(token_frames) > 2  # not all held to the end
    assert [m["eval_count"] for m in grouped.msgs if m.get("type") == "done"] == [120]


def test_merge_pieces_joins_a_streams_plain_pieces_in_order_and_nothing_else() -> None:
    def tok(rid: int, text: str, logprobs: JSONObject | None = None) -> TokenReply:
        return TokenReply(rid, Token(text, logprobs))

    done = DoneReply(2, Done("stop", 1, 1, 2, 1))
    error = ErrorReply(3, "no")
    lp: JSONObject = {"token": "c", "logprob": -0.5}
    out = [
        tok(1, "a"),
        tok(2, "x"),
        tok(1, "b"),
        tok(2, "y"),
        tok(1, "c", logprobs=lp),  # a token's logprobs stay with it
        tok(1, "d"),
        tok(1, "e"),
        done,
        error,
        tok(3, "z"),
    ]
    assert merge_pieces(out) == [
        tok(1, "ab"),
        tok(2, "xy"),
        tok(1, "c", logprobs=lp),
        tok(1, "de"),
        done,
        error,
        tok(3, "z"),
    ]
    # an end is never overtaken: a piece after another message of its stream starts a new message after it
    end = DoneReply(1, Done("stop", 1, 1, 1, 1))
    assert merge_pieces([tok(1, "a"), end, tok(1, "b")]) == [tok(1, "a"), end, tok(1, "b")]
