"""Continuous batching inside a runner: several sequences share one llama.cpp context and one ``llama_decode``
per step.

Each of ``n_parallel`` slots is a llama.cpp sequence id with its own KV stream (so a sequence computes exactly
what it computes alone) and remembers the tokens it holds.
A new request takes the idle slot whose tokens share the longest prefix with its prompt (a prefix held by a busy
slot is copied over with ``llama_memory_seq_cp``) and evaluates only the rest. A prefix that another sequence is
evaluating right now (the choices of a request with ``n`` > 1, concurrent requests with one system prompt) is waited
for and then copied, so it is evaluated once; a sequence with the same whole prompt also takes the KV of its last
token and the logits its first token is sampled from (with its own sampler and seed), so a greedy choice is exactly
its leader's answer. Every step puts one token for each decoding sequence in the batch and fills what is left of
``n_batch`` with chunks of waiting prompts, so newcomers join at the next step while the others keep decoding;
finished or cancelled sequences leave at once. When a slot is about to be overwritten, the sequence it holds is
saved to host RAM (``llama_state_seq_*``, within ``cache_bytes``, least recently saved dropped first); a later
request whose prompt continues a saved sequence further than any slot does gets it restored instead of evaluating it
again (a conversation that lost its slot to other users comes back without re-reading its history). Sampling is
vectorised over all rows (``sampling.py``; a request's logit_bias is added to its own row only); grammars (JSON,
JSON schema) are applied per sequence with llama.cpp's grammar sampler. A sequence that fills its ``num_ctx`` shifts
its context like Ollama (keep ``num_keep``, drop half of the rest) unless ``shift`` is false.

Prompts with images (docs/vision.md) come as the media prompt's cache key: token ids for text, and negative
entries, derived from each image's hash, for its positions. So the prompt cache compares images by content and never
serves one image's KV to another; reuse is cut back to the start of an image it would end inside. Text goes through
the batched prefill as usual; each image is evaluated whole by the runner's ``eval_media`` hook (libmtmd: encode,
then decode its embeddings) between two steps, one image per step, so the other sequences keep decoding between
images. Negative entries are never sampled, detokenized or returned as context.

The engine runs on its own thread inside the runner child; ``submit``, ``cancel`` and ``call`` are thread-safe.
Every llama.cpp computation of the runner happens on that thread (``call`` runs the warm-up and the projector's
load there): ggml's CPU backend runs a graph as an OpenMP parallel region, and libgomp keeps a team of worker
threads for each thread that starts one; a second team puts more spinning threads than cores on a small machine,
libgomp then cuts its barrier spins short to sleep, and every decode after that pays (a warm-up decode on the main
thread made each later token of SmolLM2 on 2 cores cost 10-12 ms instead of 7). The engine is given the
``llama_cpp`` module and the model and context pointers, so this module imports nothing from llama_cpp itself.
"""

from __future__ import annotations

import codecs
import concurrent.futures
import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from daemon.llama.sampling import SeqSampler, bias_arrays, logprobs, sample_rows
from daemon.llama.speculative import EXPLORE_EVERY, CostModel, DraftModel, SpecState
from daemon.runners.protocol import (
    Done,
    DoneReply,
    ErrorReply,
    JSONObject,
    Reply,
    SampleParams,
    SlotInfo,
    Token,
    TokenReply,
    Truncated,
    TruncatedReply,
)

if TYPE_CHECKING:
    from daemon.llama.kvblocks import Blob
    from daemon.llama.kvdisk import DiskCache

PROMPT_TOO_LONG = (
    "the prompt is longer than the context length currently available to the model; shorten the prompt, adjust "
    "the context length in settings, or use a model with a longer context length"
)

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)

Emit = Callable[[list[Reply]], None]
# The LoRA adapters a sequence is computed under: (adapter path, scale) pairs in order; () for the base model alone.
# KV computed under one set is never reused under another.
AdapterSet = tuple[tuple[str, float], ...]


SAVE_MIN_TOKENS = 64  # a slot's tail shorter than this is cheaper to evaluate again than to save and restore
# Restoring a saved sequence, or copying another slot's (llama.cpp copies a whole KV stream, ~8 ms per 2,048 cells
# on 2 CPU cores whatever the prefix), is done only when it spares evaluating at least this many tokens
MIN_GAIN = 16
# A sequence saved in host RAM is restored when it spares evaluating at least max(RESTORE_MIN_GAIN, its length //
# RESTORE_RATIO) tokens beyond what the slot or a donor gives: the restore copies all of it (~1 ms for 3 MB, 130
# tokens of SmolLM2, on 2 CPU cores), an evaluated prompt token costs a pass's share (~3 ms each for sixteen
# 12-token chat prompts at once). The ratio keeps a 16k-token restore (2 GB for an 8B model, host to GPU) for
# gains that pay for it; MIN_GAIN alone made sixteen chats after sixteen other requests evaluate their last 11
# tokens each after copying the shared system prompt from a donor (420-670 ms to the first token against 99 ms).
RESTORE_MIN_GAIN = 2
RESTORE_RATIO = 32
# Image positions evaluated per engine iteration while other sequences decode (where the image can be split: causal
# attention, one position per embedding): they wait one slice for their next token (~50 ms for SmolLM2 on 2 CPU
# cores) instead of the whole image
IMAGE_SLICE = 16
# After a step that gave some sequence its first token, the engine waits this long before the next step when
# llama.cpp computes on the CPU: its threads spin on every core while they decode, so the daemon (which turns the
# token into the response's first line) and the client (which reads it) would each wait for the kernel to preempt
# one of them. Paid once per request, not per token; arrivals meanwhile join the next step.
FIRST_TOKEN_PAUSE = 0.0015
# A decoding sequence is moved into a gap between busy slots (``_compact``) only with at least this many tokens left
# to generate: the move copies a whole KV stream once (~8 ms for 2,048 cells on 2 CPU cores), a gap costs a pass
# every step (~4.5 ms)
COMPACT_MIN_LEFT = 16
# When llama.cpp's threads take every core, a running sequence's tokens are sent to the daemon at most this often (a
# first piece of text, an end and an error go at once): each frame wakes the daemon, which takes a core from the
# decode in progress and stalls all its threads at the next barrier, and each line it writes wakes the client too.
# A group travels as one piece of text (``merge_pieces``): one line for the daemon to make and the client to read.
# Only tokens faster than 20 a second are grouped (a slower model's come one by one, as made); for SmolLM2 on 2 CPU
# cores (~100 tokens/s) the daemon's CPU per token went from 0.31-0.37 ms (20 ms, a line per token) to 0.16 ms, the
# client's from 0.21 to 0.10 ms (docs/benchmarks.md, issue 19).
STREAM_INTERVAL = 0.05
# Speculative decoding drafts only while at most this many sequences decode at once (when llama.cpp computes on the
# CPU; on a GPU, SPEC_MAX_STREAMS_GPU): a step over many sequences is no longer bound by reading the weights, so
# verifying drafts there costs about what it saves (docs/benchmarks.md, "Speculative decoding")
SPEC_MAX_STREAMS = 4
SPEC_MAX_STREAMS_GPU = 16
# Before the engine has timed steps of several sizes, an extra token in a decode step is taken to cost this share of
# a one-token step (speculative.CostModel): measured for SmolLM2 on 2 CPU cores (~0.3); on a GPU a step of a few
# tokens costs about what one does
# LoRA adapter sets take turns: llama.cpp applies adapters to the whole context, and a change of the set makes it
# rebuild its scheduler and reserve its graphs before the next decode (measured: ~5 ms for SmolLM2 on 2 CPU cores,
# ~25 ms for an 8B on an H200, where a step of four rows costs ~7). A step decodes one set's sequences; the set keeps
# the turn while it has work, for as long as makes the switch that started it at most TURN_SWITCH_SHARE of the turn
# (never longer than TURN_MAX seconds, so another set's requests wait at most that per set ahead of them); then the
# set served longest ago goes. SWITCH_COST_PRIOR until the runner measured its own switches.
TURN_SWITCH_SHARE = 0.1
TURN_MAX = 0.25
SWITCH_COST_PRIOR = 0.005
SPEC_TOKEN_COST = 0.3
SPEC_TOKEN_COST_GPU = 0.05


@dataclass
class Saved:
    """A sequence's KV state kept in host RAM after its slot was given to another request."""

    tokens: list[int]
    buffer: np.ndarray  # its first ``size`` bytes are from llama_state_seq_get_data; recycled when the entry leaves
    size: int
    shifted_at: int | None = None  # the slot's ``shifted_at`` when it was saved
    adapters: AdapterSet = ()  # what the KV was computed under


class EngineError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def split_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """(text safe to emit, whether a stop string was hit). Holds back a suffix that may begin a stop string."""
    if not stops:
        return text, False
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return text[:first], True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], False


@dataclass
class Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # what this sequence id holds in the KV cache, in order
    seq: Seq | None = None
    last_used: float = 0.0
    # the position from which its KV was moved by a context shift (``_shift``): from there on it is not what
    # evaluating those tokens gives, so it is never stored on disk; None: never shifted
    shifted_at: int | None = None
    persisted: int = 0  # leading blocks of ``tokens`` known to be on disk (or queued for it)
    adapters: AdapterSet = ()  # the LoRA adapters its KV was computed under


