"""Test models: a tiny random-weight llama GGUF written with the `gguf` package, the cached SmolLM2, and hostile
variants of a GGUF header."""

from __future__ import annotations

import os
import struct
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
) -> Path:
    """A tiny llama-architecture GGUF with random weights that llama.cpp can load and sample from."""
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
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [("\u2581" + letters[i % 26] + (letters[(i // 26) % 26] if i >= 26 else "")).encode() for i in range(n_words)]
    # make every token unique
    words = [wd if i < 26 * 27 else wd + str(i).encode() for i, wd in enumerate(words)]
    seen: set[bytes] = set()
    uniq = []
    for i, wd in enumerate(words):
        while wd in seen:
            wd += str(i).encode()
        seen.add(wd)
        uniq.append(wd)
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


def hostile_gguf_variants(tiny: bytes) -> dict[str, bytes]:
    """Byte strings that must be refused as GGUF files with a clear error (never a crash or a huge allocation)."""
    header = b"GGUF" + _u32(3)

    def kv_string(key: bytes, length: int, body: bytes = b"") -> bytes:
        return _u64(len(key)) + key + _u32(8) + _u64(length) + body

    return {
        "not-gguf": b"PK\x03\x04 this is a zip, not a model" + b"\x00" * 64,
        "empty": b"",
        "magic-only": b"GGUF",
        "bad-version": b"GGUF" + _u32(99) + _u64(0) + _u64(0),
        "truncated-header": tiny[:20],
        "truncated-kv": tiny[:200],
        "truncated-data": tiny[: len(tiny) - 64],
        "huge-tensor-count": header + _u64(2**40) + _u64(0),
        "huge-kv-count": header + _u64(0) + _u64(2**40),
        "huge-string": header + _u64(0) + _u64(1) + kv_string(b"general.name", 2**62),
        "huge-key": header + _u64(0) + _u64(1) + _u64(2**62),
        "huge-array": header + _u64(0) + _u64(1) + _u64(4) + b"a.b1" + _u32(9) + _u32(4) + _u64(2**60),
        "bad-value-type": header + _u64(0) + _u64(1) + _u64(4) + b"a.b1" + _u32(77) + b"\x00" * 16,
        "tensor-past-eof": header + _u64(1) + _u64(0) + _u64(1) + b"t" + _u32(1) + _u64(1 << 40) + _u32(0) + _u64(0),
        "tensor-bad-type": header + _u64(1) + _u64(0) + _u64(1) + b"t" + _u32(1) + _u64(4) + _u32(999) + _u64(0),
        "tensor-many-dims": header + _u64(1) + _u64(0) + _u64(1) + b"t" + _u32(64) + _u64(1) * 64,
    }
