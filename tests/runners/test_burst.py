"""A burst of requests reaches an idle engine one by one, as the daemon reads them; told how many more are on their
way (``arriving``), the engine waits briefly for them and evaluates their prompts in one step, instead of starting
the first alone while the others are still being read. Never longer than ARRIVAL_WAIT for a request that does not
come, and never while other sequences decode."""

from __future__ import annotations

import time
from pathlib import Path

from daemon.runners.base import LoadSpec
from daemon.runners.engine import ARRIVAL_WAIT
from tests.runners.test_compute_thread import Chan, load


class Steps:
    """Counts ``llama_decode`` calls (the engine's steps) and the sequences each one carried."""

    def __init__(self, decodes: object) -> None:
        self.seqs: list[int] = []
        inner = decodes.llama_decode  # type: ignore[attr-defined]

        def counted(ctx: object, batch: object) -> int:
            n = batch.n_tokens  # type: ignore[attr-defined]
            self.seqs.append(len({int(batch.seq_id[i][0]) for i in range(n)}))  # type: ignore[attr-defined]
            return int(inner(ctx, batch))

        decodes.llama_decode = counted  # type: ignore[attr-defined]


def submit(runner: object, rid: int, prompt: str, arriving: int) -> None:
    params = {"num_predict": 3, "temperature": 0}
    runner.generate(rid, {"prompt": prompt, "params": params}, arriving=arriving)  # type: ignore[attr-defined]


def wait_all(chan: Chan, rids: list[int], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not all(any(m.get("id") == r and m.get("type") == "done" for m in chan.msgs) for r in rids):
        assert time.monotonic() < end, "requests did not finish"
        time.sleep(0.005)


def test_a_burst_announced_by_the_daemon_shares_its_first_step(tiny_gguf: Path) -> None:
    chan = Chan()
    runner, decodes = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=1024, num_parallel=4), chan)
    assert runner.engine is not None
    steps = Steps(decodes)
    try:
        runner.engine.call(lambda: None)
        # four requests 2 ms apart, each saying how many are still to come
        for i in range(4):
            submit(runner, i + 1, f"request number {i}", 3 - i)
            time.sleep(ARRIVAL_WAIT / 3)
        wait_all(chan, [1, 2, 3, 4])
        assert steps.seqs[0] == 4, steps.seqs
    finally:
        runner.close()


def test_a_request_that_never_comes_costs_at_most_the_wait(tiny_gguf: Path) -> None:
    chan = Chan()
    runner, decodes = load(LoadSpec(model_path=str(tiny_gguf), num_ctx=1024, num_parallel=4), chan)
    assert runner.engine is not None
    steps = Steps(decodes)
    try:
        runner.engine.call(lambda: None)
        sent = time.monotonic()
        submit(runner, 1, "alone after all", 2)
        wait_all(chan, [1])
        first = chan.times[next(i for i, m in enumerate(chan.msgs) if m.get("id") == 1)]
        assert first - sent < ARRIVAL_WAIT + 2.0  # generous for a loaded machine; the wait itself is milliseconds
        assert steps.seqs[0] == 1
        # a request that says nothing more is coming is not held at all
        submit(runner, 2, "nobody else", 0)
        wait_all(chan, [2])
        assert steps.seqs[-1] == 1
    finally:
        runner.close()