@dataclass
class Seq:
    rid: int
    prompt: list[int]
    sampler: SeqSampler
    limit: int
    stops: list[str]
    num_keep: int
    shift: bool
    top_logprobs: int | None
    grammar: Any = None  # llama_sampler pointer, or None
    slot: Slot | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet evaluated
    next_token: int | None = None  # sampled, not yet in the KV cache
    generated: list[int] = field(default_factory=list)
    text: str = ""  # decoded, not yet emitted (may begin a stop string)
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    prompt_cached: int = 0  # prompt tokens found in the KV cache (or restored), so not evaluated
    started: int = 0
    first_at: int = 0
    cancelled: bool = False
    stop_hit: str | None = None
    media: Any = None  # a vision.MediaPrompt (prompts with images), closed when the sequence ends
    media_base: int = 0  # prompt entries before the media prompt's (the request's ``context`` tokens)
    rest: list[int] = field(default_factory=list)  # prompt entries after ``pending``, from an image on
    shown: bool = False  # some of its text has been emitted
    # Another sequence evaluating a prefix of this one's prompt (``_admit``): this one holds its slot, evaluates
    # nothing, and copies the KV once ``leader`` has evaluated ``lead_to`` tokens (or stopped)
    leader: Seq | None = None
    lead_to: int = 0
    # the raw logits of its first token, kept for followers with the same whole prompt (``_start_twin``)
    first_row: np.ndarray | None = None
    lookup: Any = None  # a kvdisk.Lookup: its prompt's stored prefix, being read from disk
    spec: SpecState | None = None  # speculative decoding (a draft model or prompt lookup), when the request has it
    adapters: AdapterSet = ()  # the LoRA adapters it is computed under (loaded: ``Engine.adapter_ptrs``)


