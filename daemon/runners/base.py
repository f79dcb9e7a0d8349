"""The seam between the scheduler and whatever hosts a model: the Runner protocol and its values.

The scheduler only sees :class:`Runner`; production runners are child processes (``daemon/runners/process.py``),
tests use fakes. Nothing here imports llama_cpp.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from daemon.runners.protocol import (
    BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    Done,
    Embedding,
    GenerateRequest,
    KVDiskInfo,
    LoadSpec,
    Piece,
    RunnerInfo,
    SampleParams,
    SlotInfo,
    Token,
    Truncated,
    check_slot_name,
    option_default,
)
from errors import CorralError, InvalidRequest, NotFound, NotSupported, StoreError

# the values that cross the pipe live in the protocol module, which both sides import; the daemon's code takes them
# from here, with the Runner protocol they belong to
__all__ = [
    "BIAS_LIMIT",
    "MAX_LOGIT_BIAS",
    "Done",
    "Embedding",
    "Event",
    "GenerateRequest",
    "KVDiskInfo",
    "LoadFailed",
    "LoadSpec",
    "MemoryUse",
    "Piece",
    "Runner",
    "RunnerCrashed",
    "RunnerError",
    "RunnerInfo",
    "SampleParams",
    "SlotBusy",
    "SlotInfo",
    "SlotNoRoom",
    "SlotNotFound",
    "SlotRefused",
    "SlotResult",
    "SlotsUnavailable",
    "Token",
    "Truncated",
    "check_slot_name",
    "option_default",
    "parse_logit_bias",
]


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


class SlotRefused(InvalidRequest):
    """A slot action the runner refused as the request's fault: a bad filename or slot id, an empty slot to save,
    or a saved file this model cannot restore (damaged, another model's or llama.cpp build's, too long)."""


class SlotNotFound(NotFound):
    """No saved slot of that name for this model."""


class SlotBusy(CorralError):
    """The slot is serving a request (save, restore and erase wait for nothing: the client tries again)."""

    status = 409


class SlotNoRoom(StoreError):
    """A saved slot does not fit the prompt cache's bound (CORRAL_KV_DISK) even with every block evicted, or the
    disk is full."""

    status = 507


class SlotsUnavailable(NotSupported):
    """Saving slots needs the prompt cache on disk, which is off (CORRAL_KV_DISK=0) or cannot be kept for this
    model; llama-server answers 501 when it has no --slot-save-path."""

    status = 501


#: the error a slot action's ``ErrorReply`` becomes, by the status the runner gave it
SLOT_ERRORS: dict[int, type[CorralError]] = {
    400: SlotRefused,
    404: SlotNotFound,
    409: SlotBusy,
    501: SlotsUnavailable,
    507: SlotNoRoom,
}


@dataclass(frozen=True)
class SlotResult:
    """What a slot action did (llama-server's answer): ``tokens`` saved, restored or erased, ``bytes`` of the file
    written or read, and how long it took."""

    slot: int
    tokens: int
    filename: str = ""
    bytes: int = 0
    ms: float = 0.0


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


Event = Token | Done | Truncated


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

    async def token_pieces(self, tokens: list[int]) -> list[Piece]:
        """Each token's text: a string, or a list of byte values where it is not valid UTF-8 alone."""

    async def rerank(self, query: str, documents: list[str], *, truncate: bool = True) -> tuple[list[float], int]:
        """Each document's relevance score to ``query`` (a runner loaded with ``LoadSpec.rerank``), and the tokens
        evaluated."""

    async def slots(self) -> list[SlotInfo]:
        """The runner's sequence slots (none for an embedding runner)."""

    async def save_slot(self, slot: int, filename: str) -> SlotResult:
        """Write what ``slot`` holds to this model's saved slot ``filename`` (a plain name). Raises SlotRefused,
        SlotBusy, SlotNoRoom or SlotsUnavailable."""

    async def restore_slot(self, slot: int, filename: str) -> SlotResult:
        """Load this model's saved slot ``filename`` into ``slot``, which then serves a prompt that starts with its
        tokens as if it had evaluated them. Raises SlotNotFound, SlotRefused, SlotBusy or SlotsUnavailable; the
        slot is unchanged when it raises."""

    async def erase_slot(self, slot: int) -> SlotResult:
        """Empty ``slot``'s KV cache. Raises SlotRefused or SlotBusy."""

    async def drop_adapters(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        """Free the LoRA adapters at ``paths`` (each once no sequence uses it, at once if none does) and return the
        paths of the adapters loaded after that, those still in use included (``AdaptersOp``, issue 29)."""

    @property
    def kv_disk(self) -> KVDiskInfo | None:
        """The runner's prompt cache on disk as its last :meth:`slots` answer reported it (None before one, or for a
        runner that keeps none)."""

    async def close(self) -> None:
        """Stop the runner; memory really comes back (the process ends)."""

    def info(self) -> dict[str, int | str | bool]:
        """What the runner reported after loading (n_ctx_train, n_vocab, gpu layers, ...: ``RunnerInfo``)."""

    @property
    def exit_signal(self) -> int | None:
        """The signal that ended the runner, if one did (a native fault in llama.cpp)."""

    @property
    def decoded(self) -> bool:
        """A decode has finished: a crash from now on is not the configuration's first-decode fault."""
