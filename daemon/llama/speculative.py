"""Drafting for speculative decoding (issue 28): the tokens a sequence probably says next, for the target model to
verify in the engine's next step (``engine.py``).

Two sources, as llama-server has them:

- :class:`NgramIndex`, prompt lookup: the last ``n`` tokens of a sequence's history (prompt and answer so far) are
  looked up where they occurred before, and what followed them there is the draft. Free to make; it pays where an
  answer copies its prompt (edits, code, answers quoting a document).
- :class:`DraftModel`, a small model with the target's vocabulary, loaded in the same runner: it keeps a KV stream
  per slot, catches up with what the slot's sequence holds (only the tokens it lacks), then drafts greedily, one
  ``llama_decode`` per drafted position for every drafting sequence together, stopping a sequence's draft at a
  token it gives less than ``draft_p_min`` probability.

Verification and acceptance are the engine's: the target samples every drafted position itself and keeps the
drafted tokens while they agree, so the output is what decoding without a draft gives. Nothing here imports
llama_cpp: the runner hands over the module and the pointers, and all of it runs on the engine's thread.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# What a sequence's drafts are believed to be worth before any was verified: a drafted token is accepted with
# this probability (as if 3 of 4 had been), and the belief follows what the target accepts, recent drafts weighing
# most (ACCEPT_DECAY per verified draft)
ACCEPT_PRIOR = (3.0, 4.0)
ACCEPT_DECAY = 0.9
# A sequence whose drafts are not worth their cost now drafts again, with the draft length the cost model gives
# for a perfect acceptance, every this many steps: its acceptance may have changed (an answer that starts copying
# its prompt)
EXPLORE_EVERY = 16


@dataclass
class Acceptance:
    """The probability that the target keeps a drafted token (given it kept the ones before), from verified drafts:
    a draft of ``k`` of which the first ``m`` were kept is ``m`` successes and, when ``m < k``, one failure."""

    kept: float = ACCEPT_PRIOR[0]
    tried: float = ACCEPT_PRIOR[1]

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def update(self, drafted: int, accepted: int) -> None:
        self.kept = self.kept * ACCEPT_DECAY + accepted
        self.tried = self.tried * ACCEPT_DECAY + accepted + (1 if accepted < drafted else 0)


@dataclass
class SpecState:
    """One sequence's speculation: its settings, what its drafts' acceptance has been (per source), and its
    counts."""

    draft_max: int
    draft_min: int
    p_min: float
    ngram: int  # prompt lookup's n-gram length (0: off)
    use_model: bool  # the runner has a draft model and the request did not turn drafting off
    drafted: int = 0  # llama-server's draft_n
    accepted: int = 0  # llama-server's draft_n_accepted
    index: NgramIndex | None = None
    pending: list[int] = field(default_factory=list)  # this step's draft, being verified
    from_model: bool = False  # ``pending`` came from the draft model (else from prompt lookup)
    lookup: Acceptance = field(default_factory=Acceptance)
    model: Acceptance = field(default_factory=Acceptance)
    idle_steps: int = 0  # steps since it last drafted
    probed: bool = False  # the draft model has drafted for it once (whatever the cost model says)

    def __post_init__(self) -> None:
        if self.ngram > 0:
            self.index = NgramIndex(self.ngram)

    @property
    def active(self) -> bool:
        return self.draft_max > 0 and (self.use_model or self.ngram > 0)

    def verified(self, drafted: int, accepted: int) -> None:
        """Count a verified draft and learn from it."""
        self.drafted += drafted
        self.accepted += accepted
        (self.model if self.from_model else self.lookup).update(drafted, accepted)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step gives a sequence that verifies a draft of ``k`` (the target's own token included), each drafted
    token kept with probability ``rate`` when the ones before it were."""
    if rate >= 1.0:
        return float(k + 1)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