class Engine:
    def __init__(
        self,
        lc: Any,
        ctx: Any,
        vocab: Any,
        *,
        n_parallel: int,
        n_ctx_slot: int,
        n_batch: int,
        emit: Emit,
        chunk: int | None = None,
        cache_bytes: int = 0,
        before_first_decode: Callable[[], None] | None = None,
        eval_media: Callable[[Any, int, int, int, int, bool, int], int] | None = None,
        first_token_pause: float = 0.0,
        stream_interval: float = 0.0,
        draft: DraftModel | None = None,
        spec_max_streams: int = SPEC_MAX_STREAMS,
        spec_token_cost: float = SPEC_TOKEN_COST,
    ) -> None:
        self.lc, self.ctx, self.vocab = lc, ctx, vocab
        # (media prompt, segment index, positions of it already evaluated, n_past, seq_id, the prompt ends with it, at
        # most this many positions now) -> positions evaluated (all that are left where an image cannot be split);
        # None: no projector
        self._eval_media = eval_media
        self._before_first_decode = before_first_decode
        self.draft = draft  # the draft model beside the target (speculative.py), or None
        self.spec_max_streams = spec_max_streams
        self.spec_cost = CostModel(spec_token_cost)  # what decode steps and draft rounds cost here (measured)
        # LoRA adapters loaded into the model (path -> llama_adapter_lora pointer; the runner loads them, on this
        # thread), those to free once no sequence uses them, and the set the context applies now
        self.adapter_ptrs: dict[str, Any] = {}
        self._drop_later: set[str] = set()
        self._applied: AdapterSet = ()
        self.default_adapters: AdapterSet = ()  # what a request naming none is computed under (LoadSpec.adapters)
        # adapter sets' turns (TURN_*): the set holding it, since when, when each set was last served, and what a
        # switch costs here (seconds, measured on decode steps after one)
        self._turn_since = 0.0
        self._served: dict[AdapterSet, float] = {}
        self.switch_cost = SWITCH_COST_PRIOR
        self._after_switch: tuple[float, int] | None = None  # (seconds, rows) of the step that switched
        self.cache_bytes = max(0, cache_bytes)
        self.saved: list[Saved] = []  # oldest first
        self.spare: list[np.ndarray] = []  # buffers of entries that left, written once already: fast to reuse
        self.saved_size = 0  # bytes of the saved entries' buffers and the spare ones
        self.mem = lc.llama_get_memory(ctx)
        self.n_vocab = int(lc.llama_vocab_n_tokens(vocab))
        self.n_parallel, self.n_ctx_slot, self.n_batch = n_parallel, n_ctx_slot, n_batch
        self.chunk = chunk or n_batch
        self._emit_many = emit
        self._out: list[Reply] = []  # replies of this iteration, sent together at its end
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.waiting: deque[Seq] = deque()
        self.by_rid: dict[int, Seq] = {}
        self._cv = threading.Condition()
        self._batch = self._batch_arrays(n_batch)
        self._piece = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}  # token id -> its bytes (llama_token_to_piece, once per id)
        self._eog: dict[int, bool] = {}  # token id -> whether it ends a generation (llama_vocab_is_eog)
        self._row_types: dict[int, Any] = {}  # ctypes array types over the logits, by row count
        self.first_token_pause = first_token_pause  # seconds (FIRST_TOKEN_PAUSE when llama.cpp computes on the CPU)
        self._first_token = False  # this iteration gave some sequence its first token
        self.stream_interval = stream_interval  # seconds (STREAM_INTERVAL when llama.cpp's threads take every core)
        self._urgent = False  # ``_out`` holds a first piece of text, an end or an error: send it now
        self._sent_at = 0.0  # time.monotonic() of the last send
        self._alone_last = False  # the last step evaluated only newcomers' prompts (``_step``)
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []  # ``call``, not yet run
        self._closed = False
        self.disk: DiskCache | None = None  # the prompt cache on disk (``attach_disk``)
        self._ended: list[Slot] = []  # slots whose sequence finished: stored on disk when the engine is idle
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- API (any thread) --------------------------------------------------------------------------------------
    def submit(
        self,
        rid: int,
        prompt: list[int],
        params: SampleParams,
        *,
        shift: bool = True,
        truncate: bool = True,
        media: Any = None,
        adapters: AdapterSet = (),
    ) -> None:
        """Queue a generation; its tokens and its final ``done`` go to ``emit``. Bad input raises EngineError.
        ``media``: the vision.MediaPrompt whose ``cache_key()`` ends ``prompt`` (a prompt with images).
        ``adapters``: the LoRA adapters (loaded, ``adapter_ptrs``) and scales it is computed under."""
        missing = [path for path, _ in adapters if path not in self.adapter_ptrs or path in self._drop_later]
        if missing:
            raise EngineError(f"the LoRA adapter {missing[0]} is not loaded", 500)
        if not prompt:
            raise EngineError("empty prompt")
        if media is not None:
            if self._eval_media is None:
                raise EngineError("this model cannot take images: it has no vision projector")
            if len(prompt) >= self.n_ctx_slot:  # images are not cut in half: no truncation for them
                raise EngineError(
                    f"{PROMPT_TOO_LONG} (prompt: {len(prompt)} positions, context length: {self.n_ctx_slot})"
                )
        bad = check_token_ids(prompt if media is None else [t for t in prompt if t >= 0], self.n_vocab)
        if bad is not None:
            # refused here, before it joins a batch: an id llama.cpp does not know fails the whole llama_decode,
            # and with it every other sequence in the batch
            raise EngineError(
                f"token id {prompt[bad]} at position {bad} is out of range: this model's vocabulary "
                f"has ids 0 to {self.n_vocab - 1}"
            )
        num_keep = min(max(0, params.num_keep), self.n_ctx_slot // 2)
        given = len(prompt)
        if given >= self.n_ctx_slot:
            if not (shift and truncate):
                raise EngineError(f"{PROMPT_TOO_LONG} (prompt: {given} tokens, context length: {self.n_ctx_slot})")
            tail = self.n_ctx_slot // 2 - num_keep
            prompt = prompt[:num_keep] + prompt[len(prompt) - tail :]
        num_predict = params.num_predict
        try:  # ids beyond this model's vocabulary are refused here, for this request only (the rest was checked once,
            # on the daemon's side)
            bias = bias_arrays(params.logit_bias, self.n_vocab)
        except ValueError as exc:
            raise EngineError(f"invalid logit_bias: {exc}") from None
        seq = Seq(
            rid=rid,
            prompt=prompt,
            sampler=SeqSampler.of(params, self.n_ctx_slot, bias),
            limit=10 * self.n_ctx_slot if num_predict < 0 else min(num_predict, 10 * self.n_ctx_slot),  # as Ollama
            stops=[s for s in params.stop if s],
            num_keep=num_keep,
            shift=shift,
            top_logprobs=params.logprobs,
            started=time.perf_counter_ns(),
        )
        if media is not None:
            seq.media, seq.media_base = media, len(prompt) - media.n_pos
        seq.grammar = self._grammar(params)
        spec = SpecState(
            draft_max=max(0, params.draft_max),
            draft_min=max(0, params.draft_min),
            p_min=params.draft_p_min,
            ngram=max(0, params.draft_ngram),
            use_model=self.draft is not None and media is None,  # a draft model never sees the images
        )
        seq.spec = spec if spec.active else None
        seq.adapters = tuple(adapters) or self.default_adapters
        if len(prompt) < given:  # said now, so that the daemon hears of the cut before any of the request's tokens
            self._emit_many([TruncatedReply(rid, Truncated(given, len(prompt), num_keep, self.n_ctx_slot))])
        disk = self.disk
        if disk is not None and not seq.adapters:  # its stored prefix is read while it waits for a slot (the disk
            # cache holds the base model's KV only)
            seq.lookup = disk.lookup(prompt)
        with self._cv:
            self.by_rid[rid] = seq
            self.waiting.append(seq)
            self._cv.notify()

    def cancel(self, rid: int) -> None:
        with self._cv:
            seq = self.by_rid.get(rid)
            if seq is not None:
                seq.cancelled = True
                self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on the engine thread between two steps; its result, or its exception raised here. For the
        runner's other llama.cpp computations (the warm-up, a projector's load and warm-up): see the module's
        docstring for why they must share the engine's thread."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise EngineError("the engine is closed", 500)
            self._calls.append((fn, done))
            self._cv.notify()
        return done.result()

    def set_media(self, eval_media: Callable[[Any, int, int, int, int, bool, int], int]) -> None:
        """The hook that evaluates images (a projector loaded after the engine started, on its thread)."""
        with self._cv:
            self._eval_media = eval_media

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
        if self.disk is not None:
            self.disk.close()

    def slots_info(self) -> list[SlotInfo]:
        return [SlotInfo(s.seq_id, s.seq is not None, len(s.tokens)) for s in self.slots]

    # -- saved slots (llama-server's /slots/{id}?action=save|restore|erase; the files: kvdisk.SlotFiles) ---------------
    def slot_state(self, slot_id: int) -> tuple[list[int], int | None, bytes]:
        """What idle slot ``slot_id`` holds: its tokens, where a context shift moved its KV (None: never) and
        llama.cpp's state of its sequence (engine thread: run it through :meth:`call`). EngineError 400 for a slot
        that does not exist, 409 for one serving a request."""
        slot = self._idle_slot(slot_id)
        if not slot.tokens:
            return [], None, b""
        if slot.adapters:
            raise EngineError(
                f"slot {slot_id} holds a sequence computed with LoRA adapters: only the base model's slots are saved"
            )
        size = int(self.lc.llama_state_seq_get_size(self.ctx, slot.seq_id))
        buffer = np.empty(max(size, 1), dtype=np.uint8)
        if size <= 0 or int(self.lc.llama_state_seq_get_data(self.ctx, _bytes_ptr(buffer), size, slot.seq_id)) != size:
            raise EngineError(f"llama.cpp gave no state for slot {slot_id}", 500)
        return list(slot.tokens), slot.shifted_at, buffer[:size].tobytes()

    def restore_slot(self, slot_id: int, tokens: list[int], shifted_at: int | None, state: Blob) -> None:
        """Put a saved slot's state into idle slot ``slot_id`` (engine thread: through :meth:`call`): it holds
        ``tokens`` afterwards, so the next request whose prompt starts with them takes this slot and evaluates only
        the rest, as if the slot had evaluated them itself. Refused with EngineError, the slot unchanged: 400 a slot
        that does not exist, tokens that do not fit a slot's context or that are not this model's, or a state
        llama.cpp does not take; 409 a slot serving a request."""
        slot = self._idle_slot(slot_id)
        if not tokens:
            raise EngineError("the saved slot holds no tokens")
        if len(tokens) >= self.n_ctx_slot:
            raise EngineError(
                f"the saved slot holds {len(tokens)} tokens; a slot of this model holds at most {self.n_ctx_slot - 1} "
                f"(num_ctx {self.n_ctx_slot}): load the model with a larger num_ctx to restore it"
            )
        bad = check_token_ids([t for t in tokens if t >= 0], self.n_vocab)
        if bad is not None:
            raise EngineError("the saved slot's token ids are not this model's (a file of another vocabulary)")
        previous = b""
        if slot.tokens and not slot.adapters:  # kept, to be put back if llama.cpp refuses the saved state
            previous = self.slot_state(slot_id)[2]
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        data = np.frombuffer(state, dtype=np.uint8)
        read = int(self.lc.llama_state_seq_set_data(self.ctx, _bytes_ptr(data), data.nbytes, slot.seq_id))
        if read != data.nbytes:
            self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
            back = np.frombuffer(previous, dtype=np.uint8)
            if not previous or int(
                self.lc.llama_state_seq_set_data(self.ctx, _bytes_ptr(back), back.nbytes, slot.seq_id)
            ) != len(previous):
                self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
                slot.tokens, slot.shifted_at, slot.persisted = [], None, 0
            raise EngineError(
                "llama.cpp refused the saved slot's state (saved with another context layout or damaged); "
                "the slot is unchanged"
            )
        slot.tokens, slot.shifted_at, slot.persisted = list(tokens), shifted_at, 0
        slot.adapters = ()  # saved slots are the base model's
        slot.last_used = time.monotonic()

    def erase_slot(self, slot_id: int) -> int:
        """Empty idle slot ``slot_id``'s KV cache (engine thread: through :meth:`call`); the tokens it held."""
        slot = self._idle_slot(slot_id)
        n = len(slot.tokens)
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        slot.tokens, slot.shifted_at, slot.persisted = [], None, 0
        return n

    def check_slot(self, slot_id: int) -> None:
        """EngineError 400 unless slot ``slot_id`` exists (any thread)."""
        if not 0 <= slot_id < len(self.slots):
            raise EngineError(
                f"there is no slot {slot_id}: this model has slots 0 to {len(self.slots) - 1} (num_parallel "
                f"{len(self.slots)})"
            )

    def _idle_slot(self, slot_id: int) -> Slot:
        self.check_slot(slot_id)
        slot = self.slots[slot_id]
        if slot.seq is not None:
            raise EngineError(f"slot {slot_id} is serving a request; try again when it is idle", 409)
        return slot

    # -- the prompt cache on disk (kvdisk.py) -----------------------------------------------------------------------
    def attach_disk(self, disk: DiskCache) -> None:
        """Keep prompts' KV on disk too: what a slot holds is stored when its sequence ends or before the slot is
        reused, and a request's prompt is looked up there when it is submitted."""
        disk.local = self._held
        disk.wake = self._wake
        disk.min_gain = MIN_GAIN
        self.disk = disk

    def flush_disk(self, timeout: float) -> bool:
        """Store what every slot holds (on the engine thread, between two steps) and wait for the disk writes, at
        most ``timeout`` seconds in all (a runner that shuts down); whether everything was written."""
        disk = self.disk
        if disk is None:
            return True
        end = time.monotonic() + timeout
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def persist_all() -> None:
            for slot in self.slots:
                self._persist(slot)

        with self._cv:
            if self._closed:
                return disk.flush(timeout)
            self._calls.append((persist_all, done))
            self._cv.notify()
        try:
            done.result(timeout=max(0.0, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - a step that outlasts the wait, or a failed copy: what is queued goes
            pass
        return disk.flush(max(0.0, end - time.monotonic()))

    def _held(self, prompt: list[int]) -> int:
        """How long a prefix of ``prompt`` a slot or host RAM holds (the disk lookup's thread asks: a hint)."""
        held = [list(s.tokens) for s in self.slots] + [e.tokens for e in list(self.saved)]
        return max((common_prefix(t, prompt) for t in held), default=0)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _persist(self, slot: Slot) -> None:
        """Store on disk the whole blocks of what ``slot`` holds that are not there yet (engine thread): only the
        copy of its state out of llama.cpp happens here; the disk cache's writer cuts it into blocks and writes
        them. Skipped when the writer is too far behind (the next end or reuse of the slot tries again)."""
        disk = self.disk
        if disk is None or not disk.enabled or not slot.tokens or slot.adapters:
            return
        tokens = slot.tokens
        exact = len(tokens) if slot.shifted_at is None else min(slot.shifted_at, len(tokens))
        if exact // disk.block <= slot.persisted:
            return
        hashes, n_blocks = disk.wanted(tokens, exact)
        if not hashes:
            slot.persisted = max(slot.persisted, n_blocks)
            return
        size = int(self.lc.llama_state_seq_get_size(self.ctx, slot.seq_id))
        if size <= 0:
            return
        buffer = disk.buffer(size)
        if buffer is None:
            return
        if int(self.lc.llama_state_seq_get_data(self.ctx, _bytes_ptr(buffer), size, slot.seq_id)) != size:
            disk.give_back(buffer, size)
            return
        disk.put(hashes, list(tokens[: n_blocks * disk.block]), buffer, size)
        slot.persisted = n_blocks

    def _restore_disk(self, seq: Seq, slot: Slot, n: int) -> bool:
        """Load the first ``n`` tokens of ``seq``'s prompt, read from disk, into ``slot``; False (the slot emptied)
        when llama.cpp refuses the state."""
        disk = self.disk
        _, blob = seq.lookup.result() if seq.lookup is not None else (0, None)
        if disk is None or blob is None:
            return False
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        data = np.frombuffer(blob, dtype=np.uint8)
        read = int(self.lc.llama_state_seq_set_data(self.ctx, _bytes_ptr(data), data.nbytes, slot.seq_id))
        if read != data.nbytes:
            self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
            slot.tokens, slot.shifted_at, slot.persisted = [], None, 0
            disk.restore_failed(n)
            return False
        slot.tokens, slot.shifted_at, slot.persisted = list(seq.prompt[:n]), None, n // disk.block
        slot.adapters = ()
        disk.note_restored(n)
        return True

    def _admissible(self) -> Seq | None:
        """The first waiting request that may take a slot: one whose disk lookup has finished (or has taken too
        long: it goes without), or that was cancelled."""
        for seq in self.waiting:
            if seq.cancelled or seq.lookup is None or seq.lookup.ready():
                return seq
        return None

    # -- grammar -------------------------------------------------------------------------------------------------
    def _grammar(self, params: SampleParams) -> Any:
        text = params.grammar
        if params.json_schema:
            from llama_cpp.llama_grammar import json_schema_to_gbnf  # the runner child only

            try:
                text = json_schema_to_gbnf(params.json_schema)
            except Exception as exc:  # noqa: BLE001
                raise EngineError(f"invalid format: could not build a grammar from the schema: {exc}") from None
        if not text:
            return None
        smpl = self.lc.llama_sampler_init_grammar(self.vocab, text.encode("utf-8"), b"root")
        if not smpl:
            raise EngineError("invalid format: llama.cpp could not parse the grammar")
        return smpl

    def _allows(self, grammar: Any, token: int) -> bool:
        one = np.zeros(1, dtype=TOKEN_DATA)
        one["id"], one["logit"] = token, 0.0
        arr = self.lc.llama_token_data_array(
            data=one.ctypes.data_as(ctypes.POINTER(self.lc.llama_token_data)), size=1, selected=-1, sorted=False
        )
        self.lc.llama_sampler_apply(grammar, ctypes.byref(arr))
        return bool(np.isfinite(one["logit"][0]))

    def _constrain(self, row: np.ndarray, grammar: Any) -> None:
        data = np.empty(row.shape[0], dtype=TOKEN_DATA)
        data["id"] = np.arange(row.shape[0], dtype=np.int32)
        data["logit"] = row
        data["p"] = 0.0
        arr = self.lc.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(self.lc.llama_token_data)),
            size=row.shape[0],
            selected=-1,
            sorted=False,
        )
        self.lc.llama_sampler_apply(grammar, ctypes.byref(arr))
        row[:] = data["logit"]

    # -- the loop (engine thread) ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._closed
                    and not self._calls
                    and not any(s.seq for s in self.slots)
                    and (not self.waiting or self._admissible() is None)
                ):
                    # requests whose stored prefix is being read: woken when a read ends (``_wake``), or to admit
                    # one without it after kvdisk.LOOKUP_WAIT
                    self._cv.wait(0.5 if self.waiting else None)
                if self._closed:
                    break
                calls, self._calls = self._calls, []
            for fn, done in calls:
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    done.set_exception(exc)
            try:
                with self._cv:
                    self._admit()
                    self._compact()
                self._reap_cancelled()
                self._eval_image()
                self._step()
            except EngineError as exc:
                self._fail_started(str(exc), exc.status)
            except Exception as exc:  # noqa: BLE001 - report to every active request and keep serving
                self._fail_started(f"llama.cpp error: {exc}", 500)
            self._flush()
            if self._ended and self._idle():
                # Only when nothing else runs: copying a long sequence's state out of llama.cpp stops the engine
                # (on an H200, 2 GB for 16k tokens of an 8B model held a request sent right after for ~0.9 s), so
                # with other work going the copy waits for a quiet moment or for the slot's reuse (``_save``).
                ended, self._ended = self._ended, []
                for slot in ended:
                    if slot.seq is None:
                        self._persist(slot)
            if self._first_token:
                self._first_token = False
                if self.first_token_pause > 0:
                    time.sleep(self.first_token_pause)

    def _idle(self) -> bool:
        """Nothing to decode, admit or call: the engine would wait for work now."""
        return not self._calls and not self.waiting and not any(s.seq for s in self.slots)

    def _batch_arrays(self, n_batch: int) -> Any:
        """A ``llama_batch`` over numpy arrays this engine owns (never given to ``llama_batch_free``): a step fills
        them with slice assignments instead of five ctypes stores per token. Every token belongs to one sequence,
        so ``n_seq_id`` is all ones and ``seq_id[i]`` points at ``_sid[i]`` once and for all."""
        lc = self.lc
        self._tok = np.zeros(n_batch, dtype=np.int32)
        self._pos = np.zeros(n_batch, dtype=np.int32)
        self._nseq = np.ones(n_batch, dtype=np.int32)
        self._sid = np.zeros(n_batch, dtype=np.int32)
        self._want = np.zeros(n_batch, dtype=np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        base = self._sid.ctypes.data
        self._sid_ptrs = (int_p * n_batch)(*(ctypes.cast(base + 4 * i, int_p) for i in range(n_batch)))
        batch = lc.llama_batch()
        batch.n_tokens = 0
        batch.token = self._tok.ctypes.data_as(int_p)
        batch.embd = ctypes.POINTER(ctypes.c_float)()
        batch.pos = self._pos.ctypes.data_as(int_p)
        batch.n_seq_id = self._nseq.ctypes.data_as(int_p)
        batch.seq_id = ctypes.cast(self._sid_ptrs, ctypes.POINTER(int_p))
        batch.logits = self._want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        return batch

    def emit(self, msg: Reply) -> None:
        if not isinstance(msg, TokenReply):
            self._urgent = True
        self._out.append(msg)

    def _flush(self) -> None:
        """Send what the iterations produced in one go: one write and one wake-up of the daemon per step, not one
        per sequence (on 2 cores each wake-up takes a core from ``llama_decode``), and with ``stream_interval`` set,
        one per interval while only running sequences' next tokens are waiting."""
        if not self._out:
            return
        at = time.monotonic()
        if not self._urgent and at - self._sent_at < self.stream_interval and self._plain_step_next():
            return
        out, self._out = self._out, []
        self._urgent, self._sent_at = False, at
        self._emit_many(merge_pieces(out) if len(out) > 1 else out)

    def _plain_step_next(self) -> bool:
        """The next iteration only decodes running sequences' next tokens. Tokens are held for ``stream_interval``
        only then: never behind a call, an admission, a prompt's chunk or an image, which take far longer, nor while
        the engine goes idle."""
        if self._calls or self.waiting:
            return False
        running = False
        for slot in self.slots:
            seq = slot.seq
            if seq is not None:
                if seq.pending or seq.rest or seq.leader is not None:
                    return False
                running = True
        return running

    def _admit(self) -> None:
        """Give waiting requests free slots, reusing the longest cached prefix (caller holds the lock). Followers
        whose leader has evaluated what they share (or stopped: cancelled, failed, ended) take their prefix first,
        before a newcomer may take the leader's slot."""
        for slot in self.slots:
            seq = slot.seq
            if seq is not None and seq.leader is not None and not seq.cancelled and not self._leading(seq):
                leader = seq.leader
                seq.leader, seq.lead_to = None, 0
                if not self._start_twin(seq, leader):
                    self._place(seq, slot)
        while self.waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                return
            ready = self._admissible()
            if ready is None:  # every waiting request's stored prefix is still being read
                return
            self.waiting.remove(ready)
            seq = ready
            if seq.cancelled:
                self._finish(seq, "stop")
                continue
            best = self._pick(free, seq.prompt, seq.adapters)
            seq.slot, best.seq = best, seq
            self._place(seq, best)

    def _place(self, seq: Seq, best: Slot) -> None:
        """Set up ``seq``'s KV in its slot ``best``: the longest prefix of its prompt that the slot holds, another
        slot holds (copied), or host RAM holds (restored); the rest of the prompt is left to evaluate. Unless
        another sequence is evaluating a longer prefix of this prompt right now (the choices of a request with
        ``n`` > 1, or concurrent requests with one system prompt): then ``seq`` follows it (``_leader``) and is
        placed again once that prefix is in the leader's slot, so the prefix is evaluated once, not once per
        sequence. Otherwise the last prompt token is always left to evaluate: a sequence needs a logits row for its
        first token (a follower with the same whole prompt takes its leader's: ``_start_twin``)."""
        n = len(seq.prompt)
        key = seq.adapters
        reuse = min(self._shared(best, seq), n - 1)
        donor = max(self.slots, key=lambda s: self._shared(s, seq))
        donor_len = min(self._shared(donor, seq), n - 1)
        hit, hit_len = self._find_saved(seq.prompt, key)
        # the prefix read from disk (only text before the first image, never the last prompt token)
        disk_len = seq.lookup.result()[0] if seq.lookup is not None else 0
        leader, lead_to = self._leader(seq)
        if leader is not None and lead_to >= max(reuse, donor_len, hit_len, disk_len) + MIN_GAIN:
            seq.leader, seq.lead_to = leader, lead_to
            seq.pending, seq.rest = [], []
            return
        if len(best.tokens) - reuse >= SAVE_MIN_TOKENS and reuse < n - 1:
            # what it holds beyond the shared prefix is about to be overwritten; not when that is the answer to
            # this same prompt (asked again: a regenerated answer replaces it, and a greedy one is the same again),
            # which cost sixteen repeated chats ~48 ms of copies before their first tokens
            self._save(best)
        restored = 0  # the prefix restored from disk or host RAM
        if disk_len >= max(reuse, donor_len, hit_len) + MIN_GAIN:
            if self._restore_disk(seq, best, disk_len):
                restored = disk_len
            else:  # the slot was emptied: nothing of it to reuse; the prompt is evaluated
                reuse = 0
                donor_len = min(self._shared(donor, seq), n - 1)
        if seq.lookup is not None:
            seq.lookup.drop()
            seq.lookup = None
        if (
            not restored
            and hit is not None
            and hit_len - max(reuse, donor_len) >= max(RESTORE_MIN_GAIN, hit_len // RESTORE_RATIO)
        ):
            if self._restore(hit, best):
                restored = hit_len
            else:  # the slot was emptied: nothing of it to reuse
                reuse = 0
                donor_len = min(self._shared(donor, seq), n - 1)
        if restored:
            self.lc.llama_memory_seq_rm(self.mem, best.seq_id, restored, -1)
            self._trim(best, restored)
            reuse = restored
        elif donor is not best and donor_len >= reuse + MIN_GAIN:
            # a slot is its own KV stream, and llama.cpp copies between streams only whole: copy, then trim
            self.lc.llama_memory_seq_rm(self.mem, best.seq_id, -1, -1)
            self.lc.llama_memory_seq_cp(self.mem, donor.seq_id, best.seq_id, -1, -1)
            self.lc.llama_memory_seq_rm(self.mem, best.seq_id, donor_len, -1)
            best.tokens, best.shifted_at, best.persisted = list(donor.tokens), donor.shifted_at, donor.persisted
            self._trim(best, donor_len)
            reuse = donor_len
        else:
            self.lc.llama_memory_seq_rm(self.mem, best.seq_id, reuse, -1)
            self._trim(best, reuse)
        best.adapters = key  # what its KV is (from here on) computed under
        if seq.media is not None and reuse > seq.media_base:
            # an image is evaluated whole: a cached prefix that ends inside one is cut back to its start
            safe = seq.media_base + seq.media.safe_prefix(reuse - seq.media_base)
            if safe < reuse:
                self.lc.llama_memory_seq_rm(self.mem, best.seq_id, safe, -1)
                self._trim(best, safe)
                reuse = safe
        seq.pending = list(seq.prompt[reuse:])
        if seq.media is not None:
            seq.pending, seq.rest = split_at_image(seq.pending)
        seq.prompt_cached = reuse

    @staticmethod
    def _shared(slot: Slot, seq: Seq) -> int:
        """The prefix of ``seq``'s prompt that ``slot``'s KV holds for it: none when computed under other adapters."""
        return common_prefix(slot.tokens, seq.prompt) if slot.adapters == seq.adapters else 0

    def _trim(self, slot: Slot, n: int) -> None:
        """``slot`` keeps its first ``n`` tokens (the caller removed the rest from the KV cache)."""
        slot.tokens = slot.tokens[:n]
        slot.persisted = min(slot.persisted, n // self.disk.block) if self.disk is not None else 0
        if slot.shifted_at is not None and n <= slot.shifted_at:
            slot.shifted_at = None  # what it keeps was evaluated, and what comes next will be

    def _leader(self, seq: Seq) -> tuple[Seq | None, int]:
        """The sequence evaluating the longest prefix of ``seq``'s prompt beyond what its slot holds now, and that
        prefix's length (at most all but the last prompt token, cut back to the start of an image it would end
        inside): one with prompt (text or images) left to evaluate, not cancelled and not itself a follower.
        Image entries are keys of the images' content, so a prefix with images is shared only by the same images."""
        found: Seq | None = None
        found_len = 0
        for slot in self.slots:
            other = slot.seq
            if other is None or other is seq or other.cancelled or other.leader is not None:
                continue
            if other.adapters != seq.adapters:
                continue
            if not (other.pending or other.rest):
                continue
            common = common_prefix(other.prompt, seq.prompt)
            # the same whole prompt: all of it (and the leader's first logits); else all but the last token
            n = common if common == len(seq.prompt) == len(other.prompt) else min(common, len(seq.prompt) - 1)
            if seq.media is not None and n > seq.media_base:
                n = seq.media_base + seq.media.safe_prefix(n - seq.media_base)
            if n > len(slot.tokens) and n > found_len:
                found, found_len = other, n
        return found, found_len

    def _leading(self, seq: Seq) -> bool:
        """``seq``'s leader is still in its slot evaluating the prefix ``seq`` waits for."""
        leader = seq.leader
        slot = leader.slot if leader is not None else None
        return (
            leader is not None
            and slot is not None
            and slot.seq is leader
            and not leader.cancelled
            and bool(leader.pending or leader.rest)
            and len(slot.tokens) < seq.lead_to
        )

    def _start_twin(self, seq: Seq, leader: Seq) -> bool:
        """A follower with its leader's whole prompt starts as the leader did: the leader's KV copied whole, and its
        first token sampled (with its own sampler, seed and grammar) from the logits the leader's first token came
        from. So its state is the leader's bit for bit, and a greedy choice is the leader's answer: evaluating the
        last prompt token again, in another batch, gives logits that differ in the last bits, enough to change a
        near tie. False when the leader stopped before its prompt's end (the follower is placed as a newcomer)."""
        row, slot, n = leader.first_row, seq.slot, len(seq.prompt)
        if row is None or slot is None or leader.prompt != seq.prompt:
            return False
        places = ([leader.slot] if leader.slot is not None else []) + self.slots  # the leader's own KV first
        donor = next((s for s in places if self._shared(s, seq) == n), None)
        if donor is None:
            return False
        if donor is not slot:
            if len(slot.tokens) - common_prefix(slot.tokens, seq.prompt) >= SAVE_MIN_TOKENS:
                self._save(slot)  # what it holds is about to be overwritten
            self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
            self.lc.llama_memory_seq_cp(self.mem, donor.seq_id, slot.seq_id, -1, -1)
            slot.tokens, slot.shifted_at, slot.persisted = list(donor.tokens), donor.shifted_at, donor.persisted
        slot.adapters = seq.adapters
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, n, -1)  # the leader's tokens since
        self._trim(slot, n)
        slot.tokens = list(seq.prompt)
        seq.pending, seq.rest, seq.prompt_cached = [], [], n
        row = row.copy()
        raw = row.copy() if seq.top_logprobs is not None else None
        if seq.grammar is not None:
            self._constrain(row, seq.grammar)
        token = sample_rows(row[None, :], [seq.sampler], [slot.tokens])[0]
        seq.first_at, self._first_token = time.perf_counter_ns(), True
        self._accept(seq, token, raw)
        return True

    def _keep_first_row(self, seq: Seq, row: np.ndarray) -> None:
        """Keep a copy of ``seq``'s first logits (before sampling penalises them in place) when a follower waits for
        its whole prompt."""
        n = len(seq.prompt)
        if any(s.seq is not None and s.seq.leader is seq and s.seq.lead_to == n for s in self.slots):
            seq.first_row = row.copy()

    def _compact(self) -> None:
        """Keep the busy slots together: when a free slot lies between busy ones, move the sequence in the highest
        busy slot into it (one move per step). llama.cpp runs a step over several KV streams in passes of
        consecutive sequence ids, so busy slots 0, 1, 2 and 4 cost two passes a step where 0-3 cost one; requests
        take the slot that holds their prompt, so earlier traffic decides where they land (four streams after
        sixteen: 142 against 174 tokens/s on 2 CPU cores). Only a sequence that is decoding (no prompt or image
        left to evaluate) with at least ``COMPACT_MIN_LEFT`` tokens to go moves; its old slot keeps the same KV as a
        cached prefix for later requests. Never while a request still waits for its first token."""
        busy = [s for s in self.slots if s.seq is not None]
        if len(busy) < 2 or busy[-1].seq_id - busy[0].seq_id + 1 == len(busy):
            return
        if self.waiting or any(s.seq is not None and (s.seq.pending or s.seq.first_at == 0) for s in busy):
            return  # first tokens come first: a move waits until nobody is waiting for one
        src = busy[-1]
        seq = src.seq
        assert seq is not None
        if seq.pending or seq.rest or seq.next_token is None or seq.limit - len(seq.generated) < COMPACT_MIN_LEFT:
            return
        dst = next(s for s in self.slots[busy[0].seq_id : src.seq_id] if s.seq is None)
        if len(dst.tokens) >= SAVE_MIN_TOKENS:
            self._save(dst)  # what it held is about to be overwritten
        self.lc.llama_memory_seq_rm(self.mem, dst.seq_id, -1, -1)
        self.lc.llama_memory_seq_cp(self.mem, src.seq_id, dst.seq_id, -1, -1)
        dst.tokens, src.tokens = src.tokens, list(src.tokens)
        dst.shifted_at, dst.persisted, dst.adapters = src.shifted_at, src.persisted, src.adapters
        dst.seq, src.seq, seq.slot = seq, None, dst
        dst.last_used = src.last_used = time.monotonic()

    def _pick(self, free: list[Slot], prompt: list[int], adapters: AdapterSet = ()) -> Slot:
        """The free slot for a new request: the one whose cached tokens share the longest prefix with its prompt;
        among equals, one that loses nothing (empty, or holding a prefix of the prompt), then one next to busy
        slots, then the least recently used.

        A slot's prefix counts only when it is at least what taking the slot would overwrite: a conversation's own
        slot (its history, then the last answer) always, but not another conversation's slot for the few tokens of
        the template they both start with, nor for a shared system prompt while a free slot holds less (the prefix
        is copied into that slot from the other, ``_place``, and the other conversation keeps its history). Taking
        the longest match whatever it held made concurrent conversations with one opening take each other's slots
        and come back to nothing cached.

        llama.cpp runs a batch over several KV streams in passes (ubatches) of consecutive sequence ids only, so
        busy slots 0, 5 and 9 cost three passes over the weights each step where 0, 1 and 2 cost one (~4.5 ms a
        pass for SmolLM2 on 2 CPU cores; on a GPU a pass is nearly all of a small model's step). The cached prefix
        still comes first: on the CPU an evaluated token costs about as much as a pass, and a newcomer waits for
        its prompt (a bonus of 16 tokens per busy neighbour made first tokens at 16 streams three times later)."""
        slots = self.slots
        last = len(slots) - 1

        def score(s: Slot) -> tuple[int, bool, int, float]:
            i = s.seq_id
            near = (i > 0 and slots[i - 1].seq is not None) + (i < last and slots[i + 1].seq is not None)
            shared = common_prefix(s.tokens, prompt) if s.adapters == adapters else 0
            lost = len(s.tokens) - shared
            return (shared if shared >= lost else 0), not lost, near, -s.last_used

        return max(free, key=score)

    def _eval_image(self) -> None:
        """Evaluate the next image (or the next slice of it, as ``eval_media`` decides) of the oldest sequence that
        has evaluated all its text before it: one per engine iteration, so the other sequences decode a token
        between two. While others are there, an image goes ``IMAGE_SLICE`` positions at a time where the runner can
        split it; alone, whole (one ``llama_decode`` over all its embeddings is cheaper than several). A prompt that
        ends with the image is sampled here, from its last position. A failure fails that request alone (its
        positions are removed)."""
        ready = [s.seq for s in self.slots if s.seq is not None and s.seq.rest and not s.seq.pending]
        if not ready or self._eval_media is None:
            return
        seq = min(ready, key=lambda q: q.started)
        slot = seq.slot
        assert slot is not None and seq.media is not None
        at = len(slot.tokens)
        index, offset = seq.media.segment_at(at - seq.media_base)
        segments = seq.media.segments
        left = segments[index].n_pos - offset if index < len(segments) else 0
        try:
            if left <= 0 or segments[index].kind != "image":
                raise RuntimeError(f"the image at position {at} is out of step with the prompt")
            # its followers wait for it rather than decode: they are no reason to slice it
            others = bool(self.waiting) or any(
                s.seq is not None and s.seq is not seq and s.seq.leader is not seq for s in self.slots
            )
            limit = IMAGE_SLICE if others else left
            self._apply_adapters(seq.adapters)  # an image's positions are computed under its sequence's adapters
            n = self._eval_media(seq.media, index, offset, at, slot.seq_id, left == len(seq.rest), limit)
            if not 0 < n <= left:
                raise RuntimeError(f"{n} image positions evaluated of {left}")
        except Exception as exc:  # noqa: BLE001 - this request fails (its positions are removed), others go on
            self._fail(seq, f"evaluating an image failed: {exc}", 500)
            return
        slot.tokens += seq.rest[:n]
        seq.pending, seq.rest = split_at_image(seq.rest[n:])
        if not seq.pending and not seq.rest:  # the prompt ended with it: its logits are the last decode's only row
            now = time.perf_counter_ns()
            row = self._logits(1)[0]
            self._keep_first_row(seq, row)
            raw = row.copy() if seq.top_logprobs is not None else None
            if seq.grammar is not None:
                self._constrain(row, seq.grammar)
            token = sample_rows(row[None, :], [seq.sampler], [slot.tokens])[0]
            seq.first_at = seq.first_at or now
            self._accept(seq, token, raw)

    # -- sequences kept in host RAM ------------------------------------------------------------------------------
    def _find_saved(self, prompt: list[int], adapters: AdapterSet = ()) -> tuple[Saved | None, int]:
        best: Saved | None = None
        best_len = 0
        for entry in self.saved:
            if entry.adapters != adapters:
                continue
            n = common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        return best, min(best_len, len(prompt) - 1)

    def _save(self, slot: Slot) -> None:
        """Copy the slot's sequence to host RAM (unless it is already there or does not fit ``cache_bytes``), and
        its whole blocks not yet on disk to the disk cache."""
        self._persist(slot)
        if self.cache_bytes <= 0 or not slot.tokens:
            return
        tokens, key = slot.tokens, slot.adapters
        if any(e.adapters == key and common_prefix(e.tokens, tokens) == len(tokens) for e in self.saved):
            return  # a saved sequence already covers it
        size = int(self.lc.llama_state_seq_get_size(self.ctx, slot.seq_id))
        if size <= 0 or size + size // 4 > self.cache_bytes:
            return
        buffer = self._buffer(size)
        if int(self.lc.llama_state_seq_get_data(self.ctx, _bytes_ptr(buffer), size, slot.seq_id)) != size:
            self.spare.append(buffer)
            return
        self._drop(lambda e: e.adapters == key and common_prefix(e.tokens, tokens) == len(e.tokens))  # it covers these
        self.saved.append(
            Saved(tokens=list(tokens), buffer=buffer, size=size, shifted_at=slot.shifted_at, adapters=key)
        )
        while self.saved_size > self.cache_bytes and (self.spare or len(self.saved) > 1):
            if not self.spare:
                self._drop(lambda e: e is self.saved[0])  # the oldest: its buffer becomes the spare freed next
            self.saved_size -= self.spare.pop(0).nbytes

    def _buffer(self, size: int) -> np.ndarray:
        """RAM for a saved sequence: a spare buffer that fits without wasting half of it, else a new one. Numpy,
        not a ctypes array (whose creation fills it byte by byte: ~100 ms for the 28 MB of a 1,224-token SmolLM2
        sequence); and a spare rather than fresh memory, whose first write faults every page in (25-60 ms for
        those 28 MB on 2 cores, against ~3 ms for the copy into memory already touched)."""
        fits = [b for b in self.spare if size <= b.nbytes <= 2 * size]
        if fits:
            buffer = min(fits, key=lambda b: b.nbytes)
            self.spare = [b for b in self.spare if b is not buffer]  # by identity: == on arrays compares bytes
            return buffer
        capacity = size + size // 4  # room for the conversation to grow by a turn and still fit when saved again
        self.saved_size += capacity
        return np.empty(capacity, dtype=np.uint8)

    def _drop(self, which: Callable[[Saved], bool]) -> None:
        keep = []
        for entry in self.saved:
            if which(entry):
                self.spare.append(entry.buffer)
            else:
                keep.append(entry)
        self.saved = keep

    def _restore(self, entry: Saved, slot: Slot) -> bool:
        """Load a saved sequence into ``slot`` (it leaves the saved list: the slot holds it now)."""
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
        read = int(self.lc.llama_state_seq_set_data(self.ctx, _bytes_ptr(entry.buffer), entry.size, slot.seq_id))
        self._drop(lambda e: e is entry)
        if read <= 0:
            self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, -1, -1)
            slot.tokens, slot.shifted_at, slot.persisted = [], None, 0
            return False
        slot.tokens, slot.shifted_at, slot.persisted = list(entry.tokens), entry.shifted_at, 0
        slot.adapters = entry.adapters
        return True

    def _reap_cancelled(self) -> None:
        with self._cv:
            gone = [q for q in self.waiting if q.cancelled]  # left before they got a slot
        for seq in gone:
            self._finish(seq, "stop")
        for slot in self.slots:
            if slot.seq is not None and slot.seq.cancelled:
                self._finish(slot.seq, "stop")

    def _step(self) -> None:
        # What each sequence puts in this step: a decoding one its sampled token, a prefilling one (oldest first) a
        # chunk of its prompt within what is left of the batch. Except that newcomers whose whole prompts fit in one
        # batch get a step of their own first: their first token then comes after a pass over their own few tokens
        # instead of after a pass over every running sequence's too (one newcomer beside 15 running sequences on 2
        # CPU cores: ~9 ms instead of ~70), and the running sequences wait one short pass for it. Not twice in a
        # row unless the newcomers outnumber the running sequences (a burst of arrivals), so a stream of arrivals
        # cannot stall decoding; a longer prompt is prefilled in chunks alongside decoding.
        plan: dict[int, list[int]] = {}
        turn = self._turn()  # the adapter set whose sequences this step serves (all of them when there is one set)
        prefilling = [s.seq for s in self.slots if s.seq is not None and s.seq.pending and s.seq.adapters == turn]
        alone = False
        if prefilling and sum(len(q.pending) for q in prefilling) <= min(self.n_batch, self.chunk):
            running = sum(
                1 for s in self.slots if s.seq is not None and s.seq.next_token is not None and s.seq.adapters == turn
            )
            alone = running > 0 and (not self._alone_last or len(prefilling) >= running)
        self._alone_last = alone
        for slot in self.slots:
            seq = slot.seq
            if alone or seq is None or seq.next_token is None or seq.adapters != turn:
                continue
            if len(slot.tokens) + 1 > self.n_ctx_slot and not self._shift(seq):
                self._finish(seq, "length")
                continue
            plan[slot.seq_id] = [seq.next_token]
            seq.next_token = None
        if plan:
            self._draft(plan)
        budget = min(self.n_batch - sum(len(t) for t in plan.values()), self.chunk)
        decode_only = not alone and not (prefilling and budget > 0)  # a step the cost model learns from
        if prefilling and budget > 0:
            for seq in sorted(prefilling, key=lambda q: q.started):
                if budget <= 0:
                    break
                assert seq.slot is not None
                chunk = seq.pending[:budget]
                del seq.pending[: len(chunk)]
                plan[seq.slot.seq_id] = chunk
                budget -= len(chunk)
        if not plan:
            return
        switched = turn != self._applied
        started = time.perf_counter()
        self._apply_adapters(turn)
        self._served[turn] = started
        self._decode_plan(plan, decode_only and not switched)
        # A switch's cost: the first step of a turn against the next, of the same sequences. Whole steps, the
        # logits' read included: on a GPU llama_decode returns before the card is done, and the wait is there.
        took = time.perf_counter() - started
        rows = len(plan)
        if switched:
            self._after_switch = (took, rows) if decode_only else None
        elif self._after_switch is not None:
            first, first_rows = self._after_switch
            self._after_switch = None
            if decode_only and rows == first_rows:
                self.switch_cost = 0.7 * self.switch_cost + 0.3 * max(0.0, first - took)

    def _turn(self) -> AdapterSet:
        """The LoRA adapter set this step serves (TURN_*): the one the context holds while it has work and its turn
        lasts, else the set with work served longest ago (one never served first)."""
        sets = {
            s.seq.adapters for s in self.slots if s.seq is not None and (s.seq.next_token is not None or s.seq.pending)
        }
        now = time.perf_counter()
        if self._applied in sets:
            if len(sets) == 1:
                return self._applied
            length = min(TURN_MAX, self.switch_cost * (1 - TURN_SWITCH_SHARE) / TURN_SWITCH_SHARE)
            if now - self._turn_since < length:
                return self._applied
            sets.discard(self._applied)
        if not sets:
            return self._applied
        turn = min(sets, key=lambda k: (self._served.get(k, 0.0), k))
        self._turn_since = now
        for gone in [k for k in self._served if k not in sets and k != self._applied and k != turn]:
            del self._served[gone]  # forgotten once idle: a set coming back is served as a newcomer
        return turn

    # -- LoRA adapters (engine thread: through ``call``) -------------------------------------------------------------
    def add_adapter(self, path: str, ptr: Any) -> None:
        """An adapter the runner loaded (``llama_adapter_lora_init``), usable by requests from now on."""
        self.adapter_ptrs[path] = ptr
        self._drop_later.discard(path)

    def drop_adapters(self, paths: tuple[str, ...]) -> list[str]:
        """Free these adapters: now when no sequence uses them, else when the last that does ends (no new request
        may use them meanwhile). The adapters still loaded, in load order."""
        for path in paths:
            if path in self.adapter_ptrs:
                self._drop_later.add(path)
        self._free_unused()
        return list(self.adapter_ptrs)

    def _free_unused(self) -> None:
        if not self._drop_later:
            return
        with self._cv:
            seqs = [s.seq for s in self.slots if s.seq is not None] + list(self.waiting)
        used = {path for q in seqs for path, _ in q.adapters}
        for path in sorted(self._drop_later - used):
            if any(path == p for p, _ in self._applied):
                self._apply_adapters(())  # the context lets go of it first
            self.lc.llama_adapter_lora_free(self.adapter_ptrs.pop(path))
            self._drop_later.discard(path)

    def _apply_adapters(self, key: AdapterSet) -> None:
        """Make the context compute under the LoRA adapters ``key`` (llama.cpp does nothing when they are set)."""
        if key == self._applied:
            return
        lc, n = self.lc, len(key)
        if n:
            ptrs = (lc.llama_adapter_lora_p_ctypes * n)(*(self.adapter_ptrs[path] for path, _ in key))
            scales = (ctypes.c_float * n)(*(scale for _, scale in key))
            rc = lc.llama_set_adapters_lora(self.ctx, ptrs, n, scales)
        else:
            rc = lc.llama_set_adapters_lora(self.ctx, None, 0, None)
        if rc != 0:
            raise EngineError(f"llama.cpp could not apply the LoRA adapters ({rc})", 500)
        self._applied = key

    def _decode_plan(self, plan: dict[int, list[int]], decode_only: bool) -> None:
        """One ``llama_decode`` of the tokens ``plan`` puts after each slot's KV, and the sampling of every
        sequence that gets logits from it (``_verify`` when some verify drafts)."""
        lc, batch = self.lc, self._batch
        # laid out in sequence-id order: llama.cpp splits a batch over several KV streams into passes of consecutive
        # sequence ids with as many tokens each, so out of order it would run extra passes. The batch's arrays are
        # numpy arrays of this engine's (``_batch_arrays``): filled with four slice assignments, not per token.
        toks: list[int] = []
        poss: list[int] = []
        sids: list[int] = []
        rows: list[int] = []  # batch indices that want logits
        outputs: list[Seq] = []  # the sequences that get logits rows, in batch order
        drafting = False  # some sequence verifies a draft: a row per position it put in
        for slot in self.slots:
            seq = slot.seq
            if seq is None:
                continue
            take = plan.get(slot.seq_id)
            if not take:
                continue
            k, at = len(take), len(slot.tokens)
            toks += take
            poss += range(at, at + k)
            sids += [slot.seq_id] * k
            slot.tokens += take
            if seq.spec is not None and seq.spec.pending:
                rows += range(len(toks) - k, len(toks))
                outputs.append(seq)
                drafting = True
            elif not seq.pending and not seq.rest:  # an image still to come: no logits yet
                rows.append(len(toks) - 1)
                outputs.append(seq)
        n = len(toks)
        if n == 0:
            return
        self._tok[:n] = toks
        self._pos[:n] = poss
        self._sid[:n] = sids
        self._want[:n] = 0
        self._want[rows] = 1
        batch.n_tokens = n
        if self._before_first_decode is not None:
            hook, self._before_first_decode = self._before_first_decode, None
            hook()
        started = time.perf_counter_ns()
        rc = lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed ({rc}): the context is full or the batch is too large", 500)
        now = time.perf_counter_ns()
        seconds = (now - started) / 1e9
        if decode_only:
            self.spec_cost.observe_step(n, seconds)
        if drafting:
            self._verify(outputs, self._logits(len(rows)), now)
            return
        # a view of llama.cpp's logits, not a copy: they are read (and penalised in place) before the next decode
        logits = self._logits(len(outputs))
        for i, q in enumerate(outputs):
            if q.first_at == 0:
                self._keep_first_row(q, logits[i])
        samplers = [q.sampler for q in outputs]
        windows = [q.slot.tokens if q.slot else [] for q in outputs]
        if not any(q.top_logprobs is not None or q.grammar is not None for q in outputs):
            # the usual step: no logprobs, no grammar (greedy rows of it take one argmax over all rows together)
            tokens = sample_rows(logits, samplers, windows)
            for seq, tok in zip(outputs, tokens, strict=True):
                if seq.first_at == 0:
                    seq.first_at, self._first_token = now, True
                self._accept(seq, tok, None)
            return
        lp_rows = {i: logits[i].copy() for i, q in enumerate(outputs) if q.top_logprobs is not None}
        constrained = [i for i, q in enumerate(outputs) if q.grammar is not None]
        unconstrained = {i: logits[i].copy() for i in constrained}
        tokens = sample_rows(logits, samplers, windows)
        for i in constrained:
            # as llama.cpp's common sampler: check the free choice against the grammar (cheap), and only when the
            # grammar rejects it apply the grammar to the whole vocabulary (expensive) and draw again
            if not self._allows(outputs[i].grammar, tokens[i]):
                row = unconstrained[i]
                self._constrain(row, outputs[i].grammar)
                tokens[i] = sample_rows(row[None, :], [outputs[i].sampler], [windows[i]])[0]
        for i, (seq, tok) in enumerate(zip(outputs, tokens, strict=True)):
            if seq.first_at == 0:
                seq.first_at, self._first_token = now, True
            self._accept(seq, tok, lp_rows.get(i))

    # -- speculative decoding (speculative.py) --------------------------------------------------------------------
    def _draft(self, plan: dict[int, list[int]]) -> None:
        """Add drafts to the step's plan: after each speculating sequence's next token, the tokens prompt lookup
        (its history's last n-gram seen before) or else the draft model proposes, as many as its adaptive length,
        its context, its token limit and the batch allow. Nothing while more sequences decode than
        ``spec_max_streams``: there the step is no longer bound by reading the weights."""
        if len(plan) > self.spec_max_streams:
            return
        room = self.n_batch - sum(len(t) for t in plan.values())
        decoding = len(plan)
        cost = self.spec_cost
        model_jobs: list[tuple[int, list[int], int, float]] = []
        want: dict[int, Seq] = {}
        for sid in plan:
            slot = self.slots[sid]
            seq = slot.seq
            spec = seq.spec if seq is not None else None
            if seq is None or spec is None:
                continue
            history = slot.tokens + plan[sid]  # what the KV holds, and the sampled token about to join it
            cap = min(spec.draft_max, self.n_ctx_slot - len(history), seq.limit - len(seq.generated) - 1, room)
            if cap <= 0 or cap < spec.draft_min:
                continue
            spec.idle_steps += 1
            # every EXPLORE_EVERY steps without a draft, one as if its drafts were doing well: they may be now
            explore = spec.idle_steps >= EXPLORE_EVERY
            need = max(1, spec.draft_min)
            if spec.index is not None:
                rate = max(spec.lookup.rate, 0.75) if explore else spec.lookup.rate
                k = cost.best_k(rate, cap, decoding, model=False)
                if spec.drafted == 0:  # its first lookup that finds something is verified whatever the cost model
                    k = max(k, min(cap, 2))  # says: its own acceptance, and counts that show lookup at work
                drafted = spec.index.draft(history, k) if k >= need else []
                if len(drafted) >= need:
                    spec.pending, spec.from_model, spec.idle_steps = drafted, False, 0
                    room -= len(drafted)
                    continue
            if spec.use_model:
                rate = max(spec.model.rate, 0.75) if explore else spec.model.rate
                k = cost.best_k(rate, cap, decoding, model=True)
                p_min = spec.p_min
                if not spec.probed:  # each request's draft model drafts once whatever it costs or trusts: its
                    spec.probed = True  # acceptance, and counts that say the draft is there and what it is worth
                    k, p_min = max(k, min(cap, 2)), 0.0
                if k >= need:
                    model_jobs.append((sid, history, k, p_min))
                    want[sid] = seq
                    room -= k
        if model_jobs and self.draft is not None:
            try:
                drafts = self.draft.draft(model_jobs)
            except Exception:  # noqa: BLE001 - the step goes on without these drafts (the streams start over)
                drafts = {}
            cost.observe_draft(self.draft.rounds, self.draft.round_seconds)
            for sid, seq in want.items():
                drafted = drafts.get(sid, [])
                if seq.spec is not None and len(drafted) >= max(1, seq.spec.draft_min):
                    seq.spec.pending, seq.spec.from_model, seq.spec.idle_steps = drafted, True, 0
        for sid in plan:
            seq = self.slots[sid].seq
            if seq is not None and seq.spec is not None and seq.spec.pending:
                plan[sid] = plan[sid] + seq.spec.pending

    def _verify(self, outputs: list[Seq], logits: np.ndarray, now: int) -> None:
        """Sample a step in which some sequences verify drafts. Each such sequence has a logits row per position
        it put in; the target samples each position itself, in order, and the drafted token that follows is kept
        while it is what the target sampled, so the output is the target's own (greedy: token for token; sampled:
        its distribution, each draw made as without a draft). The positions after the first disagreement leave
        the KV cache."""
        at = 0
        for seq in outputs:
            spec, slot = seq.spec, seq.slot
            assert slot is not None
            drafts = spec.pending if spec is not None else []
            base = len(slot.tokens) - len(drafts) - 1  # what the slot held before this step
            j = 0
            while True:
                row = logits[at + j]
                if seq.first_at == 0:
                    self._keep_first_row(seq, row)
                    seq.first_at, self._first_token = now, True
                raw = row.copy() if seq.top_logprobs is not None else None
                # the penalty window is what the KV holds up to this position (a copy: only when penalised)
                window = slot.tokens[: base + j + 1] if seq.sampler.penalised else []
                tok = self._sample_one(seq, row, window)
                self._accept(seq, tok, raw)
                if seq.slot is not slot or j == len(drafts) or tok != drafts[j]:
                    break
                j += 1
            at += len(drafts) + 1
            if drafts and spec is not None:
                keep = base + j + 1
                if keep < len(slot.tokens):
                    self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, keep, -1)
                    self._trim(slot, keep)
                spec.verified(len(drafts), j)
                spec.pending = []

    def _sample_one(self, seq: Seq, row: np.ndarray, window: list[int]) -> int:
        """One token from one row (penalised in place), under the sequence's grammar as ``_step`` applies it."""
        if seq.grammar is None:
            return sample_rows(row[None, :], [seq.sampler], [window])[0]
        free = row.copy()
        tok = sample_rows(row[None, :], [seq.sampler], [window])[0]
        if self._allows(seq.grammar, tok):
            return tok
        self._constrain(free, seq.grammar)
        return sample_rows(free[None, :], [seq.sampler], [window])[0]

    def _logits(self, rows: int) -> np.ndarray:
        addr = ctypes.cast(self.lc.llama_get_logits(self.ctx), ctypes.c_void_p).value
        kind = self._row_types.get(rows)
        if kind is None:
            kind = self._row_types[rows] = ctypes.c_float * (rows * self.n_vocab)
        assert addr is not None, "llama.cpp returned no logits"
        view: Any = kind.from_address(addr)  # a ctypes array over llama.cpp's buffer (the buffer protocol)
        return np.frombuffer(view, dtype=np.float32).reshape(rows, self.n_vocab)

    def _shift(self, seq: Seq) -> bool:
        """Make room for one more token: drop half of what follows ``num_keep`` (Ollama's context shift)."""
        slot = seq.slot
        assert slot is not None
        if not seq.shift or not self.lc.llama_memory_can_shift(self.mem):
            return False
        n_past = len(slot.tokens)
        discard = (n_past - seq.num_keep) // 2
        if discard <= 0:
            return False
        keep = seq.num_keep
        self.lc.llama_memory_seq_rm(self.mem, slot.seq_id, keep, keep + discard)
        self.lc.llama_memory_seq_add(self.mem, slot.seq_id, keep + discard, -1, -discard)
        slot.tokens = slot.tokens[:keep] + slot.tokens[keep + discard :]
        slot.shifted_at = keep if slot.shifted_at is None else min(slot.shifted_at, keep)
        slot.persisted = min(slot.persisted, keep // self.disk.block) if self.disk is not None else 0
        return True

    def _accept(self, seq: Seq, token: int, raw: np.ndarray | None) -> None:
        if seq.cancelled:
            self._finish(seq, "stop")
            return
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(self.lc.llama_vocab_is_eog(self.vocab, token))
        if eog:
            self._finish(seq, "stop")
            return
        if seq.grammar is not None:
            self.lc.llama_sampler_accept(seq.grammar, token)
        seq.generated.append(token)
        seq.text += seq.decoder.decode(self._token_bytes(token))
        emit, hit = split_stop(seq.text, seq.stops)
        if emit:
            if not seq.shown:  # a stream's first text goes out at once (its time to first token)
                seq.shown = self._urgent = True
            lp = self._logprobs(raw, token, seq.top_logprobs or 0) if raw is not None else None
            self.emit(TokenReply(seq.rid, Token(emit, lp)))
        elif raw is not None:  # held back (may start a stop string): the logprob still belongs to the stream
            self.emit(TokenReply(seq.rid, Token("", self._logprobs(raw, token, seq.top_logprobs or 0))))
        if hit:
            seq.stop_hit = next((s for s in sorted(seq.stops, key=seq.text.find) if s in seq.text), None)
            seq.text = ""
            self._finish(seq, "stop")
            return
        seq.text = seq.text[len(emit) :]
        if len(seq.generated) >= seq.limit:
            self._finish(seq, "length")
            return
        seq.next_token = token

    def _logprobs(self, raw: np.ndarray, token: int, top: int) -> JSONObject:
        """Ollama's logprob entry: the token's text, log-probability and bytes, and its top alternatives."""
        lp = logprobs(raw, token, top)

        def entry(tok: int, value: float) -> JSONObject:
            data = self._token_bytes(tok)
            return {"token": data.decode("utf-8", errors="replace"), "logprob": value, "bytes": list(data)}

        out = entry(token, lp["logprob"])
        if top > 0:
            out["top_logprobs"] = [entry(t, v) for t, v in lp["top"]]
        return out

    def _token_bytes(self, token: int) -> bytes:
        """A token's bytes, from llama.cpp once per token id, then from a cache (a vocabulary does not change)."""
        data = self._pieces.get(token)
        if data is not None:
            return data
        n = self.lc.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            data = buf.raw[:n]
        else:
            data = self._piece.raw[:n]
        self._pieces[token] = data
        return data

    def _finish(self, seq: Seq, reason: Literal["stop", "length"]) -> None:
        if seq.text and not seq.cancelled:
            seq.text += seq.decoder.decode(b"", final=True)
            self.emit(TokenReply(seq.rid, Token(seq.text)))
        seq.text = ""
        ended = time.perf_counter_ns()
        first = seq.first_at or ended
        done = Done(
            done_reason=reason,
            # as Ollama (llama.cpp's cache_n + prompt_n): every prompt token, those reused from the cache included
            prompt_eval_count=len(seq.prompt),
            prompt_cached=seq.prompt_cached,
            prompt_eval_duration=max(1, first - seq.started),
            eval_count=len(seq.generated),
            eval_duration=max(1, ended - first),
            context=tuple([t for t in seq.prompt if t >= 0] + seq.generated),  # no image keys
            stop_sequence=seq.stop_hit,
            draft_n=seq.spec.drafted if seq.spec is not None else 0,
            draft_n_accepted=seq.spec.accepted if seq.spec is not None else 0,
        )
        self.emit(DoneReply(seq.rid, done))
        if seq.slot is not None and self.disk is not None:
            self._ended.append(seq.slot)  # its whole blocks go to disk at the next idle moment
        self._release(seq)

    def _fail_started(self, message: str, status: int) -> None:
        """Fail every request that left the queue: those in slots, and one caught half-way through admission."""
        with self._cv:
            queued = {id(q) for q in self.waiting}
            started = [q for q in self.by_rid.values() if id(q) not in queued]
        for seq in started:
            self._fail(seq, message, status)

    def _fail(self, seq: Seq, message: str, status: int) -> None:
        self.emit(ErrorReply(seq.rid, message, status))
        if seq.slot is not None:  # what the KV holds for it is no longer trusted
            self.lc.llama_memory_seq_rm(self.mem, seq.slot.seq_id, -1, -1)
            if self.draft is not None:
                self.draft.forget(seq.slot.seq_id)
            seq.slot.tokens, seq.slot.shifted_at, seq.slot.persisted = [], None, 0
        self._release(seq)

    def _release(self, seq: Seq) -> None:
        if seq.grammar is not None:
            self.lc.llama_sampler_free(seq.grammar)
            seq.grammar = None
        if seq.media is not None:  # libmtmd's chunks (the preprocessed images) are freed with the request
            seq.media.close()
            seq.media = None
        if seq.lookup is not None:
            seq.lookup.drop()
            seq.lookup = None
        with self._cv:
            self.by_rid.pop(seq.rid, None)
            if seq in self.waiting:
                self.waiting.remove(seq)
        slot = seq.slot
        if slot is not None and slot.seq is seq:
            if seq.next_token is not None:
                seq.next_token = None  # sampled but never decoded: the cache ends before it
            slot.seq = None
            slot.last_used = time.monotonic()
        seq.slot = None
        if self._drop_later and seq.adapters:
            self._free_unused()


def merge_pieces(out: list[Reply]) -> list[Reply]:
    """A stream's plain pieces of text in one send as one message, in order: what the daemon forwards as one line
    (one event through its parsers, one chunk on the wire) instead of one per token. A piece with logprobs stays
    a message of its own (a token's logprobs belong to it), and nothing joins a piece across another message of
    its stream (an end, an error)."""
    merged: list[Reply] = []
    open_at: dict[int, int] = {}  # stream id -> index in ``merged`` of its last plain piece, while it may grow
    for msg in out:
        rid = getattr(msg, "id", -1)
        if isinstance(msg, TokenReply) and msg.token.logprobs is None:
            at = open_at.get(rid)
            if at is not None:
                last = merged[at]
                assert isinstance(last, TokenReply)
                merged[at] = TokenReply(rid, Token(last.token.text + msg.token.text))
                continue
            open_at[rid] = len(merged)
        else:
            open_at.pop(rid, None)
        merged.append(msg)
    return merged


def check_token_ids(tokens: list[int], n_vocab: int) -> int | None:
    """The position of the first id that is not an int in ``0 <= id < n_vocab``, or None when all are."""
    if not tokens:
        return None
    try:
        if min(tokens) >= 0 and max(tokens) < n_vocab and all(type(t) is int for t in tokens):
            return None
    except TypeError:
        pass
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t < n_vocab:
            return i
    return None


def split_at_image(keys: list[int]) -> tuple[list[int], list[int]]:
    """(the text entries before the first image entry, the rest from it on): what the batched prefill takes, and
    what waits for the image's evaluation."""
    for i, k in enumerate(keys):
        if k < 0:
            return keys[:i], keys[i:]
    return keys, []


def _bytes_ptr(data: np.ndarray) -> Any:
    return data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists, by slice comparisons (C speed) and a binary
    search rather than a Python step per token: admitting a request compares its prompt (a long chat history, say)
    with every slot's tokens."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
