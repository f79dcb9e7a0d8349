"""The runner protocol: every message between the daemon and a runner child, typed, each with one encoding.

Both sides import this module: the daemon (``daemon/runners/process.py``) builds ops from it and reads replies with
it, the runner child (``daemon/llama/runner.py``, ``engine.py``) reads ops and builds replies. So it imports only the
standard library and ``modelfile.params`` (the one table of option defaults, which ``SampleParams`` starts from);
nothing here touches llama.cpp, numpy or the daemon. docs/runner-protocol.md describes the lifecycle and lists every
message; a test checks that it names every class here.

Framing: a 4-byte big-endian length, then that many bytes of UTF-8 JSON, one object per frame, on the child's
stdin (ops, with an ``"op"`` key) and its original stdout (replies, with a ``"type"`` key). A message is a frozen
dataclass; :func:`encode` writes it (fields in order, a field whose value is None left out, a ``flat`` value's
fields spread into the message), :func:`decode_op` and :func:`decode_reply` read one back and check every field
against its annotation. A frame that is not a message of this protocol raises :class:`ProtocolError` (a
ValueError), never a KeyError or TypeError deep in a handler.

Frames are small on purpose: the engine sends one frame per step with every sequence's tokens in it
(:class:`BatchReply`), a token is ``{"type":"token","id":1,"text":"..."}``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar, Literal, TypeAlias

from modelfile.params import DEFAULT_OPTIONS, SPECULATIVE_DEFAULTS

MAX_FRAME = 256 * 1024 * 1024
HEADER = struct.Struct(">I")

#: A JSON value as ``json.loads`` gives it.
JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"

# Ollama's accepted names (fs/ggml ParseFileType; upper-cased first) -> llama.cpp's LLAMA_FTYPE: the TYPE argument of
# the quantize worker (daemon/llama/quantize.py), checked by the daemon (daemon/runners/quantize.py)
QUANT_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q4_K": 15, "BF16": 32}

MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
BIAS_LIMIT = 100.0  # biases lie in [-100, 100], as OpenAI's; -100 bans the token outright


SLOT_NAME_MAX = 128  # characters of a saved slot's filename
_SLOT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
SLOT_NAME_RULE = (
    f"a saved slot's filename is a plain name of 1 to {SLOT_NAME_MAX} letters, digits, '_', '-' and '.', not starting "
    "with '.' (no folders: the file goes to this model's saved slots under CORRAL_KV_DISK_DIR)"
)


def check_slot_name(name: object) -> str | None:
    """Why ``name`` cannot name a saved slot (``SlotSaveOp``, ``SlotRestoreOp``), None when it can: only a plain
    name, so a request never names a path. Checked by the daemon before the op is sent and by the runner again."""
    if not isinstance(name, str) or not name:
        return f"filename is missing: {SLOT_NAME_RULE}"
    if not _SLOT_NAME.fullmatch(name):
        shown = name if len(name) <= 60 else name[:60] + "..."
        return f"filename {shown!r} is not allowed: {SLOT_NAME_RULE}"
    return None


class ProtocolError(ValueError):
    """A frame that is not a message of the runner protocol: not a JSON object, an unknown op or reply type, a
    missing or ill-typed field. Says which message and field."""


def option_default(name: str) -> Any:
    """``modelfile.params.DEFAULT_OPTIONS[name]``, the one table of option defaults (typed loosely: callers read it
    through ``int()`` or ``float()``)."""
    return DEFAULT_OPTIONS[name] if name in DEFAULT_OPTIONS else SPECULATIVE_DEFAULTS[name]


# -- the values that cross the pipe --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadSpec:
    """Everything fixed when a model is loaded; a request that needs different values reloads the model."""

    model_path: str
    adapters: tuple[str, ...] = ()
    num_ctx: int = 4096  # per sequence slot
    num_batch: int = 512
    num_gpu: int = 0  # llama.cpp n_gpu_layers: the output layer counts as one (n_layer + 1 or -1 = all)
    num_thread: int = 0  # 0 = physical cores
    # the logical CPUs the runner may use, as the daemon counts them (daemon/hardware.py: CPU affinity and a
    # container's CPU quota); 0 = those its affinity allows
    cpus: int = 0
    use_mmap: bool | None = None
    num_parallel: int = 1
    embedding: bool = False
    prompt_cache: int = 0  # bytes of host RAM for sequences saved from reused slots (counted as the model's RAM)
    flash_attn: str = "auto"  # "auto" (llama.cpp decides), "on" or "off" (CORRAL_FLASH_ATTENTION)
    kv_cache_type: str = (
        "f16"  # f16, q8_0 or q4_0 for both K and V (CORRAL_KV_CACHE_TYPE; quantized needs flash attention)
    )
    main_gpu: int = 0  # the GPU that holds the whole model when it is not split, and the small tensors when it is
    tensor_split: tuple[float, ...] = ()  # share of the offloaded layers per GPU (empty: llama.cpp's own split)
    extra_bufts: bool = True  # llama.cpp's extra CPU buffer types (weight repacking, AMX); off is the safe fallback
    rerank: bool = False  # with embedding: pooling type rank (a reranker's score per query/document pair)
    projector_path: str = ""  # the vision projector (mmproj) GGUF loaded with the model, or "" for none
    # the prompt cache on disk (daemon/runners/kvstore.py): its root directory, shared by every runner
    # (CORRAL_KV_DISK_DIR), or "" for none (embedding runners, CORRAL_KV_DISK=0); its bound in bytes over the whole
    # directory (CORRAL_KV_DISK); and the daemon's part of the cache key: canonical JSON (sorted keys, no spaces) of
    # {"model": blob digest, "adapters": [digests], "projector": digest or "", "kv_type", "flash_attn", "rope":
    # {the model's rope/context metadata}}, digests as "sha256:<hex>". The runner adds the llama.cpp build and hashes
    # the whole into the key; "model", "adapters" and "projector" go into the key directory's meta.json, which
    # `corral prune` reads
    kv_disk_dir: str = ""
    kv_disk_bytes: int = 0
    kv_key: str = ""
    # speculative decoding (issue 28): a draft model loaded beside the target in this runner ("" for none; the
    # daemon has checked that it shares the target's vocabulary), and the draft's n_gpu_layers (same counting as
    # ``num_gpu``)
    draft_path: str = ""
    draft_num_gpu: int = 0
    # one model over several hosts (issue 30, CORRAL_RPC_SERVERS): the llama.cpp rpc-servers ("host:port") this
    # runner offloads layers to, llama.cpp's first devices; with them, ``tensor_split`` has one share per server
    # (in this order), then one per local GPU (daemon/rpc.py, daemon/llama/rpc.py)
    rpc_servers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SampleParams:
    """Per-request generation settings (Ollama option names and meanings). Sent whole with each generation and
    read once by the runner: its sampler (``daemon/llama/sampling.py`` ``SeqSampler``) holds this value."""

    # the defaults are modelfile.params.DEFAULT_OPTIONS (the one table), as the options merge starts from it
    num_predict: int = int(option_default("num_predict"))
    temperature: float = float(option_default("temperature"))
    top_k: int = int(option_default("top_k"))
    top_p: float = float(option_default("top_p"))
    min_p: float = float(option_default("min_p"))
    typical_p: float = float(option_default("typical_p"))
    repeat_penalty: float = float(option_default("repeat_penalty"))
    repeat_last_n: int = int(option_default("repeat_last_n"))
    presence_penalty: float = float(option_default("presence_penalty"))
    frequency_penalty: float = float(option_default("frequency_penalty"))
    seed: int = int(option_default("seed"))
    stop: tuple[str, ...] = ()
    num_keep: int = int(option_default("num_keep"))
    grammar: str | None = None  # GBNF, for format="json"
    json_schema: str | None = None  # JSON schema text (format=<schema>); the runner turns it into a grammar
    logprobs: int | None = None  # None: off; n: each token's log-probability and its n most likely alternatives
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before every sampling step
    # (-100 bans the token, +100 all but forces it); checked once, by daemon.runners.base.parse_logit_bias, on the
    # daemon's side; ids < n_vocab by the runner (sampling.bias_arrays)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # speculative decoding, llama-server's names: at most ``draft_max`` tokens drafted per step (0: none), a draft
    # shorter than ``draft_min`` is not verified, the draft model stops drafting at a token it gives less than
    # ``draft_p_min`` probability; ``draft_ngram``: prompt lookup with n-grams of this length (0: off), used
    # with or without a draft model
    draft_max: int = int(option_default("draft_max"))
    draft_min: int = int(option_default("draft_min"))
    draft_p_min: float = float(option_default("draft_p_min"))
    draft_ngram: int = int(option_default("draft_ngram"))


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SampleParams = field(default_factory=SampleParams)
    add_special: bool = True  # let the tokenizer add BOS (false when the template already has it)
    context: tuple[int, ...] = ()  # tokens to put before the prompt (the deprecated generate `context`)
    shift: bool = True  # context shift instead of failing when the prompt is too long
    truncate: bool = True
    images: tuple[str, ...] = ()  # base64, one per media marker in the prompt, in order (daemon/chat/media.py)
    # LoRA adapters applied to this request's sequence (issue 29): (adapter GGUF path, scale) in the model's ADAPTER
    # order, scale 0 left out by the daemon. The runner loads each path once, the first time a request names it,
    # and keeps it until an AdaptersOp drops it; a runner serves every model over its base weights, whatever their
    # adapters. Empty: the base model alone.
    adapters: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Token:
    """A piece of generated text (already stop-string-filtered, UTF-8 complete)."""

    text: str
    logprobs: JSONObject | None = None  # Ollama's shape: token, logprob, bytes, top_logprobs


@dataclass(frozen=True)
class Done:
    done_reason: Literal["stop", "length"]
    prompt_eval_count: int  # every prompt token, as Ollama counts them
    prompt_eval_duration: int  # ns
    eval_count: int
    eval_duration: int  # ns
    prompt_cached: int = 0  # of prompt_eval_count, the tokens reused from the KV cache rather than evaluated
    context: tuple[int, ...] = ()  # prompt + response tokens
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    draft_n: int = 0  # tokens drafted (speculative decoding; llama-server's timings name)
    draft_n_accepted: int = 0  # of those, the tokens the model kept


@dataclass(frozen=True)
class Truncated:
    """The runner cut the prompt to fit its context (before evaluating any of it): its first ``num_keep`` tokens
    and its end were kept, ``kept_tokens`` of ``prompt_tokens``."""

    prompt_tokens: int
    kept_tokens: int
    num_keep: int
    num_ctx: int


@dataclass(frozen=True)
class Embedding:
    vectors: list[list[float]]
    prompt_eval_count: int


@dataclass(frozen=True)
class SlotInfo:
    """One of a runner's sequence slots: busy or not, and how many tokens its KV cache holds for reuse."""

    id: int
    busy: bool
    cached_tokens: int


