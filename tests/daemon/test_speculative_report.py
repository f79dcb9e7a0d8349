"""Speculative decoding's request and response surface (issue 28): how a request asks for it (Ollama options, a
Modelfile PARAMETER, LM Studio's ``draft_model`` and llama-server's ``speculative.*`` fields on /v1, with a 400
naming the field for a bad value), and where the runner's ``draft_n``/``draft_n_accepted`` show: the final object
of /api/generate and /api/chat, /v1 ``usage`` (chat, completions, responses), ``/metrics``, the request log line
and ``corral run --verbose``.

The real HTTP server, middleware, scheduler, store and routes run in process with a fake runner whose Done carries
the draft counts a test sets (the runner's own drafting is tested in tests/runners/test_speculative.py); the last
test runs a real daemon on SmolLM2 with prompt lookup."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from cli.chat import stats_lines
from daemon.api.app import create_app
from daemon.api.compat import BadParam, speculative_options
from daemon.runners.base import Done, Event, GenerateRequest, MemoryUse, Token
from daemon.settings import Settings
from tests.conftest import REPO, start_daemon, stop_daemon
from tests.fakes import FakeRunner
from tests.models import smollm2_path, write_tiny_gguf

MEMORY = MemoryUse(ram=1 << 20, vram=0)


class DraftingRunner(FakeRunner):
    """Answers "Hello world" and ends with the draft counts in :attr:`drafts` (what a test sets); records the
    requests it was sent."""

    drafts: tuple[int, int] = (0, 0)
    requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        DraftingRunner.requests.append(req)
        yield Token("Hello")
        yield Token(" world")
        n, accepted = DraftingRunner.drafts
        yield Done("stop", 5, 1_000_000, 2, 2_000_000, draft_n=n, draft_n_accepted=accepted)


class AccessLog(logging.Handler):
    """The request log lines (logger ``daemon.access``) written while it is installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Served:
    def __init__(self, url: str, log: AccessLog) -> None:
        self.url, self.log = url, log

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            return c.post(path, json=body)

    def lines(self, path: str) -> list[str]:
        """The log lines of the requests to ``path`` (the line is written when the response has gone)."""
        deadline = time.monotonic() + 10
        while True:
            found = [ln for ln in self.log.lines if f"path={path} " in ln]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.01)


