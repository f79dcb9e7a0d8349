"""A sequence's KV state cut into blocks of positions and put back together, for the prompt cache on disk.

``llama_state_seq_get_data`` gives one sequence's state as one blob. In this build (read against the vendored
source of llama-cpp-python 0.3.36: src/llama-context.cpp ``state_seq_get_data``, src/llama-kv-cache.cpp
``state_write``/``state_write_meta``/``state_write_data`` and their ``state_read_*`` counterparts) it is, for a
standard KV cache, little-endian::

    u32 magic 0xaf143cd8, i32 source seq id   (the context's header; llama_state_seq_set_data wants it too)
    u32 n_stream
    per stream: u32 cell_count (0: nothing more for this stream), then
        per cell: i32 pos, u32 n_seq_id (1 for one sequence), [i32 x, i32 y, i32 tok when the cache keeps
                  llama_kv_cell_ext], n_seq_id x i32 seq id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_size_row, cell_count rows of K
        V, per layer (none at all for an MLA cache):
            not transposed: i32 v_type, u64 v_size_row, cell_count rows
            transposed:     i32 v_type, u32 v_size_el, u32 n_embd_v_gqa, then per embedding element j the
                            cell_count elements of row j

The cells come in cell order, which is not position order once the cache has been fragmented. :func:`split`
picks the cells of positions ``[i*block, (i+1)*block)`` for block ``i`` (in position order) and writes each
block as a self-describing payload (its layout, its cells' positions, their K/V rows); :func:`join` checks that
the payloads fit together (one layout, positions ``0..N-1``) and writes one blob in llama.cpp's format (header
included) with every cell in the first stream, which ``llama_state_seq_set_data`` restores into the destination
sequence's own stream (``state_read`` puts a stream's cells where ``seq_to_stream[dest]`` says). Any other
memory (a sliding-window cache's two states, a recurrent or hybrid state) or a blob that does not parse to its
exact length is :class:`Unsplittable`.

Payload (version 1), little-endian: ``b"CKVB"``, u32 version, u32 n_cells, the layout (u32 ext, u32 v_trans,
u32 n_layer, u32 n_v_layers; per K layer i32 type, u64 row bytes; per V layer i32 type, u64 row bytes (not
transposed) or i32 type, u32 element bytes, u32 n_embd_v_gqa (transposed)), i32 pos[n_cells], [i32 ext[n_cells][3]],
the K rows of each layer, then the V rows of each layer (transposed: n_embd_v_gqa x n_cells elements)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from daemon.runners.kvstore import BLOCK_TOKENS

MAGIC = b"CKVB"
SEQ_MAGIC = 0xAF143CD8  # the header of a sequence state (llama-context.cpp io_magic), then the source seq id
VERSION = 1
_MAX_LAYERS = 1 << 16  # sanity bounds on the counts read from a blob
_MAX_STREAMS = 1 << 16
_MAX_TYPE = 1 << 10  # ggml type ids are small
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<4sII")  # magic, version, n_cells
_LAYOUT = struct.Struct("<IIII")  # ext, v_trans, n_layer, n_v_layers
_ROW = struct.Struct("<iQ")  # type, row bytes
_TRANS = struct.Struct("<iII")  # type, element bytes, n_embd_v_gqa

Blob = bytes | bytearray | memoryview | np.ndarray  # a state as llama.cpp wrote it (numpy: uint8)


class Unsplittable(ValueError):
    """A state blob this module cannot cut into blocks (another memory type, another format, damaged, or lacking
    positions), or payloads that do not form one prefix."""


@dataclass(frozen=True)
class _Layout:
    ext: bool  # cells carry llama_kv_cell_ext (M-RoPE, per-layer token embeddings)
    v_trans: bool
    n_layer: int
    k: tuple[tuple[int, int], ...]  # per layer: ggml type, row bytes
    v: tuple[tuple[int, int, int], ...]  # per V layer: ggml type, row (or element) bytes, n_embd_v_gqa (transposed)

    def encode(self) -> bytes:
        out = [_LAYOUT.pack(int(self.ext), int(self.v_trans), self.n_layer, len(self.v))]
        out += [_ROW.pack(t, row) for t, row in self.k]
        if self.v_trans:
            out += [_TRANS.pack(t, el, n_embd) for t, el, n_embd in self.v]
        else:
            out += [_ROW.pack(t, row) for t, row, _ in self.v]
        return b"".join(out)


@dataclass
class _Cells:
    """Cells of one sequence: their positions (and ext) and, per layer, their K rows and V rows as numpy views
    (K and plain V: one void item of a row's bytes per cell; transposed V: shape (n_embd_v_gqa, cells) of
    elements)."""

    layout: _Layout
    pos: np.ndarray
    ext: np.ndarray | None  # (cells, 3) int32
    k: list[np.ndarray]
    v: list[np.ndarray]


class _Reader:
    def __init__(self, data: np.ndarray, at: int = 0) -> None:
        self.data = data
        self.at = at

    def need(self, n: int) -> None:
        if n < 0 or self.at + n > self.data.nbytes:
            raise Unsplittable(f"the state ends at byte {self.data.nbytes}, {n} more wanted at byte {self.at}")

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        self.need(fmt.size)
        values = fmt.unpack_from(self.data.data, self.at)
        self.at += fmt.size
        return tuple(int(v) for v in values)

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def array(self, dtype: np.dtype[np.generic] | str, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        self.need(dt.itemsize * count)
        out = np.frombuffer(self.data, dtype=dt, count=count, offset=self.at)
        self.at += dt.itemsize * count
        return out

    def rows(self, row: int, count: int) -> np.ndarray:
        """``count`` items of ``row`` bytes each."""
        if not 0 < row <= self.data.nbytes:
            raise Unsplittable(f"a row of {row} bytes")
        return self.array(np.dtype((np.void, row)), count)


def _as_bytes(blob: Blob) -> np.ndarray:
    try:
        return np.frombuffer(blob, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise Unsplittable(f"not a byte buffer: {e}") from e


def _memory_state(blob: Blob) -> np.ndarray:
    """The memory's part of a sequence state: after the context's header when it has one (a memory state alone,
    as some callers strip it, is taken as it is; its first u32, a stream count, is never the magic)."""
    data = _as_bytes(blob)
    if data.nbytes >= 8 and _U32.unpack_from(data.data, 0)[0] == SEQ_MAGIC:
        return data[8:]
    return data


def n_stream_of(blob: Blob) -> int:
    """The stream count a context writes at the head of every sequence state (read it from an empty sequence's
    state; :func:`join` needs it)."""
    data = _memory_state(blob)
    if data.nbytes < 4:
        raise Unsplittable(f"a state of {data.nbytes} bytes has no stream count")
    return int(_U32.unpack_from(data.data, 0)[0])


def _check_type(t: int) -> None:
    if not 0 <= t < _MAX_TYPE:
        raise Unsplittable(f"ggml type {t}")


def _parse_stream(r: _Reader, cell_count: int, ext: bool, mla: bool) -> _Cells:
    width = 6 if ext else 3  # pos, n_seq_id, [x, y, tok], seq id
    meta = r.array("<i4", cell_count * width).reshape(cell_count, width)
    if not (meta[:, 1] == 1).all():
        raise Unsplittable("a cell of the state belongs to other than one sequence")
    v_trans, layers = r.u32(), r.u32()
    if v_trans not in (0, 1) or not 0 < layers <= _MAX_LAYERS:
        raise Unsplittable(f"v_trans {v_trans}, {layers} layers")
    trans = bool(v_trans)
    ks, k_rows = [], []
    for _ in range(layers):
        t, row = r.unpack(_ROW)
        _check_type(t)
        ks.append((t, row))
        k_rows.append(r.rows(row, cell_count))
    vs, v_rows = [], []
    for _ in range(0 if mla else layers):
        if trans:
            t, el, n_embd = r.unpack(_TRANS)
            _check_type(t)
            if n_embd <= 0:
                raise Unsplittable(f"n_embd_v_gqa {n_embd}")
            vs.append((t, el, n_embd))
            v_rows.append(r.rows(el, n_embd * cell_count).reshape(n_embd, cell_count))
        else:
            t, row = r.unpack(_ROW)
            _check_type(t)
            vs.append((t, row, 0))
            v_rows.append(r.rows(row, cell_count))
    layout = _Layout(ext=ext, v_trans=trans, n_layer=layers, k=tuple(ks), v=tuple(vs))
    return _Cells(layout, meta[:, 0], meta[:, 2:5] if ext else None, k_rows, v_rows)


def _parse_as(data: np.ndarray, ext: bool, mla: bool) -> _Cells | None:
    r = _Reader(data)
    n_stream = r.u32()
    if not 0 < n_stream <= _MAX_STREAMS:
        raise Unsplittable(f"{n_stream} streams")
    found: _Cells | None = None
    for _ in range(n_stream):
        cell_count = r.u32()
        if cell_count == 0:
            continue
        if found is not None:
            raise Unsplittable("the sequence has cells in more than one stream")
        found = _parse_stream(r, cell_count, ext, mla)
    if r.at != data.nbytes:
        raise Unsplittable(f"{data.nbytes - r.at} bytes after the state")
    return found


def _parse(blob: Blob) -> _Cells | None:
    """The cells of a sequence state (None: an empty sequence). The blob says neither whether its cells carry
    llama_kv_cell_ext nor whether its cache has V at all (an MLA cache writes none): every reading is tried and
    exactly one must account for every byte."""
    data = _memory_state(blob)
    readings: list[_Cells | None] = []
    why = ""
    for ext in (False, True):
        for mla in (False, True):
            try:
                readings.append(_parse_as(data, ext, mla))
            except Unsplittable as e:
                why = why or str(e)
    if not readings:
        raise Unsplittable(f"not a KV cache sequence state: {why}")
    if len(readings) > 1 and any(c is not None for c in readings):
        raise Unsplittable("the state reads in more than one way")
    return readings[0]


def split(blob: Blob, n_blocks: int, block: int = BLOCK_TOKENS) -> list[bytes]:
    """Payloads of blocks ``0..n_blocks-1`` (positions ``[i*block, (i+1)*block)``) of a sequence state blob from
    ``llama_state_seq_get_data``; every one of those positions must be among its cells (in any cell order), else
    :class:`Unsplittable`. The whole blob is parsed even for ``n_blocks`` 0: ``split(empty_state, 0)`` at load
    tells whether a context's memory is a standard KV cache at all (a sliding-window, recurrent or hybrid
    memory's state is Unsplittable, empty or not)."""
    if n_blocks < 0 or block <= 0:
        raise ValueError(f"{n_blocks} blocks of {block} tokens")
    cells = _parse(blob)
    if n_blocks == 0:
        return []
    if cells is None:
        raise Unsplittable("the sequence is empty")
    n = n_blocks * block
    pos = cells.pos
    chosen = np.flatnonzero((pos >= 0) & (pos < n))
    order = chosen[np.argsort(pos[chosen], kind="stable")]
    if order.size != n or not np.array_equal(pos[order], np.arange(n, dtype=pos.dtype)):
        raise Unsplittable(f"positions 0..{n - 1} are not all in the sequence ({order.size} cells there)")
    lay = cells.layout
    head_rest = lay.encode()
    out = []
    for b in range(n_blocks):
        idx = order[b * block : (b + 1) * block]
        # cells of consecutive indices (the common case): rows are a slice of the blob, not a copy
        rows: slice | np.ndarray = idx
        if int(idx[-1]) - int(idx[0]) == block - 1 and bool((np.diff(idx) == 1).all()):
            rows = slice(int(idx[0]), int(idx[0]) + block)
        parts: list[bytes | memoryview] = [_HEAD.pack(MAGIC, VERSION, block), head_rest]
        parts.append(pos[rows].astype("<i4").tobytes())
        if cells.ext is not None:
            parts.append(cells.ext[rows].astype("<i4").tobytes())
        parts += [k[rows].view(np.uint8).data for k in cells.k]
        if lay.v_trans:
            parts += [np.ascontiguousarray(v[:, rows]).view(np.uint8).reshape(-1).data for v in cells.v]
        else:
            parts += [v[rows].view(np.uint8).data for v in cells.v]
        out.append(b"".join(parts))
    return out


