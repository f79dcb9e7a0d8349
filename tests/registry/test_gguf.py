"""registry.gguf: our bounded GGUF header reader, checked against the gguf package, hostile inputs and llama.cpp."""

from __future__ import annotations

import ast
import io
import random
import struct
import sys
import tracemalloc
from pathlib import Path

import gguf
import pytest

import registry.gguf as gguf_module
from errors import InvalidGGUF, InvalidRequest
from registry.gguf import GGUFInfo, format_parameter_count, model_info, read_gguf_file, read_gguf_header
from tests.models import hostile_gguf_variants, smollm2_path, write_tiny_gguf


def _variant_names() -> list[str]:
    """The variant names, from a stand-in for the tiny file (so collecting the tests writes no model)."""
    stand_in = bytearray(b"GGUF" + b"\x00" * 400)
    stand_in[100:117] = b"token_embd.weight"
    stand_in[200:207] = b".weight"
    return list(hostile_gguf_variants(bytes(stand_in)))


def _parse(data: bytes, **kw: object) -> GGUFInfo:
    return read_gguf_header(io.BytesIO(data), len(data), **kw)  # type: ignore[arg-type]


class _Unseekable(io.RawIOBase):
    """A pipe-like stream: read() only, short reads, no seek."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, n: int = -1) -> bytes:
        n = min(n if n >= 0 else len(self._data), 777)
        out = self._data[self._pos : self._pos + n]
        self._pos += len(out)
        return out


def test_reads_what_gguf_package_reads(tiny_gguf: Path) -> None:
    ours = read_gguf_file(tiny_gguf)
    theirs = gguf.GGUFReader(tiny_gguf)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert list(a.shape) == [int(x) for x in b.shape]
        assert a.ggml_type == int(b.tensor_type)
        assert a.type_name == b.tensor_type.name
        assert a.n_bytes == int(b.n_bytes)
        assert a.n_elements == int(b.n_elements)
        assert ours.data_offset + a.offset == int(b.data_offset)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert ours.version == 3
    assert ours.array_lengths["tokenizer.ggml.tokens"] == 300
    assert ours.architecture == "llama" and ours.file_type_name == "F32" and ours.general_type == ""
    assert (ours.context_length, ours.embedding_length, ours.block_count) == (512, 64, 2)
    assert (ours.head_count, ours.head_count_kv) == (2, 1)
    assert not ours.has_pooling and ours.chat_template is None
    assert ours.parameter_count == sum(int(t.n_elements) for t in theirs.tensors)
    assert ours.file_size == tiny_gguf.stat().st_size


def test_chat_template_and_options(tmp_path: Path) -> None:
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %} \u00e9\u2603"
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template=template, context_length=1024, n_layer=3, seed=5)
    info = read_gguf_file(path)
    assert info.chat_template == template
    assert (info.context_length, info.block_count) == (1024, 3)

    skipped = read_gguf_file(path, keep_arrays=False)
    assert skipped.metadata["tokenizer.ggml.tokens"] == [] and skipped.array_lengths["tokenizer.ggml.tokens"] == 300
    assert skipped.array_length("tokenizer.ggml.scores") == 300
    assert skipped.tensors == info.tensors and skipped.data_offset == info.data_offset
    assert read_gguf_file(path, max_array_keep=300).metadata == info.metadata
    assert read_gguf_file(path, max_array_keep=299).metadata["tokenizer.ggml.tokens"] == []

    data = path.read_bytes()
    streamed = read_gguf_header(_Unseekable(data), len(data), max_array_keep=5)  # type: ignore[arg-type]
    assert streamed.tensors == info.tensors and streamed.chat_template == template


def test_model_info(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", chat_template="{{ x }}")
    short = model_info(read_gguf_file(path, max_array_keep=5), verbose=False)
    assert "general.name" not in short and "tokenizer.chat_template" not in short
    assert short["general.architecture"] == "llama" and short["llama.context_length"] == 512
    assert short["tokenizer.ggml.tokens"] == [] and short["tokenizer.ggml.token_type"] == []
    full_info = read_gguf_file(path)
    assert short["general.parameter_count"] == full_info.parameter_count
    full = model_info(full_info, verbose=True)
    assert len(full["tokenizer.ggml.tokens"]) == 300 and full["tokenizer.ggml.tokens"][3] == "<0x00>"
    assert model_info(full_info, verbose=False) == short


@pytest.mark.parametrize("name", _variant_names())
def test_hostile_variants_are_refused(name: str, tiny_gguf: Path) -> None:
    data = hostile_gguf_variants(tiny_gguf.read_bytes())[name]
    tracemalloc.start()
    try:
        with pytest.raises(InvalidGGUF) as exc:
            _parse(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(exc.value) and isinstance(exc.value, InvalidRequest)
    assert peak < 4 * len(data) + (2 << 20), f"{name}: {peak} bytes allocated for a {len(data)} byte file"
    with pytest.raises(InvalidGGUF):
        read_gguf_header(_Unseekable(data), len(data))  # type: ignore[arg-type]


def test_specific_messages(tiny_gguf: Path) -> None:
    v = hostile_gguf_variants(tiny_gguf.read_bytes())
    for name, words in [
        ("not-gguf", "not a GGUF file (the first bytes are not 'GGUF')"),
        ("bad-version", "unsupported GGUF version 99"),
        ("truncated-in-counts", "truncated GGUF"),
        ("huge-tensor-count", "tensors"),
        ("huge-string", "bytes"),
        ("huge-array", "elements"),
        ("bad-value-type", "unknown value type 77"),
        ("tensor-bad-type", "unknown ggml type 999"),
        ("tensor-offset-past-eof", "truncated GGUF"),
        ("key-not-utf8", "UTF-8"),
    ]:
        with pytest.raises(InvalidGGUF) as exc:
            _parse(v[name])
        assert words in str(exc.value), (name, str(exc.value))


def test_file_shorter_than_declared(tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    with pytest.raises(InvalidGGUF, match="truncated GGUF"):
        read_gguf_header(io.BytesIO(data[:500]), len(data))


def test_every_prefix_is_refused(tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    header_end = read_gguf_file(tiny_gguf).data_offset
    rng = random.Random(7)
    cuts = list(range(300)) + rng.sample(range(300, header_end), 200) + [header_end, len(data) - 1]
    for cut in cuts:
        with pytest.raises(InvalidGGUF):
            _parse(data[:cut])


def test_random_mutations_only_raise_invalid_gguf(tiny_gguf: Path) -> None:
    original = tiny_gguf.read_bytes()
    header_end = read_gguf_file(tiny_gguf).data_offset
    rng = random.Random(1234)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(400):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            pos = rng.randrange(header_end)
            r = rng.random()
            if r < 0.6:
                data[pos] = rng.randrange(256)
            elif r < 0.8 and pos + 8 <= header_end:  # a plausible-looking huge length or count
                data[pos : pos + 8] = struct.pack("<Q", rng.choice([2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]))
            else:
                data[pos] ^= 1 << rng.randrange(8)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        try:
            _parse(bytes(data), max_array_keep=rng.choice([None, 5]))
            outcomes["ok"] += 1
        except InvalidGGUF as exc:
            assert str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["ok"] > 0, outcomes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (8_030_000_000, "8.0B"),
        (8_000_000_000, "8B"),
        (1_234_500_000, "1.2B"),
        (70_553_706_496, "70.6B"),
        (134_515_008, "134.52M"),
        (1_000_000, "1M"),
        (1_500_000, "1.50M"),
        (999_999, "1000K"),
        (12_345, "12K"),
        (1_000, "1K"),
        (999, "999"),
        (0, "0"),
    ],
)
def test_parameter_count(n: int, text: str) -> None:
    assert format_parameter_count(n) == text


def test_reader_is_stdlib_only() -> None:
    tree = ast.parse(Path(gguf_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module if node.module.startswith("registry") else node.module.split(".")[0])
    assert imported - {"errors"} <= set(sys.stdlib_module_names), imported


def test_tiny_model_runs_in_llama_cpp(tiny_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=128, verbose=False)
    try:
        out = llm.create_completion("hello world", max_tokens=6, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
        assert llm.n_vocab() == 300  # (n_ctx is padded by llama.cpp: 128 becomes 256)
    finally:
        llm.close()


class _CountingFile(io.RawIOBase):
    """A file that counts the reads the header reader makes of it, and the bytes they return."""

    def __init__(self, f: io.BufferedReader) -> None:
        self.f, self.reads, self.bytes = f, 0, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.reads += 1
        self.bytes += len(data)
        return data

    def seekable(self) -> bool:
        return self.f.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)


@pytest.mark.real_model
def test_smollm2_header_is_read_in_chunks_and_its_token_lists_on_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work of reading a real header (49k tokens, 48k merges), counted, not timed: the file is read in chunks of
    64 KiB or more (a read per token would be 100k reads), never into the tensor data past one chunk of read-ahead,
    and the token lists take the buffered fast path of ``_Reader.strings``, leaving the checked slow path
    (``_Reader.string``) to the elements that straddle a chunk's end: at most one per read."""
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not cached (run scripts/fetch_smollm2.py)")
    slow = 0
    string = gguf_module._Reader.string

    def counted(self: gguf_module._Reader, what: str, *, keep: bool = True) -> str | None:
        nonlocal slow
        slow += what.startswith("element ")  # of an array of strings; not a key's value or a tensor's name
        return string(self, what, keep=keep)

    monkeypatch.setattr(gguf_module._Reader, "string", counted)
    with open(path, "rb") as raw:
        f = _CountingFile(raw)
        info = read_gguf_header(f, path.stat().st_size)
    tokens = info.array_lengths["tokenizer.ggml.tokens"] + info.array_lengths["tokenizer.ggml.merges"]
    assert tokens > 90_000
    assert info.data_offset < f.bytes <= info.data_offset + gguf_module._CHUNK
    assert f.reads <= f.bytes // (64 * 1024) + 1, (f.reads, f.bytes)  # buffered: 64 KiB or more a read
    assert slow <= f.reads, (slow, f.reads)


@pytest.mark.real_model
def test_smollm2_header() -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 not cached (run scripts/fetch_smollm2.py)")
    info = read_gguf_file(path)  # every array kept: the 49k-token vocabulary and merges
    assert (info.architecture, info.file_type_name, info.parameter_count) == ("llama", "Q4_1", 134_515_008)
    assert format_parameter_count(info.parameter_count) == "134.52M"
    assert (info.context_length, info.embedding_length, info.block_count) == (8192, 576, 30)
    assert (info.head_count, info.head_count_kv, len(info.tensors)) == (9, 3, 272)
    assert info.chat_template and "<|im_start|>" in info.chat_template
    assert info.array_lengths["tokenizer.ggml.tokens"] == 49152 and not info.has_pooling
    theirs = gguf.GGUFReader(path)
    assert [(t.name, [int(x) for x in t.shape], int(t.tensor_type)) for t in theirs.tensors] == [
        (t.name, list(t.shape), t.ggml_type) for t in info.tensors
    ]
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert info.metadata[key] == field.contents(), key