@dataclass(frozen=True)
class KVDiskInfo:
    """A runner's prompt cache on disk, in its ``SlotsReply``: where and how big it may grow (the whole directory,
    every model's), what this model's key holds (blocks, bytes) and how lookups went (hits, misses, tokens
    restored instead of evaluated). ``enabled`` false with a ``reason`` when this model keeps none (a KV cache
    llama.cpp's state cannot be cut into blocks for); false with no reason when the daemon sent no directory."""

    dir: str = ""
    limit_bytes: int = 0
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    enabled: bool = False
    reason: str = ""


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner reports once loaded."""

    n_ctx: int  # the whole context (every slot's)
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    n_gpu_layers: int
    extra_bufts: bool
    flash_attn: str
    kv_cache_type: str
    num_parallel: int
    projector: bool  # a vision projector was loaded with the model
    projector_gpu: bool
    gpu_offload_supported: bool
    pid: int
    log_lines: tuple[str, ...] = ()  # llama.cpp's log of the load (the daemon reads buffer sizes from it)

    def public(self) -> dict[str, int | str | bool]:
        """The fields as a dict, without the log lines (``Runner.info``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "log_lines"}


#: A token's text (``PiecesOp``): a string, or its bytes where they are not valid UTF-8 alone.
Piece: TypeAlias = "str | list[int]"


