"""Sampling for many sequences at once, vectorised over the logits with numpy.

The batched runner (``engine.py``) hands this module one logits row per sequence that needs a token. Rows at
temperature 0 take the argmax (all of them in one call when no row is penalised). Rows with a top_k find their
k best tokens together without a pass of argpartition over the vocabulary (``top_candidates``; with Ollama's
defaults a quarter of the time that took: ``bench/sampling.py``), then share one sort of the survivors and
row-wise softmax, top-p and min-p masks. Rows without a top_k
draw from the whole row when nothing truncates it, else look for their nucleus among their best tokens first.
Typical-p, a rare option, runs per row. Each sequence has its own random generator, so a seeded
request samples the same tokens whatever else is in the batch.

Semantics are Ollama's options (``api/types.go``), in the order of Ollama's own sampler: a request's
``logit_bias`` (OpenAI's; first, as in llama.cpp's sampler chain; -100 bans a token), repeat, presence and
frequency penalties over the last ``repeat_last_n`` tokens of the context, then top-k, temperature, softmax,
top-p, min-p, typical-p, and a draw. ``top_k`` <= 0 means the whole vocabulary. Mirostat is not here: Ollama
dropped it, and the API checks and drops its options (``modelfile.params.DEPRECATED_OPTIONS``). The defaults are
``modelfile.params.DEFAULT_OPTIONS``. Nothing here imports llama_cpp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daemon.runners.protocol import BIAS_LIMIT, SampleParams

NEG_INF = np.float32(-np.inf)


@dataclass
class SeqSampler:
    """One sequence's sampling state: its request's settings as they came over the pipe (``SampleParams``, read
    once, never copied field by field: issue 26, duplicate D11), the penalty window they resolve to, its random
    generator, its logit bias as arrays, and the two facts the step's fast path asks of every row."""

    params: SampleParams
    repeat_last_n: int  # the penalty window (``params.repeat_last_n``, with -1 resolved to the context length)
    rng: np.random.Generator
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (token ids, values): ``bias_arrays``
    penalised: bool = field(init=False)  # repeat, presence or frequency penalties apply
    greedy: bool = field(init=False)  # temperature 0: the argmax

    def __post_init__(self) -> None:
        p = self.params
        self.penalised = self.repeat_last_n > 0 and (
            p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        )
        self.greedy = p.temperature <= 0.0

    @classmethod
    def of(cls, params: SampleParams, num_ctx: int, bias: tuple[np.ndarray, np.ndarray] | None = None) -> SeqSampler:
        """The sampler for a request's settings in a context of ``num_ctx`` tokens per sequence; ``bias``: its
        logit_bias as ``bias_arrays`` gives it."""
        last_n = params.repeat_last_n
        return cls(
            params,
            repeat_last_n=num_ctx if last_n < 0 else last_n,
            rng=np.random.default_rng(params.seed if params.seed >= 0 else None),
            bias=bias,
        )


