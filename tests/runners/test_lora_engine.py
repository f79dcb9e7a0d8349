"""Many LoRA adapters on one loaded base (issue 29; engine._step's batches per adapter set, runner._load_adapters,
AdaptersOp): each request's sequence is computed under its own adapters, in mixed batches, exactly as a runner
loaded with that adapter alone computes it; the prefix cache never serves KV computed under one set to another;
adapters load on first use and are freed when dropped, after the sequences using them end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon.llama.runner import RequestError
from daemon.runners.protocol import AdaptersOp, AdaptersReply, GenerateRequest, SampleParams
from tests.models import write_lora_gguf, write_tiny_gguf
from tests.runners.test_shared_prompt import prompt_of, start, text_of, wait_done


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("lora") / "base.gguf", context_length=2048, never_ends=True)


@pytest.fixture(scope="module")
def loras(base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("adapters")
    return [str(write_lora_gguf(folder / f"a{i}.gguf", base, seed=i + 1)) for i in range(4)]


def greedy(n: int = 24, **kw: Any) -> SampleParams:
    return SampleParams(**{"num_predict": n, "temperature": 0, "repeat_penalty": 1.0, **kw})


def alone(base: Path, prompt: list[int], adapter: str | None, params: SampleParams) -> str:
    """What a runner loaded with this adapter (the load's own, as before issue 29) answers."""
    r, chan, _ = start(base, num_ctx=512, num_parallel=1, adapters=(adapter,) if adapter else ())
    try:
        r.engine.submit(1, prompt, params)
        wait_done(chan, [1])
        return text_of(chan, 1)
    finally:
        r.close()


def submit(r: Any, rid: int, prompt: list[int], adapters: tuple[tuple[str, float], ...], params: SampleParams) -> None:
    """As the daemon's GenerateOp does: the runner loads the adapters it lacks, then queues the sequence."""
    r.engine.call(lambda: r._load_adapters([p for p, _ in adapters]))
    r.engine.submit(rid, prompt, params, adapters=adapters)


def test_four_adapters_and_the_base_in_mixed_batches_answer_as_each_alone(base: Path, loras: list[str]) -> None:
    prompts = [prompt_of(20, seed=i) for i in range(5)]
    expected = [alone(base, prompts[0], None, greedy())] + [
        alone(base, prompts[i + 1], lora, greedy()) for i, lora in enumerate(loras)
    ]
    assert len(set(expected)) == 5  # the adapters change the answers
    r, chan, counted = start(base, num_ctx=512, num_parallel=5)
    try:
        r.engine.call(lambda: r._load_adapters(loras))
        r.engine.call(lambda: None)
        with r.engine._cv:
            r.engine.submit(1, prompts[0], greedy())
            for i, lora in enumerate(loras):
                r.engine.submit(i + 2, prompts[i + 1], greedy(), adapters=((lora, 1.0),))
        ends = wait_done(chan, [1, 2, 3, 4, 5])
        assert all(e["type"] == "done" for e in ends.values())
        assert [text_of(chan, rid) for rid in (1, 2, 3, 4, 5)] == expected
        assert list(r.engine.adapter_ptrs) == loras  # each loaded once, into the one model
    finally:
        r.close()


def test_the_prefix_cache_is_kept_per_adapter_set(base: Path, loras: list[str]) -> None:
    prompt = prompt_of(60, seed=9)  # with its answer, long enough to be worth saving (engine.SAVE_MIN_TOKENS)
    r, chan, _ = start(base, num_ctx=512, num_parallel=1, prompt_cache=32 << 20)
    try:
        submit(r, 1, prompt, ((loras[0], 1.0),), greedy())
        first = wait_done(chan, [1])[1]
        submit(r, 2, prompt, ((loras[1], 1.0),), greedy())
        other = wait_done(chan, [2])[2]
        assert other["prompt_cached"] == 0  # the slot's KV was computed under another adapter
        assert text_of(chan, 2) == alone(base, prompt, loras[1], greedy())
        submit(r, 3, prompt, ((loras[0], 1.0),), greedy())
        again = wait_done(chan, [3])[3]
        # the first adapter's sequence came back from host RAM, where it went when the slot was reused
        assert again["prompt_cached"] == len(prompt) - 1
        assert text_of(chan, 3) == text_of(chan, 1) and first["type"] == "done"
        submit(r, 4, prompt, (), greedy())
        assert wait_done(chan, [4])[4]["prompt_cached"] == 0
        assert text_of(chan, 4) == alone(base, prompt, None, greedy())
    finally:
        r.close()


def test_scales_and_several_adapters_in_one_set(base: Path, loras: list[str]) -> None:
    prompt = prompt_of(20, seed=3)
    r, chan, _ = start(base, num_ctx=512, num_parallel=4)
    try:
        sets: list[tuple[tuple[str, float], ...]] = [
            ((loras[0], 1.0),),
            ((loras[0], 0.25),),
            ((loras[0], 1.0), (loras[1], 1.0)),
            ((loras[0], 0.0),),
        ]
        for rid, key in enumerate(sets, 1):
            submit(r, rid, prompt, key, greedy())
        wait_done(chan, [1, 2, 3, 4])
        texts = [text_of(chan, rid) for rid in (1, 2, 3, 4)]
        assert len(set(texts[:3])) == 3
        assert texts[3] == alone(base, prompt, None, greedy())  # scale 0: the base's own answer
    finally:
        r.close()


def test_speculation_under_an_adapter_gives_the_adapters_answer(base: Path, loras: list[str]) -> None:
    from tests.runners.test_speculative import Always

    prompt = prompt_of(16, seed=5) * 4
    r, chan, _ = start(base, num_ctx=512, num_parallel=2)
    r.engine.spec_cost = Always()
    try:
        submit(r, 1, prompt, ((loras[2], 1.0),), greedy(draft_ngram=2, draft_p_min=0.0))
        done = wait_done(chan, [1])[1]
        assert done["draft_n"] > 0
        assert text_of(chan, 1) == alone(base, prompt, loras[2], greedy())
    finally:
        r.close()


def test_a_dropped_adapter_is_freed_once_its_sequences_end(base: Path, loras: list[str]) -> None:
    r, chan, _ = start(base, num_ctx=1024, num_parallel=2)
    try:
        long_params = greedy(n=600)
        submit(r, 1, prompt_of(20, seed=1), ((loras[0], 1.0),), long_params)
        submit(r, 2, prompt_of(20, seed=2), ((loras[1], 1.0),), greedy(n=40))
        wait_done(chan, [2])
        reply = r._adapters(AdaptersOp(7, (loras[0], loras[1])))
        # the second is free (its sequence ended); the first is still in use and waits for its sequence
        assert isinstance(reply, AdaptersReply) and reply.loaded == (loras[0],)
        with pytest.raises(Exception, match="not loaded"):  # no new request may take it meanwhile
            r.engine.submit(3, prompt_of(5), greedy(), adapters=((loras[0], 1.0),))
        done = wait_done(chan, [1])[1]
        assert done["type"] == "done" and done["eval_count"] == 600  # undisturbed
        assert r._adapters(AdaptersOp(8, ())) == AdaptersReply(8, ())
        # asked for again later: loaded again, and it answers as before
        submit(r, 4, prompt_of(20, seed=2), ((loras[1], 1.0),), greedy(n=40))
        wait_done(chan, [4])
        assert text_of(chan, 4) == text_of(chan, 2)
    finally:
        r.close()


def test_an_adapter_that_does_not_fit_the_base_is_a_400(base: Path, tmp_path: Path) -> None:
    other_base = write_tiny_gguf(tmp_path / "wide.gguf", n_embd=96, context_length=512)
    wrong_shape = str(write_lora_gguf(tmp_path / "wide-lora.gguf", other_base))
    wrong_arch = str(write_lora_gguf(tmp_path / "qwen-lora.gguf", base, architecture="qwen2"))
    r, chan, _ = start(base, num_ctx=512, num_parallel=1)
    try:
        for bad in (wrong_shape, wrong_arch):
            with pytest.raises(RequestError) as err:
                r.generate(1, GenerateRequest(prompt="a b c", params=greedy(), adapters=((bad, 1.0),)))
            assert err.value.status == 400 and "does not fit this model" in str(err.value)
        r.generate(2, GenerateRequest(prompt="a b c", params=greedy(n=4)))  # the runner goes on serving
        assert wait_done(chan, [2])[2]["type"] == "done"
    finally:
        r.close()


def test_adapter_sets_take_turns_of_several_steps_and_none_starves(base: Path, loras: list[str]) -> None:
    """A change of the context's adapter set costs llama.cpp a scheduler reserve (engine.TURN_*): a step serves one
    set, which keeps the turn for several steps; the sets are served in turn (the longest waiting first), so every
    set's streams start before any set is served twice, and each answers as it would alone."""
    prompts = [prompt_of(16, seed=40 + i) for i in range(8)]
    params = greedy(40)
    r, chan, _ = start(base, num_ctx=512, num_parallel=8)
    engine = r.engine
    switches: list[tuple[tuple[str, float], ...]] = []
    steps = [0]
    apply, decode = engine._apply_adapters, engine._decode_plan

    def counting_apply(key: tuple[tuple[str, float], ...]) -> None:
        if key != engine._applied:
            switches.append(key)
        apply(key)

    def counting_decode(plan: dict[int, list[int]], decode_only: bool) -> None:
        steps[0] += 1
        decode(plan, decode_only)

    try:
        engine.call(lambda: r._load_adapters(loras))
        engine.switch_cost = 0.01  # a switch as costly as on a GPU: turns of 90 ms (tiny steps take well under 1)
        engine._apply_adapters, engine._decode_plan = counting_apply, counting_decode
        with engine._cv:
            for i, prompt in enumerate(prompts):
                engine.submit(i + 1, prompt, params, adapters=((loras[i % 4], 1.0),))
        ends = wait_done(chan, list(range(1, 9)))
        assert all(e["type"] == "done" for e in ends.values())
        sets = [key[0][0] for key in switches if key]
        assert sorted(sets[:4]) == sorted(loras)  # each set served once before any set a second time
        assert len(switches) * 3 <= steps[0]  # several steps a turn, not a switch a step
    finally:
        engine._apply_adapters, engine._decode_plan = apply, decode
        r.close()
    for i in (0, 1):  # and the answers are those of the adapter alone
        assert text_of(chan, i + 1) == alone(base, prompts[i], loras[i], params)
