"""Speculative decoding inside the engine (issue 28; daemon/llama/speculative.py, engine._draft / _verify): drafts
from a draft model or from prompt lookup are verified in the batched step, and the output is the target's own:
greedy output token for token what decoding without a draft gives, alone and beside other streams, with stop
strings, a JSON grammar, penalties and logprobs; rejected positions leave the KV cache, so the prefix cache serves
a continuation correctly. A draft model of another vocabulary is refused at load; a failing draft decode costs
only the drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon.generation.inference import JSON_GBNF
from daemon.llama.runner import RequestError, Runner
from daemon.llama.speculative import Acceptance, CostModel, NgramIndex, SpecState, expected_tokens
from daemon.runners.protocol import LoadSpec, SampleParams
from tests.models import smollm2_path, write_tiny_gguf
from tests.runners.test_compute_thread import _KEEP, Chan
from tests.runners.test_shared_prompt import Counted, prompt_of, start, text_of, wait_done

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached: run scripts/fetch_smollm2.py")


# -- pure parts ------------------------------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_last_occurrence() -> None:
    idx = NgramIndex(2)
    history = [1, 2, 3, 4, 5, 9, 1, 2]
    assert idx.draft(history, 3) == [3, 4, 5]
    # grown by a token: the latest occurrence wins, and the index is extended, not rebuilt
    history += [7, 1, 2]
    assert idx.draft(history, 2) == [7, 1]
    assert idx.draft(history + [42], 4) == []  # (2, 42) never occurred before
    # a shorter history (a context shift rewrote it): the index starts over
    assert idx.draft([5, 6, 5], 2) == []
    assert idx.draft([5, 6, 8, 5, 6], 5) == [8, 5, 6]


def test_ngram_index_never_drafts_image_keys() -> None:
    idx = NgramIndex(1)
    assert idx.draft([3, -7, -8, 4, 3], 4) == [4, 3]


def test_acceptance_follows_what_the_target_keeps() -> None:
    spec = SpecState(draft_max=8, draft_min=0, p_min=0.75, ngram=2, use_model=True)
    assert spec.model.rate == spec.lookup.rate == 0.75
    for _ in range(20):
        spec.from_model = True
        spec.verified(4, 4)
    assert spec.model.rate > 0.95 and spec.lookup.rate == 0.75  # per source
    for _ in range(20):
        spec.from_model = False
        spec.verified(4, 0)
    assert spec.lookup.rate < 0.1
    assert (spec.drafted, spec.accepted) == (160, 80)
    a = Acceptance()
    a.update(5, 2)  # two kept, then one refused
    assert a.kept == 0.9 * 3 + 2 and a.tried == 0.9 * 4 + 3
    assert not SpecState(draft_max=0, draft_min=0, p_min=0.0, ngram=3, use_model=True).active
    assert not SpecState(draft_max=16, draft_min=0, p_min=0.0, ngram=0, use_model=False).active


def test_the_cost_model_drafts_only_where_it_pays() -> None:
    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    cpu = CostModel(prior_ratio=0.3)
    assert cpu.best_k(0.9, 8, 1, model=False) == 1  # nothing measured: a short draft to learn from
    # SmolLM2 F16 on 2 CPU cores: 8.8 ms for one token, 21 for four, 32 for eight
    for n, ms in [(1, 8.8), (4, 21.0), (8, 32.0), (1, 8.8), (2, 12.0)] * 5:
        cpu.observe_step(n, ms / 1000)
    fixed, per = cpu.line() or (0.0, 0.0)
    assert 0.004 < fixed < 0.008 and 0.002 < per < 0.004
    assert cpu.best_k(0.95, 16, 1, model=False) >= 4  # prompt lookup copying its prompt: long drafts
    assert 1 <= cpu.best_k(0.6, 16, 1, model=False) <= 2
    assert cpu.best_k(0.2, 16, 1, model=False) == 0  # drafts that are mostly wrong cost more than they give
    assert cpu.best_k(0.95, 16, 4, model=False) < cpu.best_k(0.95, 16, 1, model=False)  # others wait too
    # a draft model is timed first; about as slow as the target it is never worth it, a tenth of its cost is
    assert cpu.best_k(0.9, 16, 1, model=True) == 2
    cpu.observe_draft(4, 4 * 0.0075)
    assert cpu.best_k(0.9, 16, 1, model=True) == 0
    cheap = CostModel(prior_ratio=0.05)
    cheap.observe_step(1, 0.020)
    cheap.observe_draft(1, 0.002)
    assert cheap.best_k(0.8, 16, 1, model=True) >= 3


class Always(CostModel):
    """A cost model that always drafts as much as allowed: the tests check what verification does with drafts."""

    def __init__(self) -> None:
        super().__init__(0.0)

    def best_k(self, rate: float, k_max: int, decoding: int, model: bool) -> int:
        return k_max


# -- the engine, real llama.cpp --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", context_length=2048, never_ends=True)


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("spec") / "other.gguf", n_vocab=280, context_length=2048)


def greedy(**kw: Any) -> SampleParams:
    # draft_p_min 0: a random model is never sure of a token
    return SampleParams(**{"num_predict": 48, "temperature": 0, "repeat_penalty": 1.0, "draft_p_min": 0.0, **kw})


def run(model: Path, jobs: list[tuple[list[int], SampleParams]], **spec: Any) -> list[dict[str, Any]]:
    """Each job's text and final message, the jobs submitted together."""
    r, chan, _ = start(model, **{"num_ctx": 1024, "num_parallel": 4, **spec})
    r.engine.spec_cost = Always()
    try:
        rids = list(range(1, len(jobs) + 1))
        r.engine.call(lambda: None)
        with r.engine._cv:
            for rid, (prompt, p) in zip(rids, jobs, strict=True):
                r.engine.submit(rid, prompt, p)
        ends = wait_done(chan, rids)
        assert all(ends[rid]["type"] == "done" for rid in rids), ends
        return [{**ends[rid], "text": text_of(chan, rid)} for rid in rids]
    finally:
        r.close()


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats itself: prompt lookup finds n-grams in it."""
    part = prompt_of(n // 4, seed)
    return part * 4


@pytest.mark.parametrize(
    "how",
    [{"draft": True}, {"draft": False, "draft_ngram": 2}, {"draft": True, "draft_ngram": 3}],
    ids=["draft-model", "ngram", "both"],
)
def test_greedy_output_is_the_same_with_speculation_alone_and_with_four_streams(tiny: Path, how: dict) -> None:
    how = dict(how)
    draft = how.pop("draft")
    prompts = [repetitive(64, seed) for seed in range(4)]
    plain = run(tiny, [(p, greedy()) for p in prompts])
    spec_kw: dict[str, Any] = {"draft_path": str(tiny)} if draft else {}
    one = run(tiny, [(prompts[0], greedy(**how))], **spec_kw)
    four = run(tiny, [(p, greedy(**how)) for p in prompts], **spec_kw)
    assert one[0]["text"] == plain[0]["text"]
    assert [f["text"] for f in four] == [p["text"] for p in plain]
    assert [f["eval_count"] for f in four] == [48] * 4
    # the draft model is the model itself: it drafts what the target says
    assert all(f["draft_n"] > 0 for f in four)
    if draft and not how:  # prompt lookup's drafts come first where it has one, and are often wrong
        assert all(f["draft_n_accepted"] == f["draft_n"] for f in four), [
            (f["draft_n"], f["draft_n_accepted"]) for f in four
        ]
    assert all(0 <= f["draft_n_accepted"] <= f["draft_n"] for f in four)
    assert all(p.get("draft_n", 0) == 0 for p in plain)


def test_penalties_logprobs_and_seeded_sampling_are_unchanged_by_drafts(tiny: Path) -> None:
    prompt = repetitive(80, 7)
    kinds = [
        greedy(repeat_penalty=1.3, repeat_last_n=16, presence_penalty=0.5),
        greedy(logprobs=2),
        SampleParams(num_predict=40, temperature=0.9, top_k=20, seed=42, repeat_penalty=1.0, draft_p_min=0.0),
    ]
    for p in kinds:
        plain = run(tiny, [(prompt, p)])[0]
        spec = run(tiny, [(prompt, SampleParams(**{**p.__dict__, "draft_ngram": 2}))], draft_path=str(tiny))[0]
        assert spec["text"] == plain["text"], p
        assert spec["draft_n"] > 0


def test_logprobs_with_drafts_are_each_tokens_own(tiny: Path) -> None:
    prompt = repetitive(64, 3)
    r, chan, _ = start(tiny, num_ctx=1024, num_parallel=2)
    try:
        r.engine.submit(1, prompt, greedy(logprobs=1))
        wait_done(chan, [1])
        plain = [m["logprobs"] for m in chan.msgs if m.get("id") == 1 and m.get("logprobs")]
    finally:
        r.close()
    r, chan, _ = start(tiny, num_ctx=1024, num_parallel=2, draft_path=str(tiny))
    r.engine.spec_cost = Always()
    try:
        r.engine.submit(1, prompt, greedy(logprobs=1))
        wait_done(chan, [1])
        spec = [m["logprobs"] for m in chan.msgs if m.get("id") == 1 and m.get("logprobs")]
    finally:
        r.close()
    assert [e["token"] for e in spec] == [e["token"] for e in plain]
    assert [e["logprob"] for e in spec] == pytest.approx([e["logprob"] for e in plain], abs=1e-3)


def test_rejected_positions_leave_the_cache_and_a_continuation_is_served_right(tiny: Path) -> None:
    """The second request continues the first one's conversation, so it reuses the slot's KV: what a rejected draft
    left there would change its answer."""
    prompt = repetitive(64, 11)
    outs = {}
    for label, kw, spec in (("plain", {}, {}), ("spec", {"draft_ngram": 1}, {"spec": True})):
        r, chan, _ = start(tiny, num_ctx=1024, num_parallel=1)
        r.engine.spec_cost = Always()
        try:
            r.engine.submit(1, prompt, greedy(**kw))
            first = wait_done(chan, [1])[1]
            follow = list(first["context"]) + prompt_of(5, 99)
            r.engine.submit(2, follow, greedy(**kw))
            second = wait_done(chan, [2])[2]
            slot = r.engine.slots[0]
            outs[label] = (text_of(chan, 1), text_of(chan, 2), second["prompt_cached"])
            if spec:
                # the slot holds exactly what was evaluated: the prompt and the answer but its last token
                assert slot.tokens == list(second["context"])[:-1]
                assert first["draft_n"] > first["draft_n_accepted"]  # some drafts were rejected
        finally:
            r.close()
    assert outs["spec"] == outs["plain"]
    assert outs["spec"][2] >= len(prompt)


def test_stop_strings_and_token_limits_end_where_they_would(tiny: Path) -> None:
    prompt = repetitive(64, 5)
    plain = run(tiny, [(prompt, greedy(num_predict=30))])[0]
    stop = plain["text"][10:13]
    expected = run(tiny, [(prompt, greedy(num_predict=30, stop=(stop,)))])[0]
    spec = run(tiny, [(prompt, greedy(num_predict=30, stop=(stop,), draft_ngram=2))], draft_path=str(tiny))[0]
    assert spec["text"] == expected["text"] and spec["done_reason"] == expected["done_reason"]
    for limit in (1, 2, 7):
        got = run(tiny, [(prompt, greedy(num_predict=limit))], draft_path=str(tiny))[0]
        assert got["eval_count"] == limit


def test_draft_max_zero_turns_speculation_off(tiny: Path) -> None:
    got = run(tiny, [(repetitive(64, 2), greedy(draft_max=0, draft_ngram=2))], draft_path=str(tiny))[0]
    assert got["draft_n"] == 0


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(tiny: Path, other_vocab: Path) -> None:
    runner = Runner(Chan())  # type: ignore[arg-type]
    _KEEP.append(runner)
    with pytest.raises(RequestError) as err:
        runner.load(LoadSpec(model_path=str(tiny), num_ctx=512, draft_path=str(other_vocab)))
    assert err.value.status == 400
    assert "vocabulary" in str(err.value) and "280 tokens" in str(err.value)
    runner.close()


class FailingDraft(Counted):
    """llama.cpp whose decodes on the draft's context fail (return 1) from the ``after``-th on."""

    def __init__(self, lc: Any, after: int) -> None:
        super().__init__(lc)
        self.draft_ctx: Any = None
        self.after = after
        self.draft_decodes = 0

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        if self.draft_ctx is not None and ctx == self.draft_ctx:
            self.draft_decodes += 1
            if self.draft_decodes >= self.after:
                return 1
        return super().llama_decode(ctx, batch)


