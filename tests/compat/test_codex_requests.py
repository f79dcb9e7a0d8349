"""Codex CLI's real first requests to ``POST /v1/responses``, through real HTTP, against a tool-capable SmolLM2.

The bodies follow what Codex 0.171.0 sends to a provider with ``wire_api = "responses"`` (its request format in
codex-rs, checked against a capture of the real binary): no ``instructions`` but developer messages of
``input_text`` parts, a user message with the environment context and one with the prompt, every tool Codex
offers (flat functions with ``strict: false``, a ``namespace`` tool grouping functions, the hosted
``web_search``), ``tool_choice`` auto, ``parallel_tool_calls``, ``reasoning`` with a summary and, when configured,
an effort, ``store: false``, ``include: ["reasoning.encrypted_content"]``, ``prompt_cache_key``,
``client_metadata``, ``stream: true``. What Codex needs back: typed SSE events it dispatches on the JSON ``type``
(``response.created``, ``response.output_text.delta``, ``response.output_item.done``, ``response.completed`` with
the response id and usage), ``function_call`` items with ``call_id`` and string ``arguments``, and for a
namespaced function ``name`` and ``namespace`` apart, the pair Codex finds its tools by.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.compat.conftest import HERMES_TEMPLATE, SMOL
from tests.conftest import Daemon, start_daemon, stop_daemon

pytestmark = pytest.mark.real_model


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": description,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
    }


EXEC = _fn(
    "exec_command",
    "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
    {
        "cmd": {"type": "string", "description": "Shell command to execute."},
        "workdir": {"type": "string", "description": "Working directory for the command."},
        "yield_time_ms": {"type": "number", "description": "Wait before yielding output."},
    },
    ["cmd"],
)
WRITE_STDIN = _fn(
    "write_stdin",
    "Writes characters to an existing exec session and returns recent output.",
    {"session_id": {"type": "number"}, "chars": {"type": "string"}},
    ["session_id"],
)
VIEW_IMAGE = _fn("view_image", "View a local image file.", {"path": {"type": "string"}}, ["path"])
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        _fn("close_agent", "Close an agent.", {"target": {"type": "string"}}, ["target"]),
        _fn(
            "send_input",
            "Send a message to an agent.",
            {"target": {"type": "string"}, "message": {"type": "string"}},
            ["target"],
        ),
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_TOOLS = [EXEC, WRITE_STDIN, VIEW_IMAGE, AGENTS, _fn("get_goal", "The current goal.", {}, []), WEB_SEARCH]

INSTRUCTIONS = (
    "You are a coding agent running in a terminal-based coding assistant. You are expected to be precise, safe, "
    "and helpful. Keep answers short."
)


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def codex_body(model: str, prompt: str, *, tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """One first-turn request as Codex 0.171.0 builds it (the text shorter, the shape the same)."""
    session = str(uuid.uuid4())
    turn = json.dumps({"session_id": session, "turn_id": str(uuid.uuid4()), "request_kind": "turn", "model": model})
    return {
        "model": model,
        "stream": True,
        "input": [
            {**_message("developer", INSTRUCTIONS), "id": f"msg_{uuid.uuid4()}"},
            _message("developer", "<permissions instructions>Sandbox: read-only.</permissions instructions>"),
            _message(
                "user",
                "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>",
            ),
            _message("user", prompt),
        ],
        "tools": CODEX_TOOLS if tools is None else tools,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": session,
        "client_metadata": {"x-codex-window-id": f"{session}:0", "x-codex-turn-metadata": turn, "session_id": session},
        **extra,
    }


CODEX_HEADERS = {
    "accept": "text/event-stream",
    "originator": "codex_exec",
    "user-agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) unknown (codex_exec; 0.171.0)",
    "session-id": "01a21bd0-4085-7762-ae9f-754c4a84f583",
}


def sse(daemon: Daemon, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST the body as Codex does and read the stream as Codex does: the JSON of each ``data:`` line, checked
    against its ``event:`` line."""
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=daemon.url, timeout=300) as client:
        with client.stream("POST", "/v1/responses", json=body, headers=CODEX_HEADERS) as r:
            if r.status_code != 200:
                r.read()
                raise AssertionError(f"{r.status_code}: {r.text}")
            assert r.headers["content-type"].startswith("text/event-stream")
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    data = json.loads(line[len("data: ") :])
                    assert data["type"] == name
                    events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.fixture(scope="module")
