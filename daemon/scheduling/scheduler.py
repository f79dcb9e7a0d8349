"""The scheduler: the one owner of loaded-model state.

Requests ``await scheduler.acquire(...)`` and get a :class:`Lease` (an async context manager). A loaded model that
needs no reload is handed out at once; everything else goes through a bounded queue served by one worker task, so
only one model loads or unloads at a time. The eviction choice is the pure
:func:`daemon.scheduling.eviction.decide`. The collaborators (runner factory, memory estimator, budgets, clock) are
injected so tests can fake them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from daemon.exits import signal_name
from daemon.runners.base import LoadFailed, LoadSpec, MemoryUse, Runner, RunnerCrashed, RunnerError
from daemon.scheduling.eviction import Budget, Decision, Loaded, decide
from daemon.scheduling.fallback import Fallbacks
from errors import CorralError

log = logging.getLogger(__name__)

FOREVER = math.inf
T = TypeVar("T")
MAX_REQUEST_RETRIES = 3  # a request runs again at most this often after its runner crashed on its first decode


class SchedulerError(CorralError):
    status = 500


class QueueFull(SchedulerError):
    status = 503
    retry_after = 1  # seconds; the HTTP answer carries it as Retry-After

    def __init__(self) -> None:
        super().__init__("server busy, please try again.  maximum pending requests exceeded")


class InsufficientMemory(SchedulerError):
    status = 500

    def __init__(self, name: str, need: MemoryUse, budget: Budget, *, draft: str = "", adapters: int = 0) -> None:
        which = "RAM" if need.ram > budget.ram else "VRAM"
        needed, have = (need.ram, budget.ram) if which == "RAM" else (need.vram, budget.vram)
        var = "CORRAL_RAM_BUDGET" if which == "RAM" else "CORRAL_VRAM_BUDGET"
        # a draft model (speculative decoding) is counted with the model: running without it is one way out
        with_draft = f" with its draft model '{draft}'" if draft else ""
        if adapters:  # LoRA adapters (issue 29) are counted with the runner of their base that loads them
            with_draft += f" with its {adapters} LoRA adapter{'s' if adapters != 1 else ''}"
        without = 'run it without its draft model (options.draft_model ""), ' if draft else ""
        super().__init__(
            f"model '{name}'{with_draft} needs {needed} bytes ({needed / 2**30:.2f} GiB) of {which} but the {which} "
            f"budget is {have} bytes ({have / 2**30:.2f} GiB); lower num_ctx, use a smaller model, {without}"
            f"or raise {var}"
        )
        self.need = need
        self.budget = budget


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter a request applies on its runner (issue 29): the runner loads it once, the first time a request
    names it, and keeps it; it is counted once in that runner's memory, whichever models use it."""

    path: str  # the adapter's blob
    digest: str = ""  # sha256:<hex>, as /api/ps shows it
    memory: MemoryUse = MemoryUse(0, 0)  # what loading it adds (its tensors, on the model's devices)


@dataclass(frozen=True)
class ModelRef:
    """What the scheduler needs to know about a model besides its LoadSpec."""

    # what a runner is loaded for: the weights (the model file; with its adapters for an embedding runner), shared
    # by every alias of them and, for generation, by every model over the same base that differs only by ADAPTERs
    key: str
    name: str  # short display name
    digest: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    draft: str = ""  # the draft model's name (speculative decoding, LoadSpec.draft_path), "" for none
    adapters: tuple[Adapter, ...] = ()  # the LoRA adapters this request applies (GenerateRequest.adapters)


@dataclass
class HeldAdapter:
    """An adapter a runner has loaded (or is loading for a request): its memory, and the models that used it."""

    adapter: Adapter
    models: dict[str, float] = field(default_factory=dict)  # model name -> last use
    dropping: bool = False  # asked to be freed while a sequence used it: gone once the runner is idle


