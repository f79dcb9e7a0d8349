"""Digests: only ``sha256:<64 lowercase hex>``, as a validated value type."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from errors import InvalidDigest

_HEX = re.compile(r"[0-9a-f]{64}")
_LOOSE = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


@dataclass(frozen=True)
class Digest:
    hex: str

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or not _HEX.fullmatch(self.hex):
            raise InvalidDigest(str(self.hex))

    @classmethod
    def parse(cls, raw: str) -> Digest:
        """Strict form: ``sha256:`` followed by 64 lowercase hex characters."""
        if not isinstance(raw, str) or not raw.startswith("sha256:"):
            raise InvalidDigest(str(raw))
        return cls(raw[len("sha256:") :])

    @classmethod
    def parse_param(cls, raw: str) -> Digest:
        """The blob endpoint's form: ``sha256:`` or ``sha256-`` plus 64 hex (Ollama accepts either case there).

        Upper-case hex is rejected: the digest a client names must be the one we compute and store.
        """
        if not isinstance(raw, str):
            raise InvalidDigest(str(raw))
        m = _LOOSE.fullmatch(raw)
        if not m or not _HEX.fullmatch(m.group(1)):
            raise InvalidDigest(raw)
        return cls(m.group(1))

    @classmethod
    def from_filename(cls, name: str) -> Digest | None:
        """``sha256-<hex>`` -> Digest; anything else (temp or partial files) -> None."""
        if name.startswith("sha256-") and _HEX.fullmatch(name[7:]):
            return cls(name[7:])
        return None

    @classmethod
    def of_bytes(cls, data: bytes) -> Digest:
        return cls(hashlib.sha256(data).hexdigest())

    @property
    def filename(self) -> str:
        return f"sha256-{self.hex}"

    @property
    def short(self) -> str:
        return self.hex[:12]

    def __str__(self) -> str:
        return f"sha256:{self.hex}"