# -- ops: daemon -> runner -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadOp:
    """The first op, once: load the model. Answered by stage replies, then ``LoadedReply`` or ``LoadErrorReply``."""

    op: ClassVar[str] = "load"
    spec: LoadSpec


@dataclass(frozen=True)
class GenerateOp:
    """Generate: ``TruncatedReply`` (at most once, first), ``TokenReply``s, then ``DoneReply`` or ``ErrorReply``."""

    op: ClassVar[str] = "generate"
    id: int
    req: GenerateRequest


@dataclass(frozen=True)
class CancelOp:
    """Stop generation ``id`` (read by the child's reader thread, so it reaches a generation between two steps):
    its ``DoneReply`` follows."""

    op: ClassVar[str] = "cancel"
    id: int


@dataclass(frozen=True)
class EmbedOp:
    op: ClassVar[str] = "embed"
    id: int
    inputs: tuple[str, ...]
    truncate: bool = True


@dataclass(frozen=True)
class SlotsOp:
    op: ClassVar[str] = "slots"
    id: int


@dataclass(frozen=True)
class TokenizeOp:
    op: ClassVar[str] = "tokenize"
    id: int
    text: str
    add_special: bool = True


@dataclass(frozen=True)
class DetokenizeOp:
    op: ClassVar[str] = "detokenize"
    id: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class RerankOp:
    op: ClassVar[str] = "rerank"
    id: int
    query: str
    documents: tuple[str, ...]
    truncate: bool = True


