from __future__ import annotations

import io
import random
import time
from pathlib import Path

import gguf
import pytest

from registry.errors import InvalidGGUF
from registry.gguf import format_parameter_count, model_info, read_gguf_file, read_gguf_header
from tests.models import hostile_gguf_variants, smollm2_path


def test_reads_what_gguf_package_reads(tiny_gguf: Path) -> None:
    ours = read_gguf_file(tiny_gguf)
    theirs = gguf.GGUFReader(tiny_gguf)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert list(a.shape) == [int(x) for x in b.shape]
        assert a.ggml_type == int(b.tensor_type)
        assert a.n_bytes == int(b.n_bytes)
        assert ours.data_offset + a.offset == int(b.data_offset)
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert ours.architecture == "llama" and ours.file_type_name == "F32" and ours.block_count == 2


@pytest.mark.parametrize("name", list(hostile_gguf_variants(b"GGUF" + b"\x00" * 400)))
def test_hostile_variants_are_refused(name: str, tiny_gguf: Path) -> None:
    data = hostile_gguf_variants(tiny_gguf.read_bytes())[name]
    with pytest.raises(InvalidGGUF):
        read_gguf_header(io.BytesIO(data), len(data))


def test_random_mutations_only_raise_invalid_gguf(tiny_gguf: Path) -> None:
    original = tiny_gguf.read_bytes()
    header_end = read_gguf_file(tiny_gguf).data_offset
    rng = random.Random(1234)
    for _ in range(400):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(header_end)
            data[pos] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        try:
            read_gguf_header(io.BytesIO(bytes(data)), len(data))
        except InvalidGGUF:
            pass


@pytest.mark.parametrize(
    ("n", "text"),
    [(8_030_000_000, "8.0B"), (8_000_000_000, "8B"), (134_515_008, "134.52M"), (1_000_000, "1M"), (12_345, "12K"),
     (999, "999")],
)
def test_parameter_count(n: int, text: str) -> None:
    assert format_parameter_count(n) == text


def test_model_info_hides_long_arrays(tiny_gguf: Path) -> None:
    info = read_gguf_file(tiny_gguf, max_array_keep=5)
    shown = model_info(info, verbose=False)
    assert shown["tokenizer.ggml.tokens"] == []
    assert "general.name" not in shown and shown["general.architecture"] == "llama"
    assert len(model_info(read_gguf_file(tiny_gguf), verbose=True)["tokenizer.ggml.tokens"]) == info.array_length(
        "tokenizer.ggml.tokens")


@pytest.mark.real_model
def test_smollm2_header() -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not cached")
    started = time.monotonic()
    info = read_gguf_file(path, max_array_keep=5)
    assert time.monotonic() - started < 0.5
    assert (info.architecture, info.file_type_name, format_parameter_count(info.parameter_count)) == (
        "llama", "Q4_1", "134.52M")
    assert info.context_length == 8192 and info.chat_template
