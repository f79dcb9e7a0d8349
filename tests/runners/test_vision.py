"""daemon/llama/vision.py: image bounds and sniffing (pure), and images through the test projector into SmolLM2
in-process (in a child process, so a native fault cannot take pytest down)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from daemon.llama.vision import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_SIDE,
    MediaPrompt,
    Segment,
    check_image,
    image_hash,
    image_key,
)
from tests.models import smollm2_path
from tests.vision import N_IMAGE_TOKENS, image_bytes, png_bytes, projector_path, write_projector

REPO = Path(__file__).resolve().parents[2]
SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")


# -- pure: fixtures and header checks --------------------------------------------------------------------------------


def test_image_bytes_is_deterministic_png() -> None:
    a, b = image_bytes(0), image_bytes(1)
    assert a == image_bytes(0)
    assert a != b
    assert check_image(a).format == "png"
    assert (check_image(a).width, check_image(a).height) == (64, 64)


def test_projector_is_deterministic(tmp_path: Path) -> None:
    one = write_projector(tmp_path / "a.gguf").read_bytes()
    two = write_projector(tmp_path / "b.gguf").read_bytes()
    assert one == two
    assert projector_path().read_bytes() == one  # the cached file is this layout


def _png_header(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def _jpeg_header(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof0 + b"\xff\xd9"


def test_check_image_reads_sizes() -> None:
    assert check_image(_png_header(300, 200)) == check_image(_png_header(300, 200))
    assert (check_image(_png_header(300, 200)).width, check_image(_png_header(300, 200)).height) == (300, 200)
    jpeg = check_image(_jpeg_header(640, 480))
    assert (jpeg.format, jpeg.width, jpeg.height) == ("jpeg", 640, 480)
    gif = check_image(b"GIF89a" + struct.pack("<HH", 20, 10) + b"\x00" * 8)
    assert (gif.format, gif.width, gif.height) == ("gif", 20, 10)
    bmp = check_image(b"BM" + b"\x00" * 12 + struct.pack("<Iii", 40, 7, -5) + b"\x00" * 30)
    assert (bmp.format, bmp.width, bmp.height) == ("bmp", 7, 5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"hello, this is text", "not a supported image"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "not a supported image"),  # audio: libmtmd would decode it as sound
        (b"ID3\x04\x00\x00\x00\x00\x00\x00", "not a supported image"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WebP"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not a valid PNG"),
        (b"\xff\xd8\xff\xe0\x00\x01", "not a valid JPEG"),
        (_png_header(MAX_IMAGE_SIDE + 1, 10), "pixels a side"),
        (_jpeg_header(10, MAX_IMAGE_SIDE + 1), "pixels a side"),
        (_png_header(0, 10), "empty size"),
        (_png_header(10, 10) + b"\x00" * MAX_IMAGE_BYTES, "over the limit"),
    ],
)
def test_check_image_refuses(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_image(data)


def test_image_hash_is_content_sha256() -> None:
    assert image_hash(image_bytes(0)) == image_hash(image_bytes(0))
    assert image_hash(image_bytes(0)) != image_hash(image_bytes(1))
    assert len(image_hash(b"x")) == 64


def test_prefix_reuse_stops_at_image_starts() -> None:
    h = image_hash(b"x")
    segs = [Segment("text", 3, 3, (5, 6, 7)), Segment("image", 4, 4, image_hash=h), Segment("text", 2, 2, (8, 9))]
    mp = MediaPrompt(None, None, segs)
    assert mp.n_pos == 9 and mp.image_hashes == [h]
    assert mp.cache_key() == [5, 6, 7, *(image_key(h, i) for i in range(4)), 8, 9]
    assert [mp.safe_prefix(n) for n in range(11)] == [0, 1, 2, 3, 3, 3, 3, 7, 8, 9, 9]
    assert mp.segment_at(2) == (0, 2) and mp.segment_at(3) == (1, 0) and mp.segment_at(8) == (2, 1)
    assert mp.segment_at(9) == (3, 0)
    assert image_key(h, 0) != image_key(image_hash(b"y"), 0) and image_key(h, 0) < 0


def test_daemon_side_helpers_do_not_load_llama_cpp() -> None:
    code = "import sys, daemon.llama.vision as v; v.check_image(b'GIF89a\\x01\\x00\\x01\\x00'); "
    code += "print(any(m.startswith('llama_cpp') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- real: SmolLM2 + the test projector, in a child ------------------------------------------------------------------

_CHILD = r"""
import json, sys, ctypes
sys.path.insert(0, sys.argv[2])
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as low
from daemon.llama.vision import Projector
from tests.vision import image_bytes

args = json.loads(sys.argv[1])
original_model, original_ctx = low.llama_model_default_params, low.llama_context_default_params
def model_params():
    p = original_model()
    p.use_extra_bufts = args["extra_bufts"]
    return p
