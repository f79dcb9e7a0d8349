"""Fakes for the scheduler's unit tests (the real path is tested with real runners elsewhere)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from daemon.runners.base import (
    Done,
    Embedding,
    Event,
    GenerateRequest,
    KVDiskInfo,
    LoadFailed,
    LoadSpec,
    MemoryUse,
    Piece,
    SlotInfo,
    SlotRefused,
    SlotResult,
    SlotsUnavailable,
    Token,
)


class FakeRunner:
    instances: list[FakeRunner] = []
    exit_signal: int | None = None  # how it "died" (a test may set it)
    decoded = False  # a fake's death never counts as a crash after serving
    kv_disk: KVDiskInfo | None = None  # keeps no prompt cache on disk

    def __init__(self, spec: LoadSpec, memory: MemoryUse, *, load_delay: float = 0.0, fail: bool = False) -> None:
        self.spec = spec
        self._memory = memory
        self.load_delay = load_delay
        self.fail = fail
        self.started = False
        self.closed = False
        FakeRunner.instances.append(self)

    @property
    def pid(self) -> int | None:
        return None

    @property
    def memory(self) -> MemoryUse:
        return self._memory

    def alive(self) -> bool:
        return self.started and not self.closed

    async def start(self) -> None:
        await asyncio.sleep(self.load_delay)
        if self.fail:
            raise LoadFailed("fake load failure")
        self.started = True

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        for word in req.prompt.split():
            await asyncio.sleep(0)
            yield Token(word)
        yield Done("stop", 1, 1, 1, 1)

    async def embed(self, inputs: list[str], *, truncate: bool = True) -> Embedding:
        return Embedding([[1.0] for _ in inputs], len(inputs))

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    async def detokenize(self, tokens: list[int]) -> str:
        return "".join(map(chr, tokens))

    async def token_pieces(self, tokens: list[int]) -> list[Piece]:
        return [chr(t) for t in tokens]

    async def rerank(self, query: str, documents: list[str], *, truncate: bool = True) -> tuple[list[float], int]:
        return [float(len(set(query.split()) & set(d.split()))) for d in documents], len(documents)

    async def slots(self) -> list[SlotInfo]:
        return [SlotInfo(0, False, 0)]

    async def save_slot(self, slot: int, filename: str) -> SlotResult:
        raise SlotsUnavailable("the fake runner keeps no prompt cache on disk")

    async def restore_slot(self, slot: int, filename: str) -> SlotResult:
        raise SlotsUnavailable("the fake runner keeps no prompt cache on disk")

    async def erase_slot(self, slot: int) -> SlotResult:
        if slot != 0:
            raise SlotRefused(f"there is no slot {slot}: this model has slots 0 to 0")
        return SlotResult(slot, 0)  # its one slot holds nothing

    async def close(self) -> None:
        self.closed = True

    def info(self) -> dict[str, int | str | bool]:
        return {}
