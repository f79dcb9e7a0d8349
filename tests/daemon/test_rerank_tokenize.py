"""``/api/rerank``, ``/v1/rerank``, ``/api/tokenize`` and ``/api/detokenize`` through a real daemon and real runners.

Rerank uses the tiny BERT reranker of tests/models.py (``write_tiny_reranker``). Its weights are random only in
the token embeddings; the rest is built so that the score means something: every token attends to [CLS] and to
its own copies, so a word that the query and the document share carries less of [CLS]'s feature, and the head scores
that loss. A document sharing words with the query scores above one sharing none (0 exactly), more shared words
score higher. ``tiny_reranker_scores`` computes the same forward pass in numpy from the same weights, so the daemon's
scores are checked number for number, not only in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, tiny_reranker_ids, tiny_reranker_scores, write_tiny_reranker

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")

QUERY = "apple banana"
DOCS = ["dog eat fish", "apple banana cherry", "the sky is blue", "banana grape", "apple banana"]


def create(client: ollama.Client, name: str, gguf: Path) -> None:
    digest = client.create_blob(gguf)
    client.create(model=name, files={gguf.name: digest}, stream=False)


@pytest.fixture(scope="module")
def rr_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("rerank")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    client = ollama.Client(host=d.url)
    try:
        create(client, "rr", write_tiny_reranker(tmp / "rr.gguf"))
        if SMOL is not None:
            create(client, "smol", SMOL)
        yield d
    finally:
        stop_daemon(d)


def pair_tokens(query: str, doc: str) -> int:
    return 2 + len(tiny_reranker_ids(query)) + len(tiny_reranker_ids(doc))  # [CLS] query [SEP] document


def expected_order(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


# -- rerank ----------------------------------------------------------------------------------------------------------
def test_rerank_orders_relevant_above_irrelevant(rr_daemon: Daemon) -> None:
    ref = tiny_reranker_scores(QUERY, DOCS)
    # the built weights: more shared words, higher score; none shared, 0
    assert ref[4] > ref[1] > ref[3] > 0.1 and abs(ref[0]) < 1e-3 and abs(ref[2]) < 1e-3
    r = httpx.post(rr_daemon.url + "/api/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "rr" and body["object"] == "list"
    results = body["results"]
    assert [x["index"] for x in results][:3] == [4, 1, 3]  # the ties at 0 (indices 0, 2) in any order after
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    for x in results:
        assert x["relevance_score"] == pytest.approx(ref[x["index"]], abs=2e-3)
        assert "document" not in x
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    n = sum(pair_tokens(QUERY, d) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert body["total_duration"] > 0 and body["load_duration"] >= 0


def test_rerank_top_n_and_return_documents(rr_daemon: Daemon) -> None:
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[3]]  # Jina/Cohere's object form too
    r = httpx.post(
        rr_daemon.url + "/api/rerank",
        timeout=120,
        json={"model": "rr", "query": QUERY, "documents": docs, "top_n": 2, "return_documents": True},
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [1, 2]
    assert [x["document"] for x in results] == [{"text": DOCS[1]}, {"text": DOCS[3]}]
    # usage counts every document scored, not only the top_n returned
    assert r.json()["usage"]["total_tokens"] == sum(pair_tokens(QUERY, d) for d in (DOCS[0], DOCS[1], DOCS[3]))


def test_v1_rerank_plain_httpx(rr_daemon: Daemon) -> None:
    ref = tiny_reranker_scores(QUERY, DOCS)
    r = httpx.post(
        rr_daemon.url + "/v1/rerank",
        timeout=120,
        json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3, "return_documents": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "object", "results", "usage"}
    assert [x["index"] for x in body["results"]] == [4, 1, 3]
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(ref[x["index"]], abs=2e-3)
        assert x["document"] == {"text": DOCS[x["index"]]}
    # errors in OpenAI's shape on /v1
    r = httpx.post(rr_daemon.url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": []}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "documents" in r.json()["error"]["message"]
    r = httpx.post(rr_daemon.url + "/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_rerank_many_documents_over_several_decodes(rr_daemon: Daemon) -> None:
    """num_ctx 32 (so num_batch 32): ~7-token pairs, four to a llama_decode, 40 documents in ten decodes, each
    score still its own pair's."""
    words = ["apple", "banana", "cherry", "dog", "sky", "moon", "river", "red", "big", "cold"]
    docs = [f"{words[i % 10]} {words[(i * 3) % 10]} {words[(i * 7 + 1) % 10]}" for i in range(40)]
    query = "apple moon cold"
    ref = tiny_reranker_scores(query, docs)
    r = httpx.post(
        rr_daemon.url + "/api/rerank",
        timeout=120,
        json={"model": "rr", "query": query, "documents": docs, "options": {"num_ctx": 32}},
    )
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert len(got) == 40
    for i, score in got.items():
        assert score == pytest.approx(ref[i], abs=2e-3), (i, docs[i])
    assert [x["relevance_score"] for x in r.json()["results"]] == sorted(got.values(), reverse=True)


