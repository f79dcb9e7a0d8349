"""The vectorised sampler: Ollama's option semantics, row by row, whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.runners.sampling import SeqSampler, apply_penalties, logprobs, sample_rows


def rows(n: int, vocab: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, vocab)).astype(np.float32) * 3


def test_greedy_is_argmax() -> None:
    x = rows(3)
    out = sample_rows(x.copy(), [SeqSampler(temperature=0, repeat_penalty=1.0)] * 3, [[], [], []])
    assert out == np.argmax(x, axis=1).tolist()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    x = rows(4, seed=3)
    params = {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 7, "repeat_penalty": 1.0}
    alone = [sample_rows(x[2:3].copy(), [SeqSampler.from_params(params, 512)], [[]])[0] for _ in range(3)]
    others = [SeqSampler.from_params({"temperature": t, "seed": i}, 512) for i, t in enumerate((0.0, 1.5, 0.5))]
    mixed = []
    for _ in range(3):
        batch = [others[0], others[1], SeqSampler.from_params(params, 512), others[2]]
        mixed.append(sample_rows(x.copy(), batch, [[]] * 4)[2])
    assert alone == mixed


def test_top_k_one_is_greedy_and_top_k_bounds_the_choice() -> None:
    x = rows(1, seed=5)
    assert sample_rows(x.copy(), [SeqSampler(temperature=5.0, top_k=1, repeat_penalty=1.0)], [[]]) == [
        int(np.argmax(x[0]))]
    top5 = set(np.argsort(-x[0])[:5].tolist())
    s = SeqSampler(temperature=3.0, top_k=5, top_p=1.0, repeat_penalty=1.0, rng=np.random.default_rng(1))
    assert all(sample_rows(x.copy(), [s], [[]])[0] in top5 for _ in range(200))


def test_top_p_and_min_p_cut_the_tail() -> None:
    x = np.full((1, 10), -10.0, dtype=np.float32)
    x[0, 3], x[0, 7] = 5.0, 4.0  # two likely tokens, the rest negligible
    s = SeqSampler(temperature=1.0, top_k=0, top_p=0.5, repeat_penalty=1.0, rng=np.random.default_rng(0))
    assert {sample_rows(x.copy(), [s], [[]])[0] for _ in range(100)} == {3}
    m = SeqSampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, repeat_penalty=1.0, rng=np.random.default_rng(0))
    assert {sample_rows(x.copy(), [m], [[]])[0] for _ in range(300)} == {3, 7}


def test_penalties_follow_llama_cpp() -> None:
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    apply_penalties(row, [0, 1, 0], SeqSampler(repeat_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5))
    assert row.tolist() == pytest.approx([2.0 / 2 - 0.2 - 0.5, -2.0 * 2 - 0.1 - 0.5, 1.0, 0.5])
    x = np.zeros((1, 4), dtype=np.float32)
    x[0, 0] = 1.0
    x[0, 1] = 0.9
    s = SeqSampler(temperature=0, repeat_penalty=1.5, repeat_last_n=64)
    assert sample_rows(x, [s], [[0, 0]]) == [1]  # the repeated token loses its lead


def test_mirostat_and_typical_sample_valid_tokens() -> None:
    x = rows(2, seed=9)
    for mode in (1, 2):
        s = SeqSampler(temperature=0.8, mirostat=mode, repeat_penalty=1.0, rng=np.random.default_rng(2))
        s.mu = 2 * s.mirostat_tau
        for _ in range(20):
            tok = sample_rows(x[:1].copy(), [s], [[]])[0]
            assert 0 <= tok < 1000
        assert s.mu != 2 * s.mirostat_tau  # it learns
    t = SeqSampler(temperature=1.0, typical_p=0.5, repeat_penalty=1.0, rng=np.random.default_rng(3))
    assert 0 <= sample_rows(x[1:].copy(), [t], [[]])[0] < 1000


def test_logprobs() -> None:
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float64)).astype(np.float32)
    lp = logprobs(row, 1, 2)
    assert lp["logprob"] == pytest.approx(np.log(0.25), abs=1e-5)
    assert [t for t, _ in lp["top"]] == [0, 1]
