"""A stream's first chunk reaches the client as soon as its first token is generated, through every API: the
daemon (routes, parsers, SSE framing, the response class) must not hold it until a second token comes.

Structural, not timed: the runner here is a gated fake that yields its first token and then generates nothing more
until the client says it has read that token's chunk. A route that waited for a second token before writing the
first would keep the gate shut until the fake gives up (``GIVE_UP`` seconds, only ever reached on failure) and the
test fails on what the fake recorded. The real HTTP server, middleware, scheduler, store and routes all run; only
llama.cpp is replaced (the same paths with a real model: tests/compat/test_openai.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn

from daemon.api.app import create_app
from daemon.runners.base import Done, Event, GenerateRequest, LoadSpec, MemoryUse, Token
from daemon.scheduling.scheduler import ModelRef
from daemon.settings import Settings
from tests.fakes import FakeRunner
from tests.models import write_tiny_gguf

GIVE_UP = 20.0  # seconds the fake waits for the client's word before producing its second token anyway


class Gate:
    """What the client has read, and what the runner had been told when it produced its second token; and for a
    prompt's token count (Anthropic's message_start), whether the generation had started when it was asked."""

    def __init__(self) -> None:
        self.first_chunk_read = threading.Event()
        self.second_token_after_read: bool | None = None
        self.generating = threading.Event()
        self.counted_while_generating: bool | None = None


class GatedRunner(FakeRunner):
    """Yields "Once", then waits until the client has read the first chunk, then " upon a time" and the end."""

    gate = Gate()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        gate = GatedRunner.gate
        gate.generating.set()
        yield Token("Once")
        deadline = time.monotonic() + GIVE_UP
        while not gate.first_chunk_read.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        gate.second_token_after_read = gate.first_chunk_read.is_set()
        yield Token(" upon")
        yield Token(" a time")
        yield Done("stop", 3, 1, 3, 1)

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Counts the prompt only once the generation has started (or after ``GIVE_UP``): a route that waited for
        the count before starting the generation would wait the whole ``GIVE_UP``."""
        gate = GatedRunner.gate
        deadline = time.monotonic() + GIVE_UP
        while not gate.generating.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        gate.counted_while_generating = gate.generating.is_set()
        return await super().tokenize(text, add_special=add_special)


def _factory(ref: ModelRef, spec: LoadSpec) -> GatedRunner:
    return GatedRunner(spec, MemoryUse(ram=1 << 20, vram=0))


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An in-process daemon (uvicorn on an ephemeral port, lifespan on) whose runners are :class:`GatedRunner`, with
    a tiny GGUF as model "gated"; yields its URL."""
    tmp = tmp_path_factory.mktemp("gated")
    settings = Settings(models=tmp / "models")
    app = create_app(settings, runner_factory=_factory, estimator=lambda ref, spec: MemoryUse(ram=1 << 20, vram=0))
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
        gguf = write_tiny_gguf(Path(tmp) / "tiny.gguf")
        digest = "sha256:" + __import__("hashlib").sha256(gguf.read_bytes()).hexdigest()
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post(f"/api/blobs/{digest}", content=gguf.read_bytes()).raise_for_status()
            c.post(
                "/api/create", json={"model": "gated", "files": {"tiny.gguf": digest}, "stream": False}
            ).raise_for_status()
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _check_first_chunk(read: Callable[[], Iterator[str]]) -> None:
    """Read a stream's text pieces; the first one is acknowledged to the runner as soon as it arrives."""
    GatedRunner.gate = gate = Gate()
    pieces: list[str] = []
    for piece in read():
        if piece and not pieces:
            gate.first_chunk_read.set()
        if piece:
            pieces.append(piece)
    assert "".join(pieces) == "Once upon a time"
    assert pieces[0] == "Once"
    assert gate.second_token_after_read is True, (
        "the first chunk reached the client only after the runner produced its second token"
    )


def _sse_texts(url: str, path: str, body: dict[str, Any], text_of: Callable[[dict[str, Any]], str]) -> Iterator[str]:
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield text_of(json.loads(line[6:]))


def test_completions_first_chunk_before_second_token(gated: str) -> None:
    client = openai.OpenAI(base_url=gated + "/v1", api_key="corral", max_retries=0)

    def read() -> Iterator[str]:
        for chunk in client.completions.create(model="gated", prompt="Story number 0: Once", stream=True):
            yield "".join(c.text for c in chunk.choices)

    _check_first_chunk(read)


def test_completions_with_usage_first_chunk_before_second_token(gated: str) -> None:
    body = {"model": "gated", "prompt": "Story", "stream": True, "stream_options": {"include_usage": True}}
    _check_first_chunk(
        lambda: _sse_texts(gated, "/v1/completions", body, lambda o: "".join(c["text"] for c in o["choices"]))
    )


def test_chat_completions_first_chunk_before_second_token(gated: str) -> None:
    client = openai.OpenAI(base_url=gated + "/v1", api_key="corral", max_retries=0)

    def read() -> Iterator[str]:
        stream = client.chat.completions.create(
            model="gated",
            messages=[{"role": "user", "content": "Story number 0"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            yield "".join(c.delta.content or "" for c in chunk.choices)

    _check_first_chunk(read)


def test_anthropic_messages_first_chunk_before_second_token(gated: str) -> None:
    client = anthropic.Anthropic(base_url=gated, api_key="corral", max_retries=0)

    def read() -> Iterator[str]:
        with client.messages.stream(
            model="gated", max_tokens=16, messages=[{"role": "user", "content": "Story number 0"}]
        ) as stream:
            yield from stream.text_stream

    _check_first_chunk(read)


def test_anthropic_counts_the_prompt_while_the_generation_starts(gated: str) -> None:
    """message_start says the prompt's exact length, which the runner counts; the count is asked for alongside the
    generation, not before it (a round trip to the runner on the way to the first token)."""
    GatedRunner.gate = gate = Gate()
    gate.first_chunk_read.set()
    client = anthropic.Anthropic(base_url=gated, api_key="corral", max_retries=0)
    content = "Story number 0"
    with client.messages.stream(model="gated", max_tokens=16, messages=[{"role": "user", "content": content}]) as s:
        events = list(s)
    start = next(e for e in events if e.type == "message_start")
    assert gate.counted_while_generating is True, "the prompt was counted before the generation started"
    # the fake counts one token per character of the rendered prompt (the tiny model's template: the message)
    assert start.message.usage.input_tokens >= len(content)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Once upon a time"


def test_ollama_generate_first_chunk_before_second_token(gated: str) -> None:
    def read() -> Iterator[str]:
        body = {"model": "gated", "prompt": "Story", "raw": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", gated + "/api/generate", json=body) as r:
            for line in r.iter_lines():
                yield json.loads(line).get("response", "")

    _check_first_chunk(read)
