"""Estimating a model's memory from its GGUF header (pure), and reading what llama.cpp reported after loading.

The estimate has three parts, as llama.cpp allocates them: the weights (per layer and the rest), the KV cache
(``num_ctx * num_parallel`` cells for every layer), and the compute buffer (dominated by the logits of one batch,
growing with long contexts). It decides how many layers fit a VRAM budget. A vision model's projector (mmproj) adds
its tensors and its own compute buffer (:func:`projector_memory`), on the GPU only when every layer is (as Ollama
places it: libmtmd puts a projector whole on one device).
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass

from registry.gguf import MAX_LAYERS, GGUFInfo

# bytes per K or V value; llama.cpp's quantized blocks hold 32 values: q8_0 32 int8 + an f16 scale (34 bytes),
# q4_0 16 bytes of nibbles + an f16 scale (18 bytes)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Estimate:
    weights_per_layer: tuple[int, ...]
    weights_other: int
    output_weights: int  # the output projection (the first layer llama.cpp offloads)
    kv_per_layer: int
    compute_buffer: int
    n_gpu_layers: int  # llama.cpp's count: the output layer is one, n_layer + 1 = all
    ram: int
    vram: int

    @property
    def total(self) -> int:
        return self.ram + self.vram


def _int(info: GGUFInfo, suffix: str, default: int = 0) -> int:
    v = info.metadata.get(f"{info.architecture}.{suffix}")
    if isinstance(v, list):
        v = max((x for x in v if isinstance(x, int)), default=default)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _vocab(info: GGUFInfo) -> int:
    return _int(info, "vocab_size") or info.array_length("tokenizer.ggml.tokens") or 32000


@dataclass(frozen=True)
class Layers:
    """A model's weights by layer, summed once per header: every estimate and layer split is then O(1) or
    O(log layers), never O(block_count) or O(tensors) again."""

    per_layer: tuple[int, ...]
    prefix: tuple[int, ...]  # prefix[i] = sum(per_layer[:i])
    other: int
    output: int

    @property
    def n_layer(self) -> int:
        return len(self.per_layer)


_SUMMARIES: dict[int, tuple[weakref.ref[GGUFInfo], Layers]] = {}
_SUMMARIES_LOCK = threading.Lock()


def layers_of(info: GGUFInfo) -> Layers:
    """The per-layer sums of ``info`` (cached while ``info`` lives). One pass over the tensor list; the layer count
    is the header's ``block_count``, which the reader bounds to llama.cpp's ``MAX_LAYERS`` (clamped here too, for
    a header that did not come through it)."""
    key = id(info)
    hit = _SUMMARIES.get(key)
    if hit is not None and hit[0]() is info:
        return hit[1]
    n_layer = max(1, min(info.block_count or 1, MAX_LAYERS))
    per_layer = [0] * n_layer
    other = output = 0
    for t in info.tensors:
        m = _LAYER.match(t.name)
        if m and int(m.group(1)) < n_layer:
            per_layer[int(m.group(1))] += t.n_bytes
        elif t.name.startswith("output."):
            output += t.n_bytes
        else:
            other += t.n_bytes
    prefix = [0]
    for w in per_layer:
        prefix.append(prefix[-1] + w)
    summary = Layers(per_layer=tuple(per_layer), prefix=tuple(prefix), other=other, output=output)
    with _SUMMARIES_LOCK:
        if len(_SUMMARIES) >= 128:
            for k in [k for k, (ref, _) in _SUMMARIES.items() if ref() is None]:
                del _SUMMARIES[k]
            if len(_SUMMARIES) >= 128:
                _SUMMARIES.clear()
        _SUMMARIES[key] = (weakref.ref(info), summary)
    return summary


def _buffers(info: GGUFInfo, *, num_ctx: int, num_parallel: int, num_batch: int, kv_type: str) -> tuple[int, int]:
    """(KV cache bytes per layer, compute buffer bytes) for this shape."""
    n_embd = info.embedding_length or 1
    n_head = info.head_count or 1
    n_head_kv = info.head_count_kv or n_head
    key_len = _int(info, "attention.key_length") or n_embd // n_head
    val_len = _int(info, "attention.value_length") or n_embd // n_head
    cells = max(1, num_ctx) * max(1, num_parallel)
    kv_layer = int(cells * n_head_kv * (key_len + val_len) * KV_BYTES.get(kv_type, 2.0))
    batch = max(1, min(num_batch, cells))
    n_ff = _int(info, "feed_forward_length") or 4 * n_embd
    # llama.cpp reuses graph memory, so the buffer is about the larger of the logits of one batch and the
    # attention scores of one batch over the whole cache, plus activations (calibrated on the test models).
    compute = max(_vocab(info) * batch * 4, int(cells * batch * n_head * 5.5)) + batch * (n_embd + n_ff) * 4 + (1 << 20)
    return kv_layer, compute


def _split(layers: Layers, kv_layer: int, compute: int, gpu: int, projector: int = 0) -> tuple[int, int]:
    """(ram, vram) for llama.cpp's ``n_gpu_layers = gpu``, which counts the output layer as one more layer and
    offloads it first: ``gpu`` >= 1 puts the output projection on the GPU with the last ``gpu - 1`` repeating
    layers, and only ``n_layer + 1`` puts every layer there (``n_layer`` leaves layer 0 on the CPU, which on a GPU
    costs a CPU pass per token and per row). ``projector`` (bytes, :func:`projector_memory`) is on the GPU only when
    the whole model is. The compute buffer is counted whole on each side that computes."""
    n_layer = layers.n_layer
    gpu = max(0, min(gpu, n_layer + 1))
    repeating = max(0, gpu - 1)
    cpu = n_layer - repeating
    vram = layers.prefix[n_layer] - layers.prefix[cpu] + repeating * kv_layer
    ram = layers.prefix[cpu] + cpu * kv_layer + layers.other
    if gpu > n_layer:
        vram += layers.output + compute + projector
    elif gpu > 0:
        vram += layers.output + compute
        ram += compute + projector
    else:
        ram += layers.output + compute + projector
    return ram, vram


def projector_memory(info: GGUFInfo) -> int:
    """What a vision projector (mmproj GGUF header) costs loaded: its tensors, plus libmtmd's compute buffer for
    encoding one image, estimated from the encoder's shape. The buffer is dominated by the attention scores
    (patches^2 x heads, f32, explicit attention) and the activations of one layer (patches x (ffn + 4 x width));
    doubled for the graph allocator's slack (the test projector measures 0.30 MiB against 0.31 estimated), plus
    1 MiB for libmtmd's own context."""
    tensors = sum(t.n_bytes for t in info.tensors)
    meta = info.metadata

    def num(key: str, default: int) -> int:
        v = meta.get(f"clip.vision.{key}")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default

    image, patch = num("image_size", 224), num("patch_size", 14)
    width = num("embedding_length", 1024)
    patches = max(1, (image // max(1, patch)) ** 2)
    heads = num("attention.head_count", 16)
    ffn = num("feed_forward_length", 4 * width)
    compute = 2 * (patches * patches * heads * 4 + patches * (ffn + 4 * width) * 4)
    return tensors + compute + (1 << 20)


_PROJECTORS: dict[str, int] = {}


def projector_file_memory(path: str) -> int:
    """:func:`projector_memory` of the projector GGUF at ``path`` (a content-addressed blob: cached per path; 0
    for no path)."""
    if not path:
        return 0
    hit = _PROJECTORS.get(path)
    if hit is None:
        from registry.gguf import read_gguf_file

        try:
            hit = projector_memory(read_gguf_file(path, max_array_keep=8))
        except Exception:  # noqa: BLE001 - an unreadable header: its size stands for its tensors (the load says why)
            import os

            hit = os.path.getsize(path) + (1 << 20) if os.path.exists(path) else 0
        if len(_PROJECTORS) >= 64:
            _PROJECTORS.clear()
        _PROJECTORS[path] = hit
    return hit


def estimate(
    info: GGUFInfo,
    *,
    num_ctx: int,
    num_parallel: int = 1,
    num_batch: int = 512,
    n_gpu_layers: int = 0,
    kv_type: str = "f16",
    projector: int = 0,
) -> Estimate:
    """``projector``: the vision projector's bytes (:func:`projector_memory`), 0 for a text model."""
    layers = layers_of(info)
    n_layer = layers.n_layer
    kv_layer, compute = _buffers(info, num_ctx=num_ctx, num_parallel=num_parallel, num_batch=num_batch, kv_type=kv_type)
    gpu = n_layer + 1 if n_gpu_layers < 0 else max(0, min(n_gpu_layers, n_layer + 1))
    ram, vram = _split(layers, kv_layer, compute, gpu, projector)
    return Estimate(
        weights_per_layer=layers.per_layer,
        weights_other=layers.other,
        output_weights=layers.output,
        kv_per_layer=kv_layer,
        compute_buffer=compute,
        n_gpu_layers=gpu,
        ram=ram,
        vram=vram,
    )


def choose_gpu_layers(
    info: GGUFInfo,
    *,
    num_ctx: int,
    num_parallel: int = 1,
    num_batch: int = 512,
    vram_budget: int,
    requested: int | None = None,
    kv_type: str = "f16",
    projector: int = 0,
) -> int:
    """The most layers that fit ``vram_budget`` (``requested``, the num_gpu option, overrides when >= 0).

    The VRAM an offload needs never shrinks as layers are added (each adds its weights and KV cache; the first adds
    a compute buffer, the last the output and the full one), so a binary search over the layer count finds the
    same answer as trying every count from the top, with the per-layer sums computed once."""
    layers = layers_of(info)
    n_layer = layers.n_layer
    if requested is not None and requested >= 0:
        return min(requested, n_layer + 1)
    if vram_budget <= 0:
        return 0
    kv_layer, compute = _buffers(info, num_ctx=num_ctx, num_parallel=num_parallel, num_batch=num_batch, kv_type=kv_type)
    lo, hi = 0, n_layer + 1  # vram(0) == 0 fits; find the largest count that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _split(layers, kv_layer, compute, mid, projector)[1] <= vram_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


_DRAFT_HEADERS: dict[str, GGUFInfo] = {}


def draft_header(path: str) -> GGUFInfo:
    """The GGUF header of a draft model's blob (speculative decoding, issue 28), read bounded and without the token
    list (per-layer arrays are all an estimate reads); cached per path (blobs never change)."""
    hit = _DRAFT_HEADERS.get(path)
    if hit is None:
        from registry.gguf import read_gguf_file

        hit = read_gguf_file(path, max_array_keep=MAX_LAYERS)
        if len(_DRAFT_HEADERS) >= 16:
            _DRAFT_HEADERS.clear()
        _DRAFT_HEADERS[path] = hit
    return hit


def draft_memory(
    info: GGUFInfo, *, num_ctx: int, num_parallel: int, num_batch: int, n_gpu_layers: int, kv_type: str = "f16"
) -> tuple[int, int]:
    """(ram, vram) of a draft model loaded beside its target: its weights, and its own KV cache for the same
    ``num_ctx * num_parallel`` cells (its layer count and KV shape) and compute buffer, split by its own
    ``n_gpu_layers`` (counted as the target's ``num_gpu``)."""
    est = estimate(
        info,
        num_ctx=num_ctx,
        num_parallel=num_parallel,
        num_batch=num_batch,
        n_gpu_layers=max(0, n_gpu_layers),
        kv_type=kv_type,
    )
    return est.ram, est.vram
