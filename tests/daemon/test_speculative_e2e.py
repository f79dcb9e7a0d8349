"""Speculative decoding through the daemon as apps use it (issue 28): SmolLM2 with a draft model (itself, under
another name) and with prompt lookup answers exactly as without, through /api/chat streamed and not, with a stop
string, with ``format`` JSON, through /v1/chat/completions with a forced tool call; four streams at once all finish
with their drafts counted; the counts say drafting happened."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.compat.conftest import TOOLS_TEMPLATE
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path

SMOL = smollm2_path()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.real_model,
    pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)"),
]
COPY = "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates."
GREEDY = {"temperature": 0, "num_predict": 64, "num_ctx": 1024}
# the same model under three names: plain, with itself as draft model, with prompt lookup
CONFIGS = {"plain": ("smol", {}), "draft": ("smol-d", {}), "lookup": ("smol", {"draft_ngram": 3})}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    assert SMOL is not None
    tmp = tmp_path_factory.mktemp("spec-e2e")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "4"})
    try:
        with httpx.Client(base_url=d.url, timeout=300) as c:
            data = SMOL.read_bytes()
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            c.post(f"/api/blobs/{digest}", content=data).raise_for_status()
            tools = {"template": TOOLS_TEMPLATE}  # a template that offers tools (SmolLM2's own has none)
            for name, params, extra in (
                ("smol", {}, {}),
                ("smol-d", {"draft_model": "smol"}, {}),
                ("smol-tools", {"stop": ["<|im_end|>"]}, tools),
                ("smol-tools-d", {"stop": ["<|im_end|>"], "draft_model": "smol"}, tools),
            ):
                body = {"model": name, "files": {"m.gguf": digest}, "parameters": params, "stream": False, **extra}
                r = c.post("/api/create", json=body)
                assert r.status_code == 200, r.text
        yield d
    finally:
        stop_daemon(d)


def chat(c: httpx.Client, config: str, stream: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    model, options = CONFIGS[config]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": COPY}],
        "stream": stream,
        "options": {**GREEDY, **options, **extra.pop("options", {})},
        **extra,
    }
    if not stream:
        r = c.post("/api/chat", json=body)
        assert r.status_code == 200, r.text
        final = r.json()
        return final["message"]["content"], final
    text, final = "", {}
    with c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            obj = json.loads(line)
            text += obj.get("message", {}).get("content", "")
            final = obj
    return text, final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_is_the_same_with_a_draft_model_and_with_lookup(daemon: Daemon, stream: bool) -> None:
    with httpx.Client(base_url=daemon.url, timeout=300) as c:
        plain, base = chat(c, "plain", stream)
        assert "draft_n" not in base
        for config in ("draft", "lookup"):
            text, final = chat(c, config, stream)
            assert text == plain, config
            assert final["draft_n"] > 0 and 0 <= final["draft_n_accepted"] <= final["draft_n"], (config, final)


def test_stop_strings_and_json_format_are_the_same(daemon: Daemon) -> None:
    with httpx.Client(base_url=daemon.url, timeout=300) as c:
        plain, _ = chat(c, "plain", False)
        stop = plain[20:26]
        expected = chat(c, "plain", True, options={"stop": [stop]})[0]
        as_json = chat(c, "plain", False, format="json")[0]
        assert as_json.lstrip().startswith("{")  # the grammar holds (64 tokens may end it before it closes)
        for config in ("draft", "lookup"):
            assert chat(c, config, True, options={"stop": [stop]})[0] == expected, config
            assert chat(c, config, False, format="json")[0] == as_json, config


def test_a_forced_tool_call_is_the_same(daemon: Daemon) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "add_fruit",
            "description": "Add fruits to the basket",
            "parameters": {
                "type": "object",
                "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
                "required": ["fruits"],
            },
        },
    }

    def call(config: str) -> Any:
        model, options = CONFIGS[config]
        model = "smol-tools-d" if model == "smol-d" else "smol-tools"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": COPY}],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "add_fruit"}},
            "temperature": 0,
            "max_tokens": 64,
            "options": {"num_ctx": 1024, **options},
        }
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["tool_calls"]

    with httpx.Client(base_url=daemon.url, timeout=300) as c:
        expected = call("plain")
        assert expected[0]["function"]["name"] == "add_fruit"
        for config in ("draft", "lookup"):
            got = call(config)
            assert [t["function"] for t in got] == [t["function"] for t in expected], config


def test_four_streams_at_once_all_speculate_and_finish(daemon: Daemon) -> None:
    """Four streams at once with speculation each finish with their drafts counted. Token-for-token equality at four
    streams is tests/runners/test_speculative.py's (a tiny model, where a batch's rounding cannot flip a near tie):
    with SmolLM2 a batch of four prompts can round one token's logits differently from the same four without drafts
    (a step's batch holds drafts or not, and arrivals split differently), which flips a near tie either way."""
    prompts = [f"Number {i}. {COPY}" for i in range(4)]

    def one(config: str, prompt: str) -> dict[str, Any]:
        model, options = CONFIGS[config]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": False,
            "options": {**GREEDY, **options},
        }
        with httpx.Client(base_url=daemon.url, timeout=300) as c:
            r = c.post("/api/chat", json=body)
            assert r.status_code == 200, r.text
            return dict(r.json())

    for config in ("draft", "lookup"):
        with cf.ThreadPoolExecutor(4) as ex:
            finals = list(ex.map(one, [config] * len(prompts), prompts))
        assert all(f["done"] and f["message"]["content"].strip() for f in finals), config
        assert all(0 <= f["draft_n_accepted"] <= f["draft_n"] for f in finals), config
        assert sum(f["draft_n"] for f in finals) > 0, config


def test_metrics_count_drafted_and_accepted_tokens(daemon: Daemon) -> None:
    with httpx.Client(base_url=daemon.url, timeout=300) as c:
        _, final = chat(c, "lookup", False)
        metrics = c.get("/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("corral_draft_tokens_total{")]
    accepted = [line for line in metrics.splitlines() if line.startswith("corral_draft_accepted_tokens_total{")]
    assert drafted and accepted
    assert sum(float(line.rsplit(" ", 1)[1]) for line in drafted) >= final["draft_n"] > 0
