"""The runner child with a vision projector (SmolLM2 + tests/vision.py's projector), through its daemon-side handle:
the projector loads with the model, images are evaluated between engine steps while other sequences decode (each
sequence's greedy text is what it is alone), bad images and images to a runner without a projector are the request's
400 and the runner goes on."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from daemon.runners.base import Done, GenerateRequest, LoadFailed, LoadSpec, SampleParams, Token
from daemon.runners.process import ProcessRunner, RunnerRequestError
from tests.models import smollm2_path
from tests.vision import image_bytes, projector_path, write_projector

pytestmark = [pytest.mark.anyio, pytest.mark.real_model]

SMOL = smollm2_path()
if SMOL is None:
    pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)", allow_module_level=True)

GREEDY = SampleParams(temperature=0, num_predict=10, repeat_penalty=1.0, seed=1)
MARK = "<__media__>"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def img(seed: int) -> str:
    return base64.b64encode(image_bytes(seed)).decode()


async def run(r: ProcessRunner, prompt: str, images: tuple[str, ...] = (), **kw: object) -> tuple[str, Done]:
    text: list[str] = []
    done: Done | None = None
    async for ev in r.generate(GenerateRequest(prompt=prompt, params=GREEDY, images=images, **kw)):  # type: ignore[arg-type]
        if isinstance(ev, Token):
            text.append(ev.text)
        else:
            done = ev
    assert done is not None
    return "".join(text), done


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def vrunner() -> object:
    assert SMOL is not None
    r = ProcessRunner(
        LoadSpec(model_path=str(SMOL), num_ctx=1024, num_parallel=4, projector_path=str(projector_path()))
    )
    await r.start()
    try:
        yield r
    finally:
        await r.close()


async def test_projector_loads_with_the_model(vrunner: ProcessRunner) -> None:
    info = vrunner.info()
    assert info["projector"] is True and info["projector_gpu"] is False


async def test_images_interleave_with_decoding_and_change_nothing_else(vrunner: ProcessRunner) -> None:
    texts = [chat(f"Count from {i} to ten.") for i in range(3)]
    two = chat(f"Compare {MARK} and {MARK}.")
    alone_text = [await run(vrunner, t) for t in texts]
    alone_img, done = await run(vrunner, two, (img(0), img(1)))
    assert done.prompt_eval_count > 128  # both images' 64 positions
    assert all(t >= 0 for t in done.context)  # image keys never leave the runner as tokens
    together = await asyncio.gather(*(run(vrunner, t) for t in texts), run(vrunner, two, (img(0), img(1))))
    assert [t for t, _ in together[:3]] == [t for t, _ in alone_text]
    assert together[3][0] == alone_img


async def test_context_tokens_before_an_image(vrunner: ProcessRunner) -> None:
    head = await vrunner.tokenize("<|im_start|>system\nBe brief.<|im_end|>\n", add_special=False)
    prompt = chat(f"What is {MARK}?")
    with_ctx, _ = await run(vrunner, prompt, (img(2),), context=tuple(head), add_special=False)
    inline, _ = await run(vrunner, "<|im_start|>system\nBe brief.<|im_end|>\n" + prompt, (img(2),), add_special=False)
    assert with_ctx == inline


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ((base64.b64encode(b"GIF89a\x01\x00\x01\x00").decode(),), "cannot decode this GIF"),
        (("not base64!",), "not valid base64"),
        ((img(0), img(1)), "1 image marker(s) but 2 image(s)"),
    ],
)
async def test_bad_images_are_400_and_the_runner_goes_on(
    vrunner: ProcessRunner, images: tuple[str, ...], message: str
) -> None:
    with pytest.raises(RunnerRequestError) as info:
        await run(vrunner, chat(f"Describe {MARK}"), images)
    assert message in str(info.value)  # a RunnerRequestError: the daemon's 400
    text, _ = await run(vrunner, chat(f"Describe {MARK}"), (img(0),))
    assert text


async def test_cancel_while_an_image_waits(vrunner: ProcessRunner) -> None:
    agen = vrunner.generate(GenerateRequest(prompt=chat(f"Describe {MARK}"), params=GREEDY, images=(img(3),)))
    await agen.__anext__()
    await agen.aclose()
    text, _ = await run(vrunner, chat(f"Describe {MARK}"), (img(3),))
    assert text


async def test_a_runner_without_projector_refuses_images() -> None:
    assert SMOL is not None
    r = ProcessRunner(LoadSpec(model_path=str(SMOL), num_ctx=512))
    await r.start()
    try:
        assert r.info()["projector"] is False
        with pytest.raises(RunnerRequestError) as info:
            await run(r, chat(f"Describe {MARK}"), (img(0),))
        assert "without a vision projector" in str(info.value)
        text, _ = await run(r, chat("Say hi."))
        assert text
    finally:
        await r.close()


async def test_a_projector_for_another_model_fails_the_load(tmp_path: Path) -> None:
    assert SMOL is not None
    wrong = write_projector(tmp_path / "narrow.gguf", text_embd=64)  # SmolLM2 is 576 wide
    r = ProcessRunner(LoadSpec(model_path=str(SMOL), num_ctx=512, projector_path=str(wrong)))
    with pytest.raises(LoadFailed) as info:
        await r.start()
    assert "vision projector: mismatch between text model (n_embd = 576) and mmproj (n_embd = 64)" in str(info.value)
    assert not r.alive()
