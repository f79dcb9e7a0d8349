"""The runner child process through its daemon-side handle, with real llama.cpp."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from daemon.runners.base import GenerateRequest, LoadFailed, LoadSpec, RunnerCrashed, SampleParams, Token
from daemon.runners.process import ProcessRunner, RunnerRequestError
from tests.models import write_tiny_gguf

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]
GREEDY = SampleParams(temperature=0, num_predict=24, repeat_penalty=1.0, seed=42)


async def collect(r: ProcessRunner, prompt: str, params: SampleParams = GREEDY) -> tuple[str, str]:
    text, reason = [], ""
    async for ev in r.generate(GenerateRequest(prompt=prompt, params=params)):
        if isinstance(ev, Token):
            text.append(ev.text)
        else:
            reason = ev.done_reason
    return "".join(text), reason


async def test_generate_matches_in_process(tiny_gguf: Path) -> None:
    from llama_cpp import Llama

    r = ProcessRunner(LoadSpec(model_path=str(tiny_gguf), num_ctx=256))
    await r.start()
    try:
        ours, _ = await collect(r, "a b c")
        ref = Llama(model_path=str(tiny_gguf), n_ctx=256, verbose=False, flash_attn=True).create_completion(
            "a b c", max_tokens=24, temperature=0, repeat_penalty=1.0, seed=42
        )["choices"][0]["text"]
        # random weights emit stray byte tokens: compare what both decode as valid UTF-8
        assert ours.replace("\ufffd", "") == ref.replace("\ufffd", "")
        assert r.memory.ram > 0 and r.info()["n_ctx"] == 256
        toks = await r.tokenize("a b", add_special=False)
        assert (await r.detokenize(toks)).strip() == "a b"
    finally:
        await r.close()
    assert not r.alive()


async def test_stop_strings_and_length(tiny_gguf: Path) -> None:
    r = ProcessRunner(LoadSpec(model_path=str(tiny_gguf), num_ctx=256))
    await r.start()
    try:
        full, _ = await collect(r, "a b c", SampleParams(temperature=0, num_predict=16, repeat_penalty=1.0))
        _, reason = await collect(r, "a b c", SampleParams(temperature=0, num_predict=3, repeat_penalty=1.0))
        assert reason == "length"
        if len(full.strip()) > 4:
            stop = full.strip()[2:4]
            cut, reason = await collect(
                r, "a b c", SampleParams(temperature=0, num_predict=16, repeat_penalty=1.0, stop=(stop,))
            )
            assert stop not in cut and reason == "stop" and full.startswith(cut)
    finally:
        await r.close()


async def test_cancel_then_next_request_is_clean(tiny_gguf: Path) -> None:
    r = ProcessRunner(LoadSpec(model_path=str(tiny_gguf), num_ctx=512))
    await r.start()
    try:
        expected, _ = await collect(r, "x y z")
        gen = r.generate(GenerateRequest(prompt="a b c", params=SampleParams(num_predict=400, temperature=1.0)))
        async for _ev in gen:
            break
        await gen.aclose()  # type: ignore[attr-defined]
        assert (await collect(r, "x y z"))[0] == expected
    finally:
        await r.close()


async def test_sigkill_mid_stream_is_runner_crashed(tiny_gguf: Path) -> None:
    r = ProcessRunner(LoadSpec(model_path=str(tiny_gguf), num_ctx=512))
    await r.start()
    with pytest.raises(RunnerCrashed, match="SIGKILL"):
        async for _ev in r.generate(GenerateRequest(prompt="a", params=SampleParams(num_predict=-1, temperature=1.0))):
            if r.pid and psutil.pid_exists(r.pid):
                os.kill(r.pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
    assert not r.alive()
    await r.close()


async def test_not_a_model_fails_to_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 100)
    r = ProcessRunner(LoadSpec(model_path=str(bad)))
    with pytest.raises(LoadFailed, match="llama runner process has terminated"):
        await r.start()
    assert not r.alive()


async def test_vocab_without_byte_fallback_aborts_only_the_runner(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "nobytes.gguf", byte_fallback=False)
    r = ProcessRunner(LoadSpec(model_path=str(path), num_ctx=128))
    try:
        await r.start()
    except LoadFailed:
        return  # refused at load: also fine, the test process survives
    with pytest.raises((RunnerCrashed, RunnerRequestError, Exception)):
        await asyncio.wait_for(collect(r, "日本語 ☃ ümlaut"), 60)
    await r.close()


PARENT = """
import asyncio, sys
sys.path.insert(0, sys.argv[2])
from daemon.runners.process import ProcessRunner
from daemon.runners.base import LoadSpec
async def main():
    r = ProcessRunner(LoadSpec(model_path=sys.argv[1], num_ctx=128))
    await r.start()
    print(r.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_runner_exits_when_the_daemon_is_killed(tiny_gguf: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_gguf), str(REPO)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            return
        time.sleep(0.1)
    raise AssertionError(f"runner {child} outlived its daemon")