@dataclass(frozen=True)
class PiecesOp:
    op: ClassVar[str] = "pieces"
    id: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class SlotSaveOp:
    """Write what slot ``slot`` holds (its token ids and llama.cpp's state of its sequence) to the saved-slot file
    ``filename`` of this model (llama-server's ``/slots/{id}?action=save``): ``SlotSavedReply``. The file lies in
    the ``slots/`` folder of the model's cache key under the prompt cache's directory; ``filename`` is a plain name
    that the runner checks again (``check_slot_name``). Refused with an ``ErrorReply``: 400 a bad name or
    slot id, 409 the slot is serving a request, 501 this runner keeps no prompt cache on disk, 507 the file does not
    fit ``CORRAL_KV_DISK``."""

    op: ClassVar[str] = "slot_save"
    id: int
    slot: int
    filename: str


@dataclass(frozen=True)
class SlotRestoreOp:
    """Load the saved-slot file ``filename`` into slot ``slot`` (``/slots/{id}?action=restore``):
    ``SlotRestoredReply``; the slot then holds its tokens, and a request whose prompt starts with them reuses them.
    Refused with an ``ErrorReply``, the slot unchanged: 400 a bad name or slot id, a damaged file, one saved by
    another model or llama.cpp build, or one longer than a slot's context; 404 no such file; 409 the slot is
    serving a request; 501 no prompt cache on disk."""

    op: ClassVar[str] = "slot_restore"
    id: int
    slot: int
    filename: str


@dataclass(frozen=True)
class SlotEraseOp:
    """Empty slot ``slot``'s KV cache (``/slots/{id}?action=erase``): ``SlotErasedReply``. 400 a bad slot id, 409 the
    slot is serving a request."""

    op: ClassVar[str] = "slot_erase"
    id: int
    slot: int


