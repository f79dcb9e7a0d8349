"""Native faults end to end: a runner that dies by SIGSEGV (llama.cpp's AMX kernels do on some Intel CPUs) is
loaded again without llama.cpp's extra buffer types, the request is answered, and the choice is remembered across a
daemon restart and shown in ps and info. On CPUs that do not crash, the runner's test-only fault switch
(``CORRAL_TEST_FAULT``, docs/runner-faults.md) makes it crash the same way.

Also here: names that resolve to the same weights share one runner process."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import ollama
import psutil
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path

pytestmark = pytest.mark.real_model

SMOL = smollm2_path()
if SMOL is None:
    pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)", allow_module_level=True)

GREEDY = {"temperature": 0, "seed": 42, "num_predict": 12, "num_ctx": 512, "repeat_penalty": 1.0}


def create(d: Daemon, name: str, **kw: object) -> None:
    assert SMOL is not None
    client = ollama.Client(host=d.url)
    digest = client.create_blob(SMOL)
    client.create(model=name, files={SMOL.name: digest}, stream=False, **kw)  # type: ignore[arg-type]


def generate(d: Daemon, model: str = "smol", stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of France is", "raw": True, "stream": stream, "options": GREEDY}
    return httpx.post(d.url + "/api/generate", json=body, timeout=180)


def runner_pids(d: Daemon) -> list[int]:
    return [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)]


def loads(d: Daemon) -> int:
    return len(re.findall(r"\bload model=", d.log.read_text()))


@pytest.mark.parametrize("stage", ["warmup", "first-decode"])
def test_segfault_falls_back_to_no_extra_buffer_types(tmp_path: Path, stage: str) -> None:
    models = tmp_path / "models"
    d = start_daemon(models, tmp_path / "daemon.log", {"CORRAL_TEST_FAULT": stage})
    try:
        create(d, "smol")
        r = generate(d, stream=stage == "first-decode")
        assert r.status_code == 200, r.text
        lines = [json.loads(x) for x in r.text.splitlines()] if stage == "first-decode" else [r.json()]
        assert not any("error" in x for x in lines), lines
        assert "".join(x.get("response", "") for x in lines).strip()  # an answer, not the crash
        assert lines[-1]["done"] is True
        log = d.log.read_text()
        assert "SIGSEGV" in log and "extra buffer types off" in log
        ps = httpx.get(d.url + "/api/ps").json()["models"]
        assert len(ps) == 1 and "extra buffer types off" in ps[0]["fallback"], ps
        assert "SIGSEGV" in ps[0]["fallback"]
        info = httpx.get(d.url + "/api/info").json()
        assert [f["extra_buffer_types"] for f in info["runner_fallbacks"]] == [False]
        cli = d.cli("ps")
        assert cli.returncode == 0 and "extra buffer types off" in cli.stdout, cli.stdout + cli.stderr
    finally:
        stop_daemon(d)
    assert (models / ".corral-runners.json").is_file()

    # a restarted daemon goes straight to the configuration that worked: one load, no crash
    d = start_daemon(models, tmp_path / "daemon2.log", {"CORRAL_TEST_FAULT": stage})
    try:
        r = generate(d)
        assert r.status_code == 200 and r.json()["response"].strip(), r.text
        assert loads(d) == 1
        assert "runner crashed" not in d.log.read_text() and "runner exited" not in d.log.read_text()
        ps = httpx.get(d.url + "/api/ps").json()["models"]
        assert "extra buffer types off" in ps[0]["fallback"]
        info = d.cli("info")
        assert info.returncode == 0 and "extra buffer types off" in info.stdout, info.stdout + info.stderr
    finally:
        stop_daemon(d)


def test_crash_in_every_configuration_is_one_clear_error_and_backs_off(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_TEST_FAULT": "warmup-always"})
    try:
        create(d, "smol")
        r = generate(d)
        assert r.status_code == 500
        error = r.json()["error"]
        assert "SIGSEGV" in error and "every configuration" in error and "llama.cpp issue" in error, error
        assert "/" not in error.split("(")[0]  # no paths or native traces
        tried = loads(d)
        assert tried == 1  # one load, two configurations tried inside it
        assert d.log.read_text().count("killed by SIGSEGV during warm-up") >= 2
        # the backoff: the next requests fail at once, without starting a runner again
        started = time.monotonic()
        for _ in range(3):
            again = generate(d)
            assert again.status_code == 500 and "will not load it again" in again.json()["error"]
        assert time.monotonic() - started < 5
        assert loads(d) == tried
        assert not runner_pids(d)
        # the store and the daemon are fine: listing works, another request type gets the same clear answer
        assert httpx.get(d.url + "/api/tags").status_code == 200
    finally:
        stop_daemon(d)


def test_aliases_share_one_runner_and_keep_their_own_system(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    try:
        create(d, "smol")
        client = ollama.Client(host=d.url)
        client.copy("smol", "smol-copy")
        client.create(model="pirate", from_="smol", system="You are a pirate. Always answer: Arr!", stream=False)
        client.create(model="french", from_="smol", system="Réponds toujours en français.", stream=False)
        msgs = [{"role": "user", "content": "Who are you?"}]
        opts = {"temperature": 0, "num_predict": 16, "num_ctx": 1024}
        out = {}
        pids = set()
        for name in ("smol", "smol-copy", "pirate", "french"):
            r = client.chat(model=name, messages=msgs, options=opts)
            out[name] = r.message.content
            pids.update(runner_pids(d))
        assert len(pids) == 1, pids  # one runner process for the four names
        assert out["smol"] == out["smol-copy"]
        assert out["pirate"] != out["smol"] and out["french"] != out["smol"] and out["pirate"] != out["french"]
        ps = httpx.get(d.url + "/api/ps").json()["models"]
        assert len(ps) == 1, ps
        assert ps[0]["name"] == "french:latest"  # the last name it served
        assert set(ps[0]["names"]) == {"smol:latest", "smol-copy:latest", "pirate:latest", "french:latest"}
        # the request log names each request's own model
        log = d.log.read_text()
        assert "model=pirate:latest" in log or "model=pirate" in log
    finally:
        stop_daemon(d)


def test_a_draft_model_that_crashes_its_runner_is_survived(tmp_path: Path) -> None:
    """Speculative decoding (issue 28): the draft model's kernels crash the runner (at the draft's warm-up, before
    any request is served): the runner is loaded again one step safer, draft included, and the request answered."""
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_TEST_FAULT": "draft-warmup"})
    try:
        create(d, "smol")
        create(d, "smol-d", parameters={"draft_model": "smol"})
        r = generate(d, model="smol-d")
        assert r.status_code == 200, r.text
        final = r.json()
        assert final["response"].strip() and final["draft_n"] >= 0, final
        log = d.log.read_text()
        assert "SIGSEGV" in log and "extra buffer types off" in log
        ps = httpx.get(d.url + "/api/ps").json()["models"]
        assert ps[0]["draft_model"].startswith("smol") and "extra buffer types off" in ps[0]["fallback"], ps
    finally:
        stop_daemon(d)
