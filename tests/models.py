"""Test models: a tiny random-weight llama GGUF written with the `gguf` package, the cached SmolLM2, and hostile
variants of a GGUF header."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def cache_dir() -> Path:
    return Path(os.environ.get("CORRAL_TEST_CACHE") or Path.home() / ".cache" / "corral-test")


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct (Q4_1) if scripts/fetch_smollm2.py has cached it."""
    p = cache_dir() / "SmolLM2-135M-Instruct.gguf"
    return p if p.is_file() else None


def write_tiny_gguf(
    path: Path | str,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_ff: int = 128,
    n_vocab: int = 300,
    seed: int = 0,
    chat_template: str | None = None,
    context_length: int = 512,
    byte_fallback: bool = True,
    general_type: str | None = None,
    never_ends: bool = False,
) -> Path:
    """A tiny llama-architecture GGUF with random weights that llama.cpp can load and sample from.

    ``never_ends``: greedy decoding never picks the end-of-text token (its output row is zero while every other
    row has its negation in the vocabulary, so some token always scores above it): a generation that only a
    limit or a cancel can stop."""
    import gguf

    path = Path(path)
    n_head = max(1, n_embd // 32)
    n_head_kv = max(1, n_head // 2)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    if general_type:
        w.add_type(general_type)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    byte_tokens = [f"<0x{b:02X}>".encode() for b in range(256)] if byte_fallback else []
    n_words = max(n_vocab - 3 - len(byte_tokens), 16)
    # "▁a".."▁z", "▁aa".."▁zz", ...: unique SentencePiece-style words, so short English-ish text tokenizes
    letters = "abcdefghijklmnopqrstuvwxyz"
    uniq: list[bytes] = []
    for i in range(n_words):
        word, j = "", i
        while True:
            word = letters[j % 26] + word
            j = j // 26 - 1
            if j < 0:
                break
        uniq.append(("\u2581" + word).encode())
    tokens = [b"<unk>", b"<s>", b"</s>"] + byte_tokens + uniq
    vocab = len(tokens)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [0.0] * len(byte_tokens) + [-float(i) for i in range(len(uniq))])
    w.add_token_types([2, 3, 3] + [6] * len(byte_tokens) + [1] * len(uniq))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    t("token_embd.weight", vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    if never_ends:
        out_w = (rng.standard_normal((vocab, n_embd)) * 0.02).astype(np.float32)
        out_w[2] = 0.0  # </s>
        half = (vocab - 3) // 2
        out_w[3 + half:3 + 2 * half] = -out_w[3:3 + half]
        w.add_tensor("output.weight", out_w)
    else:
        t("output.weight", vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _str(b: bytes, length: int | None = None) -> bytes:
    """A GGUF string; ``length`` overrides the declared length (to lie about it)."""
    return _u64(len(b) if length is None else length) + b


def _kv(key: bytes, vtype: int, value: bytes) -> bytes:
    return _str(key) + _u32(vtype) + value


def _tensor(name: bytes, dims: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return _str(name) + _u32(len(dims) if n_dims is None else n_dims) + b"".join(map(_u64, dims)) + _u32(
        ggml_type) + _u64(offset)


def _gguf(kvs: Sequence[bytes], tensors: Sequence[bytes] = (), *, n_kv: int | None = None, n_tensors: int | None = None,
          version: int = 3, tail: bytes = b"\x00" * 64) -> bytes:
    return (b"GGUF" + _u32(version) + _u64(len(tensors) if n_tensors is None else n_tensors)
            + _u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors) + tail)


def _patch_last_tensor_offset(tiny: bytes, new_offset: int) -> bytes:
    """``tiny`` with the data offset of its last tensor info replaced (every tiny tensor is named ``*.weight``)."""
    pos = tiny.rindex(b".weight") + len(b".weight")
    n_dims = struct.unpack_from("<I", tiny, pos)[0]
    at = pos + 4 + 8 * n_dims + 4
    return tiny[:at] + _u64(new_offset) + tiny[at + 8:]


def hostile_gguf_variants(tiny: bytes) -> dict[str, bytes]:
    """Byte strings that must be refused as GGUF files with a clear error (never a crash or a huge allocation).

    ``tiny`` is the bytes of a file from :func:`write_tiny_gguf`; some variants are cut or patched copies of it,
    the rest are small hand-made headers that lie about their sizes.
    """
    arch = _kv(b"general.architecture", 8, _str(b"llama"))
    first_tensor = tiny.index(b"token_embd.weight")
    last_offset_end = tiny.rindex(b".weight")
    return {
        # not a GGUF at all
        "empty": b"",
        "magic-only": b"GGUF",
        "not-gguf": b"PK\x03\x04 this is a zip, not a model" + b"\x00" * 64,
        "ggml-magic": b"lmgg" + b"\x00" * 64,
        "bad-version": _gguf([arch], version=99),
        "version-1": _gguf([arch], version=1),
        "big-endian": b"GGUF" + struct.pack(">I", 3) + struct.pack(">Q", 0) + struct.pack(">Q", 1) + b"\x00" * 64,
        # cut short at several points
        "truncated-in-version": tiny[:6],
        "truncated-in-counts": tiny[:20],
        "truncated-in-kv": tiny[:1000],
        "truncated-in-vocab": tiny[:2000],
        "truncated-in-tensor-infos": tiny[: first_tensor + 5],
        "truncated-after-tensor-infos": tiny[: last_offset_end + 20],
        "truncated-data": tiny[: len(tiny) - 64],
        # absurd counts and lengths
        "huge-tensor-count": _gguf([], n_tensors=2**40),
        "huge-kv-count": _gguf([], n_kv=2**40),
        "counts-beyond-file": _gguf([arch], n_kv=50_000, n_tensors=50_000),
        "huge-key": _gguf([_u64(2**62)]),
        "huge-string": _gguf([_str(b"general.name") + _u32(8) + _u64(2**62)]),
        "string-longer-than-file": _gguf([_str(b"general.name") + _u32(8) + _u64(10_000) + b"abc"]),
        "huge-array": _gguf([_kv(b"a.b", 9, _u32(4) + _u64(2**60))]),
        "array-longer-than-file": _gguf([_kv(b"a.b", 9, _u32(10) + _u64(1_000_000))]),
        "huge-string-array": _gguf([_kv(b"tokenizer.ggml.tokens", 9, _u32(8) + _u64(2**40))]),
        "string-array-lies": _gguf([_kv(b"tokenizer.ggml.tokens", 9, _u32(8) + _u64(3) + _str(b"a")
                                        + _str(b"b", 2**61))]),
        # malformed values
        "bad-value-type": _gguf([_kv(b"a.b", 77, b"\x00" * 16)]),
        "bad-array-element-type": _gguf([_kv(b"a.b", 9, _u32(13) + _u64(2))]),
        "arrays-nested-too-deep": _gguf([_kv(b"a.b", 9, _u32(9) + _u64(1) + _u32(9) + _u64(1) + _u32(9) + _u64(1)
                                             + _u32(0) + _u64(1) + b"\x01")]),
        "key-not-utf8": _gguf([_kv(b"general.\xff\xfe", 4, _u32(1))]),
        "duplicate-key": _gguf([arch, arch]),
        "bad-alignment": _gguf([_kv(b"general.alignment", 4, _u32(3))]),
        "zero-alignment": _gguf([_kv(b"general.alignment", 4, _u32(0))]),
        # malformed tensor infos
        "tensor-past-eof": _gguf([arch], [_tensor(b"t", [1 << 40])]),
        "tensor-offset-past-eof": _patch_last_tensor_offset(tiny, 1 << 40),
        "tensor-offset-misaligned": _patch_last_tensor_offset(tiny, 1),
        "tensor-bad-type": _gguf([arch], [_tensor(b"t", [4], ggml_type=999)]),
        "tensor-removed-type": _gguf([arch], [_tensor(b"t", [32], ggml_type=4)]),
        "tensor-many-dims": _gguf([arch], [_tensor(b"t", [1] * 64)], tail=b"\x00" * 600),
        "tensor-zero-dims": _gguf([arch], [_tensor(b"t", [])]),
        "tensor-absurd-shape": _gguf([arch], [_tensor(b"t", [2**62, 2**62])]),
        "tensor-overflowing-shape": _gguf([arch], [_tensor(b"t", [0, 2**64 - 1])]),
        "tensor-partial-block": _gguf([arch], [_tensor(b"t", [33], ggml_type=2)]),
        "tensor-duplicate-name": _gguf([arch], [_tensor(b"t", [8]), _tensor(b"t", [8], offset=32)],
                                       tail=b"\x00" * 128),
    }
