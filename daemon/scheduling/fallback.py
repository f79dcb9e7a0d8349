"""Surviving native faults: which configuration a model's runner gets, and what happens when llama.cpp crashes.

A crash in llama.cpp's native code kills only the runner process, by a signal. When that happens while the runner
loads, warms up or runs its first decode, the cause is almost always the configuration on this machine (llama.cpp's
AMX kernels, reached through its "extra buffer types", segfault on some Intel CPUs: llama.cpp issue 20824, Ollama
issues 17006 and 17236; a GPU driver that faults with too many layers), so the model is loaded again one step safer:

1. llama.cpp's extra CPU buffer types off (no weight repacking; llama-server's ``--no-repack``);
2. on a GPU, half the layers;
3. no GPU layers.

The configuration that worked is remembered per model file and hardware fingerprint in the store (so a restarted
daemon goes straight to it) and shown by ``/api/ps`` and ``/api/info``. A model that crashes in every configuration
gets one clear error, and is not loaded again for a while (a backoff that doubles, up to five minutes), so a crash
loop never turns into endless reloads. So does a runner that keeps crashing later in its life.

Pure apart from the two store callbacks; the clock is injected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.exits import signal_name
from daemon.runners.base import LoadSpec, RunnerError

log = logging.getLogger(__name__)

FIRST_BACKOFF = 10.0  # seconds a model that crashed in every configuration is refused, doubling each time
MAX_BACKOFF = 300.0
LOOP_CRASHES = 3  # crashes of a model's runner after its first decode within LOOP_WINDOW seconds: a crash loop
LOOP_WINDOW = 120.0
MAX_REMEMBERED = 1000


def fault_class(sig: int | None) -> str:
    """What kind of llama.cpp failure a runner's death by ``sig`` is, in words a user can search for."""
    name = signal_name(sig) if sig else ""
    if name in ("SIGSEGV", "SIGBUS"):
        return (
            "a memory fault in llama.cpp's native kernels (the class of llama.cpp's CPU-backend crashes, "
            "such as its AMX kernels on some Intel CPUs: llama.cpp issue 20824, Ollama issue 17006)"
        )
    if name == "SIGILL":
        return (
            "an illegal instruction: this llama-cpp-python was built for instructions this CPU lacks "
            '(reinstall it with CMAKE_ARGS="-DGGML_NATIVE=off")'
        )
    if name == "SIGABRT":
        return "llama.cpp aborted (a failed GGML_ASSERT: a model file or setting it does not support)"
    if name == "SIGFPE":
        return "an arithmetic fault in llama.cpp's native kernels"
    if name == "SIGKILL":
        return "the process was killed (usually the kernel's out-of-memory killer)"
    return "a crash in llama.cpp's native code"


def weights_key(spec: LoadSpec) -> str:
    """The model file (and adapters) a runner loads: what a crash belongs to."""
    parts = [spec.model_path.rsplit("/", 1)[-1], *(a.rsplit("/", 1)[-1] for a in spec.adapters)]
    return "+".join(parts)


def fingerprint(*, cpu: str, cpu_flags: str = "", gpus: tuple[str, ...] = (), llama: str = "") -> str:
    """A short hash of what decides which native code runs: CPU model and flags, GPUs, llama.cpp build."""
    text = "\n".join([platform.machine(), cpu, cpu_flags, *gpus, llama])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_fingerprint(gpus: tuple[str, ...] = ()) -> str:
    cpu, flags = "", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not cpu:
                    cpu = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if cpu and flags:
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        llama = version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - not installed: still a fingerprint
        llama = ""
    return fingerprint(cpu=cpu or platform.processor(), cpu_flags=flags, gpus=gpus, llama=llama)


def safer(spec: LoadSpec) -> tuple[LoadSpec, str] | None:
    """The next safer configuration after ``spec`` crashed, and what changed; None when there is none."""
    if spec.extra_bufts:
        return dataclasses.replace(spec, extra_bufts=False), "llama.cpp's extra buffer types off"
    # a draft model (speculative decoding) loaded beside the model steps down with it: half of its layers, none
    draft = spec.draft_num_gpu // 2 if spec.draft_num_gpu > 1 else 0
    if spec.num_gpu > 1:
        layers = spec.num_gpu // 2
        return dataclasses.replace(spec, num_gpu=layers, draft_num_gpu=draft), (
            f"{layers} GPU layers instead of {spec.num_gpu}"
        )
    if spec.num_gpu != 0 or spec.draft_num_gpu != 0:
        return dataclasses.replace(spec, num_gpu=0, tensor_split=(), draft_num_gpu=0), "no GPU layers"
    return None


