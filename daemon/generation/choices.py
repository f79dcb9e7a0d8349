"""Several choices of one prompt (OpenAI's ``n``): started together so that the runner decodes them side by side as
sequences, and their events merged into one stream of ``(choice, event)`` in the order they come. Closing the
merged stream stops every choice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from daemon.chat.types import Event, Finished
from daemon.generation.calls import Call, ChatCall, GenerateCall
from daemon.generation.inference import Inference
from daemon.generation.service import ModelOnly, run_chat, run_generate
from errors import CorralError, InvalidRequest

T = TypeVar("T")
Chunks = AsyncIterator[Event]
Started = tuple[Event | None, Chunks]  # a choice's first chunk (None: no output) and the rest


C = TypeVar("C", bound=Call)
ErrorHook = Callable[[CorralError], None]


def for_choice(call: C, i: int) -> C:
    """Choice ``i``'s call: with a fixed seed, seed + i, so the choices differ yet are reproducible."""
    seed = call.options.get("seed")
    if i == 0 or isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        return call
    return dataclasses.replace(call, options={**call.options, "seed": (seed + i) % (1 << 63)})


async def chat_choices(
    inf: Inference,
    call: ChatCall,
    n: int,
    started: float,
    *,
    relax_think: bool = False,
    on_first_error: ErrorHook | None = None,
) -> AsyncGenerator[tuple[int, Event], None]:
    """``n`` choices of one chat call, merged (see :func:`start_choices` and :func:`merged`)."""

    async def run(i: int) -> Chunks:
        started_run = await run_chat(inf, for_choice(call, i), started, relax_think=relax_think)
        if isinstance(started_run, ModelOnly):
            raise InvalidRequest("'messages' must contain at least one message")
        return started_run

    return merged(await start_choices(n, run, on_first_error=on_first_error))


async def generate_choices(
    inf: Inference, call: GenerateCall, n: int, started: float, *, on_first_error: ErrorHook | None = None
) -> AsyncGenerator[tuple[int, Event], None]:
    """``n`` completions of one prompt, merged; an empty prompt only loads the model (one Finished "load")."""

    async def run(i: int) -> Chunks:
        started_run = await run_generate(inf, for_choice(call, i), started)
        if isinstance(started_run, ModelOnly):  # an empty prompt only loads the model
            return _single(Finished(done_reason=started_run.done_reason))
        return started_run

    return merged(await start_choices(n, run, on_first_error=on_first_error))


async def _single(final: Event) -> AsyncIterator[Event]:
    yield final


async def first_then(chunks: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """Pull the first chunk so that an error before any output is still a plain error response."""
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return None, it
    return first, it


async def start_choices(
    n: int,
    run: Callable[[int], Awaitable[Chunks]],
    *,
    on_first_error: ErrorHook | None = None,
) -> list[Started]:
    """Start ``n`` generations of one prompt (``run(i)`` starts choice i) and pull each one's first chunk, so that
    an error before any output is still a plain error answer. Choice 0 is set up first (it loads the model when
    needed); then all of them run at once, as sequences that the runner decodes side by side. If one fails,
    those started are closed and its error raised. ``on_first_error`` sees an error raised by a choice's first
    chunk before it is raised (a dialect names the parameter it blames)."""
    chunks0 = await run(0)

    async def one(i: int) -> Started:
        chunks = chunks0 if i == 0 else await run(i)
        try:
            return await first_then(chunks)
        except CorralError as exc:
            if on_first_error is not None:
                on_first_error(exc)
            raise

    if n == 1:
        return [await one(0)]
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    started: list[Started] = []
    failed: list[BaseException] = []
    for r in results:
        if isinstance(r, BaseException):
            failed.append(r)
        else:
            started.append(r)
    if failed:
        for _, rest in started:
            await aclose(rest)
        raise failed[0]
    return started


async def merged(started: list[Started]) -> AsyncGenerator[tuple[int, Event], None]:
    """Every choice's chunks as ``(index, chunk)``, in the order they come; closing it stops every choice."""
    if len(started) == 1:
        first, rest = started[0]
        try:
            chunk = first
            while chunk is not None:
                yield 0, chunk
                chunk = await anext(rest, None)
        finally:
            await aclose(rest)
        return
    queue: asyncio.Queue[tuple[int, Event | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, chunk: Event | None, rest: Chunks) -> None:
        try:
            while chunk is not None:
                queue.put_nowait((i, chunk, None))
                chunk = await anext(rest, None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, first, rest)) for i, (first, rest) in enumerate(started)]
    try:
        running = len(tasks)
        while running:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
                continue
            yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in started:
            await aclose(rest)


async def aclose(events: AsyncIterator[T]) -> None:
    """Close an event iterator (an async generator or a :class:`~daemon.generation.service.Run`): the lease it holds
    goes back and the runner stops generating for it."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