@dataclass(frozen=True)
class AdaptersOp:
    """Free the LoRA adapters at these paths (a model over this base was deleted, or replaced): each is freed once
    no sequence uses it, at once if none does. ``AdaptersReply``: the adapters loaded after that."""

    op: ClassVar[str] = "adapters"
    id: int
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShutdownOp:
    """End the runner now (read by the reader thread). EOF on its stdin does the same."""

    op: ClassVar[str] = "shutdown"


Op: TypeAlias = (
    "LoadOp | GenerateOp | CancelOp | EmbedOp | SlotsOp | TokenizeOp | DetokenizeOp | RerankOp | PiecesOp"
    " | SlotSaveOp | SlotRestoreOp | SlotEraseOp | AdaptersOp | ShutdownOp"
)
#: An op that asks for one reply: the ``ErrorReply`` or the reply named here.
Call: TypeAlias = (
    "EmbedOp | SlotsOp | TokenizeOp | DetokenizeOp | RerankOp | PiecesOp | SlotSaveOp | SlotRestoreOp | SlotEraseOp"
    " | AdaptersOp"
)


# -- replies: runner -> daemon -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageReply:
    """What the load is doing now (``load``, ``warm-up``): progress, which restarts the daemon's load timeout and
    tells a crash at warm-up from one while loading."""

    type: ClassVar[str] = "stage"
    stage: str


@dataclass(frozen=True)
class LoadedReply:
    type: ClassVar[str] = "loaded"
    info: RunnerInfo


@dataclass(frozen=True)
class LoadErrorReply:
    """The model could not be loaded; the runner exits. ``message`` and ``log_lines`` may hold paths: the daemon
    logs them and shows a client only llama.cpp's known path-free reasons (``process.safe_load_reason``)."""

    type: ClassVar[str] = "load_error"
    message: str
    log_lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenReply:
    type: ClassVar[str] = "token"
    flat: ClassVar[str] = "token"
    id: int
    token: Token


@dataclass(frozen=True)
class DoneReply:
    type: ClassVar[str] = "done"
    flat: ClassVar[str] = "done"
    id: int
    done: Done


@dataclass(frozen=True)
class TruncatedReply:
    type: ClassVar[str] = "truncated"
    flat: ClassVar[str] = "truncated"
    id: int
    truncated: Truncated


@dataclass(frozen=True)
class ErrorReply:
    """Op ``id`` failed: status 400 is the request's fault (the daemon answers 400), anything else the runner's."""

    type: ClassVar[str] = "error"
    id: int
    message: str
    status: int = 500


@dataclass(frozen=True)
class EmbedReply:
    type: ClassVar[str] = "embedding"
    flat: ClassVar[str] = "embedding"
    id: int
    embedding: Embedding


@dataclass(frozen=True)
class SlotsReply:
    type: ClassVar[str] = "slots"
    id: int
    slots: tuple[SlotInfo, ...]
    kv_disk: KVDiskInfo = field(default_factory=KVDiskInfo)  # the prompt cache on disk (off: the default value)


@dataclass(frozen=True)
class TokensReply:
    """The answer to ``TokenizeOp``."""

    type: ClassVar[str] = "tokens"
    id: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class TextReply:
    """The answer to ``DetokenizeOp``."""

    type: ClassVar[str] = "text"
    id: int
    text: str


@dataclass(frozen=True)
class RerankReply:
    type: ClassVar[str] = "scores"
    id: int
    scores: tuple[float, ...]
    prompt_eval_count: int


@dataclass(frozen=True)
class PiecesReply:
    type: ClassVar[str] = "pieces"
    id: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class SlotSavedReply:
    """The answer to ``SlotSaveOp``: the tokens saved, the bytes of the file written and how long it took."""

    type: ClassVar[str] = "slot_saved"
    id: int
    slot: int
    filename: str
    n_saved: int
    n_written: int
    save_ms: float


