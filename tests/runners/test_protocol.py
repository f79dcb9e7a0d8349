"""The runner protocol module (daemon/runners/protocol.py): every message survives its encoding, a frame that is
not a message is a ProtocolError that names what is wrong, and docs/runner-protocol.md names every message."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest

from daemon.runners import protocol as p

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "runner-protocol.md"

SPEC = p.LoadSpec(model_path="/m.gguf", adapters=("/a.gguf",), tensor_split=(0.25, 0.75), use_mmap=False)
PARAMS = p.SampleParams(temperature=0.0, stop=("\n",), logit_bias=((3, -100.0), (9, 1.5)), logprobs=2)
INFO = p.RunnerInfo(
    n_ctx=8192,
    n_ctx_train=4096,
    n_vocab=49152,
    n_embd=576,
    n_gpu_layers=0,
    extra_bufts=True,
    flash_attn="auto",
    kv_cache_type="f16",
    num_parallel=2,
    projector=False,
    projector_gpu=False,
    gpu_offload_supported=False,
    pid=123,
    log_lines=("llama_model_loader: loaded",),
)
DONE = p.Done("stop", 5, 100, 3, 200, prompt_cached=2, context=(1, 2, 3), stop_sequence="\n")
EXAMPLES: list[p.Message] = [
    p.LoadOp(SPEC),
    p.GenerateOp(1, p.GenerateRequest("hi", PARAMS, add_special=False, context=(5, 6), images=("aGk=",))),
    p.CancelOp(1),
    p.EmbedOp(2, ("a", "b"), truncate=False),
    p.SlotsOp(3),
    p.TokenizeOp(4, "text", add_special=False),
    p.DetokenizeOp(5, (1, 2)),
    p.RerankOp(6, "q", ("d1", "d2")),
    p.PiecesOp(7, (1, 2)),
    p.SlotSaveOp(8, 1, "chat-42.bin"),
    p.SlotRestoreOp(9, 0, "chat-42.bin"),
    p.SlotEraseOp(10, 3),
    p.AdaptersOp(11, ("/store/blobs/sha256-aa",)),
    p.GenerateOp(12, p.GenerateRequest("hi", PARAMS, adapters=(("/store/blobs/sha256-aa", 0.5), ("/b", 1.0)))),
    p.ShutdownOp(),
    p.StageReply("warm-up"),
    p.LoadedReply(INFO),
    p.LoadErrorReply("no such file", ("line",)),
    p.TokenReply(1, p.Token("a")),
    p.TokenReply(1, p.Token("", {"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": []})),
    p.DoneReply(1, DONE),
    p.TruncatedReply(1, p.Truncated(9000, 4096, 4, 4096)),
    p.ErrorReply(1, "bad grammar", 400),
    p.EmbedReply(2, p.Embedding([[0.5, -1.0]], 3)),
    p.SlotsReply(3, (p.SlotInfo(0, True, 12), p.SlotInfo(1, False, 0))),
    p.TokensReply(4, (1, 2, 3)),
    p.TextReply(5, "ab"),
    p.RerankReply(6, (0.5, -2.0), 17),
    p.PiecesReply(7, ("a", [0xE2, 0x82])),
    p.SlotSavedReply(8, 1, "chat-42.bin", 120, 2_400_512, 12.5),
    p.SlotRestoredReply(9, 0, "chat-42.bin", 120, 2_400_512, 8.25),
    p.SlotErasedReply(10, 3, 77),
    p.AdaptersReply(11, ("/store/blobs/sha256-bb",)),
    p.BatchReply((p.TokenReply(1, p.Token("a")), p.DoneReply(2, DONE))),
]


def decode(data: bytes) -> p.Message:
    stream = io.BytesIO(data)
    payload = p.read_payload(stream)
    assert payload is not None and stream.read() == b""  # one whole frame
    obj = p.parse_payload(payload)
    return p.decode_op(obj) if "op" in obj else p.decode_reply(obj)


def test_every_message_class_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(p.OPS) | set(p.REPLIES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_survives_its_encoding(msg: p.Message) -> None:
    assert decode(p.encode(msg)) == msg


def test_frames_stay_small() -> None:
    """The engine sends a token per sequence and step: its frame holds the text and the request id, nothing more."""
    assert p.encode(p.TokenReply(12, p.Token(" the")))[4:] == b'{"type":"token","id":12,"text":" the"}'
    assert b"stop_sequence" not in p.encode(p.DoneReply(1, dataclasses.replace(DONE, stop_sequence=None)))


def test_sample_params_cross_whole_and_parsed() -> None:
    sent = next(m for m in EXAMPLES if isinstance(m, p.GenerateOp))
    got = decode(p.encode(sent))
    assert isinstance(got, p.GenerateOp)
    assert got.req.params == PARAMS and got.req.params.logit_bias == ((3, -100.0), (9, 1.5))


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ({"op": "launch"}, "unknown operation 'launch'"),
        ({"type": "tokens"}, "tokens reply: field 'id' is missing"),
        ({"op": "generate", "id": 1}, "op generate: field 'req' is missing"),
        ({"op": "embed", "id": "1", "inputs": []}, "field 'id' must be an integer"),
        ({"op": "embed", "id": True, "inputs": []}, "field 'id' must be an integer"),
        ({"op": "tokenize", "id": 1, "text": 5}, "field 'text' must be a string"),
        ({"op": "embed", "id": 1, "inputs": "ab"}, "field 'inputs' must be an array"),
        ({"op": "load", "spec": {"model_path": "m", "use_mmap": 1}}, "field 'use_mmap' must be true or false"),
        (
            {"op": "generate", "id": 1, "req": {"prompt": "x", "params": {"logit_bias": [[1]]}}},
            "field 'params': field 'logit_bias' must be \\[token id, bias\\] pairs",
        ),
        (
            {"op": "generate", "id": 1, "req": {"prompt": "x", "adapters": [["/a"]]}},
            "field 'adapters' must be \\[adapter path, scale\\] pairs",
        ),
        (
            {"type": "done", "id": 1, "done_reason": "tired", "prompt_eval_count": 1, "prompt_eval_duration": 1}
            | {"eval_count": 1, "eval_duration": 1},
            'field \'done_reason\' must be "stop" or "length"',
        ),
        ({"type": "batch", "msgs": [{"type": "token", "id": 1}]}, "token reply: field 'text' is missing"),
    ],
)
def test_a_malformed_message_is_a_clear_error(obj: p.JSONObject, words: str) -> None:
    with pytest.raises(p.ProtocolError, match=words):
        p.decode_op(obj) if "op" in obj else p.decode_reply(obj)


def test_a_frame_that_is_not_an_object_is_a_protocol_error() -> None:
    for data, words in ((b"{nope", "not JSON"), (b"[1]", "JSON list, not an object"), (b"\xff", "not JSON")):
        with pytest.raises(p.ProtocolError, match=words):
            p.parse_payload(data)
    with pytest.raises(p.ProtocolError, match="too large"):
        p.read_payload(io.BytesIO(p.HEADER.pack(p.MAX_FRAME + 1)))
    assert p.read_payload(io.BytesIO(b"")) is None and p.read_payload(io.BytesIO(p.HEADER.pack(5) + b"ab")) is None
    assert p.request_id({"op": "embed", "id": 4}) == 4 and p.request_id({"id": "4"}) is None


def test_every_call_has_its_answer() -> None:
    calls = {m for m in p.OPS if "id" in {f.name for f in dataclasses.fields(m)}} - {p.GenerateOp, p.CancelOp}
    assert set(p.ANSWERS) == calls


def test_the_document_names_every_message() -> None:
    text = DOC.read_text()
    named = set(re.findall(r"`(\w+(?:Op|Reply))`", text))
    classes = {c.__name__ for c in (*p.OPS, *p.REPLIES)}
    assert classes <= named, f"docs/runner-protocol.md does not name {sorted(classes - named)}"
    assert named <= classes, f"docs/runner-protocol.md names {sorted(named - classes)}, which protocol.py lacks"
    for c in (*p.OPS, *p.REPLIES):  # each row gives the wire name too
        wire = c.op if c in p.OPS else c.type  # type: ignore[union-attr]
        assert re.search(rf"\| `{c.__name__}` \| `{wire}` \|", text), f"no table row for {c.__name__}"