def test_rerank_truncates_long_documents_unless_told_not_to(rr_daemon: Daemon) -> None:
    long_doc = " ".join(["sky"] * 60) + " apple"
    opts = {"num_ctx": 32}
    r = httpx.post(
        rr_daemon.url + "/api/rerank",
        timeout=120,
        json={"model": "rr", "query": QUERY, "documents": [long_doc, "apple"], "options": opts},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["total_tokens"] == 32 + pair_tokens(QUERY, "apple")  # cut to the 32 that fit
    cut = " ".join(["sky"] * (32 - 4))
    by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert by_index[0] == pytest.approx(tiny_reranker_scores(QUERY, [cut])[0], abs=2e-3)
    r = httpx.post(
        rr_daemon.url + "/api/rerank",
        timeout=120,
        json={"model": "rr", "query": QUERY, "documents": [long_doc], "options": opts, "truncate": False},
    )
    assert r.status_code == 400 and "tokens" in r.json()["error"]


def test_rerank_bad_requests(rr_daemon: Daemon) -> None:
    url = rr_daemon.url + "/api/rerank"
    for body, word in (
        ({"model": "rr", "query": QUERY, "documents": []}, "documents"),  # as llama-server: 400
        ({"model": "rr", "query": QUERY}, "documents"),
        ({"model": "rr", "documents": ["x"]}, "query"),
        ({"model": "rr", "query": 3, "documents": ["x"]}, "query"),
        ({"model": "rr", "query": QUERY, "documents": ["x", 5]}, "documents[1]"),
        ({"model": "rr", "query": QUERY, "documents": ["x"], "top_n": -1}, "top_n"),
    ):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert word in r.json()["error"], (body, r.json())
    r = httpx.post(url, json={"model": "missing", "query": "q", "documents": ["d"]}, timeout=60)
    assert r.status_code == 404


def test_reranker_refuses_embeddings(rr_daemon: Daemon) -> None:
    r = httpx.post(rr_daemon.url + "/api/embed", json={"model": "rr", "input": "apple"}, timeout=120)
    assert r.status_code == 400 and "rerank" in r.json()["error"]


@needs_smol
@pytest.mark.real_model
def test_rerank_refuses_a_model_that_is_not_a_reranker(rr_daemon: Daemon) -> None:
    r = httpx.post(rr_daemon.url + "/api/rerank", json={"model": "smol", "query": "q", "documents": ["d"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"] == 'model "smol" does not support reranking'
    r = httpx.post(rr_daemon.url + "/v1/rerank", json={"model": "smol", "query": "q", "documents": ["d"]}, timeout=60)
    assert r.status_code == 400 and "does not support reranking" in r.json()["error"]["message"]


# -- tokenize / detokenize -------------------------------------------------------------------------------------------
TEXTS = ["Hello, world! The quick brown fox.", "  leading spaces and\nnew lines\t", "naïve café – 日本語 🙂", ""]


@needs_smol
@pytest.mark.real_model
def test_tokenize_equals_llama_cpp_and_round_trips(rr_daemon: Daemon) -> None:
    from llama_cpp import Llama

    ref = Llama(model_path=str(SMOL), vocab_only=True, verbose=False)  # tokenizer only: safe in-process
    with rr_daemon.client() as h:
        for text in TEXTS:
            for add_special in (False, True):
                r = h.post("/api/tokenize", json={"model": "smol", "content": text, "add_special": add_special})
                assert r.status_code == 200, r.text
                tokens = r.json()["tokens"]
                assert tokens == ref.tokenize(text.encode(), add_bos=add_special, special=True), (text, add_special)
            r = h.post("/api/tokenize", json={"model": "smol", "content": text})  # add_special: false by default
            assert r.json()["tokens"] == ref.tokenize(text.encode(), add_bos=False, special=True)
            back = h.post("/api/detokenize", json={"model": "smol", "tokens": r.json()["tokens"]})
            assert back.status_code == 200 and back.json() == {"content": text}


@needs_smol
@pytest.mark.real_model
def test_tokenize_with_pieces(rr_daemon: Daemon) -> None:
    from llama_cpp import Llama

    ref = Llama(model_path=str(SMOL), vocab_only=True, verbose=False)
    text = "Hi there 龘 ok"
    with rr_daemon.client() as h:
        r = h.post("/api/tokenize", json={"model": "smol", "content": text, "with_pieces": True})
        assert r.status_code == 200, r.text
        items = r.json()["tokens"]
    assert [x["id"] for x in items] == ref.tokenize(text.encode(), add_bos=False, special=True)
    raw = b""
    for x in items:
        piece = x["piece"]
        raw += piece.encode() if isinstance(piece, str) else bytes(piece)  # a part of a character: its bytes
        if isinstance(piece, list):
            assert all(isinstance(b, int) and 0 <= b < 256 for b in piece)
    assert raw.decode() == text
    assert any(isinstance(x["piece"], list) for x in items)  # 龘 is split over byte tokens


@needs_smol
@pytest.mark.real_model
def test_detokenize_refuses_bad_ids(rr_daemon: Daemon) -> None:
    with rr_daemon.client() as h:
        n_vocab = 49152  # SmolLM2's
        assert h.post("/api/detokenize", json={"model": "smol", "tokens": [n_vocab - 1]}).status_code == 200
        for tokens in ([n_vocab], [1, -1], [2**40], ["1"], [1.5], [True], "12"):
            r = h.post("/api/detokenize", json={"model": "smol", "tokens": tokens})
            assert r.status_code == 400, (tokens, r.text)
            assert "token" in r.json()["error"]
        r = h.post("/api/detokenize", json={"model": "smol", "tokens": [5, n_vocab + 7]})
        assert (
            r.json()["error"] == f"invalid token id {n_vocab + 7} (tokens[1]): this model's vocabulary has ids "
            f"0 to {n_vocab - 1}"
        )
        assert h.post("/api/detokenize", json={"model": "smol", "tokens": []}).json() == {"content": ""}
        # the runner is still there after all of these
        r = h.post("/api/tokenize", json={"model": "smol", "content": "ok"})
        assert r.status_code == 200 and r.json()["tokens"]


def test_tokenize_on_the_reranker(rr_daemon: Daemon) -> None:
    """A reranker tokenizes on its rerank runner (no generation runner for a model that cannot generate)."""
    with rr_daemon.client() as h:
        r = h.post("/api/tokenize", json={"model": "rr", "content": "Apple banana zebra", "add_special": True})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [2] + tiny_reranker_ids("apple banana zebra") + [3]  # [CLS] ... [SEP]
        r = h.post("/api/detokenize", json={"model": "rr", "tokens": tiny_reranker_ids("apple banana")})
        assert r.json()["content"].split() == ["apple", "banana"]