def _create(c: httpx.Client, name: str, gguf: Path, parameters: dict[str, Any] | None = None) -> None:
    data = gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    c.post(f"/api/blobs/{digest}", content=data).raise_for_status()
    body: dict[str, Any] = {"model": name, "files": {"tiny.gguf": digest}, "stream": False}
    if parameters:
        body["parameters"] = parameters
    r = c.post("/api/create", json=body)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An in-process daemon whose runners are :class:`DraftingRunner`, with the tiny GGUF as "tiny" (no draft
    options), as "ngram" (``PARAMETER draft_ngram 3``) and as "draft" (to draft for "tiny")."""
    tmp = tmp_path_factory.mktemp("spec")
    app = create_app(
        Settings(models=tmp / "models"),
        runner_factory=lambda ref, spec: DraftingRunner(spec, MEMORY),
        estimator=lambda ref, spec: MEMORY,
    )
    access = logging.getLogger("daemon.access")
    handler, level = AccessLog(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the in-process daemon did not start"
        time.sleep(0.01)
    try:
        gguf = write_tiny_gguf(tmp / "tiny.gguf")
        with httpx.Client(base_url=url, timeout=60) as c:
            _create(c, "tiny", gguf)
            _create(c, "ngram", gguf, {"draft_ngram": 3})
            _create(c, "draft", gguf)  # a draft model for "tiny": the same vocabulary
        yield Served(url, handler)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        access.removeHandler(handler)
        access.setLevel(level)


@pytest.fixture
def drafts() -> Iterator[None]:
    DraftingRunner.drafts = (0, 0)
    DraftingRunner.requests = []
    yield
    DraftingRunner.drafts = (0, 0)


NGRAM = {"draft_ngram": 3}


def _ndjson(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [
        json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


# -- the Ollama API's final object ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_generate_final_object_has_the_draft_counts(served: Served, drafts: None, stream: bool) -> None:
    DraftingRunner.drafts = (12, 9)
    r = served.post("/api/generate", {"model": "tiny", "prompt": "hi", "options": NGRAM, "stream": stream})
    final = _ndjson(r)[-1]
    assert final["done"] is True and final["response"] == ("" if stream else "Hello world")
    assert final["draft_n"] == 12 and final["draft_n_accepted"] == 9
    assert final["eval_count"] == 2  # beside Ollama's metrics, which are unchanged
    if stream:
        assert all("draft_n" not in chunk for chunk in _ndjson(r)[:-1])  # only the final object carries them


@pytest.mark.parametrize("stream", [False, True])
def test_chat_final_object_has_the_draft_counts(served: Served, drafts: None, stream: bool) -> None:
    DraftingRunner.drafts = (7, 3)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": NGRAM, "stream": stream}
    final = _ndjson(served.post("/api/chat", body))[-1]
    assert final["done"] is True
    assert (final["draft_n"], final["draft_n_accepted"]) == (7, 3)


def test_no_draft_fields_without_speculation(served: Served, drafts: None) -> None:
    """A request that did not ask for speculation (and drafted nothing) has no draft fields anywhere: its answer
    is exactly what it was before."""
    final = served.post("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}).json()
    assert final["done"] is True and "draft_n" not in final and "draft_n_accepted" not in final
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    usage = served.post("/v1/chat/completions", chat).json()["usage"]
    assert "draft_n" not in usage and "draft_n_accepted" not in usage
    line = served.lines("/api/generate")[-1]
    assert "draft_n=" not in line


def test_asked_for_but_nothing_drafted_says_zero(served: Served, drafts: None) -> None:
    """Speculation on (here by the model's PARAMETER draft_ngram) with nothing drafted reports 0, telling "on, no
    match to draft from" apart from "off"."""
    final = served.post("/api/generate", {"model": "ngram", "prompt": "hi", "stream": False}).json()
    assert (final["draft_n"], final["draft_n_accepted"]) == (0, 0)


def test_draft_max_zero_turns_the_report_off(served: Served, drafts: None) -> None:
    body = {"model": "ngram", "prompt": "hi", "stream": False, "options": {"draft_max": 0}}
    final = served.post("/api/generate", body).json()
    assert "draft_n" not in final


def test_counts_the_runner_drafted_are_shown_even_unasked(served: Served, drafts: None) -> None:
    DraftingRunner.drafts = (4, 4)
    final = served.post("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}).json()
    assert (final["draft_n"], final["draft_n_accepted"]) == (4, 4)


# -- /v1 usage -------------------------------------------------------------------------------------------------------
def test_chat_completions_usage_has_the_draft_counts(served: Served, drafts: None) -> None:
    DraftingRunner.drafts = (10, 6)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": NGRAM}
    usage = served.post("/v1/chat/completions", body).json()["usage"]
    assert (usage["draft_n"], usage["draft_n_accepted"]) == (10, 6)
    assert usage["completion_tokens"] == 2 and usage["total_tokens"] == 7
    streamed = _sse(
        served.post("/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    assert (streamed[-1]["usage"]["draft_n"], streamed[-1]["usage"]["draft_n_accepted"]) == (10, 6)
    assert all("usage" not in chunk for chunk in streamed[:-1])


def test_openai_sdk_reads_the_draft_counts(served: Served, drafts: None) -> None:
    """The official SDK keeps the extra usage fields (and sends llama-server's and LM Studio's fields through
    ``extra_body``)."""
    DraftingRunner.drafts = (9, 4)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="corral", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"options": NGRAM, "speculative.n_max": 4},
    )
    assert reply.usage is not None and reply.usage.model_extra == {"draft_n": 9, "draft_n_accepted": 4}


def test_completions_usage_sums_the_draft_counts_of_every_choice(served: Served, drafts: None) -> None:
    DraftingRunner.drafts = (10, 6)
    body = {"model": "tiny", "prompt": "hi", "options": NGRAM}
    usage = served.post("/v1/completions", body).json()["usage"]
    assert (usage["draft_n"], usage["draft_n_accepted"]) == (10, 6)
    usage = served.post("/v1/completions", {**body, "n": 3}).json()["usage"]
    assert (usage["draft_n"], usage["draft_n_accepted"], usage["completion_tokens"]) == (30, 18, 6)
    streamed = _sse(served.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert (streamed[-1]["usage"]["draft_n"], streamed[-1]["usage"]["draft_n_accepted"]) == (10, 6)


def test_responses_usage_has_the_draft_counts(served: Served, drafts: None) -> None:
    DraftingRunner.drafts = (8, 8)
    body = {"model": "tiny", "input": "hi", "options": NGRAM}
    usage = served.post("/v1/responses", body).json()["usage"]
    assert (usage["draft_n"], usage["draft_n_accepted"]) == (8, 8)
    assert usage["output_tokens"] == 2
    events = _sse(served.post("/v1/responses", {**body, "stream": True}))
    done = [e for e in events if e.get("type") == "response.completed"][-1]
    assert (done["response"]["usage"]["draft_n"], done["response"]["usage"]["draft_n_accepted"]) == (8, 8)


# -- /metrics and the request log ----------------------------------------------------------------------------------
def _counter(text: str, name: str, model: str) -> float:
    found = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} ([\d.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_metrics_and_log_line_count_drafted_and_accepted(served: Served, drafts: None) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        before = c.get("/metrics").text
        DraftingRunner.drafts = (20, 15)
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False, "options": NGRAM})
        assert r.status_code == 200
        DraftingRunner.drafts = (5, 1)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": NGRAM}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        after = c.get("/metrics").text
    for name, grown in (("corral_draft_tokens_total", 25), ("corral_draft_accepted_tokens_total", 16)):
        assert _counter(after, name, "tiny:latest") - _counter(before, name, "tiny:latest") == grown, name
    line = served.lines("/api/generate")[-1]
    assert "model=tiny:latest" in line and " eval_count=2 draft_n=20 draft_n_accepted=15 " in line
    assert "draft_n=5 draft_n_accepted=1 " in served.lines("/v1/chat/completions")[-1]


# -- requests: what reaches the options ----------------------------------------------------------------------------
def test_v1_speculative_fields_map_to_the_draft_options() -> None:
    body = {"draft_model": "smol-draft", "speculative.n_max": 8, "speculative.n_min": 2, "speculative.p_min": 0.5}
    assert speculative_options(body) == {
        "draft_model": "smol-draft",
        "draft_max": 8,
        "draft_min": 2,
        "draft_p_min": 0.5,
    }
    assert speculative_options({"model": "m", "messages": []}) == {}


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("speculative.n_max", -1, "between 0 and 256"),
        ("speculative.n_max", 257, "between 0 and 256"),
        ("speculative.n_max", "8", "must be an integer"),
        ("speculative.n_max", 2.5, "must be an integer"),
        ("speculative.n_min", -3, "between 0 and 256"),
        ("speculative.p_min", 1.5, "between 0 and 1"),
        ("speculative.p_min", True, "must be a number"),
        ("draft_model", 5, "must be a string"),
        ("draft_model", "  ", "must name a model"),
    ],
)
def test_v1_bad_speculative_values_are_a_400_naming_the_field(
    served: Served, drafts: None, field: str, value: Any, says: str
) -> None:
    with pytest.raises(BadParam) as caught:
        speculative_options({field: value})
    assert caught.value.param == field
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ("/v1/responses", {"model": "tiny", "input": "hi"}),
    ):
        r = served.post(path, {**body, field: value})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"] and says in error["message"], (path, error)
    assert DraftingRunner.requests == []  # refused before anything ran