def codex_daemon(v1_daemon: Daemon) -> Daemon:
    """The /v1 daemon with "smol-codex": SmolLM2 with tools in Qwen/Hermes tags (calls only when it copies one),
    a context for Codex's prompt, and an end at ``<|im_end|>`` or a blank line, so a turn ends on its own."""
    client = ollama.Client(host=v1_daemon.url)
    assert SMOL is not None
    client.create(
        model="smol-codex",
        files={SMOL.name: client.create_blob(SMOL)},
        template=HERMES_TEMPLATE,
        parameters={"num_ctx": 4096, "stop": ["<|im_end|>", "\n\n"], "num_predict": 200},
        stream=False,
    )
    return v1_daemon


def test_first_request_streams_an_answer(codex_daemon: Daemon) -> None:
    events = sse(codex_daemon, codex_body("smol-codex", "Say hello"))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    created = events[0]["response"]
    assert created["id"].startswith("resp_") and created["status"] == "in_progress"
    assert kinds[-1] == "response.completed", kinds[-3:]  # Codex fails a turn on response.incomplete
    done = events[-1]["response"]
    assert done["id"] == created["id"] and done["status"] == "completed"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0
    assert done["store"] is False
    assert [t["type"] for t in done["tools"]] == [t["type"] for t in CODEX_TOOLS]  # echoed as sent, web_search too
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    # an answer, as text (or, should the model call a tool, as a call Codex can run)
    assert deltas.strip() or any(i["type"] == "function_call" for i in items)
    for item in items:
        if item["type"] == "message":
            assert item["role"] == "assistant" and item["content"][0]["text"] == deltas
        else:
            assert item["type"] == "function_call" and item["call_id"]
            json.loads(item["arguments"])


def test_every_field_codex_sends_is_accepted(codex_daemon: Daemon) -> None:
    # what Codex adds with model_reasoning_effort, model_reasoning_summary, model_verbosity and service_tier set
    body = codex_body(
        "smol-codex",
        "Say hello",
        reasoning={"effort": "xhigh", "summary": "detailed"},
        service_tier="flex",
        text={"verbosity": "low"},
        stream_options={"include_obfuscation": False},
        max_output_tokens=8,
    )
    events = sse(codex_daemon, body)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["reasoning"] == {"effort": "xhigh", "summary": "detailed"}
    # and Codex's --oss body, which has no client_metadata, through the official client as well
    oai = openai.OpenAI(base_url=codex_daemon.url + "/v1", api_key="unused", max_retries=0)
    oss = codex_body("smol-codex", "Say hello", max_output_tokens=8)
    del oss["client_metadata"], oss["stream"]
    r = oai.responses.create(**oss)
    assert r.output and r.usage is not None and r.usage.output_tokens > 0


# The second turn, as Codex 0.171.0 replays it (captured): earlier calls of a namespaced function (function_call
# items carrying ``namespace``, ``status`` and ``id``) with their outputs. At temperature 0 SmolLM2 copies the
# pattern for the third question.
def _call(i: int, target: str) -> list[dict[str, Any]]:
    call_id = f"call_{i}"
    return [
        _message("user", f"Close the agent {target}."),
        {
            "type": "function_call",
            "status": "completed",
            "id": f"fc_{i}",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "arguments": json.dumps({"target": target}),
            "call_id": call_id,
        },
        {"type": "function_call_output", "id": f"fco_{i}", "call_id": call_id, "output": "closed"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Closed."}]},
    ]


def test_a_namespaced_call_comes_back_in_codex_shape(codex_daemon: Daemon) -> None:
    body = codex_body("smol-codex", "unused", temperature=0, max_output_tokens=40)
    body["input"] = [
        *body["input"][:3],
        *_call(1, "alpha"),
        *_call(2, "beta"),
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "agents"}},
        _message("user", "Close the agent gamma."),
    ]
    events = sse(codex_daemon, body)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed", kinds
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    calls = [i for i in done if i["type"] == "function_call"]
    assert calls, done
    call = calls[0]
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "close_agent")
    assert call["call_id"] and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"target": "gamma"}
    added = next(
        e["item"] for e in events if e["type"] == "response.output_item.added" and e["item"]["id"] == call["id"]
    )
    assert (added["namespace"], added["name"]) == ("multi_agent_v1", "close_agent")
    args_done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert args_done["name"] == "close_agent" and args_done["arguments"] == call["arguments"]
    assert events[-1]["response"]["output"][-1] == call


