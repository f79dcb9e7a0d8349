"""Sequences with one prompt share its evaluation (engine._place / _leader / _start_twin): the choices of a request
with ``n`` > 1, or concurrent requests with one system prompt, evaluate the common prefix once; the others wait for it
and copy its KV (``llama_memory_seq_cp``). A follower with the same whole prompt also takes the leader's first logits
(and samples them with its own sampler); one with another ending evaluates its own tail. Greedy choices are what the
request gives alone; a leader that leaves mid-prompt does not leave its followers hanging.

The count of evaluated tokens is llama.cpp's own: every token of every ``llama_decode`` batch."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.llama.engine import MIN_GAIN
from daemon.llama.runner import Runner
from daemon.runners.protocol import GenerateOp, GenerateRequest, LoadSpec, SampleParams
from tests.models import smollm2_path, write_tiny_gguf
from tests.runners.test_compute_thread import _KEEP, Chan

SMOL = smollm2_path()
PREDICT = 8


class Counted:
    """The ``llama_cpp`` module, with ``llama_decode`` counting the tokens it is given and calling ``hook`` (with
    the number of decodes so far) before each."""

    def __init__(self, lc: Any) -> None:
        self._lc = lc
        self.tokens = 0
        self.decodes = 0
        self.hook: Callable[[int], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lc, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.decodes += 1
        self.tokens += int(batch.n_tokens)
        if self.hook is not None:
            self.hook(self.decodes)
        return int(self._lc.llama_decode(ctx, batch))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("shared") / "tiny.gguf", context_length=2048, never_ends=True)


def start(model: Path, **spec: Any) -> tuple[Runner, Chan, Counted]:
    chan = Chan()
    runner = Runner(chan)  # type: ignore[arg-type]
    _KEEP.append(runner)  # its log callback must outlive any later llama.cpp call in this process
    counted = Counted(runner.lc)
    runner.lc = counted  # type: ignore[assignment]
    runner.load(LoadSpec(model_path=str(model), **spec))
    counted.tokens = counted.decodes = 0  # not the warm-up
    return runner, chan, counted


@pytest.fixture
def runner(tiny: Path) -> Iterator[tuple[Runner, Chan, Counted]]:
    r = start(tiny, num_ctx=1024, num_parallel=4, num_batch=512)
    try:
        yield r
    finally:
        r[0].close()


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 290) for _ in range(n)]


def params(**kw: Any) -> SampleParams:
    return SampleParams(**{"num_predict": PREDICT, "temperature": 0, "repeat_penalty": 1.0, **kw})


def wait_done(chan: Chan, rids: list[int], timeout: float = 120) -> dict[int, dict[str, Any]]:
    end = time.monotonic() + timeout
    while True:
        ends = {m["id"]: m for m in list(chan.msgs) if m.get("type") in ("done", "error") and m.get("id") in rids}
        if len(ends) == len(rids):
            return ends
        assert time.monotonic() < end, f"requests {sorted(set(rids) - set(ends))} did not finish"
        time.sleep(0.005)


def text_of(chan: Chan, rid: int) -> str:
    return "".join(m["text"] for m in chan.msgs if m.get("id") == rid and m.get("type") == "token")


def together(runner: Runner, jobs: list[tuple[int, list[int], SampleParams]]) -> None:
    """Submit the jobs so that the engine admits them in one go (as the daemon's fan-out of ``n`` choices)."""
    engine = runner.engine
    engine.call(lambda: None)  # the engine is up and idle
    with engine._cv:
        for rid, prompt, p in jobs:
            engine.submit(rid, prompt, p)


def alone(model: Path, prompt: list[int], p: SampleParams, **spec: Any) -> str:
    r, chan, _ = start(model, **spec)
    try:
        r.engine.submit(1, prompt, p)
        ends = wait_done(chan, [1])
        assert ends[1]["type"] == "done", ends[1]
        return text_of(chan, 1)
    finally:
        r.close()


def test_n_choices_evaluate_the_prompt_once(tiny: Path, runner: tuple[Runner, Chan, Counted]) -> None:
    r, chan, counted = runner
    prompt = prompt_of(400)
    expected = alone(tiny, prompt, params(), num_ctx=1024, num_parallel=4)
    together(r, [(rid, prompt, params()) for rid in (1, 2, 3)])
    ends = wait_done(chan, [1, 2, 3])
    assert all(e["type"] == "done" for e in ends.values()), ends
    # one prompt's worth, then PREDICT - 1 decoded tokens per choice (the last sampled one is never decoded): not
    # three prompts' worth
    assert counted.tokens == len(prompt) + 3 * (PREDICT - 1)
    assert sorted(e["prompt_cached"] for e in ends.values()) == [0, len(prompt), len(prompt)]
    assert all(e["prompt_eval_count"] == len(prompt) for e in ends.values())
    assert [text_of(chan, rid) for rid in (1, 2, 3)] == [expected] * 3


def test_a_newcomer_waits_for_a_prompt_being_evaluated(tiny: Path) -> None:
    """The second choice arrives while the first is half-way through its prompt (chunks of 64 tokens): it waits for
    the rest instead of evaluating it again beside it."""
    r, chan, counted = start(tiny, num_ctx=1024, num_parallel=4, num_batch=64)
    try:
        prompt = prompt_of(300, seed=1)

        def second(n: int) -> None:
            if n == 2:
                r.engine.submit(2, prompt, params())

        counted.hook = second
        r.engine.submit(1, prompt, params())
        ends = wait_done(chan, [1, 2])
        assert all(e["type"] == "done" for e in ends.values()), ends
        assert ends[2]["prompt_cached"] == len(prompt)
        assert counted.tokens == len(prompt) + 2 * (PREDICT - 1)
        assert text_of(chan, 1) == text_of(chan, 2)
    finally:
        r.close()


def test_a_shared_system_prompt_is_evaluated_once(tiny: Path, runner: tuple[Runner, Chan, Counted]) -> None:
    r, chan, counted = runner
    system = prompt_of(300, seed=2)
    tails = [prompt_of(40, seed=10 + i) for i in range(3)]
    together(r, [(i + 1, system + tail, params()) for i, tail in enumerate(tails)])
    ends = wait_done(chan, [1, 2, 3])
    assert all(e["type"] == "done" for e in ends.values()), ends
    assert sorted(e["prompt_cached"] for e in ends.values()) == [0, len(system), len(system)]
    assert counted.tokens == len(system) + 3 * 40 + 3 * (PREDICT - 1)
    for i, tail in enumerate(tails):
        assert text_of(chan, i + 1) == alone(tiny, system + tail, params(), num_ctx=1024, num_parallel=4)


def test_followers_go_on_when_their_leader_is_cancelled_mid_prompt(tiny: Path) -> None:
    """The leader is cancelled after its first chunk: its followers do not hang. One of them evaluates the rest
    of the prompt (taking what the leader evaluated), the other follows it; both give the answer alone."""
    r, chan, counted = start(tiny, num_ctx=1024, num_parallel=4, num_batch=64)
    try:
        prompt = prompt_of(300, seed=3)
        expected = alone(tiny, prompt, params(), num_ctx=1024, num_parallel=4, num_batch=64)
        cancelled = threading.Event()

        def cancel_leader(n: int) -> None:
            if n == 2:  # the leader's first chunk is in; its second is being evaluated
                r.engine.cancel(1)
                cancelled.set()

        counted.hook = cancel_leader
        together(r, [(rid, prompt, params()) for rid in (1, 2, 3)])
        ends = wait_done(chan, [1, 2, 3])
        assert cancelled.is_set()
        assert all(e["type"] == "done" for e in ends.values()), ends
        assert ends[1]["eval_count"] == 0
        assert text_of(chan, 2) == text_of(chan, 3) == expected
        assert sorted(ends[rid]["prompt_cached"] for rid in (2, 3)) == [128, len(prompt)]
        # the leader's two chunks and the rest once, and the two choices' tokens
        assert counted.tokens == len(prompt) + 2 * (PREDICT - 1)
    finally:
        r.close()


def test_a_cancelled_follower_leaves_and_the_others_go_on(tiny: Path, runner: tuple[Runner, Chan, Counted]) -> None:
    r, chan, _ = runner
    prompt = prompt_of(200, seed=4)
    counted = r.lc
    assert isinstance(counted, Counted)
    counted.hook = lambda n: r.engine.cancel(2) if n == 1 else None  # while it waits for the leader's prompt
    together(r, [(rid, prompt, params()) for rid in (1, 2, 3)])
    ends = wait_done(chan, [1, 2, 3])
    assert all(e["type"] == "done" for e in ends.values()), ends
    assert ends[2]["eval_count"] == 0
    assert ends[1]["eval_count"] == ends[3]["eval_count"] == PREDICT
    assert text_of(chan, 1) == text_of(chan, 3)


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_smollm2_choices_share_the_prompt_greedy_as_alone_sampled_apart() -> None:
    """SmolLM2, a ~400-token prompt, four choices (as the daemon's fan-out of ``n`` sends them): about one prompt
    evaluated, not four; the greedy choices equal the answer alone; sampled choices with their own seeds differ
    (each choice keeps its own random generator)."""
    assert SMOL is not None
    spec = {"num_ctx": 1024, "num_parallel": 4}
    text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(30)
    )
    r, chan, counted = start(SMOL, **spec)
    try:
        prompt = r.tokenize(
            f"<|im_start|>user\n{text}\nWhich box holds the most?<|im_end|>\n<|im_start|>assistant\n", True
        )
        assert len(prompt) > 300
        greedy = params(num_predict=16)
        jobs = [(1, prompt, greedy), (2, prompt, greedy)]
        jobs += [(3 + i, prompt, params(num_predict=16, temperature=1.0, seed=100 + i)) for i in range(2)]
        together(r, jobs)
        ends = wait_done(chan, [1, 2, 3, 4], timeout=600)
        assert all(e["type"] == "done" for e in ends.values()), ends
        # one prompt, then the choices' tokens (all but the last sampled, unless it ended them)
        decoded = sum(e["eval_count"] for e in ends.values())
        assert len(prompt) + decoded - 4 <= counted.tokens <= len(prompt) + decoded
        got = {rid: text_of(chan, rid) for rid in (1, 2, 3, 4)}
    finally:
        r.close()
    assert got[1] == got[2] == alone(SMOL, prompt, greedy, **spec)
    assert got[3] != got[4]


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_images_are_shared_only_with_the_same_image() -> None:
    """Three requests with one text and an image (A, A, B), admitted together: the second A copies the whole prompt,
    image included, from the first; B shares only the text before its image and evaluates its own image. Each
    greedy text is its request's alone."""
    import base64

    from tests.vision import image_bytes, projector_path

    assert SMOL is not None
    spec = {"num_ctx": 1024, "num_parallel": 4, "projector_path": str(projector_path())}
    system = "You describe pictures for a catalogue. " * 6
    prompt = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nDescribe <__media__>.<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    images = {"A": base64.b64encode(image_bytes(0)).decode(), "B": base64.b64encode(image_bytes(1)).decode()}
    greedy = params(num_predict=12)

    def req(rid: int, image: str) -> GenerateOp:
        return GenerateOp(rid, GenerateRequest(prompt, greedy, images=(images[image],)))

    r, chan, _ = start(SMOL, **spec)
    try:
        for rid, image in ((1, "A"), (2, "B")):  # alone, one after the other
            r.handle(req(rid, image))
            assert wait_done(chan, [rid])[rid]["type"] == "done"
        expected = {"A": text_of(chan, 1), "B": text_of(chan, 2)}
        media = r._media_prompt(req(0, "A").req)
        keys = media.cache_key()
        media.close()
    finally:
        r.close()
    before_image = next(i for i, k in enumerate(keys) if k < 0)
    assert before_image >= 2 * MIN_GAIN

    r, chan, _ = start(SMOL, **spec)
    try:
        r.engine.call(lambda: None)
        with r.engine._cv:  # admitted together
            for rid, image in ((1, "A"), (2, "A"), (3, "B")):
                r.handle(req(rid, image))
        ends = wait_done(chan, [1, 2, 3])
        assert all(e["type"] == "done" for e in ends.values()), ends
        assert [ends[rid]["prompt_cached"] for rid in (1, 2, 3)] == [0, len(keys), before_image]
        assert [text_of(chan, rid) for rid in (1, 2, 3)] == [expected["A"], expected["A"], expected["B"]]
    finally:
        r.close()


def test_a_twin_asking_for_logprobs_gets_them_for_its_first_token(runner: tuple[Runner, Chan, Counted]) -> None:
    r, chan, _ = runner
    prompt = prompt_of(200, seed=5)
    together(r, [(1, prompt, params()), (2, prompt, params(logprobs=2))])
    ends = wait_done(chan, [1, 2])
    assert ends[2]["type"] == "done" and ends[2]["prompt_cached"] == len(prompt), ends
    pieces = [m for m in chan.msgs if m.get("id") == 2 and m.get("type") == "token"]
    assert len(pieces) == PREDICT and all(len(m["logprobs"]["top_logprobs"]) == 2 for m in pieces)
    assert "".join(m["text"] for m in pieces) == text_of(chan, 1)