def bias_arrays(pairs: Sequence[Sequence[Any]], n_vocab: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ids, values)`` to add to a logits row, from checked pairs; a bias of -100 becomes -inf (a ban, whatever
    the logit). ValueError for an id outside the vocabulary; None when there is nothing to add."""
    if not pairs:
        return None
    ids = np.array([int(p[0]) for p in pairs], dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= n_vocab)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is out of range: this model's vocabulary has ids 0 to {n_vocab - 1}")
    values = np.array([float(p[1]) for p in pairs], dtype=np.float32)
    values[values <= -BIAS_LIMIT] = NEG_INF
    ids, first = np.unique(ids, return_index=True)  # sorted and unique (np.add on repeated ids adds once)
    return ids, values[first]


def apply_bias(row: np.ndarray, bias: tuple[np.ndarray, np.ndarray]) -> None:
    """Add a sequence's logit_bias to its row, in place (before penalties, as llama.cpp's sampler chain)."""
    ids, values = bias
    row[ids] += values


def apply_penalties(row: np.ndarray, window: Sequence[int], s: SeqSampler) -> None:
    """llama.cpp's penalties, in place: a repeated token's logit is divided by ``repeat_penalty`` when
    positive and multiplied when negative, then lowered by ``count * frequency + presence``."""
    if not window:
        return
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    ids, counts = ids[(ids >= 0) & (ids < row.shape[0])], counts[(ids >= 0) & (ids < row.shape[0])]
    values = row[ids]
    p = s.params
    if p.repeat_penalty != 1.0:
        values = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
    values = values - counts * p.frequency_penalty - (counts > 0) * p.presence_penalty
    row[ids] = values.astype(row.dtype, copy=False)


def _softmax_rows(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    total = e.sum(axis=1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def sample_rows(logits: np.ndarray, samplers: Sequence[SeqSampler], windows: Sequence[Sequence[int]]) -> list[int]:
    """One token per row of ``logits`` (shape ``(rows, vocab)``, modified in place)."""
    n_rows, vocab = logits.shape
    if all(s.greedy and not s.penalised and s.bias is None for s in samplers):  # common at temp 0: one argmax
        return list(np.argmax(logits, axis=1).tolist())
    out = [0] * n_rows
    for i, s in enumerate(samplers):  # per row, only for the rows that have a logit_bias or penalties
        if s.bias is not None:
            apply_bias(logits[i], s.bias)
        if s.penalised:
            apply_penalties(logits[i], windows[i][-s.repeat_last_n :], s)
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy:
        for i, tok in zip(greedy, np.argmax(logits[greedy], axis=1).tolist(), strict=True):
            out[i] = int(tok)
    rest = [i for i, s in enumerate(samplers) if not s.greedy]
    if rest:
        for i, tok in zip(rest, _sample_truncated(_rows(logits, rest), [samplers[i] for i in rest]), strict=True):
            out[i] = tok
    return out


OPEN_CANDIDATES = 256  # without top_k, the tokens a nucleus (top_p / min_p) is first looked for among


def top_candidates(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` largest logits (ids, values), sorted by value descending then id ascending. Exact, without
    a pass of ``argpartition`` over the whole vocabulary (16 ms for 32 rows of 128k): the vocabulary is split into
    groups (token ids g, g + n, g + 2n, ...: one vectorised max over the row gives every group's maximum), and the
    ``k`` largest values all lie in the ``k`` groups with the largest maxima (a value outside them would have ``k``
    group maxima, at distinct places, at least as large). Only those groups, and the few ids past the last whole
    group, are searched."""
    n_rows, vocab = logits.shape
    k = max(1, min(k, vocab))
    size = max(8, min(64, vocab // (4 * k)))  # tokens per group
    n_groups = vocab // size
    if k >= vocab or n_groups <= 2 * k:
        ids = (
            np.argpartition(logits, vocab - k, axis=1)[:, vocab - k :]
            if k < vocab
            else np.broadcast_to(np.arange(vocab), (n_rows, vocab))
        )
    else:
        maxima = logits[:, : n_groups * size].reshape(n_rows, size, n_groups).max(axis=1)
        groups = np.argpartition(maxima, n_groups - k, axis=1)[:, n_groups - k :]
        cand = (groups[:, :, None] + np.arange(0, size * n_groups, n_groups)).reshape(n_rows, k * size)
        if n_groups * size < vocab:  # the last ids, fewer than a group, are always candidates
            tail = np.arange(n_groups * size, vocab)
            cand = np.concatenate([cand, np.broadcast_to(tail, (n_rows, tail.size))], axis=1)
        values = np.take_along_axis(logits, cand, axis=1)
        n_cand = cand.shape[1]
        ids = np.take_along_axis(cand, np.argpartition(values, n_cand - k, axis=1)[:, n_cand - k :], axis=1)
    values = np.take_along_axis(logits, ids, axis=1)
    order = np.lexsort((ids, -values), axis=1)
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)


def _rows(logits: np.ndarray, which: list[int]) -> np.ndarray:
    """``logits[which]`` without copying the whole array when ``which`` is every row (the usual batch)."""
    return logits if len(which) == logits.shape[0] else logits[which]


def _sample_truncated(logits: np.ndarray, samplers: Sequence[SeqSampler]) -> list[int]:
    """top-k, temperature, softmax, top-p, min-p, typical-p and a draw, for rows that are not greedy. Rows with a
    top_k look only at their k best tokens (found together, ``top_candidates``). Rows without one draw from the
    whole vocabulary: straight from it when nothing truncates, else from the best ``OPEN_CANDIDATES`` when the
    nucleus ends among them (checked against the whole row's normaliser), else from the whole row sorted."""
    n_rows, vocab = logits.shape
    out = [0] * n_rows
    temps = np.array([s.params.temperature for s in samplers], dtype=np.float64)[:, None]
    limited = [i for i, s in enumerate(samplers) if 0 < s.params.top_k < vocab]
    untruncated: list[int] = []
    nucleus: list[int] = []
    for i, s in enumerate(samplers):
        if not 0 < s.params.top_k < vocab:
            plain = s.params.top_p >= 1.0 and s.params.min_p <= 0.0 and not 0.0 < s.params.typical_p < 1.0
            (untruncated if plain else nucleus).append(i)
    if limited:
        ks = np.array([samplers[i].params.top_k for i in limited])
        ids, values = top_candidates(_rows(logits, limited), int(ks.max()))
        values = values.astype(np.float64) / temps[limited]
        values[np.arange(values.shape[1])[None, :] >= ks[:, None]] = -np.inf  # each row's own k
        for i, tok in zip(limited, _draw(ids, values, [samplers[i] for i in limited], None), strict=True):
            out[i] = tok
    for i in untruncated:  # the whole distribution: no order needed, one cumulative sum
        x = logits[i].astype(np.float64) / temps[i]
        c = np.cumsum(np.exp(x - np.max(x)))
        out[i] = int(min(np.searchsorted(c, samplers[i].rng.random() * c[-1], side="right"), vocab - 1))
    if nucleus:
        rows = logits[nucleus].astype(np.float64) / temps[nucleus]
        peak = rows.max(axis=1, keepdims=True)
        log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))  # the whole row's normaliser
        ids, values = top_candidates(rows, OPEN_CANDIDATES)
        chosen = _draw(ids, values, [samplers[i] for i in nucleus], log_z)
        for r, (i, tok) in enumerate(zip(nucleus, chosen, strict=True)):
            more = OPEN_CANDIDATES
            while tok is None:  # the nucleus reaches past the candidates: 16 times more, up to the whole row
                more = min(vocab, more * 16)
                more_ids, more_values = top_candidates(rows[r : r + 1], more)
                # the whole row is its own normaliser: nothing lies past it
                tok = _draw(more_ids, more_values, [samplers[i]], None if more >= vocab else log_z[r : r + 1])[0]
            out[i] = int(tok)
    return out