def _read_payload(payload: Blob, i: int) -> _Cells:
    data = _as_bytes(payload)
    if data.nbytes < _HEAD.size:
        raise Unsplittable(f"block {i}: {data.nbytes} bytes")
    magic, version, n_cells = _HEAD.unpack_from(data.data, 0)
    if magic != MAGIC or version != VERSION or n_cells <= 0:
        raise Unsplittable(f"block {i}: not a KV block payload (version {VERSION})")
    r = _Reader(data, _HEAD.size)
    try:
        ext, v_trans, n_layer, n_v = r.unpack(_LAYOUT)
        if ext not in (0, 1) or v_trans not in (0, 1) or not 0 < n_layer <= _MAX_LAYERS or n_v not in (0, n_layer):
            raise Unsplittable(f"a layout of ext {ext}, v_trans {v_trans}, {n_layer} layers, {n_v} V layers")
        ks = [r.unpack(_ROW) for _ in range(n_layer)]
        vs = [r.unpack(_TRANS) if v_trans else (*r.unpack(_ROW), 0) for _ in range(n_v)]
        for t, *_ in (*ks, *vs):
            _check_type(t)
        lay = _Layout(
            ext=bool(ext),
            v_trans=bool(v_trans),
            n_layer=n_layer,
            k=tuple((t, row) for t, row in ks),
            v=tuple((t, size, n_embd) for t, size, n_embd in vs),
        )
        pos = r.array("<i4", n_cells)
        exts = r.array("<i4", 3 * n_cells).reshape(n_cells, 3) if ext else None
        k_rows = [r.rows(row, n_cells) for _, row in lay.k]
        if lay.v_trans:
            if any(n_embd <= 0 for _, _, n_embd in lay.v):
                raise Unsplittable("n_embd_v_gqa 0")
            v_rows = [r.rows(el, n_embd * n_cells).reshape(n_embd, n_cells) for _, el, n_embd in lay.v]
        else:
            v_rows = [r.rows(row, n_cells) for _, row, _ in lay.v]
    except Unsplittable as e:
        raise Unsplittable(f"block {i}: {e}") from e
    if r.at != data.nbytes:
        raise Unsplittable(f"block {i}: {data.nbytes - r.at} bytes more than its layout holds")
    return _Cells(lay, pos, exts, k_rows, v_rows)


