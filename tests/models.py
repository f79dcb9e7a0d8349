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
    leave_out: Sequence[str] = (),
) -> Path:
    """A tiny llama-architecture GGUF with random weights that llama.cpp can load and sample from.

    ``never_ends``: greedy decoding never picks the end-of-text token (its output row is zero while every other
    row has its negation in the vocabulary, so some token always scores above it): a generation that only a
    limit or a cancel can stop. ``leave_out``: tensor names not written (a file llama.cpp refuses)."""
    import gguf

    path = Path(path)
    n_head = max(1, n_embd // 32)
    n_head_kv = max(1, n_head // 2)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    if leave_out:
        add_tensor = w.add_tensor

        def add_kept(name: str, *args: object, **kw: object) -> None:
            if name not in leave_out:
                add_tensor(name, *args, **kw)  # type: ignore[arg-type]

        w.add_tensor = add_kept  # type: ignore[method-assign]
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
        out_w[3 + half : 3 + 2 * half] = -out_w[3 : 3 + half]
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


def write_lora_gguf(
    path: Path | str,
    base: Path | str,
    *,
    rank: int = 4,
    seed: int = 0,
    scale: float = 1.0,
    targets: Sequence[str] = ("attn_q", "attn_v"),
    alpha: float | None = None,
    architecture: str | None = None,
) -> Path:
    """A LoRA adapter GGUF for the model file ``base`` (llama.cpp's format, as convert_lora_to_gguf writes it): for
    each layer's ``targets`` weights of shape (out, in), random ``lora_a`` (rank x in) and ``lora_b`` (out x rank)
    matrices, ``scale`` times a size that changes a random or real model's greedy output visibly. ``architecture``
    overrides the base's (an adapter for another architecture)."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(base))
    field = reader.fields["general.architecture"]
    arch = architecture or bytes(field.parts[field.data[0]]).decode()
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}  # ggml order: [in, out]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha if alpha is not None else rank))
    layer = 0
    while f"blk.{layer}.attn_norm.weight" in shapes:
        for target in targets:
            name = f"blk.{layer}.{target}.weight"
            if name not in shapes:
                continue
            n_in, n_out = shapes[name][0], shapes[name][1]
            a = (rng.standard_normal((rank, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * scale).astype(np.float32)
            w.add_tensor(f"{name}.lora_a", a)
            w.add_tensor(f"{name}.lora_b", b)
        layer += 1
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
    return (
        _str(name)
        + _u32(len(dims) if n_dims is None else n_dims)
        + b"".join(map(_u64, dims))
        + _u32(ggml_type)
        + _u64(offset)
    )


def _gguf(
    kvs: Sequence[bytes],
    tensors: Sequence[bytes] = (),
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
    tail: bytes = b"\x00" * 64,
) -> bytes:
    return (
        b"GGUF"
        + _u32(version)
        + _u64(len(tensors) if n_tensors is None else n_tensors)
        + _u64(len(kvs) if n_kv is None else n_kv)
        + b"".join(kvs)
        + b"".join(tensors)
        + tail
    )


def _patch_last_tensor_offset(tiny: bytes, new_offset: int) -> bytes:
    """``tiny`` with the data offset of its last tensor info replaced (every tiny tensor is named ``*.weight``)."""
    pos = tiny.rindex(b".weight") + len(b".weight")
    n_dims = struct.unpack_from("<I", tiny, pos)[0]
    at = pos + 4 + 8 * n_dims + 4
    return tiny[:at] + _u64(new_offset) + tiny[at + 8 :]


def _patch_block_count(tiny: bytes, n: int) -> bytes:
    """``tiny`` (2 layers of tensors) with its ``llama.block_count`` (a u32) replaced (``tiny`` itself when it has
    no such key: a stand-in)."""
    key = _str(b"llama.block_count")
    if key not in tiny:
        return tiny
    at = tiny.index(key) + len(key)
    assert struct.unpack_from("<I", tiny, at)[0] == 4
    return tiny[: at + 4] + _u32(n) + tiny[at + 8 :]


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
        "huge-block-count": huge_block_count_gguf(2**32 - 1),
        "huge-block-count-u64": huge_block_count_gguf(2**63, value_type=10),
        "block-count-past-llama-cpp": huge_block_count_gguf(513),
        "block-count-beyond-tensors": _patch_block_count(tiny, 400),
        "huge-kv-count": _gguf([], n_kv=2**40),
        "counts-beyond-file": _gguf([arch], n_kv=50_000, n_tensors=50_000),
        "huge-key": _gguf([_u64(2**62)]),
        "huge-string": _gguf([_str(b"general.name") + _u32(8) + _u64(2**62)]),
        "string-longer-than-file": _gguf([_str(b"general.name") + _u32(8) + _u64(10_000) + b"abc"]),
        "huge-array": _gguf([_kv(b"a.b", 9, _u32(4) + _u64(2**60))]),
        "array-longer-than-file": _gguf([_kv(b"a.b", 9, _u32(10) + _u64(1_000_000))]),
        "huge-string-array": _gguf([_kv(b"tokenizer.ggml.tokens", 9, _u32(8) + _u64(2**40))]),
        "string-array-lies": _gguf(
            [_kv(b"tokenizer.ggml.tokens", 9, _u32(8) + _u64(3) + _str(b"a") + _str(b"b", 2**61))]
        ),
        # malformed values
        "bad-value-type": _gguf([_kv(b"a.b", 77, b"\x00" * 16)]),
        "bad-array-element-type": _gguf([_kv(b"a.b", 9, _u32(13) + _u64(2))]),
        "arrays-nested-too-deep": _gguf(
            [_kv(b"a.b", 9, _u32(9) + _u64(1) + _u32(9) + _u64(1) + _u32(9) + _u64(1) + _u32(0) + _u64(1) + b"\x01")]
        ),
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
        "tensor-duplicate-name": _gguf([arch], [_tensor(b"t", [8]), _tensor(b"t", [8], offset=32)], tail=b"\x00" * 128),
    }


def huge_block_count_gguf(block_count: int = 2**32 - 1, *, value_type: int = 4) -> bytes:
    """A ~224-byte GGUF whose header declares ``block_count`` layers (u32 by default) and has no tensors at all:
    a memory estimate that builds per-layer lists from the header allocates and loops ``block_count`` times."""
    fmt = {4: _u32, 10: _u64}[value_type]
    kvs = [
        _kv(b"general.architecture", 8, _str(b"llama")),
        _kv(b"llama.block_count", value_type, fmt(block_count)),
        _kv(b"llama.context_length", 4, _u32(2048)),
        _kv(b"llama.embedding_length", 4, _u32(64)),
        _kv(b"llama.attention.head_count", 4, _u32(2)),
    ]
    return _gguf(kvs, tail=b"")


def write_gguf_with_architecture(path: Path | str, architecture: str) -> Path:
    """A small GGUF whose header reads fine but whose architecture llama.cpp does not know (it refuses to load it
    with "unknown model architecture: '<architecture>'")."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("odd")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf_missing_tensor(path: Path | str, missing: str = "blk.1.ffn_down.weight") -> Path:
    """The tiny llama GGUF without one of its tensors: the header is well formed, llama.cpp refuses to load it
    ("missing tensor ...")."""
    return write_tiny_gguf(path, leave_out=(missing,))


# -- a tiny reranker -------------------------------------------------------------------------------------------------
#
# A BERT cross-encoder (pooling_type rank, a cls head) whose fixed weights are built, not trained, so that its score
# means something: a document that shares words with the query scores above one that shares none. How (d = 128,
# one head, two layers, feed-forward weights zero so each layer is attention + residual + LayerNorm):
#
# * every token's embedding is a row of an orthonormal basis of the zero-mean vectors (scaled to norm sqrt(d)), so
#   LayerNorm leaves it as it is and distinct tokens have dot product exactly 0; one more basis vector, f, is the
#   "feature" direction no token uses.
# * layer 0 counts copies: Q = x + x_CLS (every token also queries [CLS]), K = x, so a token attends equally to
#   [CLS] and to each copy of itself (query and document alike), nothing else; V carries only [CLS] (as f). A word
#   seen c times thus gets f/(1+c): less when it also appears in the other text. [SEP] does not match itself.
# * layer 1 averages: Q = K = 0 (uniform attention), and V reads each token's f share less what a word seen once has
#   (and zero for [CLS] and [SEP]), so [CLS] gains mu*f with mu = 0 without overlap and mu < 0 with it.
# * the head: score = tanh(beta * (f share of [CLS] without overlap - f share of [CLS])): 0 without overlap, more
#   the more of the pair's tokens are shared.
#
# tiny_reranker_scores() computes the same forward pass in numpy from the same weights.

RERANK_WORDS = (
    "apple banana cherry grape lemon mango orange peach pear plum cat dog fish bird horse mouse cow sheep goat lion "
    "red green blue black white yellow pink brown gray purple sky sun moon star rain snow wind cloud river sea the a "
    "is of and in on with to eat run swim fly sleep big small fast slow hot cold"
).split()
RERANK_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_RR_D = 128
_RR_GAMMA = 1.0
_RR_BETA = 10.0


def _tiny_reranker_weights(seed: int = 0) -> dict[str, np.ndarray]:
    d, gamma, beta = _RR_D, _RR_GAMMA, _RR_BETA
    n_vocab = len(RERANK_SPECIALS) + len(RERANK_WORDS)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d, n_vocab + 1))
    a -= a.mean(axis=0)  # every column zero-mean, so the orthonormal basis below is too
    basis, _ = np.linalg.qr(a)
    x = basis[:, :n_vocab].T * np.sqrt(d)  # token rows, norm sqrt(d), mutually orthogonal
    f = basis[:, n_vocab] * np.sqrt(d)
    cls, sep = x[2], x[3]
    every = x.sum(axis=0)  # every token row has dot product d with it
    words = every - cls - sep
    eye = np.eye(d)
    phi_cls = gamma / np.sqrt(1 + gamma**2)  # the f share of [CLS] (and [SEP]) after layer 0
    kappa = gamma / 2  # f share / own share of a word seen once: what layer 1 subtracts
    head = np.zeros((d, d))
    head[0] = -beta * f / d
    head_b = np.zeros(d)
    head_b[0] = beta * phi_cls
    out = np.zeros((1, d))
    out[0, 0] = 1.0
    return {
        "token_embd.weight": x,
        "q0": eye - np.outer(sep, sep) / d + np.outer(cls, every) / d,
        "k0": eye,
        "v0": gamma * np.outer(f, cls) / d,
        "q1": np.zeros((d, d)),
        "k1": np.zeros((d, d)),
        "v1": np.outer(f, f - kappa * words - (phi_cls * np.sqrt(1 + gamma**2)) * (cls + sep)) / d,
        "cls.weight": head,
        "cls.bias": head_b,
        "cls.output.weight": out,
    }