@dataclass(frozen=True)
class SlotRestoredReply:
    """The answer to ``SlotRestoreOp``: the tokens the slot holds now, the bytes of the file read, how long it took."""

    type: ClassVar[str] = "slot_restored"
    id: int
    slot: int
    filename: str
    n_restored: int
    n_read: int
    restore_ms: float


@dataclass(frozen=True)
class AdaptersReply:
    """The answer to ``AdaptersOp``: the paths of the adapters loaded now (those still in use by a sequence
    included), in the order they were loaded."""

    type: ClassVar[str] = "adapters"
    id: int
    loaded: tuple[str, ...] = ()


@dataclass(frozen=True)
class SlotErasedReply:
    """The answer to ``SlotEraseOp``: the tokens the slot held."""

    type: ClassVar[str] = "slot_erased"
    id: int
    slot: int
    n_erased: int


@dataclass(frozen=True)
class BatchReply:
    """Several replies in one frame: what an engine step produced for all its sequences (one JSON encoding, one
    write, one wake-up of the daemon per step)."""

    type: ClassVar[str] = "batch"
    msgs: tuple[Reply, ...]


Reply: TypeAlias = (
    "StageReply | LoadedReply | LoadErrorReply | TokenReply | DoneReply | TruncatedReply | ErrorReply | EmbedReply"
    " | SlotsReply | TokensReply | TextReply | RerankReply | PiecesReply | SlotSavedReply | SlotRestoredReply"
    " | SlotErasedReply | AdaptersReply | BatchReply"
)
Message: TypeAlias = "Op | Reply"

OPS: tuple[type[Op], ...] = (
    LoadOp,
    GenerateOp,
    CancelOp,
    EmbedOp,
    SlotsOp,
    TokenizeOp,
    DetokenizeOp,
    RerankOp,
    PiecesOp,
    SlotSaveOp,
    SlotRestoreOp,
    SlotEraseOp,
    AdaptersOp,
    ShutdownOp,
)
REPLIES: tuple[type[Reply], ...] = (
    StageReply,
    LoadedReply,
    LoadErrorReply,
    TokenReply,
    DoneReply,
    TruncatedReply,
    ErrorReply,
    EmbedReply,
    SlotsReply,
    TokensReply,
    TextReply,
    RerankReply,
    PiecesReply,
    SlotSavedReply,
    SlotRestoredReply,
    SlotErasedReply,
    AdaptersReply,
    BatchReply,
)
#: the reply each call op is answered with (or an ErrorReply)
ANSWERS: dict[type[Call], type[Reply]] = {
    EmbedOp: EmbedReply,
    SlotsOp: SlotsReply,
    TokenizeOp: TokensReply,
    DetokenizeOp: TextReply,
    RerankOp: RerankReply,
    PiecesOp: PiecesReply,
    SlotSaveOp: SlotSavedReply,
    SlotRestoreOp: SlotRestoredReply,
    SlotEraseOp: SlotErasedReply,
    AdaptersOp: AdaptersReply,
}


# -- encoding ------------------------------------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    """One frame: the length, then the message as compact JSON."""
    data = json.dumps(wire(msg), separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(data)) + data


def wire(msg: Message) -> JSONObject:
    """The message as the JSON object the frame holds: ``op`` or ``type`` first, then its fields."""
    if type(msg) is TokenReply:  # the hot path: one per sequence and step
        token = msg.token
        if token.logprobs is None:
            return {"type": "token", "id": msg.id, "text": token.text}
        return {"type": "token", "id": msg.id, "text": token.text, "logprobs": token.logprobs}
    key, name = _HEADS[type(msg)]
    out: dict[str, Any] = {key: name}
    _put(msg, out)
    return out


def _put(value: object, out: dict[str, Any]) -> None:
    for name, kind in _layout(type(value)):
        v = getattr(value, name)
        if v is None:
            continue
        if kind == _FLAT:
            _put(v, out)
        elif kind == _VALUE:
            out[name] = _plain(v)
        elif kind == _VALUES:
            out[name] = [_plain(x) for x in v]
        elif kind == _MESSAGES:
            out[name] = [wire(x) for x in v]
        else:
            out[name] = v  # JSON writes tuples as arrays


