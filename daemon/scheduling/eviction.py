"""The scheduler's pure eviction policy: given what is loaded, what a new model needs and the budgets, decide.

No I/O, no clocks: every input is a value, so the policy is unit-tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from daemon.runners.base import MemoryUse


@dataclass(frozen=True)
class Loaded:
    key: str
    memory: MemoryUse
    busy: bool  # serving or loading: never evicted
    last_used: float


@dataclass(frozen=True)
class Budget:
    ram: int
    vram: int
    max_loaded: int  # 0 = no count limit
    shared: bool = False  # unified memory: the GPU's memory is the RAM, so VRAM use counts against ``ram`` too


@dataclass(frozen=True)
class Decision:
    action: Literal["load", "evict", "wait", "never"]
    victims: tuple[str, ...] = ()
    reason: str = ""


def _fits(used: MemoryUse, need: MemoryUse, budget: Budget, count: int) -> bool:
    return (
        used.ram + need.ram <= budget.ram
        and used.vram + need.vram <= budget.vram
        and (not budget.shared or used.ram + used.vram + need.ram + need.vram <= budget.ram)
        and (budget.max_loaded <= 0 or count + 1 <= budget.max_loaded)
    )


def _sum(items: list[Loaded]) -> MemoryUse:
    return MemoryUse(ram=sum(i.memory.ram for i in items), vram=sum(i.memory.vram for i in items))


def decide(loaded: list[Loaded], need: MemoryUse, budget: Budget) -> Decision:
    """What to do so a model needing ``need`` can load.

    - ``load``: it fits now.
    - ``evict``: unload ``victims`` (idle models, least recently used first, as few as needed), then it fits.
    - ``wait``: it fits only once busy models finish; nothing idle is worth evicting yet.
    - ``never``: it does not fit even with nothing else loaded.
    """
    if need.ram > budget.ram or need.vram > budget.vram:
        which = "RAM" if need.ram > budget.ram else "VRAM"
        have, want = (budget.ram, need.ram) if which == "RAM" else (budget.vram, need.vram)
        return Decision("never", reason=f"{which}: needs {want} bytes, budget {have} bytes")
    if budget.shared and need.ram + need.vram > budget.ram:
        return Decision(
            "never",
            reason=f"RAM (shared with the GPU): needs {need.ram + need.vram} bytes, budget {budget.ram} bytes",
        )
    if _fits(_sum(loaded), need, budget, len(loaded)):
        return Decision("load")
    idle = sorted((i for i in loaded if not i.busy), key=lambda i: (i.last_used, i.key))
    remaining = list(loaded)
    victims: list[str] = []
    for candidate in idle:
        remaining = [i for i in remaining if i.key != candidate.key]
        victims.append(candidate.key)
        if _fits(_sum(remaining), need, budget, len(remaining)):
            return Decision("evict", victims=tuple(victims))
    # Even with every idle model gone it would not fit: wait for busy ones to finish, evicting nothing yet.
    return Decision("wait", reason="waiting for busy models to finish")
