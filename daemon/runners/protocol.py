"""Frames between the daemon and a runner: a 4-byte big-endian length, then UTF-8 JSON."""

from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

MAX_FRAME = 256 * 1024 * 1024
HEADER = struct.Struct(">I")


def encode(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(data)) + data


def read_frame(f: BinaryIO) -> dict[str, Any] | None:
    """Blocking read of one frame; None at EOF."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes is too large")
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)

# Ollama's accepted names (fs/ggml ParseFileType; upper-cased first) -> llama.cpp's LLAMA_FTYPE: the TYPE argument of
# the quantize worker (daemon/llama/quantize.py), checked by the daemon (daemon/runners/quantize.py)
QUANT_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q4_K": 15, "BF16": 32}
