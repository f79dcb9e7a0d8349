"""daemon/llama/kvblocks.py against real llama.cpp: a sequence's state (``llama_state_seq_get_data``) cut into
blocks of positions, the leading blocks joined and restored (``llama_state_seq_set_data``) into another sequence
(another stream, another context), the rest of the prompt evaluated there: the last token's logits are a cold
evaluation's (greedy next tokens identical). With f16 and q8_0 KV, flash attention on (V rows) and off (V
transposed), a stream per sequence and one unified cache, cells in position order and out of it. Anything
damaged, of another layout or lacking positions is refused with Unsplittable (a ValueError), never a crash.

The cell formats this build's models never write (llama_kv_cell_ext of M-RoPE models, an MLA cache without V)
are checked on blobs written here by an independent writer of llama.cpp's format (src/llama-kv-cache.cpp
``state_write_meta``/``state_write_data``)."""

from __future__ import annotations

import ctypes
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
import pytest
from llama_cpp import _internals

from daemon.llama import kvblocks
from daemon.llama.kvblocks import BLOCK_TOKENS, Unsplittable, join, n_stream_of, split
from tests.models import smollm2_path, write_tiny_gguf

SMOL = smollm2_path()
B = BLOCK_TOKENS
KV = {"f16": 1, "q8_0": 8}  # ggml types
TAIL = 20  # prompt tokens after the blocks
N_PROMPT = 3 * B + TAIL


