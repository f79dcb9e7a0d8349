"""A bounded GGUF header reader for untrusted files (stdlib only).

Every count and length in the header is checked against fixed limits *and* against the bytes left in the file
before anything is allocated, so a hostile header cannot make the daemon allocate or loop without bound. Any
problem is an :class:`InvalidGGUF` with a message that says what was wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from registry.errors import InvalidGGUF

MAX_TENSORS = 100_000
MAX_KVS = 100_000
MAX_STRING = 16 * 1024 * 1024
MAX_ARRAY = 64 * 1024 * 1024
MAX_DIMS = 8
MAX_NESTING = 2
DEFAULT_ALIGNMENT = 32

# value type id -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
            7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9

# ggml type id -> (name, block size in elements, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int  # relative to the data section
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFInfo:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int
    file_size: int
    array_lengths: dict[str, int] = field(default_factory=dict)

    def _arch_key(self, suffix: str) -> Any:
        return self.metadata.get(f"{self.architecture}.{suffix}")

    @property
    def architecture(self) -> str:
        v = self.metadata.get("general.architecture")
        return v if isinstance(v, str) else ""

    @property
    def general_type(self) -> str:
        v = self.metadata.get("general.type")
        return v if isinstance(v, str) else ""

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def file_type_name(self) -> str:
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int) and not isinstance(ft, bool):
            return FILE_TYPES.get(ft, "unknown")
        # no file type recorded: take the most common tensor type
        if not self.tensors:
            return "unknown"
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.n_bytes
        return max(counts, key=lambda k: counts[k])

    def _int(self, suffix: str) -> int:
        v = self._arch_key(suffix)
        if isinstance(v, list):
            v = max((x for x in v if isinstance(x, int)), default=0)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    @property
    def context_length(self) -> int:
        return self._int("context_length")

    @property
    def embedding_length(self) -> int:
        return self._int("embedding_length")

    @property
    def block_count(self) -> int:
        return self._int("block_count")

    @property
    def head_count(self) -> int:
        return self._int("attention.head_count")

    @property
    def head_count_kv(self) -> int:
        return self._int("attention.head_count_kv") or self.head_count

    @property
    def has_pooling(self) -> bool:
        return f"{self.architecture}.pooling_type" in self.metadata

    @property
    def chat_template(self) -> str | None:
        v = self.metadata.get("tokenizer.chat_template")
        return v if isinstance(v, str) else None

    def array_length(self, key: str) -> int:
        if key in self.array_lengths:
            return self.array_lengths[key]
        v = self.metadata.get(key)
        return len(v) if isinstance(v, list) else 0


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0

    def left(self) -> int:
        return self.size - self.pos

    def read(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise InvalidGGUF(f"truncated GGUF: the file ends inside {what} (needs {n} bytes at offset {self.pos}, "
                              f"{max(self.left(), 0)} left)")
        data = self.f.read(n)
        if len(data) != n:
            raise InvalidGGUF(f"truncated GGUF: the file ends inside {what}")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise InvalidGGUF(f"truncated GGUF: the file ends inside {what}")
        self.f.seek(n, 1)
        self.pos += n

    def u32(self, what: str) -> int:
        return int(struct.unpack("<I", self.read(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack("<Q", self.read(8, what))[0])

    def string(self, what: str, *, keep: bool = True) -> str | None:
        n = self.u64(f"the length of {what}")
        if n > MAX_STRING:
            raise InvalidGGUF(f"GGUF {what} claims {n} bytes, more than the {MAX_STRING} allowed")
        if n > self.left():
            raise InvalidGGUF(f"truncated GGUF: {what} claims {n} bytes but only {self.left()} remain")
        if not keep:
            self.skip(n, what)
            return None
        return self.read(n, what).decode("utf-8", errors="replace")


def _value(r: _Reader, vtype: int, key: str, depth: int, keep: bool) -> tuple[Any, int | None]:
    """Read one value; returns (value, array length or None)."""
    if vtype in _SCALARS:
        fmt, size = _SCALARS[vtype]
        return struct.unpack("<" + fmt, r.read(size, f'the value of "{key}"'))[0], None
    if vtype == STRING:
        return r.string(f'the value of "{key}"', keep=keep), None
    if vtype == ARRAY:
        if depth >= MAX_NESTING:
            raise InvalidGGUF(f'GGUF key "{key}" nests arrays more than {MAX_NESTING} deep')
        etype = r.u32(f'the element type of "{key}"')
        count = r.u64(f'the length of "{key}"')
        if count > MAX_ARRAY:
            raise InvalidGGUF(f'GGUF array "{key}" claims {count} elements, more than the {MAX_ARRAY} allowed')
        if etype in _SCALARS:
            fmt, size = _SCALARS[etype]
            if count * size > r.left():
                raise InvalidGGUF(f'truncated GGUF: array "{key}" claims {count} elements but the file is too short')
            if not keep:
                r.skip(count * size, f'array "{key}"')
                return [], count
            data = r.read(count * size, f'array "{key}"')
            return list(struct.unpack(f"<{count}{fmt}", data)), count
        if etype in (STRING, ARRAY):
            min_size = 8 if etype == STRING else 12
            if count * min_size > r.left():
                raise InvalidGGUF(f'truncated GGUF: array "{key}" claims {count} elements but the file is too short')
            items = [_value(r, etype, key, depth + 1, keep)[0] for _ in range(count)]
            return (items if keep else []), count
        raise InvalidGGUF(f'GGUF array "{key}" has an unknown element type {etype}')
    raise InvalidGGUF(f'GGUF key "{key}" has an unknown value type {vtype}')


def read_gguf_header(f: BinaryIO, file_size: int, *, keep_arrays: bool = True,
                     max_array_keep: int | None = None) -> GGUFInfo:
    """Parse and check a GGUF header. Arrays longer than ``max_array_keep`` are skipped (their length kept)."""
    r = _Reader(f, file_size)
    if file_size < 4 or r.read(4, "the magic number") != b"GGUF":
        raise InvalidGGUF("not a GGUF file (the first bytes are not 'GGUF')")
    version = r.u32("the version")
    if version not in (2, 3):
        raise InvalidGGUF(f"unsupported GGUF version {version} (corral reads versions 2 and 3)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the key count")
    if n_tensors > MAX_TENSORS:
        raise InvalidGGUF(f"GGUF header claims {n_tensors} tensors, more than the {MAX_TENSORS} allowed")
    if n_kv > MAX_KVS:
        raise InvalidGGUF(f"GGUF header claims {n_kv} metadata keys, more than the {MAX_KVS} allowed")
    if n_kv * 13 + n_tensors * 24 > r.left():
        raise InvalidGGUF("truncated GGUF: the header claims more keys and tensors than the file can hold")

    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for i in range(n_kv):
        key_len = r.u64(f"the length of key #{i}")
        if key_len > 65535:
            raise InvalidGGUF(f"GGUF key #{i} claims {key_len} bytes, more than the 65535 allowed")
        raw_key = r.read(key_len, f"key #{i}")
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidGGUF(f"GGUF key #{i} is not valid UTF-8") from None
        vtype = r.u32(f'the type of "{key}"')
        if vtype == ARRAY:
            # peek at the length to decide whether to keep it
            pos = f.tell()
            r.u32(f'the element type of "{key}"')
            count = r.u64(f'the length of "{key}"')
            f.seek(pos)
            r.pos -= 12
            keep = keep_arrays and (max_array_keep is None or count <= max_array_keep)
            value, n = _value(r, vtype, key, 0, keep)
            lengths[key] = n or 0
        else:
            value, _n = _value(r, vtype, key, 0, True)
        if key in metadata:
            raise InvalidGGUF(f'GGUF key "{key}" appears twice')
        metadata[key] = value

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment > 1 << 20 \
            or alignment & (alignment - 1):
        raise InvalidGGUF(f"GGUF general.alignment {alignment!r} is not a power of two")

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}") or ""
        if len(name) > 1024:
            raise InvalidGGUF(f"GGUF tensor #{i} has a name longer than 1024 bytes")
        if name in names:
            raise InvalidGGUF(f'GGUF tensor "{name}" appears twice')
        names.add(name)
        n_dims = r.u32(f'the dimension count of tensor "{name}"')
        if not 1 <= n_dims <= MAX_DIMS:
            raise InvalidGGUF(f'GGUF tensor "{name}" has {n_dims} dimensions (1 to {MAX_DIMS} allowed)')
        shape = tuple(r.u64(f'the shape of tensor "{name}"') for _ in range(n_dims))
        ttype = r.u32(f'the type of tensor "{name}"')
        offset = r.u64(f'the offset of tensor "{name}"')
        if ttype not in GGML_TYPES:
            raise InvalidGGUF(f'GGUF tensor "{name}" has an unknown type {ttype}')
        type_name, block, block_bytes = GGML_TYPES[ttype]
        n_el = 1
        for d in shape:
            n_el *= d
            if n_el > 1 << 50:
                raise InvalidGGUF(f'GGUF tensor "{name}" claims an absurd shape {shape}')
        if shape[0] % block:
            raise InvalidGGUF(f'GGUF tensor "{name}" has {shape[0]} columns, not a multiple of {type_name} blocks '
                              f"of {block}")
        if offset % alignment:
            raise InvalidGGUF(f'GGUF tensor "{name}" starts at offset {offset}, not aligned to {alignment}')
        infos.append(TensorInfo(name, shape, ttype, type_name, offset, n_el // block * block_bytes))

    data_offset = (r.pos + alignment - 1) // alignment * alignment
    for t in infos:
        end = data_offset + t.offset + t.n_bytes
        if end > file_size:
            raise InvalidGGUF(f'truncated GGUF: tensor "{t.name}" ends at byte {end} but the file has {file_size} '
                              "bytes")
    return GGUFInfo(version=version, metadata=metadata, tensors=tuple(infos), data_offset=data_offset,
                    file_size=file_size, array_lengths=lengths)


def read_gguf_file(path: str | Path, **kw: Any) -> GGUFInfo:
    p = Path(path)
    with open(p, "rb") as f:
        return read_gguf_header(f, p.stat().st_size, **kw)


def format_parameter_count(n: int) -> str:
    """Ollama's human form: 8B, 8.0B, 134.52M, 1M, 12K."""
    if n >= 1_000_000_000:
        v = n / 1e9
        return f"{v:.0f}B" if n % 1_000_000_000 == 0 else f"{v:.1f}B"
    if n >= 1_000_000:
        v = n / 1e6
        return f"{v:.0f}M" if n % 1_000_000 == 0 else f"{v:.2f}M"
    if n >= 1_000:
        return f"{n // 1000}K"
    return str(n)


def model_info(info: GGUFInfo, verbose: bool) -> dict[str, Any]:
    """``/api/show``'s model_info: every key but general.name and the chat template; long arrays as [] unless
    verbose."""
    out: dict[str, Any] = {}
    for key, value in info.metadata.items():
        if key in ("general.name", "tokenizer.chat_template"):
            continue
        if isinstance(value, list) and not verbose and info.array_length(key) > 5:
            value = []
        out[key] = value
    out["general.parameter_count"] = info.parameter_count
    return dict(sorted(out.items()))
