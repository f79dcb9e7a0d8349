"""Images into a llama.cpp model through libmtmd (the projector / mmproj GGUF): for the runner child only.

Two layers:

* pure helpers (no llama_cpp import, safe anywhere, the daemon included): :func:`check_image` sniffs an image's
  format and size from its header and applies the bounds below *before* anything decodes it; :func:`image_hash` is
  the image's content hash (the same SHA-256 libmtmd gives the bitmap as its id), for prompt-cache keys.
* :class:`Projector` (imports ``llama_cpp.mtmd_cpp`` lazily, so only the runner child ever loads libmtmd): loads a
  projector for a loaded model, tokenizes a prompt with media markers plus images into a :class:`MediaPrompt` (text
  and image chunks), and evaluates that into a llama context's sequence.

Bounds (docs/vision.md): an image is at most ``MAX_IMAGE_BYTES`` (20 MiB) encoded and ``MAX_IMAGE_SIDE`` (8192) pixels
on a side, and is a PNG, JPEG, GIF (first frame) or BMP. Anything else is a ``ValueError`` with a message fit for a
400. We never let libmtmd guess: its buffer loader treats WAV/MP3/FLAC bytes as audio and, when its image decoder
fails, hands the bytes to ffprobe/ffmpeg as a video, neither of which a client sending "an image" should reach.

Not thread-safe: one thread (the runner's engine thread) uses a Projector at a time.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_SIDE = 8192
# Where libmtmd would look for ffprobe/ffmpeg: a directory that does not exist, so its video fallback always fails
# fast instead of running a program on client bytes.
_NO_FFMPEG_DIR = b"/nonexistent/corral-no-video"


@dataclass(frozen=True)
class ImageInfo:
    """What an image's header says: its format (``png``, ``jpeg``, ``gif``, ``bmp``) and size in pixels."""

    format: str
    width: int
    height: int


def image_hash(data: bytes) -> str:
    """The image's content hash (hex SHA-256 of its encoded bytes): the id libmtmd gives its bitmap, and what a
    prompt-cache key holds for the image."""
    return hashlib.sha256(data).hexdigest()


