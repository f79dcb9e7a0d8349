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