V1_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "tiny", "prompt": "hi"},
    "/v1/responses": {"model": "tiny", "input": "hi"},
}


@pytest.mark.parametrize("path", list(V1_BODIES))
def test_v1_speculative_fields_are_the_request_options(served: Served, drafts: None, path: str) -> None:
    """llama-server's fields on each /v1 route are the request's options, over ``options``: speculative.n_max 0
    turns off the prompt lookup asked for in ``options`` (no draft counts in usage)."""
    body = {**V1_BODIES[path], "options": NGRAM}
    assert "draft_n" in served.post(path, body).json()["usage"]
    assert "draft_n" not in served.post(path, {**body, "speculative.n_max": 0}).json()["usage"]
    assert "draft_n" not in served.post(path, {**body, "options": {**NGRAM, "draft_max": 0}}).json()["usage"]
    over = {**body, "options": {**NGRAM, "draft_max": 0}, "speculative.n_max": 4}  # the field wins over options
    assert "draft_n" in served.post(path, over).json()["usage"]


@pytest.mark.parametrize("path", list(V1_BODIES))
def test_v1_speculative_fields_reach_the_runner(served: Served, drafts: None, path: str) -> None:
    fields = {"speculative.n_max": 5, "speculative.n_min": 2, "speculative.p_min": 0.25}
    r = served.post(path, {**V1_BODIES[path], "options": NGRAM, **fields})
    assert r.status_code == 200, r.text
    params = DraftingRunner.requests[-1].params
    assert (params.draft_max, params.draft_min, params.draft_p_min, params.draft_ngram) == (5, 2, 0.25, 3)