def describe(spec: LoadSpec) -> str:
    """A configuration, as ``ps`` and ``info`` show it."""
    parts = [f"extra buffer types {'on' if spec.extra_bufts else 'off'}"]
    if spec.num_gpu:
        parts.append(f"{spec.num_gpu if spec.num_gpu > 0 else 'all'} GPU layers")
    return ", ".join(parts)


class RunnerUnusable(RunnerError):
    """A model's runner crashed in every configuration, or keeps crashing: refused for a while."""

    status = 500


@dataclass
class _Overrides:
    """What is remembered for a model on this machine: the settings that made its runner work."""

    extra_bufts: bool = True
    max_gpu_layers: int | None = None
    reason: str = ""
    at: float = 0.0

    def apply(self, spec: LoadSpec) -> LoadSpec:
        out = spec
        if not self.extra_bufts and out.extra_bufts:
            out = dataclasses.replace(out, extra_bufts=False)
        if self.max_gpu_layers is not None and (out.num_gpu < 0 or out.num_gpu > self.max_gpu_layers):
            out = dataclasses.replace(
                out, num_gpu=self.max_gpu_layers, tensor_split=out.tensor_split if self.max_gpu_layers else ()
            )
        if self.max_gpu_layers == 0 and out.draft_num_gpu:  # the model runs on the CPU only: its draft too
            out = dataclasses.replace(out, draft_num_gpu=0)
        return out


@dataclass
class _Block:
    until: float
    delay: float
    message: str