@dataclass
class Entry:
    ref: ModelRef
    spec: LoadSpec
    runner: Runner
    memory: MemoryUse
    keep_alive: float
    loaded_at: float
    last_used: float
    refs: int = 0
    loading: bool = True
    ready: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    expires_at: float | None = None  # clock time; None while in use
    unload_when_idle: bool = False
    effective: LoadSpec | None = None  # what the runner was really loaded with (a safer fallback, or ``spec``)
    fallback: str | None = None  # why ``effective`` differs from ``spec``, as ps shows it
    names: dict[str, float] = field(default_factory=dict)  # the model names served by this runner, last use
    crash_counted: bool = False
    adapters: dict[str, HeldAdapter] = field(default_factory=dict)  # LoRA adapters loaded, by path (issue 29)
    awaiting: int = 0  # requests that came while it loads and wait for it (counted by Scheduler.waiting)

    @property
    def loaded_spec(self) -> LoadSpec:
        return self.effective or self.spec


@dataclass
class _Pending:
    ref: ModelRef
    spec: LoadSpec
    keep_alive: float | None
    future: asyncio.Future[Entry]


class Lease:
    """A hold on a loaded runner; releasing it starts the model's keep-alive timer."""

    def __init__(
        self,
        scheduler: Scheduler,
        entry: Entry,
        load_duration: float,
        *,
        ref: ModelRef | None = None,
        spec: LoadSpec | None = None,
        keep_alive: float | None = None,
    ) -> None:
        self._scheduler = scheduler
        self.entry = entry
        self.runner = entry.runner
        self.ref = ref or entry.ref  # the model the request named (an alias shares its weights' runner)
        self.spec = spec or entry.spec
        self.keep_alive = keep_alive
        self.load_duration = load_duration  # seconds spent waiting for the runner (queue + load)
        self.retries = 0
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._scheduler.release(self.entry)

    def may_retry(self, exc: BaseException) -> bool:
        """Whether a request whose runner just died can run again on a safer configuration: the runner died by
        a signal on its first decode, and the ladder of configurations has steps left to take."""
        return (
            isinstance(exc, RunnerCrashed)
            and exc.early
            and exc.signal is not None
            and self.retries < MAX_REQUEST_RETRIES
            and self._scheduler.fallbacks is not None
        )

    async def call(self, work: Callable[[Runner], Awaitable[T]]) -> T:
        """``work(runner)``, run again on a safer runner if this one dies by a signal on its first decode."""
        while True:
            try:
                return await work(self.runner)
            except RunnerCrashed as exc:
                if not self.may_retry(exc):
                    raise
                await self.retry_after_crash(exc)

    async def retry_after_crash(self, exc: RunnerCrashed) -> None:
        """Record that this runner's configuration crashed, and hold a runner loaded one step safer instead."""
        self._scheduler.first_decode_crashed(self.entry, exc)
        self.release()
        started = self._scheduler.clock()
        fresh = await self._scheduler.acquire(self.ref, self.spec, self.keep_alive)
        self.entry, self.runner, self._released = fresh.entry, fresh.runner, False
        self.load_duration += self._scheduler.clock() - started
        self.retries += 1

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


Estimator = Callable[[ModelRef, LoadSpec], MemoryUse]
RunnerFactory = Callable[[ModelRef, LoadSpec], Runner]


