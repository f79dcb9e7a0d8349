"""Issue 25: truncation is never silent, and every 4xx is logged once.

A real daemon with a tiny llama.cpp model whose context is 128 tokens: a prompt the runner cuts and a chat whose
oldest messages are dropped each give one INFO line with the model, the context, the prompt's tokens and what was
kept; ``truncate: false`` turns the cut into a 400 that says the sizes; a 400 from each API family (Ollama, OpenAI,
Anthropic) and unknown URLs are logged once with their reason, a repeat within the window is not, and the prompt's
text is not in the log (CORRAL_LOG_PROMPTS is unset). The rate limit's counting is checked on the middleware alone
with a fake clock."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from daemon.api.errors import REASON_CHARS, RefusalLog
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf

NUM_CTX = 128
MARKER = "qzxjv"  # in every prompt sent here; CORRAL_LOG_PROMPTS is unset, so never in the log
TEMPLATE = "{{ if .System }}[S]{{ .System }}{{ end }}{{ range .Messages }}<{{ .Role }}>{{ .Content }}{{ end }}<a>"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("trunc")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        gguf = write_tiny_gguf(tmp / "tiny.gguf", context_length=512)
        client = ollama.Client(host=d.url)
        digest = client.create_blob(gguf)
        client.create(
            model="tiny",
            files={gguf.name: digest},
            template=TEMPLATE,
            parameters={"num_ctx": NUM_CTX, "temperature": 0, "num_predict": 1},
            stream=False,
        )
        yield d
    finally:
        stop_daemon(d)


def log_lines(d: Daemon) -> list[str]:
    return d.log.read_text(errors="replace").splitlines()


def new_lines(d: Daemon, before: int, pattern: str, *, want: int = 1, wait: float = 10.0) -> list[str]:
    """The log lines after the first ``before`` that match ``pattern``, once ``want`` of them are there (or
    ``wait`` seconds have passed: a line is written before the answer, this only covers the file's buffering)."""
    deadline = time.monotonic() + wait
    while True:
        found = [ln for ln in log_lines(d)[before:] if re.search(pattern, ln)]
        if len(found) >= want or time.monotonic() > deadline:
            return found


def words(n: int) -> str:
    """``n`` tokens of the tiny model's vocabulary ("▁a" .. "▁z")."""
    return " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(n))


def long_chat() -> list[dict[str, str]]:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": words(40)} for i in range(8)]
    return [*msgs, {"role": "user", "content": f"{MARKER} b c"}]


# -- truncation ---------------------------------------------------------------------------------------------------
def test_a_prompt_the_runner_cuts_is_logged_once_at_info(served: Daemon) -> None:
    before = len(log_lines(served))
    r = httpx.post(
        served.url + "/api/generate",
        json={"model": "tiny", "prompt": f"{MARKER} {words(300)}", "stream": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    found = new_lines(served, before, "truncating input prompt")
    assert len(found) == 1, found
    line = found[0]
    assert "level=INFO" in line
    m = re.search(r"model=tiny(:latest)? num_ctx=(\d+) prompt_tokens=(\d+) kept_tokens=(\d+) num_keep=(\d+)", line)
    assert m, line
    num_ctx, prompt_tokens, kept = int(m.group(2)), int(m.group(3)), int(m.group(4))
    assert num_ctx == NUM_CTX and prompt_tokens > 300 and kept < NUM_CTX
    assert kept == r.json()["prompt_eval_count"]  # what the log says was kept is what was evaluated
    assert "CORRAL_CONTEXT_LENGTH" in line and "num_ctx" in line  # and how to keep it whole
    assert MARKER not in served.log.read_text()


def test_dropped_chat_messages_are_logged_with_what_was_kept(served: Daemon) -> None:
    before = len(log_lines(served))
    r = httpx.post(
        served.url + "/api/chat", json={"model": "tiny", "messages": long_chat(), "stream": False}, timeout=120
    )
    assert r.status_code == 200, r.text
    found = new_lines(served, before, "truncating input messages")
    assert len(found) == 1, found
    m = re.search(
        r"model=tiny(:latest)? num_ctx=(\d+) messages=(\d+) prompt_tokens=(\d+) kept_messages=(\d+) kept_tokens=(\d+)",
        found[0],
    )
    assert m, found[0]
    num_ctx, messages, total, kept_messages, kept = (int(m.group(i)) for i in range(2, 7))
    assert (num_ctx, messages) == (NUM_CTX, 9)
    assert total > NUM_CTX and 1 <= kept_messages < 9 and kept <= NUM_CTX
    assert kept == r.json()["prompt_eval_count"]  # it fit: the runner cut nothing more
    assert not new_lines(served, before, "truncating input prompt", wait=0)
    assert MARKER not in served.log.read_text()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/generate", {"prompt": f"{MARKER} {words(300)}"}),
        ("/api/chat", {"messages": long_chat()}),
    ],
)
def test_truncate_false_is_a_400_that_says_the_sizes(served: Daemon, path: str, body: dict[str, Any]) -> None:
    before = len(log_lines(served))
    r = httpx.post(served.url + path, json={"model": "tiny", "stream": False, "truncate": False, **body}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "longer than the context length" in error
    assert re.search(r"prompt: \d+ tokens, context length: 128", error), error
    refused = new_lines(served, before, f"request refused method=POST path={path} status=400")
    assert len(refused) == 1 and "longer than the context length" in refused[0], refused
    assert not new_lines(served, before, "truncating input", wait=0)  # nothing was cut
    assert MARKER not in served.log.read_text()


def test_truncate_must_be_a_boolean(served: Daemon) -> None:
    r = httpx.post(
        served.url + "/api/chat",
        json={"model": "tiny", "messages": [{"role": "user", "content": "a"}], "truncate": "no"},
    )
    assert r.status_code == 400
    assert '"truncate"' in r.json()["error"] and "boolean" in r.json()["error"]


# -- 4xx in the log -------------------------------------------------------------------------------------------------
BAD = [
    # (path, body, a piece of the reason)
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": MARKER}], "options": []}, "options"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": MARKER}], "temperature": "hot"},
        "temperature",
    ),
    (
        "/v1/messages",
        {"model": "tiny", "max_tokens": "many", "messages": [{"role": "user", "content": MARKER}]},
        "max_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "why"), BAD, ids=["ollama", "openai", "anthropic"])
def test_a_400_from_each_api_is_logged_once_with_its_reason(
    served: Daemon, path: str, body: dict[str, Any], why: str
) -> None:
    before = len(log_lines(served))
    for _ in range(3):
        r = httpx.post(served.url + path, json=body)
        assert r.status_code == 400, r.text
    found = new_lines(served, before, f"request refused method=POST path={re.escape(path)} status=400")
    time.sleep(0.5)  # the repeats would have been written by now
    found = new_lines(served, before, f"request refused method=POST path={re.escape(path)} status=400", wait=0)
    assert len(found) == 1, found
    assert "level=INFO" in found[0] and why in found[0], found[0]
    assert MARKER not in served.log.read_text()


def test_unknown_urls_and_methods_are_logged_rate_limited(served: Daemon) -> None:
    before = len(log_lines(served))
    for path in ("/api/nothing-here", "/api/nothing-here", "/elsewhere"):
        assert httpx.get(served.url + path).status_code == 404
    assert httpx.get(served.url + "/api/chat").status_code == 405
    time.sleep(0.5)
    found = new_lines(served, before, "request refused", want=2)
    assert len(found) == 2, found  # the unknown URLs are one refusal; the wrong method is another
    assert "path=/api/nothing-here status=404" in found[0] and "404 page not found" in found[0]
    assert "method=GET path=/api/chat status=405" in found[1] and "method not allowed" in found[1]


def test_a_blob_probe_is_a_question_not_a_refusal(served: Daemon) -> None:
    """`corral create` (and Ollama's client) asks HEAD /api/blobs/<digest> before every upload; its 404 means "not
    here yet, send it", so it is not logged as a refused request. An upload that is refused still is.

    A refusal's line is written before its answer, so once the upload's line is there, a line for the probe (sent
    first) would be there before it: the order, not a wait, shows that none was written. The upload's reason names
    this test's digest, so no other test's refusal (nor the rate limit) stands in for it."""
    digest = "sha256:" + "0" * 64
    before = len(log_lines(served))
    assert httpx.head(served.url + f"/api/blobs/{digest}").status_code == 404
    assert httpx.post(served.url + f"/api/blobs/{digest}", content=b"not these bytes").status_code == 400
    found = new_lines(served, before, "request refused")
    assert len(found) == 1 and "method=POST" in found[0] and "digest mismatch" in found[0], found


def test_a_wrong_host_is_logged_with_why(served: Daemon) -> None:
    before = len(log_lines(served))
    r = httpx.get(served.url + "/api/tags", headers={"Host": "evil.example"})
    assert r.status_code == 403
    found = new_lines(served, before, "request refused method=GET path=/api/tags status=403")
    assert len(found) == 1 and "evil.example" in found[0] and "not allowed" in found[0], found


# -- the rate limit, on the middleware alone -----------------------------------------------------------------------
def refusing(status: int, body: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def call(mw: RefusalLog, path: str = "/api/chat") -> None:
    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        pass

    asyncio.run(mw({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send))


def test_repeats_are_counted_and_said_when_the_window_ends(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    mw = RefusalLog(refusing(400, b'{"error": "model is required"}'), interval=60, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="daemon.api.errors")
    for _ in range(5):
        call(mw)
        now[0] += 1
    assert [r.getMessage() for r in caplog.records] == [
        'request refused method=POST path=/api/chat status=400 reason="model is required"'
    ]
    now[0] += 60
    call(mw)  # a new window: the count of those held back in the last one, then this one
    line = 'request refused method=POST path=/api/chat status=400 reason="model is required"'
    assert [r.getMessage() for r in caplog.records[1:]] == [f"{line}: 4 more times in the last 65s", line]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_held_back_refusals_are_said_when_their_window_ends_without_a_repeat(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    shapes = {
        "/api/chat": b'{"error": "one"}',
        "/v1/chat/completions": b'{"error": {"message": "two", "type": "invalid_request_error"}}',
    }

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await refusing(400, shapes[scope["path"]])(scope, receive, send)

    mw = RefusalLog(app, interval=60, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="daemon.api.errors")
    call(mw, "/api/chat")
    call(mw, "/api/chat")
    call(mw, "/api/chat")
    now[0] += 61
    call(mw, "/v1/chat/completions")  # another refusal ends the first one's window
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "2 more times in the last 61s" in said[1] and "reason=one" in said[1]
    assert "reason=two" in said[2]


def test_long_reasons_are_cut_unless_prompts_may_be_logged(caplog: pytest.LogCaptureFixture) -> None:
    reason = "x" * (REASON_CHARS * 3)
    caplog.set_level(logging.INFO, logger="daemon.api.errors")
    call(RefusalLog(refusing(400, f'{{"error": "{reason}"}}'.encode())))
    assert reason not in caplog.records[-1].getMessage()
    assert f"{REASON_CHARS * 2} more characters" in caplog.records[-1].getMessage()
    call(RefusalLog(refusing(400, f'{{"error": "{reason}"}}'.encode()), log_prompts=True))
    assert reason in caplog.records[-1].getMessage()


def test_a_shared_log_file_never_sees_a_second_line_for_one_answer(tmp_path: Path) -> None:
    """One answer, one line: a body sent in pieces is read once, and an answer cut short is still logged."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("daemon.api.errors").addHandler(handler)
    logging.getLogger("daemon.api.errors").setLevel(logging.INFO)
    try:

        async def pieces(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 422, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": ', "more_body": True})
            await send({"type": "http.response.body", "body": b'"bad"}', "more_body": False})

        async def cut(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 413, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": "too', "more_body": True})
            raise RuntimeError("the client left")

        call(RefusalLog(pieces))
        with pytest.raises(RuntimeError):
            call(RefusalLog(cut))
    finally:
        logging.getLogger("daemon.api.errors").removeHandler(handler)
    assert records == [
        "request refused method=POST path=/api/chat status=422 reason=bad",
        'request refused method=POST path=/api/chat status=413 reason="{\\"error\\": \\"too"',
    ]