@dataclass
class Fallbacks:
    """The scheduler's memory of runner configurations and crashes (one instance per daemon)."""

    machine: str = ""
    read: Callable[[], bytes | None] | None = None
    write: Callable[[bytes], None] | None = None
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _remembered: dict[str, _Overrides] = field(default_factory=dict)
    _failed: dict[str, dict[LoadSpec, str]] = field(default_factory=dict)  # this run: configs that crashed
    _blocks: dict[str, _Block] = field(default_factory=dict)
    _last_delay: dict[str, float] = field(default_factory=dict)
    _late: dict[str, list[float]] = field(default_factory=dict)
    _loaded_state: bool = False

    # -- remembered configurations -----------------------------------------------------------------------------
    def _key(self, weights: str) -> str:
        return f"{weights}@{self.machine}"

    def _load_state(self) -> None:
        if self._loaded_state:
            return
        self._loaded_state = True
        raw = self.read() if self.read else None
        if not raw:
            return
        try:
            data = json.loads(raw)
            for key, value in (data.get("runners") or {}).items():
                if isinstance(key, str) and isinstance(value, dict):
                    gpu = value.get("max_gpu_layers")
                    self._remembered[key] = _Overrides(
                        extra_bufts=bool(value.get("extra_bufts", True)),
                        max_gpu_layers=int(gpu) if isinstance(gpu, int) and gpu >= 0 else None,
                        reason=str(value.get("reason", ""))[:500],
                        at=float(value.get("at", 0) or 0),
                    )
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable runner state: %s", exc)

    def _save_state(self) -> None:
        if self.write is None:
            return
        items = sorted(self._remembered.items(), key=lambda kv: -kv[1].at)[:MAX_REMEMBERED]
        runners = {
            k: {"extra_bufts": v.extra_bufts, "max_gpu_layers": v.max_gpu_layers, "reason": v.reason, "at": v.at}
            for k, v in items
        }
        try:
            self.write(json.dumps({"version": 1, "runners": runners}, indent=1, sort_keys=True).encode())
        except Exception as exc:  # noqa: BLE001 - remembering is an optimisation; serving goes on
            log.warning("could not save the runner configuration: %s", exc)

    def effective(self, spec: LoadSpec) -> tuple[LoadSpec, str | None]:
        """The configuration to load ``spec`` with: what was remembered for this model and machine, then past
        the configurations that crashed in this run. The note says what differs from the request, if anything."""
        self._load_state()
        weights = weights_key(spec)
        remembered = self._remembered.get(self._key(weights))
        out = remembered.apply(spec) if remembered else spec
        failed = self._failed.get(weights, {})
        why = f"the runner was {remembered.reason}" if remembered and remembered.reason else "an earlier crash"
        while out in failed:
            step = safer(out)
            if step is None:
                break
            why = f"the runner was {failed[out]}"
            out = step[0]
        if out == spec:
            return out, None
        return out, f"{describe(out)} (after {why})"

    def worked(self, requested: LoadSpec, used: LoadSpec, reason: str) -> None:
        """``used`` loaded and ran where ``requested`` had crashed: remember it for this model and machine."""
        self._load_state()
        weights = weights_key(requested)
        key = self._key(weights)
        old = self._remembered.get(key)
        fewer = used.num_gpu != requested.num_gpu
        new = _Overrides(
            extra_bufts=used.extra_bufts,
            max_gpu_layers=used.num_gpu if fewer else (old.max_gpu_layers if old else None),
            reason=reason,
            at=self.wall(),
        )
        if old is not None and (old.extra_bufts, old.max_gpu_layers) == (new.extra_bufts, new.max_gpu_layers):
            return
        self._remembered[key] = new
        log.warning('runner configuration chosen model=%s config="%s" after="%s"', weights, describe(used), reason)
        self._save_state()

    def remembered(self) -> list[dict[str, Any]]:
        """Every remembered configuration of this machine, for ``/api/info``."""
        self._load_state()
        out = []
        for key, v in sorted(self._remembered.items()):
            weights, _, machine = key.rpartition("@")
            if machine != self.machine:
                continue
            out.append(
                {
                    "model_file": weights,
                    "extra_buffer_types": v.extra_bufts,
                    "max_gpu_layers": v.max_gpu_layers,
                    "reason": v.reason,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(v.at)) if v.at else "",
                }
            )
        return out

    # -- crashes -----------------------------------------------------------------------------------------------
    def failed(self, spec: LoadSpec, what: str) -> tuple[LoadSpec, str] | None:
        """``spec`` crashed (``what``: the signal and the stage): the next configuration to try, or None."""
        weights = weights_key(spec)
        self._failed.setdefault(weights, {})[spec] = what
        step = safer(spec)
        while step is not None and step[0] in self._failed[weights]:
            step = safer(step[0])
        return step

    def tried(self, spec: LoadSpec) -> dict[LoadSpec, str]:
        return dict(self._failed.get(weights_key(spec), {}))

    def give_up(self, spec: LoadSpec, name: str, sig: int | None) -> RunnerUnusable:
        """Every configuration crashed: refuse the model for a while; the error names what happened."""
        weights = weights_key(spec)
        tries = "; ".join(f"{describe(s)}: {w}" for s, w in self._failed.get(weights, {}).items())
        delay = self._backoff(weights)
        message = (
            f"model '{name}' crashed llama.cpp in every configuration corral tried ({tries}): "
            f"{fault_class(sig)}. corral will not load it again for {delay:.0f}s; the daemon log has "
            f"llama.cpp's output. Try another quantization of the model, or update llama-cpp-python"
        )
        self._block(weights, delay, message)
        self._failed.pop(weights, None)  # after the backoff, the whole ladder is tried again
        return RunnerUnusable(message)

    def late_crash(self, spec: LoadSpec, name: str, what: str, sig: int | None) -> None:
        """A runner died after it had served: count it; too many in a short time is a crash loop."""
        weights = weights_key(spec)
        now = self.clock()
        times = [t for t in self._late.get(weights, []) if now - t < LOOP_WINDOW] + [now]
        self._late[weights] = times
        if len(times) >= LOOP_CRASHES:
            delay = self._backoff(weights)
            self._late.pop(weights, None)
            message = (
                f"model '{name}' crashed {len(times)} times in {LOOP_WINDOW / 60:.0f} minutes (last: {what}): "
                f"{fault_class(sig)}. corral will not load it again for {delay:.0f}s; the daemon log has "
                f"llama.cpp's output"
            )
            log.warning("crash loop model=%s crashes=%d backoff=%.0fs", weights, len(times), delay)
            self._block(weights, delay, message)

    def blocked(self, spec: LoadSpec) -> RunnerUnusable | None:
        """The error to answer at once while a model is in its backoff, else None."""
        block = self._blocks.get(weights_key(spec))
        if block is None:
            return None
        left = block.until - self.clock()
        if left <= 0:
            del self._blocks[weights_key(spec)]
            return None
        return RunnerUnusable(f"{block.message} ({left:.0f}s left)")

    def _backoff(self, weights: str) -> float:
        delay = min(MAX_BACKOFF, self._last_delay.get(weights, FIRST_BACKOFF / 2) * 2)
        self._last_delay[weights] = delay
        return delay

    def _block(self, weights: str, delay: float, message: str) -> None:
        self._blocks[weights] = _Block(until=self.clock() + delay, delay=delay, message=message)
