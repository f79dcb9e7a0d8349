"""How many generation requests are inside the daemon and not yet handed to a runner: a burst's size, as it comes in.

A runner that is idle when the first request of a burst reaches it would otherwise start decoding that one alone at
once; on a CPU, llama.cpp's threads then take every core while the daemon is still reading the burst's other
requests, each of those reaches the runner late, and each joins a later step. Told that more are on their way (the
count rides along with each request, ``daemon.runners.process``), the engine waits a few milliseconds for them
(``daemon.runners.engine.ARRIVAL_WAIT``) and evaluates the burst in one step. One count for the daemon: a request for
another model can make a runner wait in vain, at most that long.

``Observe`` (daemon/observe.py) counts a request in when a generation endpoint is called and out when it ends; the
runner's client counts it out earlier, when it hands the request over (``handed``). The two meet through a context
variable set for the request's task.
"""

from __future__ import annotations

import contextvars

# the endpoints whose requests end in a runner's generation
GENERATION_PATHS = frozenset(
    ("/api/generate", "/api/chat", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
)


class Arrival:
    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = True


_count = 0
_current: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("corral_arrival", default=None)


def enter() -> tuple[Arrival, contextvars.Token[Arrival | None]]:
    """A generation request came in (undo with ``leave``)."""
    global _count
    _count += 1
    arrival = Arrival()
    return arrival, _current.set(arrival)


def leave(arrival: Arrival, token: contextvars.Token[Arrival | None]) -> None:
    global _count
    _current.reset(token)
    if arrival.pending:
        arrival.pending = False
        _count -= 1


def handed() -> int:
    """The current request goes to a runner now: how many others are still on their way."""
    global _count
    arrival = _current.get()
    if arrival is not None and arrival.pending:
        arrival.pending = False
        _count -= 1
    return _count