class CostModel:
    """What a step costs, learnt from the steps themselves: a decode of ``n`` tokens (the sequences' next tokens and
    their drafts, no prompt) takes about ``fixed + per_token * n`` seconds (a least-squares fit over recent such
    steps), and a round of the draft model ``draft_round`` seconds. Until steps of several sizes were seen,
    ``per_token`` is ``prior_ratio`` times a one-token step: on a CPU an extra token costs a good part of a step
    (SmolLM2 F16 on 2 cores: 8.8 ms for one token, 21 ms for four, 32 ms for eight), on a GPU a small part.

    ``best_k`` picks the draft length that gives a sequence the most tokens per second, counting that every other
    decoding sequence waits for the longer step too; 0 when no draft beats decoding without."""

    def __init__(self, prior_ratio: float) -> None:
        self.prior_ratio = prior_ratio
        self.decay = 0.97
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.draft_round = 0.0  # seconds per round of the draft model (0: not measured yet)

    def observe_step(self, n_tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(n_tokens), seconds
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def observe_draft(self, rounds: int, seconds: float) -> None:
        if rounds <= 0:
            return
        per = seconds / rounds
        self.draft_round = per if self.draft_round <= 0 else 0.8 * self.draft_round + 0.2 * per

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None before any step was seen."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 0.25:  # steps of different sizes: fit the line
            per = max(0.0, (self.sxy / self.w - mx * my) / var)
            return max(0.0, my - per * mx), per
        per = self.prior_ratio * my / max(1.0, mx)
        return max(0.0, my - per * mx), per

    def best_k(self, rate: float, k_max: int, decoding: int, model: bool) -> int:
        line = self.line()
        if line is None or k_max <= 0:
            return min(k_max, 1)  # nothing measured yet: a short draft to learn from
        if model and self.draft_round <= 0:
            return min(k_max, 2)  # the draft model not timed yet: a short draft to time it
        fixed, per = line
        draft = self.draft_round if model else 0.0
        others = max(0, decoding - 1)
        base = decoding / (fixed + per * decoding)
        best, best_rate = 0, base * 1.02  # a draft must win by a little to be worth the risk
        for k in range(1, k_max + 1):
            got = (others + expected_tokens(rate, k)) / (fixed + per * (decoding + k) + draft * k)
            if got > best_rate:
                best, best_rate = k, got
        return best


class NgramIndex:
    """Where each n-gram of a history last ended, grown as the history grows (a dict update per new token, not a
    search of the whole history per step). ``draft`` proposes what followed the history's last n-gram the last time
    it occurred before."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> the position just after its latest occurrence
        self.indexed = 0  # history positions up to which grams ending there are indexed
        self.length = 0  # the history's length when last seen (a shorter one, after a context shift: start over)

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        n, size = self.n, len(history)
        if size < self.length:
            self.after.clear()
            self.indexed = 0
        self.length = size
        if k <= 0 or size <= n:
            return []
        # grams ending before the last position: the last gram itself is the key looked up, not a match of itself
        after = self.after
        for end in range(max(self.indexed, n), size):
            after[tuple(history[end - n : end])] = end
        self.indexed = max(self.indexed, size)
        at = after.get(tuple(history[size - n :]))
        if at is None or at >= size:
            return []
        return [t for t in history[at : at + k] if t >= 0]  # never an image's key


class DraftModel:
    """A draft model's context beside the target's: a KV stream per slot (the same sequence ids as the target's
    slots) and the tokens each holds."""

    def __init__(self, lc: Any, ctx: Any, vocab: Any, *, n_parallel: int, n_batch: int) -> None:
        self.lc, self.ctx, self.vocab = lc, ctx, vocab
        self.mem = lc.llama_get_memory(ctx)
        self.n_vocab = int(lc.llama_vocab_n_tokens(vocab))
        self.n_batch = n_batch
        self.tokens: list[list[int]] = [[] for _ in range(n_parallel)]
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.before_decode: Callable[[], None] | None = None  # a test's fault injection (runner.py)
        # the last ``draft``'s drafting rounds (one token per stream) and their seconds, its catch-up left out
        self.rounds = 0
        self.round_seconds = 0.0

    def close(self) -> None:
        if self.batch is not None:
            self.lc.llama_batch_free(self.batch)
            self.batch = None

    def forget(self, seq_id: int) -> None:
        """The slot's stream is no longer trusted (its sequence failed): start it over next time."""
        self.lc.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        self.tokens[seq_id] = []

    def draft(self, jobs: list[tuple[int, list[int], int, float]]) -> dict[int, list[int]]:
        """Drafts for ``(seq_id, history, k, p_min)`` jobs: up to ``k`` tokens that follow ``history`` (the
        sequence's tokens, its sampled next token last; no image keys), greedily, each with at least ``p_min``
        probability under the draft model. Every stream first drops what it holds beyond its common prefix with
        the history and evaluates the rest (the first step of a sequence, a rejected draft's tail)."""
        from daemon.llama.engine import common_prefix  # engine.py imports this module

        lc = self.lc
        out: dict[int, list[int]] = {sid: [] for sid, _, _, _ in jobs}
        feeds: list[tuple[int, list[int]]] = []  # what each stream still has to evaluate; its last gives logits
        for sid, history, _, _ in jobs:
            held = self.tokens[sid]
            keep = common_prefix(held, history)
            keep = min(keep, len(history) - 1)  # the last token is always evaluated: its logits draft the first
            if keep < len(held):
                lc.llama_memory_seq_rm(self.mem, sid, keep, -1)
                del held[keep:]
            feeds.append((sid, history[keep:]))
        params = {sid: (k, p_min) for sid, _, k, p_min in jobs}
        self.rounds, self.round_seconds = 0, 0.0
        while feeds:
            drafting = all(len(feed) == 1 for _, feed in feeds)
            started = time.perf_counter()
            rows, feeds = self._decode(feeds)
            if drafting:
                self.rounds += 1
                self.round_seconds += time.perf_counter() - started
            if not rows:
                continue
            logits = self._logits(len(rows))
            nxt: list[tuple[int, list[int]]] = []
            for i, sid in enumerate(rows):
                row = logits[i]
                tok = int(np.argmax(row))
                k, p_min = params[sid]
                if p_min > 0.0:
                    top = float(row[tok])
                    p = 1.0 / float(np.exp(row.astype(np.float64) - top).sum())
                    if p < p_min:
                        continue
                drafted = out[sid]
                drafted.append(tok)
                if len(drafted) < k:
                    nxt.append((sid, [tok]))
            feeds = nxt
        return out

    def _decode(self, feeds: list[tuple[int, list[int]]]) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """One ``llama_decode`` over as much of the feeds as fits the batch: the streams whose feed ended in it
        (they have a logits row, in batch order), and what is left of the others."""
        lc, batch = self.lc, self.batch
        n, rows, left = 0, [], []
        for sid, feed in sorted(feeds, key=lambda f: f[0]):
            room = self.n_batch - n
            take = feed[:room]
            held = self.tokens[sid]
            for j, tok in enumerate(take):
                batch.token[n] = tok
                batch.pos[n] = len(held) + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = sid
                batch.logits[n] = False
                n += 1
            held += take
            if len(take) == len(feed) and take:
                batch.logits[n - 1] = True
                rows.append(sid)
            elif len(take) < len(feed):
                left.append((sid, feed[len(take) :]))
        if n == 0:
            return [], left
        batch.n_tokens = n
        if self.before_decode is not None:
            self.before_decode()
        rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            for sid, _ in feeds:
                self.forget(sid)
            raise RuntimeError(f"the draft model's llama_decode failed ({rc})")
        return rows, left

    def _logits(self, rows: int) -> np.ndarray:
        addr = ctypes.cast(self.lc.llama_get_logits(self.ctx), ctypes.c_void_p).value
        assert addr is not None, "llama.cpp returned no logits"
        view: Any = (ctypes.c_float * (rows * self.n_vocab)).from_address(addr)
        return np.frombuffer(view, dtype=np.float32).reshape(rows, self.n_vocab)


def vocab_mismatch(lc: Any, target: Any, draft: Any) -> str | None:
    """Why a draft model's vocabulary cannot stand for the target's (None when it can): the same type, size,
    special tokens and token texts, as llama.cpp's own check for a draft."""
    kinds = int(lc.llama_vocab_type(target)), int(lc.llama_vocab_type(draft))
    if kinds[0] != kinds[1]:
        return f"its tokenizer type ({kinds[1]}) is not the model's ({kinds[0]})"
    sizes = int(lc.llama_vocab_n_tokens(target)), int(lc.llama_vocab_n_tokens(draft))
    if sizes[0] != sizes[1]:
        return f"it has {sizes[1]} tokens, the model {sizes[0]}"
    for name in ("llama_vocab_bos", "llama_vocab_eos"):
        a, b = int(getattr(lc, name)(target)), int(getattr(lc, name)(draft))
        if a != b:
            return f"its {name.rsplit('_', 1)[1].upper()} token is {b}, the model's {a}"
    for i in range(sizes[0]):
        if lc.llama_vocab_get_text(target, i) != lc.llama_vocab_get_text(draft, i):
            return f"token {i} differs"
    return None