class Scheduler:
    def __init__(
        self,
        *,
        runner_factory: RunnerFactory,
        estimate: Estimator,
        budget: Callable[[], Budget],
        default_keep_alive: float = 300.0,
        max_queue: int = 512,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        fallbacks: Fallbacks | None = None,
    ) -> None:
        self._factory = runner_factory
        self._estimate = estimate
        self._budget = budget
        self.default_keep_alive = default_keep_alive
        self.clock = clock  # monotonic seconds (injected: tests step it)
        self._wall = wall_clock
        self.fallbacks = fallbacks
        self._loaded: dict[str, Entry] = {}
        self._max_queue = max(1, max_queue)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=self._max_queue)
        self._changed = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters = {"loads": 0, "unloads": 0, "evictions": 0, "load_seconds": 0.0}

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="corral-scheduler")

    async def close(self) -> None:
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        while not self._queue.empty():
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(SchedulerError("the server is shutting down"))
        await asyncio.gather(
            *(self._unload(e, reason="shutdown") for e in list(self._loaded.values())), return_exceptions=True
        )

    # -- requests ----------------------------------------------------------------------------------------------
    async def acquire(self, ref: ModelRef, spec: LoadSpec, keep_alive: float | None = None) -> Lease:
        """A lease on a runner for ``ref`` loaded with ``spec`` (loading, evicting or queueing as needed)."""
        if self._closing:
            raise SchedulerError("the server is shutting down")
        if self.fallbacks is not None and (blocked := self.fallbacks.blocked(spec)) is not None:
            raise blocked
        if self.waiting() >= self._max_queue:
            raise QueueFull()
        started = self.clock()
        entry = self._loaded.get(ref.key)
        if entry is not None and entry.spec == spec and not entry.unload_when_idle:
            if entry.loading and entry.ready is not None:
                entry.awaiting += 1
                try:
                    await asyncio.shield(entry.ready)
                finally:
                    entry.awaiting -= 1
            if self._loaded.get(ref.key) is entry and entry.runner.alive():
                # adapters this runner has not loaded yet are granted here when they fit; otherwise the worker
                # makes room for them (or says they cannot fit)
                extra = self._new_adapters(entry, ref)
                if extra.total == 0 or self._adapters_fit(entry, extra).action == "load":
                    self._grant(entry, keep_alive, ref)
                    return Lease(self, entry, self.clock() - started, ref=ref, spec=spec, keep_alive=keep_alive)
        future: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait(_Pending(ref, spec, keep_alive, future))
        except asyncio.QueueFull:
            raise QueueFull() from None
        self.start()
        try:
            entry = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())  # granted just as the client left
            future.cancel()
            raise
        return Lease(self, entry, self.clock() - started, ref=ref, spec=spec, keep_alive=keep_alive)

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def waiting(self) -> int:
        """Requests admitted but not yet being served: those waiting for a load (in the queue, or come while their
        model loads), and those holding a lease beyond their runner's sequence slots (they wait inside the runner).
        ``CORRAL_MAX_QUEUE`` bounds this sum, so an overloaded daemon answers 503 at once instead of queueing
        without end (requests that came during a load were not counted: any number of them got in)."""
        inside = sum(max(0, e.refs - max(1, e.loaded_spec.num_parallel)) + e.awaiting for e in self._loaded.values())
        return self._queue.qsize() + inside

    async def stop(self, key: str) -> bool:
        """Unload ``key`` now, or as soon as its requests finish (keep_alive 0). False if it was not loaded."""
        entry = self._loaded.get(key)
        if entry is None:
            return False
        entry.keep_alive = 0
        entry.unload_when_idle = True
        if entry.refs == 0 and not entry.loading:
            await self._unload(entry, reason="stop")
        return True

    def serving(self, key: str) -> LoadSpec | None:
        """The spec of the runner that serves ``key`` now (alive, loaded, not on its way out), else None."""
        entry = self._loaded.get(key)
        if entry is not None and entry.runner.alive() and not entry.unload_when_idle and not entry.loading:
            return entry.spec
        return None

    def loaded(self) -> list[dict[str, Any]]:
        """What /api/ps shows, expiring last first."""
        now_c, now_w = self.clock(), self._wall()
        out: list[dict[str, Any]] = []
        for e in self._loaded.values():
            if e.refs > 0 or e.loading or e.expires_at is None:
                remaining = e.keep_alive
            else:
                remaining = max(0.0, e.expires_at - now_c)
            out.append({"entry": e, "expires_at_wall": now_w + min(remaining, 292 * 365 * 86400.0)})
        out.sort(key=lambda item: -item["expires_at_wall"])
        return out

    # -- internals ---------------------------------------------------------------------------------------------
    def _grant(self, entry: Entry, keep_alive: float | None, ref: ModelRef | None = None) -> None:
        entry.refs += 1
        entry.last_used = self.clock()
        if ref is not None:
            entry.ref = ref  # ps names the runner after the model that used it last
            entry.names[ref.name] = entry.last_used
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None
        if ref is not None:
            for adapter in ref.adapters:  # counted once per runner, from the first request that applies it
                held = entry.adapters.get(adapter.path)
                if held is None:
                    held = entry.adapters[adapter.path] = HeldAdapter(adapter)
                    entry.memory = _plus(entry.memory, adapter.memory)
                    log.info(
                        "adapter added model=%s adapter=%s ram=%d vram=%d",
                        ref.name,
                        adapter.digest or adapter.path,
                        adapter.memory.ram,
                        adapter.memory.vram,
                    )
                held.dropping = False
                held.models[ref.name] = entry.last_used

    # -- LoRA adapters on a shared runner (issue 29) ------------------------------------------------------------
    def _new_adapters(self, entry: Entry, ref: ModelRef) -> MemoryUse:
        """What the adapters ``ref`` applies that ``entry``'s runner has not loaded add to its memory."""
        extra = MemoryUse(0, 0)
        for adapter in ref.adapters:
            if adapter.path not in entry.adapters:
                extra = _plus(extra, adapter.memory)
        return extra

    def _adapters_fit(self, entry: Entry, extra: MemoryUse) -> Decision:
        """The eviction policy's answer for ``entry`` grown by ``extra``, beside the other loaded runners."""
        others = [view for view in self._views() if view.key != entry.ref.key]
        return decide(others, _plus(entry.memory, extra), self._budget())

    async def drop_adapters(self, paths: Iterable[str]) -> list[str]:
        """Free the adapters at ``paths`` on every runner that loaded them (the models using them were deleted or
        replaced): each runner frees an adapter once no sequence uses it, and its memory stops counting then
        (at once, or when the runner next goes idle). Other streams carry on. Returns the paths asked of a runner."""
        wanted = set(paths)
        asked: list[str] = []
        for entry in list(self._loaded.values()):
            mine = tuple(path for path in entry.adapters if path in wanted)
            if not mine:
                continue
            if not entry.runner.alive():
                for path in mine:
                    self._forget_adapter(entry, path)
                continue
            try:
                loaded = set(await entry.runner.drop_adapters(mine))
            except CorralError as exc:  # the runner could not say: keep counting them, it may still hold them
                log.warning("adapters not freed model=%s error=%s", entry.ref.name, exc)
                continue
            asked.extend(mine)
            for path in mine:
                held = entry.adapters.get(path)
                if held is None:
                    continue
                if path in loaded:  # a sequence still uses it: the runner frees it when that ends
                    held.dropping = True
                else:
                    self._forget_adapter(entry, path)
            if entry.refs == 0:
                self._forget_dropped(entry)
        self._changed.set()
        return asked

    def _forget_adapter(self, entry: Entry, path: str) -> None:
        held = entry.adapters.pop(path, None)
        if held is None:
            return
        memory = held.adapter.memory
        entry.memory = MemoryUse(max(0, entry.memory.ram - memory.ram), max(0, entry.memory.vram - memory.vram))
        log.info(
            "adapter freed model=%s adapter=%s ram=%d vram=%d",
            entry.ref.name,
            held.adapter.digest or path,
            memory.ram,
            memory.vram,
        )

    def _forget_dropped(self, entry: Entry) -> None:
        """The runner is idle: the adapters it was asked to free once unused are gone now."""
        for path in [p for p, held in entry.adapters.items() if held.dropping]:
            self._forget_adapter(entry, path)

    def release(self, entry: Entry) -> None:
        """One hold on ``entry`` ends (``Lease.release``): when it was the last, its keep-alive starts."""
        entry.refs = max(0, entry.refs - 1)
        entry.last_used = self.clock()
        self._changed.set()
        if entry.refs > 0 or self._loaded.get(entry.ref.key) is not entry:
            return
        self._forget_dropped(entry)
        if not entry.runner.alive():
            self._note_crash(entry)
        if entry.keep_alive <= 0 or entry.unload_when_idle or not entry.runner.alive():
            self._spawn(self._unload(entry, reason="keep_alive" if entry.runner.alive() else "crashed"))
        elif entry.keep_alive != FOREVER:
            entry.expires_at = self.clock() + entry.keep_alive
            entry.timer = asyncio.get_running_loop().call_later(
                entry.keep_alive, lambda: self._spawn(self._expire(entry))
            )

    async def _expire(self, entry: Entry) -> None:
        if entry.refs == 0 and self._loaded.get(entry.ref.key) is entry:
            await self._unload(entry, reason="expired")

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unload(self, entry: Entry, *, reason: str) -> None:
        if self._loaded.get(entry.ref.key) is entry:
            del self._loaded[entry.ref.key]
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        self.counters["unloads"] += 1
        if reason == "evicted":
            self.counters["evictions"] += 1
        log.info(
            "unload model=%s reason=%s ram=%d vram=%d", entry.ref.name, reason, entry.memory.ram, entry.memory.vram
        )
        try:
            await entry.runner.close()
        except Exception as exc:  # noqa: BLE001 - a dead runner is already unloaded
            log.warning("runner close failed model=%s error=%s", entry.ref.name, exc)
        self._changed.set()

    def _views(self) -> list[Loaded]:
        return [
            Loaded(key=e.ref.key, memory=e.memory, busy=e.refs > 0 or e.loading, last_used=e.last_used)
            for e in self._loaded.values()
        ]

    async def _work(self) -> None:
        while True:
            pending = await self._queue.get()
            try:
                await self._serve(pending)
            except asyncio.CancelledError:
                if not pending.future.done():
                    pending.future.set_exception(SchedulerError("the server is shutting down"))
                raise
            except Exception as exc:  # never let one request kill the worker
                log.exception("scheduler error: %s", exc)
                if not pending.future.done():
                    pending.future.set_exception(exc if isinstance(exc, CorralError) else SchedulerError(str(exc)))

    async def _serve(self, p: _Pending) -> None:
        while not p.future.done():
            entry = self._loaded.get(p.ref.key)
            if entry is not None:
                if entry.spec == p.spec and entry.runner.alive() and not entry.unload_when_idle:
                    if entry.loading and entry.ready is not None:
                        await asyncio.shield(entry.ready)
                        continue
                    extra = self._new_adapters(entry, p.ref)
                    if extra.total > 0:  # adapters new to this runner: room for them beside the others
                        grow = self._adapters_fit(entry, extra)
                        if grow.action == "never":
                            p.future.set_exception(
                                InsufficientMemory(
                                    p.ref.name,
                                    _plus(entry.memory, extra),
                                    self._budget(),
                                    draft=p.ref.draft,
                                    adapters=len(p.ref.adapters),
                                )
                            )
                            return
                        if grow.action == "evict":
                            await self._evict(grow.victims)
                            continue
                        if grow.action == "wait":
                            await self._wait_change()
                            continue
                    self._grant(entry, p.keep_alive, p.ref)
                    p.future.set_result(entry)
                    return
                # Options changed (or the runner died): reload once it is idle.
                if entry.refs == 0 and not entry.loading:
                    await self._unload(entry, reason="reload")
                else:
                    entry.unload_when_idle = True
                    await self._wait_change()
                continue
            need = await asyncio.to_thread(self._estimate, p.ref, p.spec)  # reads a GGUF header: off the loop
            if p.future.done():
                return
            budget = self._budget()
            # the runner with the adapters this request applies (counted on the entry when it is granted)
            with_adapters = need
            for adapter in p.ref.adapters:
                with_adapters = _plus(with_adapters, adapter.memory)
            decision = decide(self._views(), with_adapters, budget)
            if decision.action == "never":
                p.future.set_exception(
                    InsufficientMemory(
                        p.ref.name, with_adapters, budget, draft=p.ref.draft, adapters=len(p.ref.adapters)
                    )
                )
                return
            if decision.action == "evict":
                await self._evict(decision.victims)
                continue
            if decision.action == "wait":
                await self._wait_change()
                continue
            await self._load(p, need)
            return

    async def _evict(self, victims: Iterable[str]) -> None:
        for key in victims:
            victim = self._loaded.get(key)
            if victim is not None and victim.refs == 0 and not victim.loading:
                await self._unload(victim, reason="evicted")

    async def _wait_change(self) -> None:
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=0.5)

    async def _load(self, p: _Pending, need: MemoryUse) -> None:
        if self.fallbacks is not None and (blocked := self.fallbacks.blocked(p.spec)) is not None:
            p.future.set_exception(blocked)
            return
        effective, note = self.fallbacks.effective(p.spec) if self.fallbacks is not None else (p.spec, None)
        now = self.clock()
        keep = p.keep_alive if p.keep_alive is not None else self.default_keep_alive
        entry = Entry(
            ref=p.ref,
            spec=p.spec,
            runner=self._factory(p.ref, effective),
            memory=need,
            keep_alive=keep,
            loaded_at=now,
            last_used=now,
            ready=asyncio.get_running_loop().create_future(),
            effective=effective,
            fallback=note,
        )
        self._loaded[p.ref.key] = entry
        started = time.monotonic()
        log.info(
            "load model=%s num_ctx=%d num_gpu=%d ram=%d vram=%d%s",
            p.ref.name,
            effective.num_ctx,
            effective.num_gpu,
            need.ram,
            need.vram,
            f' config="{note}"' if note else "",
        )
        while True:
            try:
                await entry.runner.start()
                break
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    await entry.runner.close()
                retry = self._safer_after(entry, exc)
                if retry is not None and not isinstance(exc, asyncio.CancelledError):
                    entry.effective, entry.fallback = retry
                    entry.runner = self._factory(p.ref, retry[0])
                    continue
                if self._loaded.get(p.ref.key) is entry:
                    del self._loaded[p.ref.key]
                assert entry.ready is not None
                entry.ready.set_result(None)
                self._changed.set()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if isinstance(exc, LoadFailed) and exc.signal is not None and self.fallbacks is not None:
                    exc = self.fallbacks.give_up(p.spec, p.ref.name, exc.signal)
                if not p.future.done():
                    p.future.set_exception(exc if isinstance(exc, CorralError) else RunnerError(str(exc)))
                return
        seconds = time.monotonic() - started
        if self.fallbacks is not None and entry.loaded_spec != p.spec:
            crashed = self.fallbacks.tried(p.spec)
            if crashed:
                self.fallbacks.worked(p.spec, entry.loaded_spec, "; ".join(dict.fromkeys(crashed.values())))
        self.counters["loads"] += 1
        self.counters["load_seconds"] += seconds
        reported = entry.runner.memory
        if reported.total > 0:
            entry.memory = reported
        entry.loading = False
        assert entry.ready is not None
        entry.ready.set_result(None)
        log.info(
            "loaded model=%s seconds=%.2f ram=%d vram=%d", p.ref.name, seconds, entry.memory.ram, entry.memory.vram
        )
        if p.future.done():  # the client left while we loaded: keep it warm for the keep-alive
            entry.refs += 1
            self.release(entry)
            return
        self._grant(entry, p.keep_alive, p.ref)
        p.future.set_result(entry)

    # -- native faults (daemon/scheduling/fallback.py) ----------------------------------------------------------------
    def _safer_after(self, entry: Entry, exc: BaseException) -> tuple[LoadSpec, str] | None:
        """After a load that died by a signal: the next configuration to load with, and why (None: give up)."""
        if self.fallbacks is None or not isinstance(exc, LoadFailed) or exc.signal is None:
            return None
        what = f"killed by {signal_name(exc.signal)} during {exc.stage}"
        step = self.fallbacks.failed(entry.loaded_spec, what)
        if step is None:
            log.warning(
                'runner crashed model=%s %s config="%s"; no safer configuration left',
                entry.ref.name,
                what,
                entry.loaded_spec,
            )
            return None
        log.warning("runner crashed model=%s %s; loading it again with %s", entry.ref.name, what, step[1])
        self.counters["fallbacks"] = self.counters.get("fallbacks", 0) + 1
        return step[0], f"{step[1]} (after the runner was {what})"

    def first_decode_crashed(self, entry: Entry, exc: RunnerCrashed) -> None:
        """A runner died by a signal on its first decode: its configuration is marked as crashing, so the next
        load of these weights takes the next safer one."""
        if self.fallbacks is None or exc.signal is None:
            return
        spec = entry.loaded_spec
        if spec in self.fallbacks.tried(spec):
            return  # another request on the same runner reported it already
        what = f"killed by {signal_name(exc.signal)} on its first decode"
        step = self.fallbacks.failed(spec, what)
        log.warning(
            "runner crashed model=%s %s; %s",
            entry.ref.name,
            what,
            f"loading it again with {step[1]}" if step else "no safer configuration left",
        )
        if step is None:
            self.fallbacks.give_up(entry.spec, entry.ref.name, exc.signal)

    def _note_crash(self, entry: Entry) -> None:
        """A runner that had served died: count it towards a crash loop (daemon/scheduling/fallback.py)."""
        sig = entry.runner.exit_signal
        if self.fallbacks is None or not entry.runner.decoded or entry.crash_counted:
            return
        entry.crash_counted = True
        what = f"killed by {signal_name(sig)}" if sig else "the runner exited"
        self.fallbacks.late_crash(entry.loaded_spec, entry.ref.name, what, sig)


def _plus(a: MemoryUse, b: MemoryUse) -> MemoryUse:
    return MemoryUse(ram=a.ram + b.ram, vram=a.vram + b.vram)
