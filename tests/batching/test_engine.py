"""The batching runner through a real daemon: concurrent sequences give exactly what they give alone, prompts
reuse cached prefixes, a client that leaves frees its slot, and a full context shifts instead of stopping."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

SMOL = smollm2_path()


def create(d: Daemon, name: str, gguf: Path, **kw: object) -> None:
    client = ollama.Client(host=d.url)
    digest = client.create_blob(gguf)
    client.create(model=name, files={gguf.name: digest}, stream=False, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("batch")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "4"})
    tiny = write_tiny_gguf(tmp / "endless.gguf", context_length=4096, never_ends=True)
    create(
        d,
        "endless",
        tiny,
        template="{{ .Prompt }}",
        parameters={"temperature": 0, "repeat_penalty": 1.0, "num_ctx": 64},
    )
    if SMOL is not None:
        create(d, "smol", SMOL, parameters={"num_ctx": 2048})
    try:
        yield d
    finally:
        stop_daemon(d)


def cached(d: Daemon, model: str = "smol:latest") -> float:
    """The daemon's count of prompt tokens reused from the KV cache rather than evaluated (``/metrics``)."""
    text = httpx.get(d.url + "/metrics").text
    found = re.search(rf'^corral_prompt_cached_tokens_total{{model="{re.escape(model)}"}} ([\d.]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def gen(d: Daemon, model: str, prompt: str, **options: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "stream": False,
        "options": {"temperature": 0, "seed": 1, **options},
    }
    fmt = options.pop("format", None)
    if fmt is not None:
        body["format"] = fmt
        body["options"] = {"temperature": 0, "seed": 1, **options}
    r = httpx.post(d.url + "/api/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_eight_concurrent_greedy_requests_match_alone(batched: Daemon) -> None:
    cases: list[tuple[str, dict[str, object]]] = [
        ("Write a short poem about the sea.", {"num_predict": 40}),
        ("List three fruits.", {"num_predict": 30, "stop": ["3."]}),
        ("Why is the sky blue?", {"num_predict": 48}),
        ("Say hello in French.", {"num_predict": 12}),
        ("Describe a cat in JSON.", {"num_predict": 60, "format": "json"}),
        ("What is 12 times 12?", {"num_predict": 24, "repeat_penalty": 1.3}),
        ("Name a famous painter.", {"num_predict": 20, "top_k": 1}),
        ("Tell me a fun fact about space.", {"num_predict": 50, "stop": ["."]}),
    ]
    alone = [gen(batched, "smol", p, **dict(o)) for p, o in cases]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda c: gen(batched, "smol", c[0], **dict(c[1])), cases))
    for (prompt, _), a, t in zip(cases, alone, together, strict=True):
        assert t["response"] == a["response"], prompt
        assert t["eval_count"] == a["eval_count"] and t["done_reason"] == a["done_reason"]
    assert "3." not in str(together[1]["response"])
    if together[4]["done_reason"] == "stop":
        assert isinstance(json.loads(str(together[4]["response"])), dict)
    else:
        assert str(together[4]["response"]).lstrip().startswith("{")
    assert together[3]["eval_count"] <= 12
    ps = httpx.get(batched.url + "/api/ps").json()["models"]
    smol = next(m for m in ps if m["name"] == "smol:latest")
    assert smol["num_parallel"] == 4 and [s["id"] for s in smol["slots"]] == [0, 1, 2, 3]
    assert all(not s["busy"] and s["cached_tokens"] > 0 for s in smol["slots"])  # kept for prefix reuse


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_a_conversation_that_lost_its_slot_comes_back_from_ram(batched: Daemon) -> None:
    """Four other users take every slot; the first conversation's history was saved to host RAM when its slot
    was reused, so its next turn is restored, not read again, and answers exactly as before."""
    history = [{"role": "system", "content": "You are a patient librarian. " * 30}]
    history += [{"role": "user", "content": f"Shelf {i} holds {i * 3} books about birds."} for i in range(15)]

    def ask(messages: list[dict[str, str]], n: int = 12) -> dict[str, object]:
        r = httpx.post(
            batched.url + "/api/chat",
            json={
                "model": "smol",
                "messages": messages,
                "stream": False,
                "options": {"temperature": 0, "num_predict": n},
            },
            timeout=300,
        )
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    first = ask(history)
    assert first["prompt_eval_count"] > 300  # type: ignore[operator]
    others = [
        [{"role": "user", "content": f"Story {k}: " + "a long winding road through hills. " * 20}] for k in range(4)
    ]
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda m: ask(m, 24), others))
    ps = httpx.get(batched.url + "/api/ps").json()["models"]
    slots = next(m for m in ps if m["name"].startswith("smol"))["slots"]
    assert all(s["cached_tokens"] < 300 for s in slots), slots  # no slot holds the librarian any more
    before = cached(batched)
    again = ask(history)
    assert again["prompt_eval_count"] == first["prompt_eval_count"]  # Ollama counts every prompt token
    assert cached(batched) - before > again["prompt_eval_count"] - 20, again  # type: ignore[operator]
    assert again["message"] == first["message"]
    # and once more, now saved into the RAM its first save left behind
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda m: ask(m, 24), others))
    before = cached(batched)
    third = ask(history)
    assert cached(batched) - before > third["prompt_eval_count"] - 20, third  # type: ignore[operator]
    assert third["message"] == first["message"]


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_a_shared_system_prompt_is_copied_from_a_busy_slot(batched: Daemon) -> None:
    """Two users with one long system prompt: while the first is still generating, the second's request takes
    another slot, gets the prefix copied from the first one's and evaluates only its own question."""
    system = {"role": "system", "content": "You answer questions about the Lighthouse Museum. " * 25}

    def ask(question: str, n: int) -> dict[str, object]:
        r = httpx.post(
            batched.url + "/api/chat",
            json={
                "model": "smol",
                "messages": [system, {"role": "user", "content": question}],
                "stream": False,
                "options": {"temperature": 0, "num_predict": n},
            },
            timeout=300,
        )
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    started = threading.Event()

    def long_answer() -> None:
        with httpx.stream(
            "POST",
            batched.url + "/api/chat",
            json={
                "model": "smol",
                "messages": [system, {"role": "user", "content": "Tell me its whole history."}],
                "options": {"temperature": 0, "num_predict": 400, "stop": ["@@never@@"]},
            },
            timeout=300,
        ) as r:
            for line in r.iter_lines():
                if json.loads(line).get("message", {}).get("content"):
                    started.set()

    with cf.ThreadPoolExecutor(1) as ex:
        busy = ex.submit(long_answer)
        assert started.wait(120)
        ps = httpx.get(batched.url + "/api/ps").json()["models"]
        slots = next(m for m in ps if m["name"].startswith("smol"))["slots"]
        assert sum(s["busy"] for s in slots) == 1
        before = cached(batched)
        second = ask("When does it open?", 16)
        reused = cached(batched) - before
        busy.result()
    assert second["prompt_eval_count"] > 200
    assert reused > second["prompt_eval_count"] - 40, reused  # type: ignore[operator] # the system prompt was copied
    assert ask("When does it open?", 16)["message"] == second["message"]


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_second_turn_reuses_the_cached_history(batched: Daemon) -> None:
    history = [{"role": "system", "content": "You are a helpful assistant. " * 40}]
    history += [{"role": "user", "content": f"Remember the number {i}."} for i in range(20)]
    first = httpx.post(
        batched.url + "/api/chat",
        json={"model": "smol", "messages": history, "stream": False, "options": {"temperature": 0, "num_predict": 8}},
        timeout=300,
    ).json()
    history += [first["message"], {"role": "user", "content": "Which numbers did I say?"}]
    before = cached(batched)
    second = httpx.post(
        batched.url + "/api/chat",
        json={"model": "smol", "messages": history, "stream": False, "options": {"temperature": 0, "num_predict": 8}},
        timeout=300,
    ).json()
    assert first["prompt_eval_count"] > 400
    assert second["prompt_eval_count"] > first["prompt_eval_count"]  # Ollama counts every prompt token
    assert cached(batched) - before > second["prompt_eval_count"] - 40  # only the new turn is evaluated
    assert second["prompt_eval_duration"] < first["prompt_eval_duration"]


