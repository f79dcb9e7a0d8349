"""The vectorised sampler: Ollama's option semantics, row by row, whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.llama.sampling import SeqSampler, apply_penalties, logprobs, sample_rows
from daemon.runners.protocol import SampleParams


def sampler(num_ctx: int = 512, **options: float) -> SeqSampler:
    """A sequence's sampler for these options (``SampleParams`` field names), as the engine builds it."""
    return SeqSampler.of(SampleParams(**options), num_ctx)  # type: ignore[arg-type]


def rows(n: int, vocab: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, vocab)).astype(np.float32) * 3


def test_greedy_is_argmax() -> None:
    x = rows(3)
    out = sample_rows(x.copy(), [sampler(temperature=0, repeat_penalty=1.0)] * 3, [[], [], []])
    assert out == np.argmax(x, axis=1).tolist()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    x = rows(4, seed=3)
    params = {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 7, "repeat_penalty": 1.0}
    alone = [sample_rows(x[2:3].copy(), [sampler(**params)], [[]])[0] for _ in range(3)]
    others = [sampler(temperature=t, seed=i) for i, t in enumerate((0.0, 1.5, 0.5))]
    mixed = []
    for _ in range(3):
        batch = [others[0], others[1], sampler(**params), others[2]]
        mixed.append(sample_rows(x.copy(), batch, [[]] * 4)[2])
    assert alone == mixed


def test_top_k_one_is_greedy_and_top_k_bounds_the_choice() -> None:
    x = rows(1, seed=5)
    assert sample_rows(x.copy(), [sampler(temperature=5.0, top_k=1, repeat_penalty=1.0)], [[]]) == [
        int(np.argmax(x[0]))
    ]
    top5 = set(np.argsort(-x[0])[:5].tolist())
    s = sampler(temperature=3.0, top_k=5, top_p=1.0, repeat_penalty=1.0, seed=1)
    assert all(sample_rows(x.copy(), [s], [[]])[0] in top5 for _ in range(200))


def test_top_p_and_min_p_cut_the_tail() -> None:
    x = np.full((1, 10), -10.0, dtype=np.float32)
    x[0, 3], x[0, 7] = 5.0, 4.0  # two likely tokens, the rest negligible
    s = sampler(temperature=1.0, top_k=0, top_p=0.5, repeat_penalty=1.0, seed=0)
    assert {sample_rows(x.copy(), [s], [[]])[0] for _ in range(100)} == {3}
    m = sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, repeat_penalty=1.0, seed=0)
    assert {sample_rows(x.copy(), [m], [[]])[0] for _ in range(300)} == {3, 7}


def test_penalties_follow_llama_cpp() -> None:
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    apply_penalties(row, [0, 1, 0], sampler(repeat_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5))
    assert row.tolist() == pytest.approx([2.0 / 2 - 0.2 - 0.5, -2.0 * 2 - 0.1 - 0.5, 1.0, 0.5])
    x = np.zeros((1, 4), dtype=np.float32)
    x[0, 0] = 1.0
    x[0, 1] = 0.9
    s = sampler(temperature=0, repeat_penalty=1.5, repeat_last_n=64)
    assert sample_rows(x, [s], [[0, 0]]) == [1]  # the repeated token loses its lead


def test_typical_samples_valid_tokens() -> None:
    x = rows(2, seed=9)
    t = sampler(temperature=1.0, typical_p=0.5, repeat_penalty=1.0, seed=3)
    assert 0 <= sample_rows(x[1:].copy(), [t], [[]])[0] < 1000


def test_logprobs() -> None:
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float64)).astype(np.float32)
    lp = logprobs(row, 1, 2)
    assert lp["logprob"] == pytest.approx(np.log(0.25), abs=1e-5)
    assert [t for t, _ in lp["top"]] == [0, 1]