def ctx_params():
    p = original_ctx()
    p.n_seq_max = 2  # a second sequence, as continuous batching uses
    return p
low.llama_model_default_params = model_params
low.llama_context_default_params = ctx_params
llm = llama_cpp.Llama(args["model"], n_ctx=1024, n_batch=256, n_threads=2, n_gpu_layers=0, verbose=False)
lctx = llm._ctx.ctx
mem = llama_cpp.llama_get_memory(lctx)
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
proj = Projector(args["projector"], llm.model, use_gpu=False, n_threads=2)
batch = llama_cpp.llama_batch_init(1, 0, 1)

def greedy(n_past, seq):
    out = []
    for _ in range(8):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        out.append(tok)
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = tok, n_past, 1, 1
        batch.seq_id[0][0] = seq
        assert llama_cpp.llama_decode(lctx, batch) == 0
        n_past += 1
    return out

PROMPT = "<|im_start|>user\nDescribe " + proj.marker + "<|im_end|>\n<|im_start|>assistant\n"

def describe(image, seq=0, segment_by_segment=False):
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    with proj.tokenize(PROMPT, [image]) as mp:
        if segment_by_segment:
            n_past = 0
            for i in range(len(mp.segments)):
                n_past = proj.eval_segment(mp, i, lctx, n_past=n_past, seq_id=seq, n_batch=16,
                                           logits_last=i == len(mp.segments) - 1)
        else:
            n_past = proj.eval(mp, lctx, n_past=0, seq_id=seq, n_batch=256)
        key = mp.cache_key()
        info = {"n_past": n_past, "n_pos": mp.n_pos, "segments": [[s.kind, s.n_pos] for s in mp.segments],
                "hashes": mp.image_hashes, "key": key}
    info["tokens"] = greedy(n_past, seq)
    return info

def reuse_text_prefix(cached_key, image, seq=0):
    # the KV of seq holds a prompt with key cached_key: keep the prefix it shares with this prompt (cut back to an
    # image boundary), evaluate the rest
    with proj.tokenize(PROMPT, [image]) as mp:
        key = mp.cache_key()
        shared = 0
        while shared < min(len(key), len(cached_key)) and key[shared] == cached_key[shared]:
            shared += 1
        keep = mp.safe_prefix(shared)
        start, offset = mp.segment_at(keep)
        assert offset == 0, (keep, start, offset)
        llama_cpp.llama_memory_seq_rm(mem, seq, keep, -1)
        n_past = proj.eval(mp, lctx, n_past=keep, seq_id=seq, n_batch=256, from_segment=start)
    return {"shared": shared, "kept": keep, "tokens": greedy(n_past, seq)}

def error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None

