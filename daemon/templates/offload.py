"""Rendering a prompt off the event loop. Every function in :mod:`daemon.templates` is blocking (a template may take
up to its time bound, and a big chat its memory), so the daemon runs them through :func:`offload`."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

RENDER_CONCURRENCY = 2  # prompts rendered at once, in worker threads

V = TypeVar("V")

_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()
_SHARED_LIMITER: anyio.CapacityLimiter | None = None


async def offload(fn: Callable[..., V], *args: Any, **kwargs: Any) -> V:
    """``fn(*args, **kwargs)`` in a worker thread, at most :data:`RENDER_CONCURRENCY` at once (the rest wait
    without holding a thread), so a slow or heavy prompt never blocks the event loop and a crowd of them cannot
    multiply their memory."""
    global _SHARED_LIMITER
    loop = asyncio.get_running_loop()
    try:  # one limiter per event loop (tests run several loops one after another)
        limiter = _LIMITERS.get(loop)
        if limiter is None:
            limiter = _LIMITERS[loop] = anyio.CapacityLimiter(RENDER_CONCURRENCY)
    except TypeError:  # a loop that cannot be weakly referenced: one limiter for all
        if _SHARED_LIMITER is None:
            _SHARED_LIMITER = anyio.CapacityLimiter(RENDER_CONCURRENCY)
        limiter = _SHARED_LIMITER
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=limiter)
