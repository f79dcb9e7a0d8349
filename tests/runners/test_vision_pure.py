"""Vision without a model: the projector's memory estimate, the engine's split at images, the scheduler key of a
model with a projector, and the CLI's image paths in a prompt."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cli.chat import extract_images
from daemon.generation.inference import ModelContext
from daemon.llama.engine import split_at_image
from daemon.scheduling.memory import choose_gpu_layers, estimate, projector_file_memory, projector_memory
from registry.gguf import read_gguf_file
from registry.names import ModelName
from tests.models import write_tiny_gguf
from tests.vision import image_bytes, projector_path


def test_projector_memory_is_its_tensors_plus_a_compute_allowance() -> None:
    info = read_gguf_file(projector_path())
    tensors = sum(t.n_bytes for t in info.tensors)
    need = projector_memory(info)
    # libmtmd reports 0.30 MiB of compute buffer for the test projector; the allowance covers it and libmtmd's context
    assert tensors + int(0.30 * (1 << 20)) < need < tensors + 4 * (1 << 20)
    assert projector_file_memory(str(projector_path())) == need
    assert projector_file_memory("") == 0


def test_the_projector_goes_with_the_whole_model(tmp_path: Path) -> None:
    info = read_gguf_file(write_tiny_gguf(tmp_path / "m.gguf"))
    proj = 50 << 20
    cpu, cpu_p = estimate(info, num_ctx=256), estimate(info, num_ctx=256, projector=proj)
    assert cpu_p.ram == cpu.ram + proj and cpu_p.vram == cpu.vram == 0
    full = estimate(info, num_ctx=256, n_gpu_layers=-1)
    full_p = estimate(info, num_ctx=256, n_gpu_layers=-1, projector=proj)
    assert full_p.vram == full.vram + proj and full_p.ram == full.ram
    # a budget that fits the whole model but not its projector too: one layer stays on the CPU, and the projector
    n_layer = len(full.weights_per_layer)
    assert choose_gpu_layers(info, num_ctx=256, vram_budget=full.vram) == n_layer + 1  # llama.cpp's "all"
    assert choose_gpu_layers(info, num_ctx=256, vram_budget=full.vram, projector=proj) <= n_layer


def test_split_at_image() -> None:
    assert split_at_image([1, 2, -5, -6, 3]) == ([1, 2], [-5, -6, 3])
    assert split_at_image([-1, 4]) == ([], [-1, 4])
    assert split_at_image([1, 2]) == ([1, 2], [])


def test_the_scheduler_key_includes_the_projector(tmp_path: Path) -> None:
    def ctx(projector: str | None) -> ModelContext:
        return ModelContext(
            raw="m",
            name=ModelName.parse("m"),
            stored=SimpleNamespace(manifest=SimpleNamespace(digest=SimpleNamespace(hex="d"))),  # type: ignore[arg-type]
            model_path=tmp_path / "sha256-model",
            adapters=(),
            info=None,  # type: ignore[arg-type]
            template=None,
            system=None,
            params={},
            messages=[],
            capabilities=[],
            projector_path=None if projector is None else tmp_path / projector,
        )

    keys = {ctx(None).ref.key, ctx("sha256-p1").ref.key, ctx("sha256-p2").ref.key}
    assert len(keys) == 3
    assert ctx("sha256-p1").ref.key == ctx("sha256-p1").ref.key


@pytest.fixture
def photos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    (tmp_path / "my pics").mkdir()
    spaced = tmp_path / "my pics" / "a b.png"
    spaced.write_bytes(image_bytes(0))
    (tmp_path / "p.jpg").write_bytes(image_bytes(1))
    monkeypatch.chdir(tmp_path)
    return {"spaced": spaced, "b64": [base64.b64encode(image_bytes(i)).decode() for i in (0, 1)]}


@pytest.mark.parametrize(
    ("prompt", "cleaned", "which"),
    [
        ("describe ./p.jpg please", "describe please", [1]),
        ("describe ./p.jpg.", "describe .", [1]),
        ("what is {escaped}?", "what is ?", [0]),
        ("compare '{spaced}' and \"./p.jpg\"", "compare and", [0, 1]),
        ("no ./missing.png here", "no ./missing.png here", []),
        ("not a path: p.jpg", "not a path: p.jpg", []),
    ],
)
def test_extract_images(photos: dict[str, Any], prompt: str, cleaned: str, which: list[int]) -> None:
    spaced = str(photos["spaced"])
    text = prompt.format(spaced=spaced, escaped=spaced.replace(" ", "\\ "))
    said: list[str] = []
    out, images = extract_images(text, say=said.append)
    assert out == cleaned
    assert images == [photos["b64"][i] for i in which]
    assert len(said) == len(which) and all(s.startswith("Added image '") for s in said)