def test_a_failing_draft_decode_costs_only_the_drafts(tiny: Path) -> None:
    prompt = repetitive(64, 9)
    plain = run(tiny, [(prompt, greedy())])[0]
    chan = Chan()
    runner = Runner(chan)  # type: ignore[arg-type]
    _KEEP.append(runner)
    failing = FailingDraft(runner.lc, after=3)
    runner.lc = failing  # type: ignore[assignment]
    try:
        runner.load(LoadSpec(model_path=str(tiny), num_ctx=1024, num_parallel=2, draft_path=str(tiny)))
        failing.draft_ctx = runner.draft_context.ctx
        runner.engine.spec_cost = Always()
        runner.engine.submit(1, prompt, greedy())
        done = wait_done(chan, [1])[1]
        assert done["type"] == "done"
        assert text_of(chan, 1) == plain["text"]
        assert failing.draft_decodes >= 3
    finally:
        runner.close()


# -- SmolLM2: a real model, a real chat, a JSON grammar --------------------------------------------------------------
@needs_smol
def test_smollm2_greedy_chat_json_and_stops_are_the_same_with_a_draft_and_lookup() -> None:
    assert SMOL is not None
    r, chan, _ = start(SMOL, num_ctx=2048, num_parallel=4)
    try:
        chat = (
            "<|im_start|>user\nRepeat this sentence three times: the quick brown fox jumps over the lazy dog."
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        ask_json = '<|im_start|>user\nGive a JSON object with keys "name" and "age".<|im_end|>\n<|im_start|>assistant\n'
        prompts = [r.tokenize(chat, False), r.tokenize(ask_json, False)]
    finally:
        r.close()
    jobs = [
        (prompts[0], greedy(num_predict=64)),
        (prompts[1], greedy(num_predict=48, grammar=JSON_GBNF)),
        (prompts[0], greedy(num_predict=64, stop=("lazy dog.",))),
        (prompts[0], greedy(num_predict=64, repeat_penalty=1.1)),
    ]
    plain = run(SMOL, jobs, num_ctx=2048)
    with_spec = [(p, SampleParams(**{**sp.__dict__, "draft_ngram": 3})) for p, sp in jobs]
    spec = run(SMOL, with_spec, num_ctx=2048, draft_path=str(SMOL))
    assert [s["text"] for s in spec] == [p["text"] for p in plain]
    json.loads(spec[1]["text"])  # the grammar held through the drafts
    assert sum(s["draft_n_accepted"] for s in spec) > 0


class Frozen(CostModel):
    """A cost model measured once (a one-token step 8 ms, each extra token 3 ms, a draft round as dear as a step)
    that the engine's own timings, noisy on a busy machine, do not move."""

    def __init__(self) -> None:
        super().__init__(0.3)
        for n, ms in [(1, 8.0), (4, 17.0), (8, 29.0)] * 4:
            super().observe_step(n, ms / 1000)
        super().observe_draft(1, 0.008)

    def observe_step(self, n_tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, rounds: int, seconds: float) -> None:
        pass


def test_a_draft_model_as_slow_as_the_target_stops_drafting(tiny: Path) -> None:
    """The model as its own draft: every draft is kept, yet each drafted token costs a step of the draft, so the
    cost model has it draft only once (its probe), not at every step."""
    r, chan, _ = start(tiny, num_ctx=1024, num_parallel=1, draft_path=str(tiny))
    r.engine.spec_cost = Frozen()
    try:
        r.engine.submit(1, repetitive(64, 4), greedy(num_predict=200))
        done = wait_done(chan, [1])[1]
        assert done["eval_count"] == 200
        assert done["draft_n"] == done["draft_n_accepted"] == 2, done
    finally:
        r.close()
