"""Vision test fixtures: a tiny random-weight projector (mmproj) GGUF that llama.cpp's libmtmd loads for SmolLM2, and
small deterministic PNG images written without an imaging library.

The projector is LLaVA-style (``clip.projector_type`` ``mlp``): a 2-layer ViT (only its first layer runs: LLaVA
reads the second-to-last layer) over 112 x 112 images in 14 x 14 patches, then a two-layer MLP up to SmolLM2's
embedding width (576). One image becomes 64 embeddings in the text model. docs/vision.md has the full layout.
"""

from __future__ import annotations

import os
import random
import struct
import zlib
from pathlib import Path

import numpy as np

from tests.models import cache_dir

# Bump when the layout or the weights change: the cached file is named after it, so a new layout is rebuilt.
PROJECTOR_VERSION = 1
TEXT_EMBD = 576  # SmolLM2-135M's embedding width: the projector's output width must match it
IMAGE_SIZE = 112
PATCH_SIZE = 14
N_EMBD = 64
N_FF = 128
N_HEAD = 4
N_LAYER = 2
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 64 embeddings per image
_SEED = 1234


def projector_path() -> Path:
    """The test projector GGUF, written once (deterministically) into the test cache and reused."""
    path = cache_dir() / f"corral-test-mmproj-v{PROJECTOR_VERSION}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # write then rename: two test processes building it at once never see a half-written file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write_projector(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def write_projector(path: Path | str, *, seed: int = _SEED, text_embd: int = TEXT_EMBD) -> Path:
    """Write the LLaVA-style (``mlp``) test projector with fixed random weights to ``path``."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    n_pos = N_IMAGE_TOKENS
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("corral-test-mmproj")
    w.add_type("mmproj")  # what convert_hf_to_gguf.py writes for a projector: how corral recognises one
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", N_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", N_FF)
    w.add_uint32("clip.vision.block_count", N_LAYER)
    w.add_uint32("clip.vision.projection_dim", text_embd)
    w.add_uint32("clip.vision.attention.head_count", N_HEAD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def rand(name: str, *shape: int, scale: float) -> None:
        # numpy shapes are ggml's ne reversed: (rows = out, cols = in) for a matrix
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def const(name: str, value: float, *shape: int) -> None:
        w.add_tensor(name, np.full(shape, value, np.float32))

    # the patch embedding is a conv with kernel = stride = patch: ne [14, 14, 3, n_embd]
    rand("v.patch_embd.weight", N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=0.05)
    const("v.patch_embd.bias", 0.0, N_EMBD)
    rand("v.position_embd.weight", n_pos, N_EMBD, scale=0.02)
    for i in range(N_LAYER):
        p = f"v.blk.{i}"
        const(f"{p}.ln1.weight", 1.0, N_EMBD)
        const(f"{p}.ln1.bias", 0.0, N_EMBD)
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            rand(f"{p}.{part}.weight", N_EMBD, N_EMBD, scale=N_EMBD**-0.5)
            const(f"{p}.{part}.bias", 0.0, N_EMBD)
        const(f"{p}.ln2.weight", 1.0, N_EMBD)
        const(f"{p}.ln2.bias", 0.0, N_EMBD)
        # up is (n_ff x n_embd), down (n_embd x n_ff): clip.cpp swaps them back only when down's ne[0] == n_embd
        rand(f"{p}.ffn_up.weight", N_FF, N_EMBD, scale=N_EMBD**-0.5)
        const(f"{p}.ffn_up.bias", 0.0, N_FF)
        rand(f"{p}.ffn_down.weight", N_EMBD, N_FF, scale=N_FF**-0.5)
        const(f"{p}.ffn_down.bias", 0.0, N_EMBD)
    # the LLaVA MLP: mm.0 (n_embd -> text width), GELU, mm.2 (text width -> text width). Its output scale is set
    # so that the images dominate SmolLM2's first tokens: at a tenth of it, SmolLM2 mostly ignores the random image
    # embeddings and different images give the same greedy text.
    rand("mm.0.weight", text_embd, N_EMBD, scale=N_EMBD**-0.5)
    const("mm.0.bias", 0.0, text_embd)
    rand("mm.2.weight", text_embd, text_embd, scale=3.0 * text_embd**-0.5)
    const("mm.2.bias", 0.0, text_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (``width * height * 3`` bytes, rows top to bottom)."""
    assert len(rgb) == width * height * 3
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))  # filter 0 on each row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw, 9))
        + _png_chunk(b"IEND", b"")
    )


def image_bytes(seed: int, size: int = 64) -> bytes:
    """A small deterministic PNG: a 4 x 4 grid of colours drawn from ``seed`` (different seeds: clearly different
    pictures)."""
    rnd = random.Random(seed)
    cells = [[bytes(rnd.randrange(256) for _ in range(3)) for _ in range(4)] for _ in range(4)]
    cell = max(1, size // 4)
    rows = []
    for y in range(size):
        row = cells[min(y // cell, 3)]
        rows.append(b"".join(row[min(x // cell, 3)] for x in range(size)))
    return png_bytes(size, size, b"".join(rows))
