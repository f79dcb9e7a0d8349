"""Claude Code's first requests, in the shape Claude Code 2.1.197 sends them to a model that is not Claude, through
the official ``anthropic`` client against a tool-capable model; and the errors clients act on, in Anthropic's types
and words.

The shape (from Anthropic's Messages API reference and a capture of Claude Code's own first request to a local
server; the texts here are stand-ins): ``POST /v1/messages?beta=true`` with an ``anthropic-beta`` header; ``system``
as text blocks with ``cache_control``; a ``role: "system"`` message inside ``messages`` after the first user turn;
its whole tool set (names, descriptions, ``input_schema`` with ``$schema`` and ``additionalProperties``), here
with the newer tool fields and a server tool added; ``thinking: {"type": "adaptive"}``,
``output_config: {"effort": "high"}``, ``max_tokens`` 32000, ``metadata.user_id``, ``context_management``,
``stream: true``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from daemon.api.bodies import BodyTooLarge
from daemon.api.compat import anthropic_error
from daemon.api.routes import anthropic as anth
from daemon.chat.types import Message, ToolCall
from daemon.llama.engine import PROMPT_TOO_LONG
from daemon.runners.process import RunnerRequestError
from daemon.scheduling.scheduler import QueueFull
from errors import CorralError, ModelNotFound
from tests.conftest import Daemon, start_daemon, stop_daemon

pytestmark = pytest.mark.real_model

BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "prompt-caching-scope-2026-01-05",
    "mid-conversation-system-2026-04-07",
    "effort-2025-11-24",
]
HEADERS = {
    "anthropic-beta": ",".join(BETAS),
    "anthropic-version": "2023-06-01",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
}
SCHEMA = "https://json-schema.org/draft/2020-12/schema"
# Claude Code's tool names; each takes a string or two, as its own tools mostly do
TOOL_NAMES = (
    "Agent Bash CronCreate CronDelete CronList Edit EnterWorktree ExitWorktree NotebookEdit Read ReportFindings "
    "ScheduleWakeup SendMessage Skill TaskCreate TaskGet TaskList TaskOutput TaskStop TaskUpdate WebFetch WebSearch "
    "Workflow Write"
).split()


def _tool(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"The {name} tool.",
        "input_schema": {
            "$schema": SCHEMA,
            "type": "object",
            "properties": {"target": {"description": "What to act on", "type": "string"}},
            "required": ["target"],
            "additionalProperties": False,
        },
    }


TOOLS: list[dict[str, Any]] = [_tool(n) for n in TOOL_NAMES] + [
    {  # the newer fields of a custom tool
        "type": "custom",
        "name": "Lookup",
        "description": "Look a word up.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        "input_examples": [{"word": "hello"}],
        "defer_loading": False,
        "strict": True,
        "cache_control": {"type": "ephemeral"},
    },
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},  # run by Anthropic's servers: dropped
]
SYSTEM: list[Any] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Answer in one short sentence.", "cache_control": {"type": "ephemeral"}},
]
AGENTS = "Agent types for the Agent tool: general (any task), explore (read-only search)."


def first_request(question: str = "Say hello") -> dict[str, Any]:
    """The body of Claude Code's first ``/v1/messages`` request, as it sends it to a model that is not Claude."""
    return {
        "model": "smol-tools",
        "max_tokens": 32000,
        "system": SYSTEM,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>\nToday's date is 2026-01-01.\n</system-reminder>\n"},
                    {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": AGENTS},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "metadata": {"user_id": json.dumps({"device_id": "0" * 64, "account_uuid": "", "session_id": "s-1"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


@pytest.fixture
def client(v1_daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=v1_daemon.url, api_key="sk-anything", max_retries=0)


def _through_sdk(client: anthropic.Anthropic, body: dict[str, Any]) -> Any:
    """``body`` through the SDK's beta client (``?beta=true`` and the ``anthropic-beta`` header, as Claude Code
    sends them); greedy, so that the tiny model ends its answer soon."""
    core = {k: body[k] for k in ("model", "max_tokens", "messages", "stream")}
    rest = {k: v for k, v in body.items() if k not in core}
    return client.beta.messages.create(
        **core,
        betas=BETAS,
        extra_headers={k: v for k, v in HEADERS.items() if k != "anthropic-beta"},
        extra_body={**rest, "temperature": 0},
    )


def test_claude_codes_first_request_streams_an_answer(client: anthropic.Anthropic) -> None:
    events = list(_through_sdk(client, first_request()))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    start = events[0].message
    assert start.role == "assistant" and start.model == "smol-tools" and start.usage.input_tokens > 100
    blocks = [e.content_block for e in events if e.type == "content_block_start"]
    assert blocks and all(b.type in ("text", "tool_use") for b in blocks)  # smol-tools cannot think: no thinking
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason in ("end_turn", "tool_use", "max_tokens") and delta.usage.output_tokens > 0
    assert text.strip() or delta.delta.stop_reason == "tool_use"


def test_the_same_request_raw_with_claude_codes_query_and_headers(v1_daemon: Daemon) -> None:
    body = {**first_request(), "stream": False, "temperature": 0}
    r = httpx.post(v1_daemon.url + "/v1/messages?beta=true", json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["type"] == "message" and reply["content"] and reply["stop_reason"] in ("end_turn", "tool_use")


def test_the_system_message_joins_the_system_prompt(client: anthropic.Anthropic) -> None:
    base = first_request()
    without = {**base, "messages": base["messages"][:1]}
    counts = []
    for body in (without, base):
        counts.append(
            client.beta.messages.count_tokens(
                model=body["model"],
                messages=body["messages"],
                system=body["system"],
                betas=BETAS,
                extra_body={"tools": body["tools"], "thinking": body["thinking"]},
            ).input_tokens
        )
    assert 0 < counts[0] < counts[1]  # the system message is in the prompt (it used to be a 400)
    # where it stands, as in Ollama: a message of its own after the user's, gathered into .System by the template
    assert anth._messages(base)[1:] == [
        Message(role="user", content="<system-reminder>\nToday's date is 2026-01-01.\n</system-reminder>\n\nSay hello"),
        Message(role="system", content=AGENTS),
    ]
    blocks = {"role": "system", "content": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}]}
    assert anth._messages({"messages": [{"role": "user", "content": "x"}, blocks]})[-1] == Message(
        role="system", content="A"
    )


def second_turn() -> dict[str, Any]:
    """Claude Code's request after the model called Read: its thinking and tool_use given back, the file in a
    tool_result with ``cache_control``."""
    body = first_request("What is in notes.txt?")
    body["messages"] += [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": ""},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"target": "notes.txt"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "tool_use_id": "toolu_01",
                    "type": "tool_result",
                    "content": "1\tThe secret word is pineapple.\n2\t",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    return body


def test_claude_codes_second_turn_after_a_tool_call(client: anthropic.Anthropic) -> None:
    body = second_turn()
    assert anth._messages(body)[2:] == [
        Message(role="system", content=AGENTS),
        Message(
            role="assistant",
            thinking="I should read it.",
            tool_calls=(ToolCall(name="Read", arguments={"target": "notes.txt"}, id="toolu_01"),),
        ),
        Message(
            role="tool",
            content="1\tThe secret word is pineapple.\n2\t",
            tool_call_id="toolu_01",
            tool_name="Read",
        ),
    ]
    first = client.beta.messages.count_tokens(
        model="smol-tools",
        messages=first_request()["messages"],
        system=SYSTEM,
        betas=BETAS,
        extra_body={"tools": TOOLS},
    )
    second = client.beta.messages.count_tokens(
        model="smol-tools", messages=body["messages"], system=SYSTEM, betas=BETAS, extra_body={"tools": TOOLS}
    )
    assert second.input_tokens > first.input_tokens + 10  # the call and the file's text are in the prompt


def test_adaptive_thinking_and_effort_turn_thinking_on(client: anthropic.Anthropic) -> None:
    shots: list[Any] = []
    for q, thought, answer in (("What is 2+2?", "2 plus 2 is 4.", "4"), ("What is 5+1?", "5 plus 1 is 6.", "6")):
        shots += [
            {"role": "user", "content": q},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": thought, "signature": ""},
                    {"type": "text", "text": answer},
                ],
            },
        ]
    kw: dict[str, Any] = {
        "model": "smol-think",
        "max_tokens": 32000,
        "messages": [*shots, {"role": "user", "content": "What is 3+3?"}],
        "timeout": 300,  # given, since the SDK refuses a whole answer of up to 32000 tokens without one
    }
    on = client.messages.create(
        **kw, extra_body={"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}, "temperature": 0}
    )
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking == "3 plus 3 is 6." and on.content[1].text == "6"
    off = client.messages.create(
        **kw, extra_body={"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}, "temperature": 0}
    )
    assert "thinking" not in [b.type for b in off.content]
    assert anth._think({"thinking": {"type": "adaptive"}}) is True
    assert anth._think({"thinking": {"type": "adaptive"}, "output_config": {"effort": "xhigh"}}) == "high"
    assert anth._think({"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}) is False
    assert anth._think({"output_config": {"effort": "medium"}}) == "medium"
    assert anth._think({"output_config": {"effort": "unheard-of"}}) is None


def test_server_tools_are_dropped_and_new_tool_fields_accepted() -> None:
    tools, forced = anth._tools({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert forced is None and tools is not None
    assert [t["function"]["name"] for t in tools] == [*TOOL_NAMES, "Lookup"]  # web_search_20250305 left out
    assert anth._tools({"tools": [TOOLS[-1]]}) == (None, None)
    with pytest.raises(anth.BadParam, match="not among the tools"):
        anth._tools({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "web_search"}})


# -- errors -------------------------------------------------------------------------------------------------------
def _error(r: httpx.Response) -> tuple[int, str, str]:
    body = r.json()
    assert body["type"] == "error" and body["request_id"].startswith("req_"), body
    assert r.headers["request-id"] == body["request_id"]
    return r.status_code, body["error"]["type"], body["error"]["message"]


def test_errors_in_anthropics_types_and_words(v1_daemon: Daemon, client: anthropic.Anthropic) -> None:
    url = v1_daemon.url + "/v1/messages"
    one = [{"role": "user", "content": "x"}]
    for role in ("developer", "tool"):
        status, kind, message = _error(
            httpx.post(url, json={"model": "smol", "max_tokens": 5, "messages": [*one, {"role": role, "content": "y"}]})
        )
        assert (status, kind) == (400, "invalid_request_error")
        assert message.startswith(f'messages: Unexpected role "{role}". Allowed roles are "user", "assistant"'), message
        # not the system role's words: Claude Code would drop its system message and retry for nothing
        assert "input message role" not in message
    status, kind, message = _error(httpx.post(url, json={"model": "no-such-model", "max_tokens": 5, "messages": one}))
    assert (status, kind) == (404, "not_found_error") and message.startswith("model: no-such-model")
    assert _error(httpx.post(url, json={"model": "smol", "max_tokens": 5, "messages": []}))[1:] == (
        "invalid_request_error",
        "messages: at least one message is required",
    )
    status, kind, message = _error(
        httpx.post(url + "/count_tokens", json={"model": "smol", "messages": [{"content": "x"}]})
    )
    assert (status, kind) == (400, "invalid_request_error") and message.startswith("messages.0.role: Field required")
    status, kind, _ = _error(
        httpx.post(url, json={"model": "smol", "max_tokens": 5, "messages": one, "thinking": {"type": "sometimes"}})
    )
    assert (status, kind) == (400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as missing:  # the SDK sees the same
        client.messages.create(model="no-such-model", max_tokens=5, messages=one)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert missing.value.request_id and missing.value.request_id.startswith("req_")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("keyed")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_API_KEY": "the-key"})
    try:
        yield d
    finally:
        stop_daemon(d)


def test_a_wrong_key_in_anthropics_words(keyed: Daemon) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(keyed.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["message"].startswith("invalid x-api-key")  # what clients match on


def test_the_error_shape_per_case() -> None:
    """Each case's status, type and the words clients match on (Claude Code: "prompt is too long" starts its
    compaction, '"model: ' is its model-not-found, "overloaded_error" its back-off)."""

    def shape(exc: Exception) -> tuple[int, str, str, dict[str, str]]:
        r = anthropic_error(exc)
        body = json.loads(bytes(r.body))
        assert body["type"] == "error" and body["request_id"] == r.headers["request-id"]
        return r.status_code, body["error"]["type"], body["error"]["message"], dict(r.headers)

    long = RunnerRequestError(f"{PROMPT_TOO_LONG} (prompt: 22322 positions, context length: 4096)")
    assert shape(long)[:2] == (400, "invalid_request_error")
    said = shape(long)[2]
    assert said.startswith("prompt is too long: 22322 tokens > 4096 maximum: the prompt is longer than the context")
    # Claude Code reads the sizes with this expression (its compaction sizes what to drop from them)
    sizes = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", said, re.IGNORECASE)
    assert sizes is not None and sizes.groups() == ("22322", "4096")
    assert shape(ModelNotFound("qwen3"))[:3] == (
        404,
        "not_found_error",
        "model: qwen3 (not found here: `corral list` shows the models, `corral pull <name>` gets one)",
    )
    status, kind, _, headers = shape(QueueFull())
    assert (status, kind, headers["retry-after"]) == (503, "overloaded_error", "1")
    assert shape(BodyTooLarge("request body is larger than 67108864 bytes"))[:2] == (413, "request_too_large")
    assert shape(CorralError("runner crashed"))[:2] == (500, "api_error")
    assert shape(CorralError("forbidden", status=403))[:2] == (403, "permission_error")
    assert shape(CorralError("slow down", status=429))[:2] == (429, "rate_limit_error")
    assert shape(CorralError("gone", status=409))[:2] == (409, "invalid_request_error")