@pytest.fixture
def debug_daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_DEBUG": "1"})
    try:
        yield d
    finally:
        stop_daemon(d)


def test_tools_corral_cannot_run_are_left_out_with_a_debug_line(debug_daemon: Daemon) -> None:
    tools = [
        WEB_SEARCH,
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "local_shell"},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}},
        {"type": "image_generation"},
        EXEC,
    ]
    r = httpx.post(debug_daemon.url + "/v1/responses", json=codex_body("absent", "hi", tools=tools), timeout=30)
    assert r.status_code == 404 and "absent" in r.json()["error"]["message"]  # got past the tools to the model
    log = debug_daemon.log.read_text()
    line = next(x for x in log.splitlines() if "corral cannot run" in x)
    for where in ("tools[0] (web_search)", "tools[1] (file_search)", "tools[2] (local_shell)", "tools[3] (custom)"):
        assert where in line


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"service_tier": "fastest"}, "service_tier", "invalid 'service_tier' value 'fastest'"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity", "use one of low, medium, high"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary", "invalid 'reasoning.summary'"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid reasoning value 'extreme'"),
        ({"include": [3]}, "include[0]", "must be a string"),
        ({"store": "no"}, "store", "must be a boolean"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
        ({"client_metadata": "x"}, "client_metadata", "must be an object"),
        ({"prompt_cache_key": 7}, "prompt_cache_key", "must be a string"),
        ({"tools": [{"name": "x"}]}, "tools[0].type", "is required"),
        ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools[0].tools", "array of the namespace's functions"),
        ({"tools": [{"type": "namespace", "tools": []}]}, "tools[0].name", "namespace"),
        ({"tools": [AGENTS], "tool_choice": {"type": "web_search"}}, "tool_choice.type", "no hosted tools"),
        ({"tools": [WEB_SEARCH], "tool_choice": "required"}, "tool_choice", "none of the 'tools' is a function"),
    ],
)
def test_wrong_values_still_get_a_clear_400(
    codex_daemon: Daemon, change: dict[str, Any], param: str, words: str
) -> None:
    body = {**codex_body("smol-codex", "hi"), **change}
    r = httpx.post(codex_daemon.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_a_namespaced_call_in_the_history_needs_a_string_namespace(codex_daemon: Daemon) -> None:
    body = codex_body("smol-codex", "hi")
    body["input"].append(
        {"type": "function_call", "name": "close_agent", "namespace": 5, "arguments": "{}", "call_id": "c"}
    )
    r = httpx.post(codex_daemon.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[4].namespace"


def test_a_websocket_upgrade_is_told_to_use_http(codex_daemon: Daemon) -> None:
    """Codex asks for the Responses API over a WebSocket first and falls back to POST + SSE at once only when the
    upgrade gets 426 Upgrade Required (any other answer it retries for seconds before falling back). corral serves
    Responses over HTTP, so the upgrade gets 426 with a reason; a plain GET is still 405, as before."""
    upgrade = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    r = httpx.get(codex_daemon.url + "/v1/responses", headers=upgrade)
    assert r.status_code == 426, r.text
    assert "POST" in r.json()["error"]["message"]
    assert httpx.get(codex_daemon.url + "/v1/responses").status_code == 405