class Ctx:
    """A llama.cpp context with ``n_seq`` sequences: a stream each, or one unified cache."""

    def __init__(
        self,
        model: Any,
        *,
        n_seq: int = 3,
        n_ctx_seq: int = 1024,
        unified: bool = False,
        kv: str = "f16",
        flash: bool = False,
    ) -> None:
        p = lc.llama_context_default_params()
        p.n_ctx = n_ctx_seq * n_seq
        p.n_batch = p.n_ubatch = 512
        p.n_seq_max = n_seq
        p.kv_unified = unified
        p.n_threads = p.n_threads_batch = 2
        p.no_perf = True
        p.type_k = p.type_v = KV[kv]
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.context = _internals.LlamaContext(model=model, params=p, verbose=False)
        self.ctx = self.context.ctx
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = int(lc.llama_vocab_n_tokens(model.vocab))
        self.batch = lc.llama_batch_init(512, 0, 1)

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        self.context.close()

    def eval(self, seq: int, tokens: list[int], start: int = 0) -> np.ndarray:
        """Evaluate ``tokens`` at positions ``start..`` of ``seq`` (batches of 512); the last one's logits."""
        for at in range(0, len(tokens), 512):
            chunk = tokens[at : at + 512]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = start + at + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = at + i == len(tokens) - 1
            assert lc.llama_decode(self.ctx, b) == 0
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def greedy(self, seq: int, logits: np.ndarray, pos: int, n: int) -> list[int]:
        out = []
        for i in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if i < n - 1:
                logits = self.eval(seq, [tok], pos + i)
        return out

    def state(self, seq: int) -> bytes:
        size = int(lc.llama_state_seq_get_size(self.ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        assert int(lc.llama_state_seq_get_data(self.ctx, buf, size, seq)) == size
        return bytes(buf)

    def restore(self, seq: int, blob: bytes) -> int:
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        return int(lc.llama_state_seq_set_data(self.ctx, buf, len(blob), seq))

    def clear(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        assert lc.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def span(self, seq: int) -> tuple[int, int]:
        return int(lc.llama_memory_seq_pos_min(self.mem, seq)), int(lc.llama_memory_seq_pos_max(self.mem, seq))


def load(path: Path) -> Any:
    return _internals.LlamaModel(path_model=str(path), params=lc.llama_model_default_params(), verbose=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = load(write_tiny_gguf(tmp_path_factory.mktemp("kvblocks") / "tiny.gguf", context_length=4096))
    yield model
    model.close()


@pytest.fixture(scope="module")
def smol() -> Iterator[Any]:
    if SMOL is None:
        pytest.skip("SmolLM2 is not cached (scripts/fetch_smollm2.py)")
    model = load(SMOL)
    yield model
    model.close()


def ctx_of(model: Any, **kw: Any) -> Ctx:
    return Ctx(model, **kw)


@pytest.fixture
def contexts() -> Iterator[list[Ctx]]:
    made: list[Ctx] = []
    yield made
    for c in made:
        c.close()


def prompt_of(n: int, seed: int = 0, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def text_prompt(model: Any, n: int) -> list[int]:
    """``n`` tokens of English text (a real model's logits are peaked on it)."""
    text = (
        "The history of the lighthouse keeper's island begins with a storm in the autumn of 1871, when a schooner "
        "carrying timber ran aground on the reef. The crew survived the night by climbing the rocks, and in the "
        "morning a fisherman rowed out from the village to bring them ashore. "
    )
    tokens: list[int] = []
    i = 0
    while len(tokens) < n:
        tokens += model.tokenize(f"Chapter {i}. {text}".encode(), False, False)
        i += 1
    return tokens[:n]


HEADER = struct.pack("<Ii", kvblocks.SEQ_MAGIC, 0)  # llama_state_seq_get_data's, before the memory's state


def first_pos(blob: bytes) -> int:
    """The position of the first cell of a one-stream state."""
    magic, _, n_stream = struct.unpack_from("<IiI", blob, 0)  # the header (magic, source seq id), then streams
    assert (magic, n_stream) == (kvblocks.SEQ_MAGIC, 1)
    return int(struct.unpack_from("<i", blob, 16)[0])


def assert_same_logits(got: np.ndarray, cold: np.ndarray, tol: float = 1e-4) -> None:
    """The same greedy token, and logits within ``tol`` of the largest one."""
    assert int(np.argmax(got)) == int(np.argmax(cold))
    np.testing.assert_allclose(got, cold, rtol=0, atol=tol * float(np.abs(cold).max()))


CONFIGS = [
    pytest.param(dict(kv="f16", flash=False), id="f16-vtrans"),
    pytest.param(dict(kv="f16", flash=True), id="f16-flash"),
    pytest.param(dict(kv="q8_0", flash=True), id="q8_0-flash"),
    pytest.param(dict(kv="f16", flash=False, unified=True), id="f16-vtrans-unified"),
    pytest.param(dict(kv="q8_0", flash=True, unified=True), id="q8_0-flash-unified"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_leading_blocks_restored_into_another_sequence_evaluate_as_cold(
    tiny: Any, contexts: list[Ctx], config: dict[str, Any]
) -> None:
    c = ctx_of(tiny, n_seq=4, **config)
    contexts.append(c)
    n_stream = n_stream_of(c.state(2))  # an empty sequence's state
    assert n_stream == (1 if config.get("unified") else 4)
    prompt = prompt_of(N_PROMPT)
    # cold evaluations in the batches the restored ones use (llama.cpp's results depend on the batch split in
    # the last bits): the prompt up to 3 blocks then the rest, and up to 2 blocks then the rest
    c.eval(0, prompt[: 3 * B])
    cold = c.eval(0, prompt[3 * B :], 3 * B)
    c.eval(3, prompt[: 2 * B])
    cold2 = c.eval(3, prompt[2 * B :], 2 * B)
    assert int(np.argmax(cold2)) == int(np.argmax(cold))
    payloads = split(c.state(0), 3)
    assert len(payloads) == 3 and all(isinstance(p, bytes) for p in payloads)
    blob = join(payloads, n_stream)
    assert c.restore(1, blob) == len(blob)
    assert c.span(1) == (0, 3 * B - 1)
    # the restored blocks are the original's, byte for byte
    assert split(c.state(1), 3) == payloads
    got = c.eval(1, prompt[3 * B :], 3 * B)
    assert_same_logits(got, cold)
    # and the leading two blocks alone: evaluate from there
    blob2 = join(payloads[:2], n_stream)
    assert c.restore(2, blob2) == len(blob2)
    assert c.span(2) == (0, 2 * B - 1)
    assert_same_logits(c.eval(2, prompt[2 * B :], 2 * B), cold2)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]])
def test_blocks_restore_into_another_context(tiny: Any, contexts: list[Ctx], config: dict[str, Any]) -> None:
    """As after a restart: the blocks of one context, restored into a fresh one with another stream layout."""
    a = ctx_of(tiny, **config)
    contexts.append(a)
    prompt = prompt_of(N_PROMPT, seed=3)
    a.eval(0, prompt[: 3 * B])
    cold = a.eval(0, prompt[3 * B :], 3 * B)
    payloads = split(a.state(0), 3)
    for unified in (False, True):
        b = ctx_of(tiny, n_seq=4, unified=unified, **{k: v for k, v in config.items() if k != "unified"})
        contexts.append(b)
        blob = join(payloads, n_stream_of(b.state(3)))
        assert b.restore(3, blob) == len(blob)
        assert_same_logits(b.eval(3, prompt[3 * B :], 3 * B), cold)


@pytest.mark.parametrize("flash", [False, True], ids=["vtrans", "flash"])
def test_cells_out_of_position_order(tiny: Any, contexts: list[Ctx], flash: bool) -> None:
    """One unified cache: sequence 1 takes cells 0..299 first, sequence 0 the next ones; once sequence 1 is
    cleared, sequence 0's later positions land in cells 0..299, so its state lists positions 500.. before 0.. .
    Its blocks restore into a cache whose free cells are scattered (sequence 2 holding some of them)."""
    kw: dict[str, Any] = dict(unified=True, n_seq=3, flash=flash)
    c = ctx_of(tiny, **kw)
    contexts.append(c)
    prompt = prompt_of(N_PROMPT, seed=1)
    c.eval(1, prompt_of(300, seed=2))
    c.eval(0, prompt[:500])
    c.clear(1)
    c.eval(0, prompt[500 : 3 * B], 500)
    cold = c.eval(0, prompt[3 * B :], 3 * B)
    state = c.state(0)
    assert first_pos(state) != 0  # the cells are out of position order
    payloads = split(state, 3)
    # a fresh evaluation in order gives the same blocks (but for rounding in another batch split)
    fresh = ctx_of(tiny, **kw)
    contexts.append(fresh)
    fresh.eval(0, prompt[: 3 * B])
    assert first_pos(fresh.state(0)) == 0
    ordered = split(fresh.state(0), 3)
    assert [len(p) for p in ordered] == [len(p) for p in payloads]
    # restore into the used cache: sequence 0 still holds its cells, sequence 2 some (a hole in them), so the
    # free cells the restore takes are not one run
    c.eval(2, prompt_of(40, seed=4))
    c.clear(2, 10, 20)
    blob = join(payloads, 1)
    assert c.restore(2, blob) == len(blob)
    assert c.span(2) == (0, 3 * B - 1)
    assert split(c.state(2), 3) == payloads
    # the same KV bytes, but in other cells than the cold sequence's: the order in which attention adds them up
    # differs (llama.cpp's CPU flash attention accumulates in f16), so the logits agree to 1e-3, not 1e-4
    tol = 2e-3 if flash else 1e-4
    assert_same_logits(c.eval(2, prompt[3 * B :], 3 * B), cold, tol)
    # and into the in-order context
    assert fresh.restore(1, blob) == len(blob)
    assert_same_logits(fresh.eval(1, prompt[3 * B :], 3 * B), cold, tol)


def test_a_sequence_of_whole_blocks_in_order_joins_to_its_own_state(tiny: Any, contexts: list[Ctx]) -> None:
    c = ctx_of(tiny, unified=True, n_seq=2)
    contexts.append(c)
    c.eval(0, prompt_of(2 * B, seed=5))
    state = c.state(0)
    assert bytes(join(split(state, 2), 1)) == state
    assert bytes(join(split(state, 1), 1)) != state


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]])
def test_smollm2_greedy_after_a_restore_is_the_cold_output(
    smol: Any, contexts: list[Ctx], config: dict[str, Any]
) -> None:
    c = ctx_of(smol, n_seq=2, **config)
    contexts.append(c)
    prompt = text_prompt(smol, N_PROMPT)
    c.eval(0, prompt[: 3 * B])
    cold_logits = c.eval(0, prompt[3 * B :], 3 * B)
    cold = c.greedy(0, cold_logits, N_PROMPT, 8)
    payloads = split(c.state(0), 3)  # positions past the prompt (the greedy tokens) are not in the blocks
    # another context, as after a restart
    d = ctx_of(smol, n_seq=2, **config)
    contexts.append(d)
    blob = join(payloads, n_stream_of(d.state(1)))
    assert d.restore(1, blob) == len(blob)
    logits = d.eval(1, prompt[3 * B :], 3 * B)
    assert_same_logits(logits, cold_logits)
    assert d.greedy(1, logits, N_PROMPT, 8) == cold


# ---- refusals: never a crash ----


@pytest.fixture(scope="module")
def sample(tiny: Any) -> Iterator[dict[str, Any]]:
    """A state of N_PROMPT tokens (3 streams), its blocks, and q8_0 blocks of the same prompt."""
    c = Ctx(tiny, flash=False)
    q = Ctx(tiny, kv="q8_0", flash=True)
    try:
        prompt = prompt_of(N_PROMPT, seed=7)
        c.eval(0, prompt)
        q.eval(0, prompt)
        state = c.state(0)
        yield dict(state=state, blocks=split(state, 3), q8=split(q.state(0), 3), empty=c.state(1), ctx=c)
    finally:
        c.close()
        q.close()


def test_a_truncated_or_extended_state_is_unsplittable(sample: dict[str, Any]) -> None:
    state: bytes = sample["state"]
    for cut in (0, 1, 3, 4, 7, 8, 20, len(state) // 2, len(state) - 4, len(state) - 1):
        with pytest.raises(Unsplittable):
            split(state[:cut], 1)
    with pytest.raises(Unsplittable):
        split(state + b"\0", 1)
    for twice in (state + state[8:], state[8:] + state[8:]):  # a sliding-window cache's two states in a row
        with pytest.raises(Unsplittable):
            split(twice, 1)
    with pytest.raises(Unsplittable):
        split(bytes(range(256)) * 40, 1)
    assert issubclass(Unsplittable, ValueError)


def test_positions_missing_are_unsplittable(sample: dict[str, Any], contexts: list[Ctx], tiny: Any) -> None:
    with pytest.raises(Unsplittable, match="positions"):
        split(sample["state"], 4)  # the prompt holds 3 blocks and 20 tokens
    assert len(split(sample["state"], 3)) == 3
    assert split(sample["state"], 0) == []
    with pytest.raises(Unsplittable):
        split(sample["empty"], 1)
    assert split(sample["empty"], 0) == []
    c = ctx_of(tiny)
    contexts.append(c)
    c.eval(0, prompt_of(N_PROMPT, seed=8))
    c.clear(0, 300, 310)  # a hole in block 1
    holed = c.state(0)
    assert len(split(holed, 1)) == 1
    with pytest.raises(Unsplittable, match="positions"):
        split(holed, 2)
    with pytest.raises(ValueError):
        split(sample["state"], -1)


def test_an_empty_state_tells_a_standard_kv_cache(sample: dict[str, Any]) -> None:
    """At load, ``split(empty_state, 0)``: [] for a standard KV cache; Unsplittable for the states of the other
    memories (src/llama-kv-cache-iswa.cpp, llama-memory-recurrent.cpp, llama-memory-hybrid.cpp state_write)."""
    empty: bytes = sample["empty"]
    assert split(empty, 0) == []
    recurrent = struct.pack("<III", 0, 0, 2) + struct.pack("<iQ", 0, 1024) * 2 + struct.pack("<iQ", 0, 4096) * 2
    assert split(empty[8:], 0) == []  # the memory's state alone, without the context's header
    for other in (empty + empty[8:], HEADER + recurrent, recurrent, empty + recurrent, b"", bytes(4), HEADER):
        with pytest.raises(Unsplittable):
            split(other, 0)


def test_join_refuses_blocks_that_do_not_fit(sample: dict[str, Any]) -> None:
    p0, p1, p2 = sample["blocks"]
    q0, q1, _ = sample["q8"]
    assert len(join([p0, p1], 3)) > 0 and len(join([q0, q1], 3)) > 0
    bad: list[list[bytes]] = [
        [],
        [p1],  # does not start at position 0
        [p1, p0],
        [p0, p2],
        [p0, p0],
        [p0, q1],  # another layout (KV type, V transposed or not)
        [q0, p1],
        [p0[:-1]],
        [p0 + b"\0"],
        [p0[:10]],
        [b""],
        [b"CKVB"],
        [bytes(len(p0))],
        [sample["state"]],
    ]
    for payloads in bad:
        with pytest.raises(ValueError):
            join(payloads, 3)
    with pytest.raises(ValueError):
        join([p0], 0)


def test_n_stream_of(sample: dict[str, Any]) -> None:
    assert n_stream_of(sample["empty"]) == 3
    assert n_stream_of(sample["state"]) == 3
    assert n_stream_of(sample["empty"][8:]) == 3  # without the header
    with pytest.raises(Unsplittable):
        n_stream_of(b"\1\0")


def test_llama_cpp_refuses_a_joined_state_of_another_kv_type(sample: dict[str, Any]) -> None:
    """What a restore of the wrong layout does (the cache key keeps it from happening): llama.cpp reads nothing
    and leaves the sequence empty."""
    c: Ctx = sample["ctx"]
    blob = join(sample["q8"], 3)
    assert c.restore(2, blob) == 0
    assert c.span(2)[1] == -1


def test_damaged_states_and_blocks_never_crash(sample: dict[str, Any]) -> None:
    """Random byte changes and cuts: Unsplittable, or (a change in K/V data or a seq id) a result."""
    rng = random.Random(11)
    state: bytes = sample["state"]
    blocks: list[bytes] = sample["blocks"]
    for _ in range(300):
        data = bytearray(rng.choice([state, *blocks]))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(min(len(data), 64 if rng.random() < 0.7 else len(data)))
            data[at] = rng.randrange(256)
        if rng.random() < 0.2:
            del data[rng.randrange(len(data)) :]
        try:
            if data[:4] == kvblocks.MAGIC:
                join([bytes(data), *blocks[1:]], 3)
            else:
                split(bytes(data), 3)
        except Unsplittable:
            pass


# ---- cell formats the test models do not write, on states from an independent writer ----


def write_state(
    n_stream: int,
    stream: int,
    pos: list[int],
    *,
    ext: bool,
    v_trans: bool,
    mla: bool,
    seed: int = 0,
    seq_ids: dict[int, list[int]] | None = None,
) -> tuple[bytes, dict[int, tuple[bytes, ...]]]:
    """A sequence state in llama.cpp's format (src/llama-kv-cache.cpp state_write): two layers, K rows of 6
    bytes, V rows of 4 bytes (or 2 elements of 2 bytes transposed); and, per position, its bytes (ext, K0, K1,
    V0, V1) to compare with. ``seq_ids``: the sequence ids of some cells (by index; else one, 5)."""
    rng = np.random.default_rng(seed)
    n = len(pos)
    ext_rows = rng.integers(-5, 5, size=(n, 3), dtype=np.int32)
    k = [rng.integers(0, 256, size=(n, 6), dtype=np.uint8) for _ in range(2)]
    v = [rng.integers(0, 256, size=(n, 4), dtype=np.uint8) for _ in range(2)]
    out = [struct.pack("<I", n_stream)]
    for s in range(n_stream):
        if s != stream:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", n))
        for i, p in enumerate(pos):
            ids = (seq_ids or {}).get(i, [5])
            out.append(struct.pack("<iI", p, len(ids)))
            if ext:
                out.append(ext_rows[i].astype("<i4").tobytes())
            out.append(struct.pack(f"<{len(ids)}i", *ids))
        out.append(struct.pack("<II", int(v_trans), 2))
        for layer in k:
            out.append(struct.pack("<iQ", 1, 6) + layer.tobytes())
        for layer in [] if mla else v:
            if v_trans:  # 2 elements of 2 bytes: element j of every cell, then element j+1
                els = layer.reshape(n, 2, 2).transpose(1, 0, 2)
                out.append(struct.pack("<iII", 1, 2, 2) + els.tobytes())
            else:
                out.append(struct.pack("<iQ", 1, 4) + layer.tobytes())
    per_pos = {
        p: (ext_rows[i].tobytes() if ext else b"", k[0][i].tobytes(), k[1][i].tobytes())
        + (() if mla else (v[0][i].tobytes(), v[1][i].tobytes()))
        for i, p in enumerate(pos)
    }
    return b"".join(out), per_pos


@pytest.mark.parametrize("ext", [False, True], ids=["plain", "ext"])
@pytest.mark.parametrize("v_trans", [False, True], ids=["vrows", "vtrans"])
@pytest.mark.parametrize("mla", [False, True], ids=["v", "mla"])
def test_written_formats_split_and_join(ext: bool, v_trans: bool, mla: bool) -> None:
    block = 4
    pos = list(range(3 * block + 2))
    random.Random(1).shuffle(pos)
    state, per_pos = write_state(3, 1, pos, ext=ext, v_trans=v_trans, mla=mla)
    assert pos[:3] != [0, 1, 2]
    payloads = split(state, 3, block)
    assert split(HEADER + state, 3, block) == payloads
    full = bytes(join(payloads, 2))
    assert full[:8] == HEADER
    joined = full[8:]
    head = 4 + 4 + (24 if ext else 12) * 3 * block
    assert struct.unpack_from("<II", joined, 0) == (2, 3 * block)  # streams; the cells, all in the first
    # cells in position order: pos, n_seq_id 1, [ext], a seq id
    for p in range(3 * block):
        at = 8 + p * (24 if ext else 12)
        assert struct.unpack_from("<iI", joined, at) == (p, 1)
        if ext:
            assert joined[at + 8 : at + 20] == per_pos[p][0]
    # data: v_trans, layers; per layer K rows in position order, then V
    assert struct.unpack_from("<II", joined, head) == (int(v_trans), 2)
    at = head + 8
    for layer in range(2):
        assert struct.unpack_from("<iQ", joined, at) == (1, 6)
        at += 12
        assert joined[at : at + 6 * 3 * block] == b"".join(per_pos[p][1 + layer] for p in range(3 * block))
        at += 6 * 3 * block
    for layer in [] if mla else range(2):
        if v_trans:
            assert struct.unpack_from("<iII", joined, at) == (1, 2, 2)
            at += 12
            rows = [per_pos[p][3 + layer] for p in range(3 * block)]
            assert joined[at : at + 4 * 3 * block] == b"".join(r[:2] for r in rows) + b"".join(r[2:] for r in rows)
        else:
            assert struct.unpack_from("<iQ", joined, at) == (1, 4)
            at += 12
            assert joined[at : at + 4 * 3 * block] == b"".join(per_pos[p][3 + layer] for p in range(3 * block))
        at += 4 * 3 * block
    assert joined[at:] == bytes(4)  # the second stream: empty
    # a joined state splits back into the same blocks
    assert split(full, 3, block) == payloads


def test_written_states_with_duplicate_positions_or_shared_cells_are_unsplittable() -> None:
    kw: dict[str, Any] = dict(ext=False, v_trans=False, mla=False)
    state, _ = write_state(1, 0, list(range(12)), **kw)
    assert len(split(state, 3, 4)) == 3
    with pytest.raises(Unsplittable, match="positions"):
        split(write_state(1, 0, [*range(12), 5], **kw)[0], 3, 4)  # position 5 twice
    # cells of two sequences or none (a whole-context state): even where the bytes line up so that reading every
    # cell as one sequence's gives the same positions (the cell before position 2 has no id, position 2's two)
    shared, _ = write_state(1, 0, [0, 1, 3, 2, *range(4, 12)], seq_ids={2: [], 3: [5, 6]}, **kw)
    assert len(shared) == len(state)
    with pytest.raises(Unsplittable, match="one sequence"):
        split(shared, 3, 4)


def test_the_block_size_is_the_stores() -> None:
    from daemon.runners import kvstore

    assert BLOCK_TOKENS == kvstore.BLOCK_TOKENS


def test_a_state_in_a_numpy_buffer_or_memoryview(sample: dict[str, Any]) -> None:
    """The engine keeps states in numpy buffers bigger than the state (llama_state_seq_get_data's first bytes)."""
    state: bytes = sample["state"]
    buffer = np.zeros(len(state) + 100, dtype=np.uint8)
    buffer[: len(state)] = np.frombuffer(state, dtype=np.uint8)
    want = sample["blocks"]
    assert split(buffer[: len(state)], 3) == want
    assert split(memoryview(buffer)[: len(state)], 3) == want
    assert split(memoryview(buffer)[8 : len(state)], 3) == want  # without the header
    assert bytes(join([memoryview(p) for p in want], 3)) == bytes(join(want, 3))
    with pytest.raises(Unsplittable):
        split(buffer, 3)  # the whole buffer: bytes after the state