def image_key(digest: str, index: int) -> int:
    """The prompt-cache entry for position ``index`` of the image with hash ``digest``: a negative 62-bit number
    (token ids are >= 0), distinct per image and position but for a hash collision (about 2**-62 a pair)."""
    h = hashlib.blake2b(f"{digest}:{index}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(h, "little") >> 2)


def _png_size(data: bytes) -> tuple[int, int]:
    # the first chunk must be IHDR: width and height are big-endian u32s at bytes 16..24
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError("image is not a valid PNG (no IHDR header)")
    w, h = struct.unpack_from(">II", data, 16)
    return w, h


def _jpeg_size(data: bytes) -> tuple[int, int]:
    # walk the marker segments up to the first start-of-frame (SOF0..SOF15 except DHT C4, JPG C8, DAC CC)
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            raise ValueError("image is not a valid JPEG (bad marker)")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker == 0xD9:
            break
        (length,) = struct.unpack_from(">H", data, i + 2)
        if length < 2:
            raise ValueError("image is not a valid JPEG (bad segment length)")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 9 > n:
                break
            h, w = struct.unpack_from(">HH", data, i + 5)
            return w, h
        i += 2 + length
    raise ValueError("image is not a valid JPEG (no frame header)")


def _bmp_size(data: bytes) -> tuple[int, int]:
    if len(data) < 26:
        raise ValueError("image is not a valid BMP (truncated header)")
    (dib,) = struct.unpack_from("<I", data, 14)
    if dib == 12:  # OS/2 BITMAPCOREHEADER: u16 sizes
        w, h = struct.unpack_from("<HH", data, 18)
        return w, h
    w, h = struct.unpack_from("<ii", data, 18)
    return abs(w), abs(h)  # a negative height is a top-down bitmap


def check_image(data: bytes) -> ImageInfo:
    """The format and size of ``data`` from its header, or a ``ValueError`` (with a message fit for a 400) when it
    is not a supported image or is over the bounds. Decodes nothing."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError("image must be bytes")
    data = bytes(data)
    if not data:
        raise ValueError("image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES} bytes")
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        fmt, (w, h) = "png", _png_size(data)
    elif data.startswith(b"\xff\xd8\xff"):
        fmt, (w, h) = "jpeg", _jpeg_size(data)
    elif data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        fmt, (w, h) = "gif", struct.unpack_from("<HH", data, 6)
    elif data.startswith(b"BM"):
        fmt, (w, h) = "bmp", _bmp_size(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise ValueError("WebP images are not supported (send PNG, JPEG, GIF or BMP)")
    else:
        raise ValueError("not a supported image (send PNG, JPEG, GIF or BMP)")
    if w <= 0 or h <= 0:
        raise ValueError(f"image has an empty size ({w}x{h})")
    if w > MAX_IMAGE_SIDE or h > MAX_IMAGE_SIDE:
        raise ValueError(f"image is {w}x{h} pixels, over the limit of {MAX_IMAGE_SIDE} pixels a side")
    return ImageInfo(fmt, w, h)


@dataclass(frozen=True)
class Segment:
    """One chunk of a :class:`MediaPrompt`: ``text`` (its token ids) or ``image`` (its hash), and how many KV
    positions it takes (``n_pos``; for text that is ``len(tokens)``, for an image ``n_tokens`` or fewer with
    M-RoPE models)."""

    kind: str
    n_pos: int
    n_tokens: int
    tokens: tuple[int, ...] = ()
    image_hash: str = ""


@dataclass
class MediaPrompt:
    """A tokenized prompt with images: libmtmd's input chunks (owned: :meth:`close` frees them) and a Python view of
    them (``segments``). Close it (or use ``with``) when it has been evaluated."""

    _chunks: Any
    _mtmd: Any
    segments: list[Segment] = field(default_factory=list)
    encoded: Any = None  # (segment index, embeddings) of an image being decoded in slices (the runner's)

    @property
    def n_tokens(self) -> int:
        """Embeddings the model decodes (text tokens plus image embeddings)."""
        return sum(s.n_tokens for s in self.segments)

    @property
    def n_pos(self) -> int:
        """KV positions the prompt takes: n_past advances by this much."""
        return sum(s.n_pos for s in self.segments)

    @property
    def image_hashes(self) -> list[str]:
        return [s.image_hash for s in self.segments if s.kind == "image"]

    def cache_key(self) -> list[int]:
        """One entry per KV position, in the same list as token ids: the token id for text, a negative number
        derived from the image's hash and the position's index within it for an image (:func:`image_key`). Two
        prompts share a key prefix only where they share text *and* images, so the engine's prompt cache
        (``Slot.tokens``, saved sequences, ``common_prefix``) never serves one image's KV to another. Entries below 0
        are not tokens: leave them out of repeat-penalty windows and detokenization."""
        key: list[int] = []
        for s in self.segments:
            if s.kind == "text":
                key.extend(s.tokens)
            else:
                key.extend(image_key(s.image_hash, i) for i in range(s.n_pos))
        return key

    def safe_prefix(self, n: int) -> int:
        """The longest reusable cached prefix of at most ``n`` positions: ``n`` cut back to the start of the image
        segment it ends inside (an image is evaluated whole, never from its middle)."""
        pos = 0
        for s in self.segments:
            if pos + s.n_pos > n:
                return pos if s.kind == "image" else n
            pos += s.n_pos
        return min(n, pos)

    def segment_at(self, n: int) -> tuple[int, int]:
        """(index of the segment holding position ``n``, positions of that segment before ``n``): where evaluation
        resumes after ``n`` cached positions (``(len(segments), 0)`` past the end)."""
        pos = 0
        for i, s in enumerate(self.segments):
            if n < pos + s.n_pos:
                return i, n - pos
            pos += s.n_pos
        return len(self.segments), 0

    def close(self) -> None:
        if self._chunks is not None:
            self._mtmd.mtmd_input_chunks_free(self._chunks)
            self._chunks = None

    def __enter__(self) -> MediaPrompt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # a safety net (callers close explicitly); at interpreter exit the library may already be gone
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class Projector:
    """A loaded projector (mmproj) for one loaded llama.cpp model.

    ``model`` is the ``llama_model *`` (``Llama.model`` or ``LlamaModel.model``); its embedding width must match
    the projector's output width (libmtmd refuses a mismatch: the load fails with a ``ValueError``).
    ``log_callback``: a ``llama_cpp.llama_log_callback`` to route libmtmd's logs through (kept alive by the
    caller), as the runner does for llama.cpp's.
    """

    def __init__(
        self,
        path: str,
        model: Any,
        *,
        use_gpu: bool = True,
        n_threads: int = 4,
        flash_attn: bool | None = None,
        warmup: bool = True,
        log_callback: Any = None,
    ) -> None:
        import llama_cpp
        import llama_cpp.mtmd_cpp as mtmd

        self._mtmd = mtmd
        self._lc = llama_cpp
        self._ctx: Any = None
        if log_callback is not None:
            mtmd.mtmd_log_set(log_callback, ctypes.c_void_p(0))
            mtmd.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = bool(use_gpu)
        params.n_threads = max(1, int(n_threads))
        params.print_timings = False
        params.warmup = bool(warmup)
        if flash_attn is not None:
            params.flash_attn_type = (
                llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ValueError(
                f"cannot load projector {path}: not a projector libmtmd supports, or made for a different model "
                "(its output width must match the model's embedding width)"
            )
        self._ctx = ctx
        self._model = model
        if not mtmd.mtmd_support_vision(ctx):
            self.close()
            raise ValueError(f"projector {path} has no vision encoder")
        self.marker: str = (mtmd.mtmd_get_marker(ctx) or mtmd.mtmd_default_marker()).decode()
        self.uses_mrope: bool = bool(mtmd.mtmd_decode_use_mrope(ctx))

    # -- lifetime ----------------------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._ctx is not None:
            self._mtmd.mtmd_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> Projector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> Any:
        if self._ctx is None:
            raise RuntimeError("projector is closed")
        return self._ctx

    # -- images ------------------------------------------------------------------------------------------------------

    def _bitmap(self, data: bytes, index: int) -> Any:
        """A decoded bitmap (the caller frees it), or ValueError."""
        mtmd = self._mtmd
        try:
            info = check_image(data)
        except ValueError as e:
            raise ValueError(f"image {index + 1}: {e}") from None
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        opt = mtmd.mtmd_helper_init_opt_default()
        opt.video_params.ffmpeg_bin_dir = _NO_FFMPEG_DIR
        wrapped = mtmd.mtmd_helper_bitmap_init_from_buf_wrapper(self._live(), buf, len(data), False, opt)
        bitmap, video = wrapped.bitmap, wrapped.video_ctx
        if video:  # unreachable without ffmpeg, but never keep a video context (or its process) around
            mtmd.mtmd_helper_video_free(video)
            if bitmap:
                mtmd.mtmd_bitmap_free(bitmap)
            raise ValueError(f"image {index + 1}: not a still image")
        if not bitmap:
            raise ValueError(f"image {index + 1}: cannot decode this {info.format.upper()} (corrupt or unsupported)")
        if mtmd.mtmd_bitmap_is_audio(bitmap):
            mtmd.mtmd_bitmap_free(bitmap)
            raise ValueError(f"image {index + 1}: not an image")
        return bitmap

    def tokenize(
        self, prompt: str, images: Sequence[bytes], *, add_special: bool = False, parse_special: bool = True
    ) -> MediaPrompt:
        """``prompt`` (with one :attr:`marker` per image, in order) and the images' bytes as input chunks.

        ``add_special``: let libmtmd add the model's BOS (off by default: corral's rendered prompts carry their
        own). ValueError for a marker/image count mismatch or an image that is not a decodable supported image;
        nothing allocated is kept on error."""
        ctx = self._live()
        mtmd = self._mtmd
        n_markers = prompt.count(self.marker)
        if n_markers != len(images):
            raise ValueError(f"the prompt has {n_markers} image marker(s) but {len(images)} image(s) were sent")
        hashes = [image_hash(bytes(b)) for b in images]
        bitmaps: list[Any] = []
        chunks: Any = None
        try:
            for i, data in enumerate(images):
                bitmaps.append(self._bitmap(bytes(data), i))
            text = mtmd.mtmd_input_text()
            raw = prompt.encode()
            text.text = raw
            text.text_len = len(raw)
            text.add_special = add_special
            text.parse_special = parse_special
            chunks = mtmd.mtmd_input_chunks_init()
            if not chunks:
                raise MemoryError("mtmd_input_chunks_init failed")
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), array, len(bitmaps))
            if rc == 1:
                raise ValueError(f"the prompt's image markers do not match the {len(images)} image(s) sent")
            if rc != 0:
                raise ValueError(f"cannot preprocess the image(s) (mtmd_tokenize returned {rc})")
            result = MediaPrompt(chunks, mtmd, self._segments(chunks, hashes))
            chunks = None  # owned by result now
            return result
        finally:
            if chunks is not None:
                mtmd.mtmd_input_chunks_free(chunks)
            # the chunks hold their own preprocessed copy of each image: the bitmaps can go now
            for b in bitmaps:
                mtmd.mtmd_bitmap_free(b)

    def _segments(self, chunks: Any, hashes: list[str]) -> list[Segment]:
        mtmd = self._mtmd
        out: list[Segment] = []
        images = iter(hashes)
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens = tuple(ptr[j] for j in range(n.value)) if ptr else ()
                out.append(Segment("text", len(tokens), len(tokens), tokens=tokens))
            elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
                out.append(Segment("image", n_pos, n_tokens, image_hash=next(images, "")))
            else:  # audio cannot arise: every bitmap was checked to be an image
                raise ValueError("unexpected non-image media chunk")
        return out

    def eval_segment(
        self,
        prompt: MediaPrompt,
        index: int,
        lctx: Any,
        *,
        n_past: int,
        seq_id: int = 0,
        n_batch: int = 512,
        logits_last: bool = False,
    ) -> int:
        """Decode segment ``index`` of ``prompt`` alone (for an image: run the projector, then decode its embeddings
        in batches of ``n_batch``) into sequence ``seq_id`` at ``n_past``; the new n_past. This is how the engine
        interleaves: it prefills text segments in its own batches and calls this for each image between steps.
        ``logits_last`` on an image (a prompt that ends with it): libmtmd's helper never asks for logits on image
        embeddings, so the image's last position is decoded again alone, with logits (:meth:`_last_logits`).
        RuntimeError on failure (the caller removes the sequence's positions from ``n_past`` on)."""
        mtmd, lc = self._mtmd, self._lc
        ctx = self._live()
        if prompt._chunks is None:
            raise RuntimeError("media prompt is closed")
        if not 0 <= index < mtmd.mtmd_input_chunks_size(prompt._chunks):
            raise IndexError(f"segment {index} out of range")
        new_n_past = lc.llama_pos(n_past)
        chunk = mtmd.mtmd_input_chunks_get(prompt._chunks, index)
        rc = mtmd.mtmd_helper_eval_chunk_single(
            ctx, lctx, chunk, n_past, seq_id, n_batch, logits_last, ctypes.byref(new_n_past)
        )
        if rc != 0:
            raise RuntimeError(f"evaluating segment {index} of the prompt failed ({rc})")
        if logits_last and mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            self._last_logits(chunk, lctx, int(new_n_past.value) - 1, seq_id)
        return int(new_n_past.value)

    def _last_logits(self, chunk: Any, lctx: Any, pos: int, seq_id: int) -> None:
        """Logits at an image's last position: its KV entry is removed and its embedding (still in libmtmd's output
        buffer from the encode just done) decoded again alone, with logits. The same computation: the last position
        attends to every earlier one and itself, causal or not. Not for M-RoPE models (positions in several
        dimensions), where a prompt has to go on after its last image."""
        mtmd, lc = self._mtmd, self._lc
        if self.uses_mrope:
            raise RuntimeError("with this model a prompt cannot end with an image: put text after it")
        embd = self._output(int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)))
        lc.llama_memory_seq_rm(lc.llama_get_memory(lctx), seq_id, pos, -1)
        self.decode_embeddings(lctx, embd[-1:], n_past=pos, seq_id=seq_id, logits_last=True)

    # -- an image in slices (the engine interleaves them with other sequences' steps) -------------------------------

    def can_split(self, prompt: MediaPrompt, index: int) -> bool:
        """Whether image segment ``index`` may be decoded in slices, in separate ``llama_decode`` calls: only with
        causal attention over the image and one position per embedding (not Gemma 3's non-causal images, not
        M-RoPE's 2-D positions, which libmtmd's helper must lay out)."""
        mtmd = self._mtmd
        if prompt._chunks is None or self.uses_mrope:
            return False
        chunk = mtmd.mtmd_input_chunks_get(prompt._chunks, index)
        if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            return False
        if mtmd.mtmd_decode_use_non_causal(self._live(), chunk):
            return False
        return int(mtmd.mtmd_input_chunk_get_n_pos(chunk)) == int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))

    def encode(self, prompt: MediaPrompt, index: int) -> Any:
        """Run the projector on image segment ``index``: its embeddings, a (n_tokens, n_embd) float32 numpy copy
        (libmtmd's output buffer is overwritten by the next encode). RuntimeError on failure."""
        mtmd = self._mtmd
        if prompt._chunks is None:
            raise RuntimeError("media prompt is closed")
        chunk = mtmd.mtmd_input_chunks_get(prompt._chunks, index)
        rc = mtmd.mtmd_encode_chunk(self._live(), chunk)
        if rc != 0:
            raise RuntimeError(f"encoding image segment {index} failed ({rc})")
        return self._output(int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))).copy()

    def _output(self, n_tokens: int) -> Any:
        """A numpy view of libmtmd's last encode output: (n_tokens, n_embd) float32."""
        import numpy as np

        embd = self._mtmd.mtmd_get_output_embd(self._live())
        if not embd:
            raise RuntimeError("the projector has no output embeddings")
        n_embd = int(self._lc.llama_model_n_embd(self._model))
        addr = ctypes.cast(embd, ctypes.c_void_p).value
        assert addr is not None
        view: Any = (ctypes.c_float * (n_tokens * n_embd)).from_address(addr)  # a ctypes array (buffer protocol)
        return np.frombuffer(view, dtype=np.float32).reshape(n_tokens, n_embd)

    def decode_embeddings(self, lctx: Any, embd: Any, *, n_past: int, seq_id: int, logits_last: bool) -> None:
        """Decode rows of :meth:`encode`'s output into sequence ``seq_id`` at positions ``n_past`` on, in one
        ``llama_decode`` (logits for the last row when ``logits_last``). RuntimeError on failure."""
        import numpy as np

        lc = self._lc
        rows = np.ascontiguousarray(embd, dtype=np.float32)
        n, n_embd = rows.shape
        batch = lc.llama_batch_init(n, n_embd, 1)
        try:
            ctypes.memmove(batch.embd, rows.ctypes.data, rows.nbytes)
            batch.n_tokens = n
            for i in range(n):
                batch.pos[i] = n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = logits_last and i == n - 1
            rc = lc.llama_decode(lctx, batch)
        finally:
            lc.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"decoding image embeddings failed ({rc})")

    def eval(
        self,
        prompt: MediaPrompt,
        lctx: Any,
        *,
        n_past: int,
        seq_id: int = 0,
        n_batch: int = 512,
        logits_last: bool = True,
        from_segment: int = 0,
    ) -> int:
        """Decode ``prompt`` into sequence ``seq_id`` of the llama context ``lctx`` (a ``llama_context *``) from
        position ``n_past``; the new n_past (``n_past + prompt.n_pos`` for a whole prompt). Images are encoded by the
        projector here (for a real projector, the slow part), then decoded as embeddings in batches of
        ``n_batch``. ``logits_last``: the last position's logits are kept for sampling. ``from_segment``: skip the
        first segments (already in the KV cache from an earlier request with the same key prefix; see
        :meth:`MediaPrompt.safe_prefix` and :meth:`MediaPrompt.segment_at`). RuntimeError when encoding or decoding
        fails (the sequence then holds a partial prefill: the caller clears it from ``n_past`` on)."""
        mtmd, lc = self._mtmd, self._lc
        ctx = self._live()
        if prompt._chunks is None:
            raise RuntimeError("media prompt is closed")
        new_n_past = lc.llama_pos(n_past)
        n = mtmd.mtmd_input_chunks_size(prompt._chunks)
        if from_segment <= 0:
            rc = mtmd.mtmd_helper_eval_chunks(
                ctx, lctx, prompt._chunks, n_past, seq_id, n_batch, logits_last, ctypes.byref(new_n_past)
            )
            if rc != 0:
                raise RuntimeError(f"evaluating the prompt with images failed (mtmd_helper_eval_chunks: {rc})")
            return int(new_n_past.value)
        pos = n_past
        for i in range(from_segment, n):
            pos = self.eval_segment(
                prompt, i, lctx, n_past=pos, seq_id=seq_id, n_batch=n_batch, logits_last=logits_last and i == n - 1
            )
        return pos