def reference_distribution(row: np.ndarray, s: SeqSampler) -> dict[int, float]:
    """Ollama's truncation done the slow, obvious way: sort the whole row, top-k, temperature, softmax over what
    top-k kept, top-p, min-p; the probabilities of the tokens left, renormalised."""
    order = np.argsort(-row, kind="stable")
    p = s.params
    k = p.top_k if 0 < p.top_k < row.shape[0] else row.shape[0]
    kept = order[:k]
    x = row[kept].astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    cum = np.cumsum(probs)
    keep = ((cum - probs) < (p.top_p if p.top_p < 1.0 else np.inf)) & (probs >= p.min_p * probs[0])
    keep[0] = True
    q = np.where(keep, probs, 0.0)
    return {int(t): float(v / q.sum()) for t, v in zip(kept, q, strict=True) if v > 0}


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 40, "top_p": 0.9},
        {"top_k": 0, "top_p": 0.9},  # no top-k: the nucleus is looked for among the best 256 first
        {"top_k": 0, "top_p": 0.999, "temperature": 3.0},  # a nucleus of thousands of tokens: the wider searches
        {"top_k": 0, "top_p": 1.0, "min_p": 0.05},
        {"top_k": 0, "top_p": 1.0},  # nothing truncates: drawn from the whole row without sorting
        {"top_k": 5000, "top_p": 1.0, "temperature": 2.0},
    ],
)
def test_sampled_frequencies_match_the_exact_distribution(params: dict[str, float]) -> None:
    vocab = 6000
    x = rows(1, vocab=vocab, seed=11)
    s = sampler(**{"repeat_penalty": 1.0, "seed": 5, **params})
    ref = reference_distribution(x[0], s)
    draws = 4000
    counts: dict[int, int] = {}
    for _ in range(draws):
        tok = sample_rows(x.copy(), [s], [[]])[0]
        counts[tok] = counts.get(tok, 0) + 1
    assert set(counts) <= set(ref)  # never a token the truncation removed
    # total variation distance between the empirical and the exact distribution, over 10 buckets of tokens of
    # about equal mass when the tokens are too many for 4,000 draws to show each one's share
    ranked = sorted(ref, key=lambda t: -ref[t])
    mass_before = np.cumsum([0.0] + [ref[t] for t in ranked[:-1]])
    bucket = (
        {t: min(9, int(10 * m)) for t, m in zip(ranked, mass_before, strict=True)}
        if len(ref) > 50
        else {t: t for t in ref}
    )
    want: dict[int, float] = {}
    got: dict[int, float] = {}
    for t, p in ref.items():
        want[bucket[t]] = want.get(bucket[t], 0.0) + p
        got[bucket[t]] = got.get(bucket[t], 0.0) + counts.get(t, 0) / draws
    tv = 0.5 * sum(abs(got[b] - want[b]) for b in want)
    assert tv < 0.05, (len(ref), tv)


def test_top_candidates_are_the_exact_top_k() -> None:
    from daemon.llama.sampling import top_candidates

    rng = np.random.default_rng(2)
    for trial in range(200):
        n, vocab, k = int(rng.integers(1, 5)), int(rng.integers(20, 9000)), int(rng.integers(1, 400))
        x = rng.standard_normal((n, vocab)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x * 2) / 2  # many equal values
        ids, values = top_candidates(x, k)
        kk = min(k, vocab)
        for r in range(n):
            assert values[r].tolist() == sorted(x[r].tolist(), reverse=True)[:kk]
            assert x[r][ids[r]].tolist() == values[r].tolist() and len(set(ids[r].tolist())) == kk
            ties = values[r][:-1] == values[r][1:]
            assert (ids[r][:-1][ties] < ids[r][1:][ties]).all()  # equal values in id order


# -- logit_bias ---------------------------------------------------------------------------------------------------
def biased(pairs: dict[int, float], vocab: int = 1000, **kw: float) -> SeqSampler:
    """A sampler with a logit_bias, parsed on the daemon's side and turned into arrays by the runner."""
    from daemon.llama.sampling import bias_arrays
    from daemon.runners.base import parse_logit_bias

    bias = bias_arrays(parse_logit_bias({str(k): v for k, v in pairs.items()}), vocab)
    return SeqSampler.of(SampleParams(**{"repeat_penalty": 1.0, **kw}), 512, bias)  # type: ignore[arg-type]


