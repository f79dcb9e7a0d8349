"""A bounded GGUF header reader for untrusted files (stdlib only).

Every count and length in the header is checked against fixed limits *and* against the bytes left in the file
before anything is allocated, so a hostile header cannot make the daemon allocate or loop without bound. Any
problem is an :class:`InvalidGGUF` with a message that says what was wrong.

The reader only reads forward (it seeks only to skip, and only when the file is seekable), so it also works on a
pipe or an upload stream as long as the caller knows the total size. It reads the header through its own buffer,
so the position of ``f`` afterwards is unspecified.

Format (little-endian): ``b"GGUF"``, u32 version (2 or 3), u64 tensor count, u64 key count, the key/value pairs
(key = u64 length + UTF-8 bytes, u32 value type, value), the tensor infos (name string, u32 n_dims, n_dims x u64
dims, u32 ggml type, u64 offset relative to the data section), padding to ``general.alignment`` (default 32),
then the tensor data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from errors import InvalidGGUF

MAX_TENSORS = 100_000
MAX_KVS = 100_000
MAX_KEY = 65_535
MAX_STRING = 16 * 1024 * 1024
MAX_ARRAY = 64 * 1024 * 1024
MAX_KEPT_ELEMENTS = 16 * 1024 * 1024  # array elements kept in memory across the whole header; the rest: length only
MAX_TENSOR_NAME = 1024
MAX_DIMS = 8
MAX_DIM = 1 << 50
MAX_NESTING = 2  # an array of arrays is fine, an array of arrays of arrays is not
MAX_ALIGNMENT = 1 << 20
# llama.cpp's LLAMA_MAX_LAYERS: it keeps per-layer hyperparameters in arrays of this size and refuses a model that
# declares more layers ("n > N_MAX: ... for key <arch>.feed_forward_length"), so such a file can never run
MAX_LAYERS = 512
DEFAULT_ALIGNMENT = 32
_CHUNK = 1 << 16

# value type id -> (struct format, size); 8 = string, 9 = array
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
STRING, ARRAY = 8, 9
_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ggml type id -> (name, block size in elements, bytes per block), from ggml's type traits. (Q8_1 is 36 bytes in
# ggml: two halves and 32 int8; older gguf-py tables say 40.) Ids 4 and 5 (Q4_2, Q4_3) and 31-33, 36-38 are gone.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

# llama.cpp's LLAMA_FTYPE (general.file_type) -> the name Ollama shows
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4",
    39: "NVFP4",
    40: "Q1_0",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the innermost (contiguous) dimension
    ggml_type: int
    type_name: str
    offset: int  # relative to the data section (GGUFInfo.data_offset)
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFInfo:
    """A checked GGUF header.

    ``metadata`` holds every key; arrays are lists, except that an array that was not kept (``keep_arrays=False``,
    longer than ``max_array_keep``, or past the overall element budget) is an empty list and its real length is
    in ``array_lengths`` (which records the length of every array, kept or not).
    """

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # absolute offset of the tensor data section
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
        """The sum of all tensor elements (what Ollama reports as the parameter count)."""
        return sum(t.n_elements for t in self.tensors)

    @property
    def file_type_name(self) -> str:
        """``general.file_type`` as a name (``Q4_K_M``); "unknown" for an id llama.cpp does not define. Without
        the key, the tensor type that holds the most bytes."""
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int) and not isinstance(ft, bool):
            return FILE_TYPES.get(ft, "unknown")
        if not self.tensors:
            return "unknown"
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.n_bytes
        return max(counts, key=lambda k: counts[k])

    def _int(self, suffix: str) -> int:
        v = self._arch_key(suffix)
        if isinstance(v, list):  # per-layer values (e.g. OpenELM head counts): the largest
            v = max((x for x in v if isinstance(x, int) and not isinstance(x, bool)), default=0)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0

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
        """``<arch>.pooling_type`` is present: an embedding model (Ollama's ``embedding`` capability)."""
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
    """Forward-only reads through a private buffer, each checked against the declared file size first."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0  # absolute offset of the next unread byte
        self.buf = b""
        self.bpos = 0
        try:
            self.seekable = bool(f.seekable())
        except (AttributeError, OSError, ValueError):
            self.seekable = False

    def left(self) -> int:
        return self.size - self.pos

    def _truncated(self, n: int, what: str) -> InvalidGGUF:
        return InvalidGGUF(
            f"truncated GGUF: the header ends before {what} (needs {n} bytes at offset {self.pos}, "
            f"the file has {max(self.left(), 0)} left)"
        )

    def _fill(self, n: int, what: str) -> None:
        """Make sure ``n`` unread bytes are buffered (n has been checked against the bytes left)."""
        have = len(self.buf) - self.bpos
        if have >= n:
            return
        parts = [self.buf[self.bpos :]]
        # never read past the declared size; read ahead by a chunk to make small reads cheap
        want = min(max(n - have, _CHUNK), self.size - self.pos - have)
        while want > 0 and have < n:
            try:
                data = self.f.read(want)
            except OSError as exc:
                raise InvalidGGUF(f"could not read the GGUF header: {exc}") from None
            if not data:
                raise InvalidGGUF(
                    f"truncated GGUF: the file is shorter than its declared size {self.size} "
                    f"(it ends at offset {self.pos + have}, inside {what})"
                )
            parts.append(data)
            have += len(data)
            want -= len(data)
        if have < n:
            raise self._truncated(n, what)
        self.buf = b"".join(parts)
        self.bpos = 0

    def read(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise self._truncated(n, what)
        self._fill(n, what)
        out = self.buf[self.bpos : self.bpos + n]
        self.bpos += n
        self.pos += n
        return out

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise self._truncated(n, what)
        have = len(self.buf) - self.bpos
        if n <= have:
            self.bpos += n
            self.pos += n
            return
        rest = n - have
        self.buf, self.bpos = b"", 0
        self.pos += have
        if self.seekable:
            try:
                self.f.seek(rest, 1)
                self.pos += rest
                return
            except (OSError, ValueError):
                self.seekable = False
        while rest:
            data = self.f.read(min(rest, 1 << 20))
            if not data:
                raise InvalidGGUF(
                    f"truncated GGUF: the file is shorter than its declared size {self.size} "
                    f"(it ends at offset {self.pos}, inside {what})"
                )
            rest -= len(data)
            self.pos += len(data)

    def _unpack(self, fmt: struct.Struct, what: str) -> int:
        size = fmt.size
        if self.left() < size:
            raise self._truncated(size, what)
        self._fill(size, what)
        v: int = fmt.unpack_from(self.buf, self.bpos)[0]
        self.bpos += size
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self._unpack(_U32, what)

    def u64(self, what: str) -> int:
        return self._unpack(_U64, what)

    def string(self, what: str, *, keep: bool = True) -> str | None:
        n = self.u64(f"the length of {what}")
        if n > MAX_STRING:
            raise InvalidGGUF(f"invalid GGUF: {what} claims {n} bytes, more than the {MAX_STRING} allowed")
        if n > self.left():
            raise InvalidGGUF(f"truncated GGUF: {what} claims {n} bytes but only {self.left()} remain in the file")
        if not keep:
            self.skip(n, what)
            return None
        return self.read(n, what).decode("utf-8", errors="replace")

    def strings(self, count: int, what: str, keep: bool) -> list[str]:
        """``count`` strings in a row (token lists: tens of thousands), with the checks of :meth:`string`."""
        out: list[str] = []
        append = out.append
        unpack = _U64.unpack_from
        for i in range(count):
            # fast path: length and body already buffered
            if len(self.buf) - self.bpos >= 8:
                n = unpack(self.buf, self.bpos)[0]
                if n <= MAX_STRING and 8 + n <= self.left() and len(self.buf) - self.bpos >= 8 + n:
                    start = self.bpos + 8
                    if keep:
                        append(self.buf[start : start + n].decode("utf-8", errors="replace"))
                    self.bpos = start + n
                    self.pos += 8 + n
                    continue
            s = self.string(f"element {i} of {what}", keep=keep)
            if keep:
                append(s or "")
        return out


class _Budget:
    def __init__(self) -> None:
        self.kept = 0


def _value(r: _Reader, vtype: int, key: str, depth: int, keep: bool, budget: _Budget) -> tuple[Any, int | None]:
    """Read one value; returns (value, array length or None). A skipped array is []."""
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        fmt, size = scalar
        return struct.unpack("<" + fmt, r.read(size, f'the value of "{key}"'))[0], None
    if vtype == STRING:
        return r.string(f'the value of "{key}"'), None
    if vtype != ARRAY:
        raise InvalidGGUF(f'GGUF key "{key}" has an unknown value type {vtype}')
    if depth >= MAX_NESTING:
        raise InvalidGGUF(f'GGUF key "{key}" nests arrays more than {MAX_NESTING} deep')
    etype = r.u32(f'the element type of "{key}"')
    count = r.u64(f'the length of "{key}"')
    if count > MAX_ARRAY:
        raise InvalidGGUF(f'GGUF array "{key}" claims {count} elements, more than the {MAX_ARRAY} allowed')
    scalar = _SCALARS.get(etype)
    min_size = scalar[1] if scalar else 8 if etype == STRING else 12 if etype == ARRAY else None
    if min_size is None:
        raise InvalidGGUF(f'GGUF array "{key}" has an unknown element type {etype}')
    if count * min_size > r.left():
        raise InvalidGGUF(
            f'truncated GGUF: array "{key}" claims {count} elements but only {r.left()} bytes remain in the file'
        )
    keep = keep and budget.kept + count <= MAX_KEPT_ELEMENTS
    if keep:
        budget.kept += count
    if scalar is not None:
        fmt, size = scalar
        if not keep:
            r.skip(count * size, f'array "{key}"')
            return [], count
        data = r.read(count * size, f'array "{key}"')
        return list(struct.unpack(f"<{count}{fmt}", data)), count
    if etype == STRING:
        return r.strings(count, f'array "{key}"', keep), count
    items = [_value(r, ARRAY, key, depth + 1, keep, budget)[0] for _ in range(count)]
    return (items if keep else []), count


def read_gguf_header(
    f: BinaryIO, file_size: int, *, keep_arrays: bool = True, max_array_keep: int | None = None
) -> GGUFInfo:
    """Parse and check the header of a GGUF file of ``file_size`` bytes read from ``f`` (at its start).

    Top-level arrays longer than ``max_array_keep`` (or all arrays, with ``keep_arrays=False``) are skipped and
    stored as ``[]``, their length in ``array_lengths``. Raises :class:`InvalidGGUF` for anything that is not a
    well-formed GGUF within sane limits, including tensor data that would lie outside the file.
    """
    if file_size < 0:
        raise InvalidGGUF("not a GGUF file (negative size)")
    r = _Reader(f, file_size)
    if file_size < 4 or r.read(4, "the magic number") != b"GGUF":
        raise InvalidGGUF("not a GGUF file (the first bytes are not 'GGUF')")
    version = r.u32("the version")
    if version not in (2, 3):
        if version in (2 << 24, 3 << 24):
            raise InvalidGGUF("unsupported GGUF: big-endian files are not supported")
        raise InvalidGGUF(f"unsupported GGUF version {version} (corral reads versions 2 and 3)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the key count")
    if n_tensors > MAX_TENSORS:
        raise InvalidGGUF(f"GGUF header claims {n_tensors} tensors, more than the {MAX_TENSORS} allowed")
    if n_kv > MAX_KVS:
        raise InvalidGGUF(f"GGUF header claims {n_kv} metadata keys, more than the {MAX_KVS} allowed")
    # smallest key/value: 8 (key length) + 4 (type) + 1 (u8); smallest tensor info: 8 + 4 + 8 + 4 + 8
    if n_kv * 13 + n_tensors * 32 > r.left():
        raise InvalidGGUF(
            f"truncated GGUF: the header claims {n_kv} keys and {n_tensors} tensors, more than the "
            f"{file_size} byte file can hold"
        )

    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    budget = _Budget()
    for i in range(n_kv):
        key_len = r.u64(f"the length of key #{i}")
        if key_len > MAX_KEY:
            raise InvalidGGUF(f"GGUF key #{i} claims {key_len} bytes, more than the {MAX_KEY} allowed")
        raw_key = r.read(key_len, f"key #{i}")
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidGGUF(f"GGUF key #{i} is not valid UTF-8") from None
        if key in metadata:
            raise InvalidGGUF(f'GGUF key "{key}" appears twice')
        vtype = r.u32(f'the type of "{key}"')
        keep = keep_arrays
        if vtype == ARRAY and keep and max_array_keep is not None:
            # peek at the length (element type u32, then count u64) to decide whether to keep the array
            if r.left() >= 12:
                r._fill(12, f'the header of array "{key}"')
                count = _U64.unpack_from(r.buf, r.bpos + 4)[0]
                keep = count <= max_array_keep
        value, n = _value(r, vtype, key, 0, keep, budget)
        if n is not None:
            lengths[key] = n
        metadata[key] = value

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or not 0 < alignment <= MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        raise InvalidGGUF(f"GGUF general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")

    infos: list[TensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}") or ""
        if len(name) > MAX_TENSOR_NAME:
            raise InvalidGGUF(f"GGUF tensor #{i} has a name longer than {MAX_TENSOR_NAME} bytes")
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
            raise InvalidGGUF(f'GGUF tensor "{name}" has an unknown ggml type {ttype}')
        type_name, block, block_bytes = GGML_TYPES[ttype]
        n_el = 1
        for d in shape:
            if d > MAX_DIM:
                raise InvalidGGUF(f'GGUF tensor "{name}" claims an absurd shape {list(shape)}')
            n_el *= d
        if n_el > MAX_DIM:
            raise InvalidGGUF(f'GGUF tensor "{name}" claims an absurd shape {list(shape)}')
        if shape[0] % block:
            raise InvalidGGUF(
                f'GGUF tensor "{name}" has {shape[0]} columns, not a multiple of the {type_name} block size {block}'
            )
        if offset % alignment:
            raise InvalidGGUF(f'GGUF tensor "{name}" starts at offset {offset}, not aligned to {alignment}')
        infos.append(TensorInfo(name, shape, ttype, type_name, offset, n_el // block * block_bytes))

    _check_block_count(metadata, infos)

    data_offset = (r.pos + alignment - 1) // alignment * alignment
    for t in infos:
        end = data_offset + t.offset + t.n_bytes
        if end > file_size:
            raise InvalidGGUF(
                f'truncated GGUF: tensor "{t.name}" ends at byte {end} but the file has {file_size} bytes'
            )
    return GGUFInfo(
        version=version,
        metadata=metadata,
        tensors=tuple(infos),
        data_offset=data_offset,
        file_size=file_size,
        array_lengths=lengths,
    )


def _check_block_count(metadata: dict[str, Any], tensors: list[TensorInfo]) -> None:
    """``<arch>.block_count`` is a layer count llama.cpp can hold (everything that sizes per-layer work, the memory
    estimate and the split over GPUs, is bounded by it) and, in a model whose tensors are numbered by layer
    (``blk.N.*``), not far beyond the layers those tensors describe (llama.cpp would refuse the file anyway, with a
    missing tensor). An adapter may cover only some layers, so it is not held to the second rule."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return
    key = f"{arch}.block_count"
    if key not in metadata:
        return
    n = metadata[key]
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidGGUF(f'invalid GGUF: "{key}" must be an integer layer count, got {type(n).__name__}')
    if not 0 <= n <= MAX_LAYERS:
        raise InvalidGGUF(f'invalid GGUF: "{key}" declares {n} layers; llama.cpp supports at most {MAX_LAYERS}')
    if metadata.get("general.type") == "adapter":
        return
    present = 0
    for t in tensors:
        if t.name.startswith("blk."):
            index = t.name[4:].partition(".")[0]
            if index.isdigit() and len(index) <= 4:
                present = max(present, int(index) + 1)
    if present and n > 2 * present:
        raise InvalidGGUF(f'invalid GGUF: "{key}" declares {n} layers but the tensors describe {present}')


def read_gguf_file(path: str | Path, *, keep_arrays: bool = True, max_array_keep: int | None = None) -> GGUFInfo:
    """:func:`read_gguf_header` on a file on disk."""
    p = Path(path)
    with open(p, "rb") as f:
        return read_gguf_header(f, os.fstat(f.fileno()).st_size, keep_arrays=keep_arrays, max_array_keep=max_array_keep)


def format_parameter_count(n: int) -> str:
    """Ollama's ``format.HumanNumber``: 8B, 8.0B, 134.52M, 1M, 12K, 999."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.0f}B" if n % 1_000_000_000 == 0 else f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.0f}M" if n % 1_000_000 == 0 else f"{n / 1e6:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def model_info(info: GGUFInfo, verbose: bool) -> dict[str, Any]:
    """``/api/show``'s model_info: every key but general.name and tokenizer.chat_template, plus
    general.parameter_count; arrays longer than 5 become [] unless verbose (for verbose output, read the header
    with every array kept)."""
    return _kv_view(info, verbose, drop=("general.name", "tokenizer.chat_template"))


def projector_info(info: GGUFInfo, verbose: bool) -> dict[str, Any]:
    """``/api/show``'s projector_info: the projector GGUF's keys shaped as model_info, except that (as in Ollama)
    no key is left out."""
    return _kv_view(info, verbose, drop=())


def _kv_view(info: GGUFInfo, verbose: bool, drop: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in info.metadata.items():
        if key in drop:
            continue
        if isinstance(value, list) and not verbose and info.array_length(key) > 5:
            value = []
        out[key] = value
    out["general.parameter_count"] = info.parameter_count
    return dict(sorted(out.items()))