@pytest.mark.real_model
@pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached")
def test_one_prompt_sent_three_times_at_once_is_evaluated_once(batched: Daemon) -> None:
    """Three requests with one long prompt at the same moment (an app's parallel calls, or ``n`` = 3): the prompt is
    evaluated once and copied to the other two (each evaluates only its last token), and each greedy answer is the
    one a request alone gets; then ``n`` = 3 through ``/v1/completions`` gives three equal greedy choices."""
    prompt = "Here are the measurements of the day. " + " ".join(f"At {i} h it was {i * 37 % 23} C." for i in range(80))
    before = cached(batched)
    with cf.ThreadPoolExecutor(3) as ex:
        answers = list(ex.map(lambda _: gen(batched, "smol", prompt, num_predict=8), range(3)))
    reused = cached(batched) - before
    count = answers[0]["prompt_eval_count"]
    assert isinstance(count, int) and count > 500
    # two copies of all but the last token (and whatever template prefix earlier tests left in the slots)
    assert 2 * (count - 1) <= reused < 2 * (count - 1) + count // 4, reused
    assert len({a["response"] for a in answers}) == 1
    r = httpx.post(
        batched.url + "/v1/completions",
        json={"model": "smol", "prompt": prompt + " Next:", "n": 3, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    r.raise_for_status()
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1


def test_a_client_that_leaves_frees_its_slot(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_NUM_PARALLEL": "1"})
    try:
        create(
            d,
            "endless",
            write_tiny_gguf(tmp_path / "e.gguf", context_length=4096, never_ends=True),
            template="{{ .Prompt }}",
            parameters={"temperature": 0, "repeat_penalty": 1.0, "num_ctx": 256},
        )
        with httpx.stream(
            "POST",
            d.url + "/api/generate",
            json={"model": "endless", "prompt": "go", "options": {"num_predict": -1}},
            timeout=60,
        ) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n > 20:
                    break
        started = time.monotonic()
        out = gen(d, "endless", "again", num_predict=5)  # the only slot must be free again
        assert out["eval_count"] == 5 and time.monotonic() - started < 20
    finally:
        stop_daemon(d)


def test_a_full_context_shifts_instead_of_stopping(batched: Daemon) -> None:
    out = gen(batched, "endless", "go", num_predict=200)  # num_ctx is 64
    assert out["eval_count"] == 200 and out["done_reason"] == "length"
    with pytest.raises(httpx.HTTPStatusError) as info:
        httpx.post(
            batched.url + "/api/generate",
            json={
                "model": "endless",
                "prompt": "a " * 100,
                "stream": False,
                "truncate": False,
                "shift": False,
                "options": {"num_predict": 5},
            },
            timeout=60,
        ).raise_for_status()
    assert info.value.response.status_code == 400
    assert "longer than the context length" in info.value.response.json()["error"]


def test_num_predict_is_capped_at_ten_contexts_as_in_ollama(batched: Daemon) -> None:
    """An app's max_tokens far over the context (Claude Code sends 32000) generates at most 10 x num_ctx tokens,
    as Ollama caps it: a model that never ends cannot run on for ever through context shifts."""
    out = gen(batched, "endless", "go", num_predict=5000)  # num_ctx is 64
    assert out["eval_count"] == 640 and out["done_reason"] == "length"