A, B = image_bytes(0), image_bytes(1)
res = {"marker": proj.marker, "a": describe(A), "b": describe(B), "a_again": describe(A, seq=1)}
res["a_segments"] = describe(A, seq=1, segment_by_segment=True)
describe(A)
res["b_reusing_a"] = reuse_text_prefix(res["a"]["key"], B)
res["corrupt"] = error(lambda: proj.tokenize("x " + proj.marker, [A[: len(A) // 2]]))
res["garbage"] = error(lambda: proj.tokenize("x " + proj.marker, [b"\x89PNG\r\n\x1a\n" + b"\x00" * 100]))
res["too_many"] = error(lambda: proj.tokenize("x " + proj.marker, [A, B]))
res["too_few"] = error(lambda: proj.tokenize("x " + proj.marker + proj.marker, [A]))
res["after_errors"] = describe(B)

def by_segments(image, prompt, sliced, seq=0):
    # what the runner does: text segments alone, images whole through libmtmd's helper or (sliced) encoded once and
    # decoded 16 embeddings per llama_decode; logits for the prompt's last position, an image's included
    llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
    with proj.tokenize(prompt, [image]) as mp:
        n_past = 0
        for i, s in enumerate(mp.segments):
            last = i == len(mp.segments) - 1
            if s.kind == "image" and sliced:
                assert proj.can_split(mp, i)
                embd = proj.encode(mp, i)
                for o in range(0, len(embd), 16):
                    part = embd[o : o + 16]
                    end = last and o + 16 >= len(embd)
                    proj.decode_embeddings(lctx, part, n_past=n_past, seq_id=seq, logits_last=end)
                    n_past += len(part)
            else:
                n_past = proj.eval_segment(mp, i, lctx, n_past=n_past, seq_id=seq, n_batch=256, logits_last=last)
    return greedy(n_past, seq)

ENDS = "<|im_start|>user\nDescribe " + proj.marker
res["sliced"] = {"a": by_segments(A, PROMPT, True), "b": by_segments(B, PROMPT, True)}
res["ends"] = {k: [by_segments(img, ENDS, sliced) for sliced in (False, True)] for k, img in (("a", A), ("b", B))}
proj.close()
llama_cpp.llama_batch_free(batch)
sys.stdout.write("\nRESULT " + json.dumps(res) + "\n")
"""


@pytest.fixture(scope="module")
def vision_run() -> dict[str, Any]:
    assert SMOL is not None
    projector = str(projector_path())
    for extra in (True, False):  # a native fault with llama.cpp's extra buffer types on: as the runner falls back
        payload = json.dumps({"model": str(SMOL), "projector": projector, "extra_bufts": extra})
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, payload, str(REPO)], capture_output=True, text=True, timeout=300
        )
        if r.returncode < 0 and extra:
            continue
        assert r.returncode == 0, f"vision child failed ({r.returncode}): {r.stderr[-3000:]}"
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                result: dict[str, Any] = json.loads(line[len("RESULT ") :])
                return result
        raise AssertionError(f"no result from the vision child: {r.stderr[-3000:]}")
    raise AssertionError("unreachable")


@pytest.mark.real_model
@needs_smol
def test_images_steer_greedy_output(vision_run: dict[str, Any]) -> None:
    a, b, again = vision_run["a"], vision_run["b"], vision_run["a_again"]
    assert vision_run["marker"] == "<__media__>"
    assert a["tokens"] != b["tokens"], "two different images gave the same greedy output"
    assert a["tokens"] == again["tokens"], "the same image gave different greedy outputs (sequence 0 vs 1)"
    assert [kind for kind, _ in a["segments"]] == ["text", "image", "text"]
    assert a["segments"][1][1] == N_IMAGE_TOKENS
    assert a["n_past"] == a["n_pos"] == sum(n for _, n in a["segments"]) == len(a["key"])
    assert a["hashes"] == [image_hash(image_bytes(0))]
    assert b["hashes"] == [image_hash(image_bytes(1))]


@pytest.mark.real_model
@needs_smol
def test_cache_keys_tell_images_apart(vision_run: dict[str, Any]) -> None:
    a, b = vision_run["a"], vision_run["b"]
    n_text = a["segments"][0][1]
    image_a = a["key"][n_text : n_text + N_IMAGE_TOKENS]
    image_b = b["key"][n_text : n_text + N_IMAGE_TOKENS]
    assert a["key"][:n_text] == b["key"][:n_text] and all(k >= 0 for k in a["key"][:n_text])
    assert all(k < 0 for k in image_a + image_b)  # not token ids
    assert len(set(image_a)) == N_IMAGE_TOKENS and not set(image_a) & set(image_b)
    assert a["key"] == vision_run["a_again"]["key"]


@pytest.mark.real_model
@needs_smol
def test_segment_by_segment_and_prefix_reuse_match_a_full_prefill(vision_run: dict[str, Any]) -> None:
    assert vision_run["a_segments"]["tokens"] == vision_run["a"]["tokens"]
    reuse = vision_run["b_reusing_a"]
    n_text = vision_run["a"]["segments"][0][1]
    assert reuse["shared"] == n_text == reuse["kept"]  # the text before the image is shared, the image is not
    assert reuse["tokens"] == vision_run["b"]["tokens"]


@pytest.mark.real_model
@needs_smol
def test_bad_images_are_value_errors_and_leave_the_context_working(vision_run: dict[str, Any]) -> None:
    assert vision_run["corrupt"] is not None and "cannot decode" in vision_run["corrupt"]
    assert vision_run["garbage"] is not None and "image 1" in vision_run["garbage"]
    assert vision_run["too_many"] is not None and "1 image marker(s) but 2 image(s)" in vision_run["too_many"]
    assert vision_run["too_few"] is not None and "2 image marker(s) but 1 image(s)" in vision_run["too_few"]
    assert vision_run["after_errors"]["tokens"] == vision_run["b"]["tokens"]


def test_png_bytes_round_trip_header() -> None:
    png = png_bytes(3, 2, bytes(range(18)))
    assert check_image(png).width == 3 and check_image(png).height == 2


@pytest.mark.real_model
@needs_smol
def test_sliced_images_and_prompts_that_end_with_one(vision_run: dict[str, Any]) -> None:
    # an image encoded once and decoded in slices (as the runner interleaves it with other sequences) gives what
    # libmtmd's helper gives whole
    assert vision_run["sliced"]["a"] == vision_run["a"]["tokens"]
    assert vision_run["sliced"]["b"] == vision_run["b"]["tokens"]
    # a prompt that ends with its image: logits from the image's last position, whole or sliced, the same
    for key in ("a", "b"):
        whole, sliced = vision_run["ends"][key]
        assert whole == sliced
    assert vision_run["ends"]["a"][0] != vision_run["ends"]["b"][0]
