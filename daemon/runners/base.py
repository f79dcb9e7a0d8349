"""The seam between the scheduler and whatever hosts a model: the Runner protocol and its values.

The scheduler only sees :class:`Runner`; production runners are child processes (``daemon/runners/process.py``),
tests use fakes. Nothing here imports llama_cpp.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from errors import CorralError
from modelfile.params import DEFAULT_OPTIONS


def option_default(name: str) -> Any:
    """``modelfile.params.DEFAULT_OPTIONS[name]``, the one table of option defaults (typed loosely: callers read it
    through ``int()`` or ``float()``)."""
    return DEFAULT_OPTIONS[name]


class RunnerError(CorralError):
    """A runner failed (status 500 unless the error says otherwise)."""

    status = 500


class LoadFailed(RunnerError):
    """The model could not be loaded. ``signal`` is set when the runner died by one (a native fault), with the
    ``stage`` it was at ("load" or "warm-up")."""

    def __init__(self, message: str, *, signal: int | None = None, stage: str = "load") -> None:
        super().__init__(message)
        self.signal = signal
        self.stage = stage


class RunnerCrashed(RunnerError):
    """The runner died while serving. ``early``: before it had finished any decode (its first decode crashed)."""

    def __init__(self, message: str, *, signal: int | None = None, early: bool = False) -> None:
        super().__init__(message)
        self.signal = signal
        self.early = early


@dataclass(frozen=True)
class LoadSpec:
    """Everything fixed when a model is loaded; a request that needs different values reloads the model."""

    model_path: str
    adapters: tuple[str, ...] = ()
    num_ctx: int = 4096  # per sequence slot
    num_batch: int = 512
    num_gpu: int = 0  # layers offloaded to the GPU (-1 = all)
    num_thread: int = 0  # 0 = physical cores
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


MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias
BIAS_LIMIT = 100.0  # biases lie in [-100, 100], as OpenAI's; -100 bans the token outright


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A ``logit_bias`` checked: OpenAI's object ``{"token id": bias}`` (ids as decimal strings) or pairs
    ``[[id, bias], ...]``; ids integers >= 0, biases finite numbers in [-100, 100], at most ``MAX_LOGIT_BIAS``
    entries. Pairs sorted by id (a repeated id keeps its last bias). ValueError says what is wrong (the caller
    names the field); the upper bound of the ids, the model's vocabulary, is checked by ``bias_arrays``."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for item in value:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError("must be an object of token ids and biases, or an array of [id, bias] pairs")
            items.append((item[0], item[1]))
    else:
        raise ValueError("must be an object mapping token ids (as strings) to biases between -100 and 100")
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"has {len(items)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str) and key.strip().lstrip("-").isdigit() and key.strip().isascii():
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise ValueError(f"keys must be token ids (integers, as strings), got {key!r}")
        if token < 0:
            raise ValueError(f"token id {token} is negative")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"bias for token {token} must be a number between -100 and 100, got {bias!r}")
        if not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ValueError(f"bias for token {token} must be between -100 and 100, got {bias!r}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SampleParams:
    """Per-request generation settings (Ollama option names and meanings)."""

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
    # (-100 bans the token, +100 all but forces it); checked by sampling.parse_logit_bias, ids < n_vocab by the runner
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SampleParams = field(default_factory=SampleParams)
    add_special: bool = True  # let the tokenizer add BOS (false when the template already has it)
    context: tuple[int, ...] = ()  # tokens to put before the prompt (the deprecated generate `context`)
    shift: bool = True  # context shift instead of failing when the prompt is too long
    truncate: bool = True
    images: tuple[str, ...] = ()  # base64, one per media marker in the prompt, in order (daemon/chat/media.py)


@dataclass(frozen=True)
class Token:
    """A piece of generated text (already stop-string-filtered, UTF-8 complete)."""

    text: str
    logprobs: dict[str, Any] | None = None  # Ollama's shape: token, logprob, bytes, top_logprobs


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


@dataclass(frozen=True)
class Truncated:
    """The runner cut the prompt to fit its context (before evaluating any of it): its first ``num_keep`` tokens
    and its end were kept, ``kept_tokens`` of ``prompt_tokens``."""

    prompt_tokens: int
    kept_tokens: int
    num_keep: int
    num_ctx: int


Event = Token | Done | Truncated


@dataclass(frozen=True)
class Embedding:
    vectors: list[list[float]]
    prompt_eval_count: int


@dataclass(frozen=True)
class MemoryUse:
    ram: int
    vram: int

    @property
    def total(self) -> int:
        return self.ram + self.vram


@runtime_checkable
class Runner(Protocol):
    spec: LoadSpec

    @property
    def pid(self) -> int | None: ...

    @property
    def memory(self) -> MemoryUse: ...

    def alive(self) -> bool: ...

    async def start(self) -> None:
        """Load the model; raise LoadFailed with llama.cpp's reason if it cannot be loaded."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        """Tokens as they are sampled, then one Done. Closing the iterator early cancels generation."""

    async def embed(self, inputs: list[str], *, truncate: bool = True) -> Embedding: ...

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    async def detokenize(self, tokens: list[int]) -> str: ...

    async def close(self) -> None:
        """Stop the runner; memory really comes back (the process ends)."""

    def info(self) -> dict[str, Any]:
        """What the runner reported after loading (n_ctx_train, n_vocab, gpu layers, buffer sizes...)."""