def _draw(
    ids: np.ndarray,
    values: np.ndarray,
    samplers: Sequence[SeqSampler],
    log_z: np.ndarray | None,
) -> list[Any]:
    """One token per row from candidates sorted best first, their values already divided by the temperature:
    softmax over the candidates, or, given ``log_z``, against the whole row's normaliser (the candidates are then
    the row's best tokens, not all of them), top-p, min-p, typical-p. With ``log_z``, a row whose cut does not
    fall inside its candidates gets None."""
    probs = _softmax_rows(values) if log_z is None else np.exp(values - log_z[:, None])
    top_p = np.array([s.params.top_p for s in samplers], dtype=np.float64)
    cum = np.cumsum(probs, axis=1)
    keep = (cum - probs) < np.where(top_p >= 1.0, np.inf, top_p)[:, None]  # the first token is always kept
    min_p = np.array([s.params.min_p for s in samplers], dtype=np.float64)
    keep &= probs >= (min_p[:, None] * probs[:, :1])
    keep[:, 0] = True
    # with log_z, the cut is inside the candidates when their last one is cut (every later token is smaller)
    complete = np.ones(len(samplers), dtype=bool) if log_z is None else ~keep[:, -1]
    probs = np.where(keep, probs, 0.0)
    for r, s in enumerate(samplers):
        if complete[r] and 0.0 < s.params.typical_p < 1.0:
            probs[r] = _typical(probs[r], s.params.typical_p)
    totals = probs.sum(axis=1)
    draws = np.array([s.rng.random() for s in samplers]) * totals
    chosen = (np.cumsum(probs, axis=1) > draws[:, None]).argmax(axis=1)
    return [int(ids[r, c]) if complete[r] else None for r, c in enumerate(chosen.tolist())]


def _typical(p: np.ndarray, typical_p: float) -> np.ndarray:
    """Locally typical sampling over an already-normalised, sorted row: keep the tokens whose surprise is
    closest to the entropy until their mass reaches ``typical_p``."""
    total = p.sum()
    if total <= 0:
        return p
    q = p / total
    nz = q > 0
    logq = np.where(nz, np.log(np.where(nz, q, 1.0)), 0.0)
    entropy = -(q * logq).sum()
    shifted = np.where(nz, np.abs(-logq - entropy), np.inf)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(q[order])
    cut = int(np.searchsorted(cum, typical_p) + 1)
    mask = np.zeros_like(q, dtype=bool)
    mask[order[: max(cut, 1)]] = True
    return np.where(mask, p, 0.0)


def logprobs(row: np.ndarray, token: int, top: int) -> dict[str, Any]:
    """The chosen token's log-probability under the model (raw logits) and the ``top`` most likely
    alternatives, as ``{"token": id, "logprob": x, "top": [[id, logprob], ...]}``."""
    x = row.astype(np.float64)
    m = float(np.max(x))
    lse = m + math.log(float(np.exp(x - m).sum()))
    out: dict[str, Any] = {"token": int(token), "logprob": float(x[token] - lse), "top": []}
    if top > 0:
        k = min(top, x.shape[0])
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        out["top"] = [[int(i), float(x[i] - lse)] for i in idx]
    return out
