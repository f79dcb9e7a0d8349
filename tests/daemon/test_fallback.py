"""The native-fault policy (daemon/scheduling/fallback.py) and the scheduler's ladder of configurations, with fake
runners that "crash" by a signal in chosen configurations (the real path: tests/daemon/test_runner_faults.py)."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from daemon.runners.base import LoadFailed, LoadSpec, MemoryUse, RunnerCrashed
from daemon.scheduling.eviction import Budget
from daemon.scheduling.fallback import Fallbacks, RunnerUnusable, fault_class, safer, weights_key
from daemon.scheduling.scheduler import ModelRef, Scheduler
from tests.fakes import FakeRunner

SEGV = int(signal.SIGSEGV)
SPEC = LoadSpec(model_path="/store/blobs/sha256-aa", num_gpu=20)


def test_ladder_extra_bufts_then_half_the_layers_then_none() -> None:
    steps = []
    spec: LoadSpec | None = SPEC
    while spec is not None:
        steps.append((spec.extra_bufts, spec.num_gpu))
        nxt = safer(spec)
        spec = nxt[0] if nxt else None
    assert steps == [(True, 20), (False, 20), (False, 10), (False, 5), (False, 2), (False, 1), (False, 0)]
    cpu = LoadSpec(model_path="/m")
    assert safer(cpu) is not None and safer(safer(cpu)[0]) is None  # type: ignore[index]


def test_fault_classes_name_the_signal_kind() -> None:
    assert "AMX" in fault_class(SEGV) and "20824" in fault_class(SEGV)
    assert "GGML_NATIVE" in fault_class(int(signal.SIGILL))
    assert "GGML_ASSERT" in fault_class(int(signal.SIGABRT))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_remembered_per_model_and_machine_across_restarts() -> None:
    disk: dict[str, bytes] = {}

    def make(machine: str) -> Fallbacks:
        return Fallbacks(machine=machine, read=lambda: disk.get("state"), write=lambda b: disk.update(state=b))

    fb = make("m1")
    nxt = fb.failed(SPEC, "killed by SIGSEGV during warm-up")
    assert nxt is not None and nxt[0].extra_bufts is False
    assert fb.effective(SPEC)[0] == nxt[0]
    fb.worked(SPEC, nxt[0], "killed by SIGSEGV during warm-up")
    saved = json.loads(disk["state"])
    assert list(saved["runners"].values())[0]["extra_bufts"] is False

    again = make("m1")  # a restarted daemon, same machine: straight to what worked
    eff, note = again.effective(SPEC)
    assert eff.extra_bufts is False and eff.num_gpu == 20
    assert note and "SIGSEGV" in note
    assert again.remembered()[0]["model_file"] == weights_key(SPEC)
    other_model = dataclasses.replace(SPEC, model_path="/store/blobs/sha256-bb")
    assert again.effective(other_model) == (other_model, None)
    elsewhere = make("m2")  # another machine (or llama.cpp build): nothing remembered
    assert elsewhere.effective(SPEC) == (SPEC, None) and elsewhere.remembered() == []


def test_unreadable_state_is_ignored() -> None:
    fb = Fallbacks(machine="m", read=lambda: b"{not json", write=lambda b: None)
    assert fb.effective(SPEC) == (SPEC, None)


def test_give_up_backs_off_doubling_and_then_tries_again() -> None:
    clock = Clock()
    fb = Fallbacks(machine="m", clock=clock)
    err = fb.give_up(SPEC, "smol", SEGV)
    assert isinstance(err, RunnerUnusable) and "memory fault" in str(err)
    assert "every configuration" in str(err) and "10s" in str(err)
    assert fb.blocked(SPEC) is not None
    clock.now += 11
    assert fb.blocked(SPEC) is None
    assert "20s" in str(fb.give_up(SPEC, "smol", SEGV))
    for _ in range(10):
        fb.give_up(SPEC, "smol", SEGV)
    assert "300s" in str(fb.give_up(SPEC, "smol", SEGV))


def test_late_crashes_make_a_crash_loop() -> None:
    clock = Clock()
    fb = Fallbacks(machine="m", clock=clock)
    fb.late_crash(SPEC, "smol", "killed by SIGSEGV", SEGV)
    clock.now += 200  # outside the window: forgotten
    fb.late_crash(SPEC, "smol", "killed by SIGSEGV", SEGV)
    fb.late_crash(SPEC, "smol", "killed by SIGSEGV", SEGV)
    assert fb.blocked(SPEC) is None
    fb.late_crash(SPEC, "smol", "killed by SIGSEGV", SEGV)
    blocked = fb.blocked(SPEC)
    assert blocked is not None and "crashed 3 times" in str(blocked)


# -- the scheduler's ladder, with fake runners ---------------------------------------------------------------------
pytestmark = pytest.mark.anyio


class CrashingRunner(FakeRunner):
    """Dies by SIGSEGV at load while ``crash_when(spec)``."""

    crash_when = staticmethod(lambda spec: spec.extra_bufts)

    async def start(self) -> None:
        if type(self).crash_when(self.spec):
            raise LoadFailed("killed by SIGSEGV during warm-up", signal=SEGV, stage="warm-up")
        self.started = True


def scheduler(fb: Fallbacks) -> Scheduler:
    FakeRunner.instances = []
    return Scheduler(
        runner_factory=lambda ref, spec: CrashingRunner(spec, MemoryUse(1, 0)),
        estimate=lambda ref, spec: MemoryUse(1, 0),
        budget=lambda: Budget(10, 0, 0),
        fallbacks=fb,
    )


async def test_scheduler_loads_again_without_extra_bufts() -> None:
    fb = Fallbacks(machine="m")
    s = scheduler(fb)
    lease = await s.acquire(ModelRef("w", "smol"), SPEC)
    assert [r.spec.extra_bufts for r in FakeRunner.instances] == [True, False]
    assert lease.entry.spec == SPEC and lease.entry.loaded_spec.extra_bufts is False
    assert lease.entry.fallback and "extra buffer types off" in lease.entry.fallback
    lease.release()
    # the same request again gets the loaded runner (the requested spec is what it is compared with)
    again = await s.acquire(ModelRef("w", "smol"), SPEC)
    assert len(FakeRunner.instances) == 2
    again.release()
    await s.close()


async def test_scheduler_gives_up_with_one_clear_error_and_backs_off() -> None:
    CrashingRunner.crash_when = staticmethod(lambda spec: True)
    try:
        fb = Fallbacks(machine="m")
        s = scheduler(fb)
        with pytest.raises(RunnerUnusable) as err:
            await s.acquire(ModelRef("w", "smol"), SPEC)
        assert "every configuration" in str(err.value)
        tried = len(FakeRunner.instances)
        assert tried == 7  # the whole ladder, once
        with pytest.raises(RunnerUnusable):
            await s.acquire(ModelRef("w", "smol"), SPEC)
        assert len(FakeRunner.instances) == tried  # no reload during the backoff
        await s.close()
    finally:
        CrashingRunner.crash_when = staticmethod(lambda spec: spec.extra_bufts)


async def test_first_decode_crash_is_retried_on_a_safer_runner() -> None:
    fb = Fallbacks(machine="m")
    FakeRunner.instances = []
    s = Scheduler(
        runner_factory=lambda ref, spec: FakeRunner(spec, MemoryUse(1, 0)),
        estimate=lambda ref, spec: MemoryUse(1, 0),
        budget=lambda: Budget(10, 0, 0),
        fallbacks=fb,
    )
    lease = await s.acquire(ModelRef("w", "smol"), SPEC)
    first = lease.runner
    crash = RunnerCrashed("killed", signal=SEGV, early=True)

    async def work(runner: FakeRunner) -> str:
        if runner.spec.extra_bufts:
            runner.closed = True  # it died
            raise crash
        return "answer"

    assert await lease.call(work) == "answer"  # type: ignore[arg-type]
    assert lease.runner is not first and lease.entry.loaded_spec.extra_bufts is False
    assert not lease.may_retry(RunnerCrashed("late", signal=SEGV, early=False))
    lease.release()
    await s.close()