def _plain(value: object) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _put(value, out)
    return out


_PLAIN, _FLAT, _VALUE, _VALUES, _MESSAGES = range(5)
_LAYOUTS: dict[type, tuple[tuple[str, int], ...]] = {}


def _layout(cls: type) -> tuple[tuple[str, int], ...]:
    """How each field of a message or value class is written: as it is, spread into its message (``flat``), as a
    nested object or array of objects."""
    got = _LAYOUTS.get(cls)
    if got is None:
        flat = getattr(cls, "flat", None)
        fields = []
        for f in dataclasses.fields(cls):
            t = str(f.type)
            if f.name == flat:
                kind = _FLAT
            elif t in _CLASSES:
                kind = _VALUE
            elif t.startswith("tuple[") and t[6:-6] in _CLASSES:
                kind = _VALUES
            elif t == "tuple[Reply, ...]":
                kind = _MESSAGES
            else:
                kind = _PLAIN
            fields.append((f.name, kind))
        got = _LAYOUTS[cls] = tuple(fields)
    return got


# -- decoding ------------------------------------------------------------------------------------------------------
def read_payload(f: BinaryIO) -> bytes | None:
    """Blocking read of one frame's bytes; None at EOF. A length over ``MAX_FRAME`` is a ProtocolError after which
    the stream cannot be read on (the frame is not consumed)."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes is too large")
    data = f.read(n)
    if len(data) < n:
        return None
    return data


def parse_payload(data: bytes) -> JSONObject:
    """A frame's bytes as its JSON object; ProtocolError if they are not one."""
    try:
        obj = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ProtocolError(f"a frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"a frame holds a JSON {type(obj).__name__}, not an object")
    return obj


_OP_CLASSES: dict[str, type[Op]] = {c.op: c for c in OPS}
_REPLY_CLASSES: dict[str, type[Reply]] = {c.type: c for c in REPLIES}
_HEADS: dict[type, tuple[str, str]] = {
    **{c: ("op", name) for name, c in _OP_CLASSES.items()},
    **{c: ("type", name) for name, c in _REPLY_CLASSES.items()},
}


def decode_op(obj: JSONObject) -> Op:
    """The op a frame holds; ProtocolError if it is not one."""
    name = obj.get("op")
    cls = _OP_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown operation {name!r}")
    op: Op = _read(cls, obj, f"op {name}")
    return op


def decode_reply(obj: JSONObject) -> Reply:
    """The reply a frame holds; ProtocolError if it is not one."""
    name = obj.get("type")
    if name == "token":  # the hot path, checked as the general one would
        rid, text, logprobs = obj.get("id"), obj.get("text"), obj.get("logprobs")
        if type(rid) is int and type(text) is str and (logprobs is None or type(logprobs) is dict):
            return TokenReply(rid, Token(text, logprobs))
    cls = _REPLY_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown reply type {name!r}")
    reply: Reply = _read(cls, obj, f"{name} reply")
    return reply


def request_id(obj: JSONObject) -> int | None:
    """The ``id`` of a frame that may not decode, to answer or fail that request alone."""
    rid = obj.get("id")
    return rid if type(rid) is int else None


def _read(cls: type[Any], obj: JSONObject, what: str) -> Any:
    """An instance of ``cls`` from ``obj``, each field checked; a missing field takes its default."""
    readers = _READERS.get(cls)
    if readers is None:
        readers = _READERS[cls] = _readers_of(cls)
    kwargs: dict[str, Any] = {}
    for name, read, required, flat in readers:
        if flat:
            kwargs[name] = read(obj, what)
            continue
        value = obj.get(name)
        if value is None:
            if required:
                raise ProtocolError(f"{what}: field {name!r} is missing")
            continue
        kwargs[name] = read(value, f"{what}: field {name!r}")
    return cls(**kwargs)


_Reader = Callable[[Any, str], Any]
_READERS: dict[type, tuple[tuple[str, _Reader, bool, bool], ...]] = {}


def _readers_of(cls: type) -> tuple[tuple[str, _Reader, bool, bool], ...]:
    flat = getattr(cls, "flat", None)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, _reader(str(f.type)), required, f.name == flat))
    return tuple(out)