def test_logit_bias_bans_and_forces_including_greedy() -> None:
    x = rows(3, seed=21)
    best = np.argmax(x, axis=1).tolist()
    plain = sampler(temperature=0, repeat_penalty=1.0)
    ban = biased({best[1]: -100}, temperature=0)
    force = biased({7: 100}, temperature=0)
    # a biased row and two plain ones in the same batch: each row gets only its own bias
    out = sample_rows(x.copy(), [force, ban, plain], [[], [], []])
    second = int(np.argsort(-x[1])[1])
    assert out == [7, second, best[2]]
    # a ban holds whatever the logit and at any temperature; a force at any temperature too
    y = x.copy()
    y[0, 5] = 1e6
    for temp in (0.0, 0.7, 2.0):
        for top_k in (40, 0):
            s = biased({5: -100}, temperature=temp, top_k=top_k, top_p=1.0, seed=1)
            f = biased({11: 100}, temperature=temp, top_k=top_k, top_p=0.9, seed=1)
            assert all(sample_rows(y[:1].copy(), [s], [[]])[0] != 5 for _ in range(30))
            assert all(sample_rows(x[:1].copy(), [f], [[]])[0] == 11 for _ in range(30))


def test_logit_bias_is_added_before_penalties_and_shifts_the_distribution() -> None:
    row = np.array([[1.0, 0.0, 0.5, -1.0]], dtype=np.float32)
    s = biased({1: 2.0, 3: -100.0}, vocab=4, temperature=0)
    assert sample_rows(row.copy(), [s], [[]]) == [1]  # 0 + 2 beats 1
    s = biased({1: 2.0, 3: -100.0}, vocab=4, temperature=0, repeat_penalty=2.0, repeat_last_n=64)
    assert sample_rows(row.copy(), [s], [[1]]) == [0]  # (0 + 2) / 2 = 1, and 1 wins the tie by id
    # at temperature 1 the bias moves probability as exp(bias): a +ln(3) bias on one of two equal tokens gives 3:1
    two = np.zeros((1, 2), dtype=np.float32)
    t = biased({0: float(np.log(3.0))}, vocab=2, temperature=1.0, top_k=0, top_p=1.0, seed=4)
    share = np.mean([sample_rows(two.copy(), [t], [[]])[0] == 0 for _ in range(4000)])
    assert share == pytest.approx(0.75, abs=0.03)


def test_logit_bias_leaves_unbiased_rows_on_the_vectorised_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon.llama import sampling

    calls: list[int] = []
    real = sampling.apply_bias
    monkeypatch.setattr(sampling, "apply_bias", lambda row, bias: (calls.append(1), real(row, bias)))
    x = rows(4, seed=2)
    greedy = [sampler(temperature=0, repeat_penalty=1.0) for _ in range(4)]
    assert sample_rows(x.copy(), greedy, [[]] * 4) == np.argmax(x, axis=1).tolist() and not calls
    assert (
        sample_rows(x.copy(), [*greedy[:3], biased({0: 1.0}, temperature=0)], [[]] * 4)[:3]
        == np.argmax(x[:3], axis=1).tolist()
    )
    assert calls == [1]  # only the biased row


@pytest.mark.parametrize(
    "value, words",
    [
        ({"abc": 1}, "token ids"),
        ({"1.5": 1}, "token ids"),
        ({"-3": 1}, "negative"),
        ({"3": 1000}, "between -100"),
        ({"3": float("nan")}, "number"),
        ({"3": "high"}, "number"),
        ({"3": True}, "number"),
        ("1:5", "object"),
        ([[1]], "pairs"),
        ({str(i): 1 for i in range(1025)}, "at most 1024"),
    ],
)
def test_parse_logit_bias_refuses(value: object, words: str) -> None:
    from daemon.runners.base import parse_logit_bias

    with pytest.raises(ValueError, match=words):
        parse_logit_bias(value)


def test_parse_logit_bias_accepts_both_forms_and_checks_the_vocabulary() -> None:
    from daemon.llama.sampling import bias_arrays
    from daemon.runners.base import parse_logit_bias

    assert parse_logit_bias({"9": -100, "2": 1.5, " 4": 0}) == ((2, 1.5), (4, 0.0), (9, -100.0))
    assert parse_logit_bias([[9, -100], [2, 1.5], [4, 0]]) == ((2, 1.5), (4, 0.0), (9, -100.0))
    assert parse_logit_bias(None) == () and bias_arrays((), 10) is None
    ids, values = bias_arrays([[2, 1.5], [9, -100]], 10)  # type: ignore[misc]
    assert ids.tolist() == [2, 9] and values[0] == 1.5 and values[1] == -np.inf
    with pytest.raises(ValueError, match="ids 0 to 9"):
        bias_arrays([[10, 1.0]], 10)