def join(payloads: Sequence[Blob], n_stream: int) -> np.ndarray:
    """One sequence state for ``llama_state_seq_set_data`` (of a context whose states start with ``n_stream``)
    holding the blocks' cells, positions ``0..N-1``, as a uint8 array. ValueError (:class:`Unsplittable`) when the
    payloads are damaged, of different layouts, or not consecutive blocks from position 0.

    Written in one pass into memory the kernel hands over already mapped (:func:`_filled_buffer`): joining into
    fresh memory cost a page fault per 4 KiB written, which was half of a restore's time (61 of 148 ms for 90 MiB of
    SmolLM2 blocks, docs/benchmarks.md)."""
    if not payloads:
        raise ValueError("no blocks to join")
    if not 0 < n_stream <= _MAX_STREAMS:
        raise ValueError(f"{n_stream} streams")
    blocks = [_read_payload(p, i) for i, p in enumerate(payloads)]
    lay = blocks[0].layout
    for i, b in enumerate(blocks[1:], 1):
        if b.layout != lay:
            raise Unsplittable(f"block {i} has another layout than block 0")
    pos = np.concatenate([b.pos for b in blocks])
    if not np.array_equal(pos, np.arange(pos.size, dtype=pos.dtype)):
        raise Unsplittable(f"the blocks do not hold positions 0..{pos.size - 1} in order")
    n = int(pos.size)
    width = 6 if lay.ext else 3
    size = 16 + 4 * width * n + 8
    size += sum(_ROW.size + row * n for _, row in lay.k)
    size += sum(
        (_TRANS.size if lay.v_trans else _ROW.size) + row * (n_embd if lay.v_trans else 1) * n
        for _, row, n_embd in lay.v
    )
    size += 4 * (n_stream - 1)  # the other streams: empty
    out = _filled_buffer(size)
    at = 0

    def put(data: bytes | np.ndarray) -> None:
        nonlocal at
        raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        out[at : at + raw.size] = raw
        at += raw.size

    put(struct.pack("<IiII", SEQ_MAGIC, 0, n_stream, n))  # the source seq id is not read by a host restore
    meta = out[at : at + 4 * width * n].view("<i4").reshape(n, width)
    meta[:, 0] = pos
    meta[:, 1] = 1  # one sequence id per cell; its value is not read (the destination's is used)
    meta[:, 2:] = 0
    if lay.ext:
        meta[:, 2:5] = np.concatenate([b.ext for b in blocks if b.ext is not None])
    at += meta.nbytes
    put(struct.pack("<II", int(lay.v_trans), lay.n_layer))
    for layer, (t, row) in enumerate(lay.k):
        put(_ROW.pack(t, row))
        for b in blocks:
            put(b.k[layer])
    for layer, (t, size_el, n_embd) in enumerate(lay.v):
        if lay.v_trans:
            put(_TRANS.pack(t, size_el, n_embd))
            # per embedding element, the cells of every block in order: a (n_embd, n x el) view filled per block
            rows = out[at : at + n_embd * n * size_el].reshape(n_embd, n * size_el)
            col = 0
            for b in blocks:
                part = b.v[layer].view(np.uint8).reshape(n_embd, -1)
                rows[:, col : col + part.shape[1]] = part
                col += part.shape[1]
            at += rows.size
        else:
            put(_ROW.pack(t, size_el))
            for b in blocks:
                put(b.v[layer])
    out[at:] = 0
    return out


def _filled_buffer(size: int) -> np.ndarray:
    """``size`` bytes of anonymous memory mapped in advance (``MAP_POPULATE``: the kernel maps every page at once,
    much faster than faulting them in one by one while writing) in 4 KiB pages: numpy's own allocations of this
    size ask for huge pages, whose first allocation can stall for memory compaction (150 ms seen after the page
    cache was dropped). Where mmap cannot (another platform), a numpy array."""
    import mmap

    populate = getattr(mmap, "MAP_POPULATE", 0)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | populate
    if populate and size > 0:
        try:
            return np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=np.uint8)
        except (OSError, ValueError):
            pass
    return np.empty(size, dtype=np.uint8)