def _bad(where: str, wanted: str, value: object) -> ProtocolError:
    shown = repr(value)
    return ProtocolError(f"{where} must be {wanted}, got {shown[:80]}")


def _int(v: Any, where: str) -> int:
    if type(v) is not int:
        raise _bad(where, "an integer", v)
    return v


def _float(v: Any, where: str) -> float:
    if type(v) not in (int, float):
        raise _bad(where, "a number", v)
    return float(v)


def _bool(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise _bad(where, "true or false", v)
    return v


def _str(v: Any, where: str) -> str:
    if type(v) is not str:
        raise _bad(where, "a string", v)
    return v


def _object(v: Any, where: str) -> JSONObject:
    if not isinstance(v, dict):
        raise _bad(where, "an object", v)
    return v


def _array(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(where, "an array", v)
    return v


def _tuple_of(item: _Reader) -> _Reader:
    return lambda v, where: tuple(item(x, where) for x in _array(v, where))


def _list_of(item: _Reader) -> _Reader:
    return lambda v, where: [item(x, where) for x in _array(v, where)]


def _bias_pair(v: Any, where: str) -> tuple[int, float]:
    pair = _array(v, where)
    if len(pair) != 2:
        raise _bad(where, "[token id, bias] pairs", v)
    return _int(pair[0], where), _float(pair[1], where)


def _adapter_pair(v: Any, where: str) -> tuple[str, float]:
    pair = _array(v, where)
    if len(pair) != 2:
        raise _bad(where, "[adapter path, scale] pairs", v)
    return _str(pair[0], where), _float(pair[1], where)


def _piece(v: Any, where: str) -> str | list[int]:
    return v if type(v) is str else [_int(x, where) for x in _array(v, where)]


def _done_reason(v: Any, where: str) -> Literal["stop", "length"]:
    if v == "stop" or v == "length":
        return v  # type: ignore[no-any-return]
    raise _bad(where, '"stop" or "length"', v)


def _value_of(cls: type) -> _Reader:
    return lambda v, where: _read(cls, _object(v, where), where)


def _reply(v: Any, where: str) -> Reply:
    return decode_reply(_object(v, where))


_SCALARS: dict[str, _Reader] = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "JSONObject": _object,
    "Piece": _piece,
    "tuple[int, float]": _bias_pair,
    "tuple[str, float]": _adapter_pair,
    "Literal['stop', 'length']": _done_reason,  # as ``from __future__ import annotations`` spells it
    "Reply": _reply,
}
_CLASSES: dict[str, type] = {
    c.__name__: c
    for c in (
        LoadSpec,
        SampleParams,
        GenerateRequest,
        Token,
        Done,
        Truncated,
        Embedding,
        SlotInfo,
        KVDiskInfo,
        RunnerInfo,
    )
}


def _reader(annotation: str) -> _Reader:
    """The check for a field from its annotation (this module's annotations are strings: ``from __future__``)."""
    if annotation.endswith(" | None"):
        return _reader(annotation[: -len(" | None")])  # None is a missing field: the default
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if annotation in _CLASSES:
        return _value_of(_CLASSES[annotation])
    if annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        return _tuple_of(_reader(annotation[6:-6]))
    if annotation.startswith("list[") and annotation.endswith("]"):
        return _list_of(_reader(annotation[5:-1]))
    raise TypeError(f"the runner protocol cannot read a field of type {annotation}")


for _cls in (*OPS, *REPLIES, *_CLASSES.values()):  # every reader and layout, built at import (an unknown type fails)
    _READERS[_cls] = _readers_of(_cls)
    _layout(_cls)
