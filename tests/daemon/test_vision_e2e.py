"""Vision end to end: a real daemon runs SmolLM2 with the test projector (tests/vision.py) and images change its
greedy answers through every API (/api/generate, /api/chat, /v1/chat/completions, /v1/messages, /v1/responses),
streamed and not; the prompt cache never serves one image's KV to another; bad images are clear 400s that leave the
runner serving; ``corral run`` and its REPL attach the image files a prompt names."""

from __future__ import annotations

import base64
import io
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from cli.client import DaemonClient
from cli.interactive import Repl, Session
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path
from tests.vision import image_bytes, png_bytes, projector_path

pytestmark = pytest.mark.real_model

SMOL = smollm2_path()
if SMOL is None:
    pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)", allow_module_level=True)

OPTIONS = {"temperature": 0, "seed": 1, "num_predict": 12, "num_ctx": 2048}
QUESTION = "Describe this picture."
A, B = image_bytes(0), image_bytes(1)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


@pytest.fixture(scope="module")
def vis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with "vis" (SmolLM2 + the test projector, greedy by default) and "smol" (SmolLM2 alone)."""
    root = tmp_path_factory.mktemp("vision-e2e")
    d = start_daemon(root / "models", root / "daemon.log")
    try:
        c = ollama.Client(host=d.url)
        assert SMOL is not None
        model, proj = c.create_blob(SMOL), c.create_blob(projector_path())
        # one create with both files, as `corral create` sends a Modelfile with two FROM lines
        c.create(
            model="vis",
            files={"model.gguf": model, "mmproj.gguf": proj},
            parameters={"temperature": 0, "num_predict": 12, "seed": 1},
            stream=False,
        )
        # bounded: an unbounded greedy answer to a file path can run for minutes on a loaded 2-core machine
        c.create(model="smol", files={"model.gguf": model}, parameters={"num_predict": 24}, stream=False)
        yield d
    finally:
        stop_daemon(d)


def generate(d: Daemon, image: bytes | None, *, prompt: str = QUESTION, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "vis", "prompt": prompt, "stream": False, "options": OPTIONS, **extra}
    if image is not None:
        body["images"] = [b64(image)]
    return httpx.post(d.url + "/api/generate", json=body, timeout=300)


def check_images_steer(answer: Any) -> None:
    """Two different images give different greedy answers, the same image twice the same one."""
    a, b, a2 = answer(A), answer(B), answer(A)
    assert a and b
    assert a != b
    assert a == a2


# -- every API ---------------------------------------------------------------------------------------------------
def test_generate(vis: Daemon) -> None:
    def answer(img: bytes) -> str:
        r = generate(vis, img)
        assert r.status_code == 200, r.text
        return str(r.json()["response"])

    check_images_steer(answer)
    with httpx.stream(
        "POST",
        vis.url + "/api/generate",
        json={"model": "vis", "prompt": QUESTION, "images": [b64(B)], "options": OPTIONS},
        timeout=300,
    ) as r:
        import json

        streamed = "".join(json.loads(line).get("response", "") for line in r.iter_lines() if line)
    assert streamed == answer(B)
    plain = generate(vis, None).json()["response"]
    assert plain != answer(A)  # the image is really in the prompt


def test_chat_ollama_client(vis: Daemon) -> None:
    c = ollama.Client(host=vis.url)

    def messages(img: bytes) -> list[dict[str, Any]]:
        return [{"role": "user", "content": QUESTION, "images": [img]}]

    def answer(img: bytes) -> str:
        return str(c.chat(model="vis", messages=messages(img), options=OPTIONS).message.content)

    check_images_steer(answer)
    streamed = "".join(
        str(part.message.content) for part in c.chat(model="vis", messages=messages(A), options=OPTIONS, stream=True)
    )
    assert streamed == answer(A)


def test_openai_chat_completions(vis: Daemon) -> None:
    c = openai.OpenAI(base_url=vis.url + "/v1", api_key="unused", max_retries=0)

    def messages(img: bytes) -> Any:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": data_url(img)}},
                ],
            }
        ]

    def answer(img: bytes) -> str:
        r = c.chat.completions.create(model="vis", messages=messages(img), temperature=0, seed=1, max_tokens=12)
        return str(r.choices[0].message.content)

    check_images_steer(answer)
    stream = c.chat.completions.create(
        model="vis", messages=messages(B), temperature=0, seed=1, max_tokens=12, stream=True
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == answer(B)
    # a remote URL is refused (corral fetches nothing): a 400, not a silently dropped image
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="vis",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}],
        )


def test_anthropic_messages(vis: Daemon) -> None:
    c = anthropic.Anthropic(base_url=vis.url, api_key="unused", max_retries=0)

    def messages(img: bytes) -> Any:
        source = {"type": "base64", "media_type": "image/png", "data": b64(img)}
        return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}]

    def answer(img: bytes) -> str:
        r = c.messages.create(model="vis", messages=messages(img), max_tokens=12)
        return "".join(b.text for b in r.content if b.type == "text")

    check_images_steer(answer)
    with c.messages.stream(model="vis", messages=messages(A), max_tokens=12) as s:
        streamed = "".join(s.text_stream)
    assert streamed == answer(A)


def test_responses_input_image(vis: Daemon) -> None:
    c = openai.OpenAI(base_url=vis.url + "/v1", api_key="unused", max_retries=0)

    def inputs(img: bytes) -> Any:
        content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(img)}]
        return [{"role": "user", "content": content}]

    def answer(img: bytes) -> str:
        return c.responses.create(model="vis", input=inputs(img), temperature=0, max_output_tokens=12).output_text

    check_images_steer(answer)
    streamed = "".join(
        ev.delta
        for ev in c.responses.create(model="vis", input=inputs(B), temperature=0, max_output_tokens=12, stream=True)
        if ev.type == "response.output_text.delta"
    )
    assert streamed == answer(B)


# -- the prompt cache --------------------------------------------------------------------------------------------
def unload(d: Daemon) -> None:
    r = httpx.post(d.url + "/api/generate", json={"model": "vis", "keep_alive": 0}, timeout=60)
    assert r.status_code == 200, r.text
    for _ in range(100):
        if not httpx.get(d.url + "/api/ps", timeout=10).json()["models"]:
            return
        import time

        time.sleep(0.1)
    raise AssertionError("the model did not unload")


def test_prompt_cache_never_serves_one_images_kv_to_another(vis: Daemon) -> None:
    c = openai.OpenAI(base_url=vis.url + "/v1", api_key="unused", max_retries=0)

    def ask(img: bytes) -> tuple[str, int, int]:
        content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": data_url(img)}}]
        r = c.chat.completions.create(
            model="vis", messages=[{"role": "user", "content": content}], temperature=0, seed=1, max_tokens=12
        )
        usage = r.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return (
            str(r.choices[0].message.content),
            usage.prompt_tokens,
            int(usage.prompt_tokens_details.cached_tokens or 0),
        )

    unload(vis)
    fresh_b, n_prompt, cached = ask(B)  # B on a fresh runner
    assert cached == 0
    unload(vis)
    ask(A)
    after_a, n_prompt2, cached = ask(B)  # same text, another image: only the text before the image is reused
    assert n_prompt2 == n_prompt
    assert after_a == fresh_b
    assert 0 < cached <= n_prompt - 64  # the image's 64 positions (and what follows) were evaluated again
    again, _, cached_again = ask(B)  # the same image again: all but the last position come from the cache
    assert again == fresh_b
    assert cached_again == n_prompt - 1
    metrics = httpx.get(vis.url + "/metrics", timeout=10)
    if metrics.status_code == 200:
        assert "corral_prompt_cached_tokens" in metrics.text


def test_a_prompt_that_ends_with_its_image(vis: Daemon) -> None:
    # raw: the image's embeddings are the prompt's last positions, so the first token is sampled from them
    def answer(img: bytes) -> str:
        r = generate(vis, None, prompt="[img-0]", raw=True, images=[b64(img)])
        assert r.status_code == 200, r.text
        return str(r.json()["response"])

    check_images_steer(answer)


# -- bad input ---------------------------------------------------------------------------------------------------
def wav_header() -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    return b"RIFF" + struct.pack("<I", 36 + 64) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + bytes(68)


def huge_png() -> bytes:
    # a valid header that claims 9000 x 9000 pixels: refused from the header, before anything decodes it
    small = png_bytes(4, 4, bytes(48))
    return small[:16] + struct.pack(">II", 9000, 9000) + small[24:]


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ("vis", A[: len(A) // 2], "cannot decode this PNG"),
        ("vis", b"this is not an image at all", "not a supported image"),
        ("vis", wav_header(), "not a supported image"),
        ("vis", huge_png(), "over the limit of 8192 pixels"),
        ("smol", A, "does not support images"),
    ],
    ids=["corrupt", "text", "wav", "oversized", "no-projector"],
)
def test_bad_images_are_400s_and_the_next_request_works(vis: Daemon, model: str, data: bytes, message: str) -> None:
    for path, body in (
        ("/api/generate", {"prompt": QUESTION, "images": [b64(data)]}),
        ("/api/chat", {"messages": [{"role": "user", "content": QUESTION, "images": [b64(data)]}]}),
    ):
        r = httpx.post(vis.url + path, json={"model": model, "stream": False, **body}, timeout=300)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"], r.text
    r = generate(vis, A)
    assert r.status_code == 200 and r.json()["response"], r.text


# -- the CLI -----------------------------------------------------------------------------------------------------
def test_corral_run_attaches_the_image(vis: Daemon, tmp_path: Path) -> None:
    pics = tmp_path / "my pics"
    pics.mkdir()
    photo = pics / "photo 1.png"
    photo.write_bytes(B)
    want = httpx.post(
        vis.url + "/api/generate",
        json={"model": "vis", "prompt": "describe", "images": [b64(B)], "stream": False},
        timeout=300,
    ).json()["response"]
    escaped = str(photo).replace(" ", "\\ ")
    for arg in (f"describe {escaped}", f"describe '{photo}'"):
        r = vis.cli("run", "vis", arg)
        assert r.returncode == 0, r.stderr
        assert f"Added image '{photo}'" in r.stderr
        assert r.stdout.strip() == want.strip()
    # a path that is not a file stays in the prompt as text
    r = vis.cli("run", "vis", f"describe {tmp_path}/missing.png")
    assert r.returncode == 0 and "Added image" not in r.stderr


def test_repl_attaches_images(vis: Daemon, tmp_path: Path) -> None:
    photo = tmp_path / "a.png"
    photo.write_bytes(A)
    lines = iter([f"what is in {photo}?"])

    def read(_prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    with DaemonClient(vis.url, timeout=300) as client:
        info = client.show("vis")
        session = Session(model="vis", info=info, wordwrap=False, history=False)
        Repl(client, session, read=read, out=out).run()
    user = session.messages[0]
    assert user["content"] == "what is in ?"
    assert user["images"] == [b64(A)]
    assert f"Added image '{photo}'" in out.getvalue()
    want = ollama.Client(host=vis.url).chat(
        model="vis", messages=[{"role": "user", "content": "what is in ?", "images": [A]}]
    )
    assert session.messages[1]["content"] == want.message.content


def test_run_without_vision_leaves_paths_alone(vis: Daemon, tmp_path: Path) -> None:
    photo = tmp_path / "a.png"
    shutil.copyfile(projector_path(), photo)  # any file: a text model never reads it
    r = vis.cli("run", "smol", f"describe {photo}", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "Added image" not in r.stderr