def write_tiny_reranker(path: Path | str, *, seed: int = 0, context_length: int = 512) -> Path:
    """A tiny BERT reranker GGUF (pooling_type rank, a cls head, a WordPiece vocabulary of RERANK_WORDS) with the
    built weights described above: it scores a query/document pair by how many tokens they share."""
    import gguf

    path = Path(path)
    d, n_ff = _RR_D, 16
    wts = _tiny_reranker_weights(seed)
    tokens = list(RERANK_SPECIALS) + ["\u2581" + word for word in RERANK_WORDS]
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_name("tiny-reranker")
    w.add_context_length(context_length)
    w.add_embedding_length(d)
    w.add_block_count(2)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(1)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["relevance"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(RERANK_SPECIALS) + [1] * len(RERANK_WORDS))
    w.add_token_type_count(2)
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_bos_token_id(2)  # [CLS]
    w.add_sep_token_id(3)
    w.add_mask_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_add_eos_token(False)

    def put(name: str, value: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))

    put("token_embd.weight", wts["token_embd.weight"])
    put("token_types.weight", np.zeros((2, d)))
    put("position_embd.weight", np.zeros((context_length, d)))
    put("token_embd_norm.weight", np.ones(d))
    put("token_embd_norm.bias", np.zeros(d))
    for i in range(2):
        put(f"blk.{i}.attn_q.weight", wts[f"q{i}"])
        put(f"blk.{i}.attn_k.weight", wts[f"k{i}"])
        put(f"blk.{i}.attn_v.weight", wts[f"v{i}"])
        put(f"blk.{i}.attn_output.weight", np.eye(d))
        put(f"blk.{i}.attn_output_norm.weight", np.ones(d))
        put(f"blk.{i}.attn_output_norm.bias", np.zeros(d))
        put(f"blk.{i}.ffn_up.weight", np.zeros((n_ff, d)))
        put(f"blk.{i}.ffn_down.weight", np.zeros((d, n_ff)))
        put(f"blk.{i}.layer_output_norm.weight", np.ones(d))
        put(f"blk.{i}.layer_output_norm.bias", np.zeros(d))
    for name in ("cls.weight", "cls.bias", "cls.output.weight"):
        put(name, wts[name])
    put("cls.output.bias", np.zeros(1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_reranker_ids(text: str) -> list[int]:
    """The WordPiece ids of ``text`` in the tiny reranker's vocabulary (lower-case words split on spaces; a word it
    does not have is [UNK])."""
    index = {word: i + len(RERANK_SPECIALS) for i, word in enumerate(RERANK_WORDS)}
    return [index.get(word, 1) for word in text.lower().split()]


def tiny_reranker_scores(query: str, documents: Sequence[str], *, seed: int = 0) -> list[float]:
    """The tiny reranker's score for each (query, document) pair, computed in numpy from the same weights:
    [CLS] query [SEP] document, as llama.cpp's rerank prompt is for a vocabulary that adds BOS and SEP, not EOS."""
    wts = _tiny_reranker_weights(seed)
    d = _RR_D

    def norm(h: np.ndarray) -> np.ndarray:
        h = h - h.mean(axis=-1, keepdims=True)
        return h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + 1e-12)

    scores = []
    for doc in documents:
        ids = [2] + tiny_reranker_ids(query) + [3] + tiny_reranker_ids(doc)
        h = norm(wts["token_embd.weight"][ids])
        for i in range(2):
            q, k, v = h @ wts[f"q{i}"].T, h @ wts[f"k{i}"].T, h @ wts[f"v{i}"].T
            s = q @ k.T / np.sqrt(d)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            h = norm(norm(h + p @ v))  # attention, residual, norm; zero feed-forward, residual, norm
        hidden = np.tanh(wts["cls.weight"] @ h[0] + wts["cls.bias"])
        scores.append(float((wts["cls.output.weight"] @ hidden)[0]))
    return scores
