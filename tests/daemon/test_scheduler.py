"""Scheduler semantics with fake runners: load on demand, one load per model, LRU eviction, waiting, keep-alive."""

from __future__ import annotations

import asyncio

import pytest

from daemon.runners.base import LoadFailed, LoadSpec, MemoryUse
from daemon.scheduling.eviction import Budget, Loaded, decide
from daemon.scheduling.scheduler import InsufficientMemory, ModelRef, QueueFull, Scheduler
from tests.fakes import FakeRunner

GB = 10**9

pytestmark = pytest.mark.anyio


def mem(ram: int, vram: int = 0) -> MemoryUse:
    return MemoryUse(ram=ram, vram=vram)


# -- the pure policy ----------------------------------------------------------------------------------------------
def test_decide_fits() -> None:
    assert decide([], mem(GB), Budget(2 * GB, 0, 0)).action == "load"


def test_decide_never() -> None:
    d = decide([], mem(3 * GB), Budget(2 * GB, 0, 0))
    assert d.action == "never" and "RAM" in d.reason


def test_decide_evicts_lru_idle_only_as_many_as_needed() -> None:
    loaded = [
        Loaded("a", mem(GB), busy=False, last_used=3),
        Loaded("b", mem(GB), busy=False, last_used=1),
        Loaded("c", mem(GB), busy=True, last_used=0),
    ]
    d = decide(loaded, mem(GB), Budget(3 * GB, 0, 0))
    assert (d.action, d.victims) == ("evict", ("b",))


def test_decide_waits_for_busy() -> None:
    loaded = [Loaded("a", mem(2 * GB), busy=True, last_used=0)]
    assert decide(loaded, mem(GB), Budget(2 * GB, 0, 0)).action == "wait"


def test_decide_count_limit() -> None:
    loaded = [Loaded("a", mem(1), busy=False, last_used=0)]
    d = decide(loaded, mem(1), Budget(GB, 0, 1))
    assert (d.action, d.victims) == ("evict", ("a",))


def test_decide_vram() -> None:
    loaded = [Loaded("a", mem(0, 2 * GB), busy=False, last_used=0)]
    d = decide(loaded, mem(0, 2 * GB), Budget(GB, 3 * GB, 0))
    assert d.victims == ("a",)


# -- the actor ------------------------------------------------------------------------------------------------------
def make(
    sizes: dict[str, int], budget: int, *, load_delay: float = 0.0, max_queue: int = 8, fail: set[str] | None = None
) -> Scheduler:
    FakeRunner.instances = []

    def factory(ref: ModelRef, spec: LoadSpec) -> FakeRunner:
        return FakeRunner(spec, mem(sizes[ref.key]), load_delay=load_delay, fail=ref.key in (fail or set()))

    return Scheduler(
        runner_factory=factory,
        estimate=lambda ref, spec: mem(sizes[ref.key]),
        budget=lambda: Budget(budget, 0, 0),
        max_queue=max_queue,
    )


def ref(key: str) -> ModelRef:
    return ModelRef(key=key, name=key)


SPEC = LoadSpec(model_path="/x")


async def test_concurrent_requests_share_one_load() -> None:
    s = make({"a": GB}, 2 * GB, load_delay=0.05)
    leases = await asyncio.gather(*(s.acquire(ref("a"), SPEC) for _ in range(5)))
    assert len(FakeRunner.instances) == 1
    assert {id(lease.runner) for lease in leases} == {id(FakeRunner.instances[0])}
    for lease in leases:
        lease.release()
    await s.close()


async def test_alternating_models_evict_and_reload() -> None:
    s = make({"a": GB, "b": GB}, GB)
    for key in ["a", "b", "a"]:
        async with await s.acquire(ref(key), SPEC):
            pass
    assert [r.closed for r in FakeRunner.instances] == [True, True, False]
    assert s.counters["evictions"] == 2
    await s.close()