@pytest.mark.parametrize("path", list(V1_BODIES))
def test_v1_draft_model_loads_the_draft_beside_the_model(served: Served, drafts: None, path: str) -> None:
    """LM Studio's top-level ``draft_model`` names the draft for this request: the runner is loaded with it (its
    blob in the load spec), and usage reports the counts; a draft that is not in the store is a 400 naming the
    field."""
    DraftingRunner.drafts = (6, 5)
    r = served.post(path, {**V1_BODIES[path], "draft_model": "draft"})
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["draft_n"], r.json()["usage"]["draft_n_accepted"]) == (6, 5)
    spec = DraftingRunner.instances[-1].spec
    assert spec.draft_path and Path(spec.draft_path).is_file()
    r = served.post(path, {**V1_BODIES[path], "draft_model": "no-such-draft"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "draft_model" and "no-such-draft" in error["message"], error


def test_bad_draft_options_are_a_400_naming_the_option(served: Served, drafts: None) -> None:
    r = served.post("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": {"draft_max": -1}})
    assert r.status_code == 400 and "draft_max" in r.json()["error"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": {"draft_p_min": 2}}
    r = served.post("/v1/chat/completions", body)
    assert r.status_code == 400 and "draft_p_min" in r.json()["error"]["message"]


# -- corral run --verbose ------------------------------------------------------------------------------------------
def test_verbose_stats_show_drafted_and_accepted() -> None:
    final = {"total_duration": 2_000_000_000, "eval_count": 200, "eval_duration": 1_000_000_000}
    assert not any("draft" in line for line in stats_lines(final))
    lines = stats_lines({**final, "draft_n": 120, "draft_n_accepted": 96})
    assert lines[-1] == "draft tokens:         120 token(s) (96 accepted, 80%)"
    assert lines[-2].startswith("eval rate:")  # beside the eval stats
    assert (
        stats_lines({**final, "draft_n": 0, "draft_n_accepted": 0})[-1]
        == "draft tokens:         0 token(s) (0 accepted)"
    )


def test_corral_run_verbose_prints_the_draft_line(served: Served, drafts: None) -> None:
    """`corral run --verbose` on a model whose Modelfile turns prompt lookup on prints drafted and accepted tokens
    beside the eval stats; on one without, no such line."""
    DraftingRunner.drafts = (120, 96)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    env.update(CORRAL_HOST=served.url.removeprefix("http://"), PYTHONPATH=str(REPO))

    def run(model: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "cli", "run", model, "--verbose", "hi"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "Hello world"
        return r.stderr

    err = run("ngram")
    assert "draft tokens:         120 token(s) (96 accepted, 80%)" in err
    assert err.index("eval count:") < err.index("draft tokens:")
    DraftingRunner.drafts = (0, 0)
    assert "draft tokens" not in run("tiny")


# -- end to end: SmolLM2 with prompt lookup --------------------------------------------------------------------------
SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
# a prompt whose greedy continuation copies from itself, so that prompt lookup finds n-grams to draft from
REPEATING = "one two three four five six seven eight. " * 6 + "one two three"
LOOKUP = {"temperature": 0, "seed": 1, "num_predict": 48, "num_ctx": 512, "draft_ngram": 3, "draft_max": 8}


@pytest.mark.slow
@pytest.mark.real_model
@needs_smol
def test_smollm2_prompt_lookup_reports_its_drafts(tmp_path: Path) -> None:
    assert SMOL is not None
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    try:
        with httpx.Client(base_url=d.url, timeout=300) as c:
            _create(c, "smol", SMOL)
            before = c.get("/metrics").text
            r = c.post(
                "/api/generate",
                json={"model": "smol", "prompt": REPEATING, "raw": True, "stream": False, "options": LOOKUP},
            )
            assert r.status_code == 200, r.text
            final = r.json()
            assert final["draft_n"] > 0, final
            assert 0 < final["draft_n_accepted"] <= final["draft_n"], final
            body = {"model": "smol", "prompt": REPEATING, "raw": True, "max_tokens": 48, "temperature": 0}
            usage = c.post("/v1/completions", json={**body, "options": LOOKUP}).json()["usage"]
            assert usage["draft_n"] > 0 and 0 < usage["draft_n_accepted"] <= usage["draft_n"], usage
            assert usage["completion_tokens"] == final["eval_count"]  # the same greedy answer
            plain = c.post("/v1/completions", json=body).json()["usage"]
            assert "draft_n" not in plain  # no speculation asked for: no draft fields
            after = c.get("/metrics").text
        for name, grown in (
            ("corral_draft_tokens_total", final["draft_n"] + usage["draft_n"]),
            ("corral_draft_accepted_tokens_total", final["draft_n_accepted"] + usage["draft_n_accepted"]),
        ):
            assert _counter(after, name, "smol:latest") - _counter(before, name, "smol:latest") == grown, name
        line = [ln for ln in d.log.read_text().splitlines() if "path=/api/generate " in ln][-1]
        assert f"draft_n={final['draft_n']} draft_n_accepted={final['draft_n_accepted']} " in line
    finally:
        stop_daemon(d)
