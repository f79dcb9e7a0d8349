"""Work counted in steps, not timed (issue 26): a wall-clock bound in a test is the next CI flake on a loaded
machine, while the Python lines a piece of code runs are the same on every machine.

    with steps(budget=20_000) as taken:
        estimate(info, num_ctx=512)
    assert taken.lines < 5_000

The count is of ``line`` events (:func:`sys.settrace`) in every Python frame the block calls, on this thread. Past
``budget`` the block is stopped with :class:`TooManySteps`, so a loop that runs away (per declared layer, per byte)
fails at once instead of running for minutes. Work done in C (``[0] * n``, ``bytes.find``) is not counted: pair
this with a memory or size check where that matters."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class TooManySteps(AssertionError):
    """The block ran more Python lines than its budget."""


class Taken:
    def __init__(self) -> None:
        self.lines = 0


@contextmanager
def steps(budget: int) -> Iterator[Taken]:
    taken = Taken()

    def local(_frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line":
            taken.lines += 1
            if taken.lines > budget:
                raise TooManySteps(f"more than {budget} lines run")
        return local

    def call(_frame: FrameType, _event: str, _arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield taken
    finally:
        sys.settrace(previous)