async def test_busy_model_is_not_evicted_and_newcomer_waits() -> None:
    s = make({"a": GB, "b": GB}, GB)
    lease_a = await s.acquire(ref("a"), SPEC)
    waiter = asyncio.ensure_future(s.acquire(ref("b"), SPEC))
    await asyncio.sleep(0.2)
    assert not waiter.done() and not FakeRunner.instances[0].closed
    lease_a.release()
    lease_b = await asyncio.wait_for(waiter, 5)
    assert FakeRunner.instances[0].closed
    lease_b.release()
    await s.close()


async def test_too_big_fails_with_bytes_and_budget() -> None:
    s = make({"big": 5 * GB}, GB)
    with pytest.raises(InsufficientMemory, match="5000000000 bytes.*budget is 1000000000 bytes"):
        await s.acquire(ref("big"), SPEC)
    await s.close()


async def test_keep_alive_zero_unloads_after_release() -> None:
    s = make({"a": GB}, 2 * GB)
    async with await s.acquire(ref("a"), SPEC, keep_alive=0):
        pass
    await asyncio.sleep(0.05)
    assert FakeRunner.instances[0].closed and s.loaded() == []
    await s.close()


async def test_keep_alive_timer_expires() -> None:
    s = make({"a": GB}, 2 * GB)
    async with await s.acquire(ref("a"), SPEC, keep_alive=0.1):
        pass
    assert len(s.loaded()) == 1
    await asyncio.sleep(0.3)
    assert s.loaded() == []
    await s.close()


async def test_changed_load_options_reload() -> None:
    s = make({"a": GB}, 2 * GB)
    async with await s.acquire(ref("a"), SPEC):
        pass
    async with await s.acquire(ref("a"), LoadSpec(model_path="/x", num_ctx=8192)):
        pass
    assert len(FakeRunner.instances) == 2 and FakeRunner.instances[0].closed
    await s.close()


async def test_load_failure_reaches_request_and_next_try_loads_again() -> None:
    s = make({"a": GB}, 2 * GB, fail={"a"})
    with pytest.raises(LoadFailed):
        await s.acquire(ref("a"), SPEC)
    assert s.loaded() == []
    await s.close()


async def test_queue_full_is_503() -> None:
    s = make({"a": GB, "b": GB}, GB, max_queue=1)
    lease = await s.acquire(ref("a"), SPEC)
    first = asyncio.ensure_future(s.acquire(ref("b"), SPEC))
    await asyncio.sleep(0.05)  # the worker holds `first`, waiting for `a`
    second = asyncio.ensure_future(s.acquire(ref("b"), SPEC))
    await asyncio.sleep(0.01)
    third = asyncio.ensure_future(s.acquire(ref("b"), SPEC))
    with pytest.raises(QueueFull) as e:
        await third
    assert e.value.status == 503
    lease.release()
    for fut in (first, second):
        (await asyncio.wait_for(fut, 5)).release()
    await s.close()


async def test_requests_that_come_while_their_model_loads_count_against_the_queue() -> None:
    """Requests arriving during a load wait for it outside the queue: they are waiting requests all the same, so
    CORRAL_MAX_QUEUE bounds them (before, any number got in while a model loaded)."""
    s = make({"a": GB}, 2 * GB, load_delay=0.3, max_queue=2)
    loader = asyncio.ensure_future(s.acquire(ref("a"), SPEC))
    await asyncio.sleep(0.05)  # the worker is loading `a` for it
    later = [asyncio.ensure_future(s.acquire(ref("a"), SPEC)) for _ in range(5)]
    done = await asyncio.gather(loader, *later, return_exceptions=True)
    leases = [d for d in done if not isinstance(d, BaseException)]
    refused = [d for d in done if isinstance(d, QueueFull)]
    assert len(leases) == 3 and len(refused) == 3, done  # one served, two waiting (CORRAL_MAX_QUEUE=2)
    assert s.waiting() == 2
    for lease in leases:
        lease.release()
    assert s.waiting() == 0
    await s.close()


async def test_stop_unloads_idle_model() -> None:
    s = make({"a": GB}, 2 * GB)
    async with await s.acquire(ref("a"), SPEC, keep_alive=-1):
        pass
    assert await s.stop("a")
    assert s.loaded() == [] and FakeRunner.instances[0].closed
    await s.close()
