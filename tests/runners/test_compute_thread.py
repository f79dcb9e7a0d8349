"""A runner does every llama.cpp computation on its engine's thread: the warm-up, the projector's load (libmtmd warms
it up with an encode) and every decode. ggml's CPU backend runs a graph as an OpenMP parallel region and libgomp
keeps a team of worker threads per thread that starts one; a second team (a warm-up decode on the main thread, say)
leaves more OpenMP threads than cores on a small machine, libgomp then sleeps at barriers instead of spinning, and
every later token pays for it (issue 19: 10-12 ms a token of SmolLM2 on 2 cores instead of 7)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.llama.engine import FIRST_TOKEN_PAUSE, EngineError
from daemon.llama.runner import Runner
from daemon.runners.protocol import GenerateOp, GenerateRequest, LoadSpec, Reply, SampleParams, wire
from tests.models import smollm2_path

# Runners made here stay referenced for the whole session: each installs its log callback in llama.cpp, which must
# outlive any later llama.cpp call in this process.
_KEEP: list[Runner] = []


class Chan:
    """The runner's channel to the daemon, kept in memory (with the time each message came)."""

    def __init__(self) -> None:
        self.msgs: list[dict[str, Any]] = []  # each reply as it goes over the pipe (``protocol.wire``)
        self.times: list[float] = []
        self.done = threading.Event()

    def send(self, reply: Reply) -> None:
        self.send_many([reply])

    def send_many(self, replies: list[Reply]) -> None:
        objs = [wire(r) for r in replies]
        self.msgs += objs
        self.times += [time.monotonic()] * len(objs)
        if any(o.get("type") in ("done", "error") for o in objs):
            self.done.set()


class Decodes:
    """The ``llama_cpp`` module, with ``llama_decode`` noting the thread that calls it."""

    def __init__(self, lc: Any) -> None:
        self._lc = lc
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lc, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.threads.append(threading.current_thread().name)
        return int(self._lc.llama_decode(ctx, batch))


def load(spec: LoadSpec, chan: Chan) -> tuple[Runner, Decodes]:
    runner = Runner(chan)  # type: ignore[arg-type]
    _KEEP.append(runner)
    decodes = Decodes(runner.lc)
    runner.lc = decodes
    runner.load(spec)
    return runner, decodes


def generate(runner: Runner, chan: Chan, rid: int, prompt: str, tokens: int = 4) -> None:
    chan.done.clear()
    runner.handle(GenerateOp(rid, GenerateRequest(prompt, SampleParams(num_predict=tokens, temperature=0))))
    assert chan.done.wait(60)
    assert not [m for m in chan.msgs if m.get("type") == "error"]


def test_warm_up_and_decodes_share_the_engine_thread(tiny_gguf: Path) -> None:
    chan = Chan()
    runner, decodes = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=128, num_parallel=2), chan)
    try:
        assert decodes.threads == ["engine", "engine"]  # the warm-up: a prompt-sized decode and a 1-token one
        generate(runner, chan, 1, "hello there")
        generate(runner, chan, 2, "another prompt")
        assert len(decodes.threads) > 4
        assert set(decodes.threads) == {"engine"}
    finally:
        runner.close()


def test_engine_call(tiny_gguf: Path) -> None:
    runner, _ = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=128), Chan())
    engine = runner.engine
    assert engine is not None
    try:
        assert engine.call(lambda: threading.current_thread().name) == "engine"

        def fails() -> None:
            raise ValueError("from the engine thread")

        with pytest.raises(ValueError, match="from the engine thread"):
            engine.call(fails)
        assert engine.call(lambda: 42) == 42  # the engine goes on after a call that failed
    finally:
        runner.close()
    with pytest.raises(EngineError, match="closed"):
        engine.call(lambda: None)


def test_a_pause_after_first_tokens_only(tiny_gguf: Path) -> None:
    """On the CPU the engine waits a moment after a step that gave a sequence its first token (the daemon and the
    client get the cores to pass it on), and never between later tokens."""
    chan = Chan()
    runner, _ = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=128), chan)
    engine = runner.engine
    assert engine is not None
    try:
        assert engine.first_token_pause == FIRST_TOKEN_PAUSE > 0
        engine.first_token_pause = 0.5  # long enough to see through any scheduling noise
        engine.stream_interval = 0.0  # a frame per step, to time each token
        generate(runner, chan, 1, "hello there", tokens=6)
        at = [t for m, t in zip(chan.msgs, chan.times, strict=True) if m.get("type") == "token"]
        assert len(at) == 6
        assert at[1] - at[0] >= 0.5
        assert all(b - a < 0.5 for a, b in zip(at[1:], at[2:], strict=False))
    finally:
        runner.close()


@pytest.mark.real_model
def test_projector_loads_on_the_engine_thread() -> None:
    smol = smollm2_path()
    if smol is None:
        pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
    from tests.vision import projector_path

    loaded_on: list[str] = []
    original = Runner._load_projector

    def spy(self: Runner, *args: Any) -> None:
        loaded_on.append(threading.current_thread().name)
        original(self, *args)

    chan = Chan()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Runner, "_load_projector", spy)
        runner, decodes = load(LoadSpec(model_path=str(smol), num_ctx=256, projector_path=str(projector_path())), chan)
    try:
        assert loaded_on == ["engine"]
        assert runner.projector is not None
        generate(runner, chan, 1, "hello")
        assert set(decodes.threads) == {"engine"}
    finally:
        runner.close()
