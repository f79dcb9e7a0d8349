"""The runner's other services besides generating and embedding: reranking documents against a query, and turning
text into token ids and back. The routes (``daemon/api/routes/rerank.py``) read the wire shapes; this module loads
the right runner and asks it.

Rerank needs a reranker GGUF (``<arch>.pooling_type`` = 4, rank: a cross-encoder with a classifier head, or a
causal reranker such as Qwen3-Reranker); its runner is loaded for embeddings with pooling rank
(``LoadSpec.rerank``) and scores every query/document pair in as few ``llama_decode`` calls as fit the batch.
Scores are the model's raw output, as llama-server returns them, sorted best first.

Tokenize and detokenize run on whatever runner holds the model (a loaded one is used as it is; else the model's
ordinary runner is loaded: its generation runner, or its embedding/rerank runner for such models).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from daemon.chat.types import JSONObject
from daemon.generation.calls import KeepAlive
from daemon.generation.inference import Inference, ModelContext, keep_alive_value
from daemon.runners.base import LoadSpec, Piece
from errors import InvalidRequest

POOLING_RANK = 4  # LLAMA_POOLING_TYPE_RANK


def is_reranker(ctx: ModelContext) -> bool:
    meta = ctx.info.metadata
    value = meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
    return isinstance(value, int) and not isinstance(value, bool) and value == POOLING_RANK


@dataclass(frozen=True, kw_only=True)
class RerankCall:
    """Documents to score against a query (Ollama-style /api/rerank; llama-server's and Jina/Cohere's /v1/rerank)."""

    model: str
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None  # 0 or None: every document (llama-server's default)
    truncate: bool = True
    options: JSONObject = field(default_factory=dict)
    keep_alive: KeepAlive = None


@dataclass(frozen=True)
class Ranked:
    """The documents' scores, best first, with what reranking them took."""

    order: tuple[int, ...]  # document indexes, best first (top_n of them)
    scores: tuple[float, ...]  # by document index
    prompt_tokens: int
    load_duration: float  # seconds
    total_duration: float  # seconds


async def rerank(inf: Inference, call: RerankCall, started: float) -> Ranked:
    ctx = await inf.lookup(call.model)
    if not is_reranker(ctx):
        raise InvalidRequest(f'model "{call.model}" does not support reranking')
    opts = inf.options(ctx, call.options)
    spec = dataclasses.replace(inf.load_spec(ctx, opts, embedding=True), rerank=True)
    documents = list(call.documents)
    async with await inf.acquire(ctx, spec, keep_alive_value(call.keep_alive)) as lease:
        scores, count = await lease.call(lambda runner: runner.rerank(call.query, documents, truncate=call.truncate))
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
    if call.top_n is not None and call.top_n > 0:
        order = order[: call.top_n]
    return Ranked(
        order=tuple(order),
        scores=tuple(scores),
        prompt_tokens=count,
        load_duration=lease.load_duration,
        total_duration=time.monotonic() - started,
    )


async def _spec_for(inf: Inference, ctx: ModelContext, options: JSONObject) -> LoadSpec:
    """The spec of the runner that holds this model now, else of the model's ordinary runner."""
    serving = inf.scheduler.serving(ctx.ref.key)
    if serving is not None:
        return serving
    opts = inf.options(ctx, options)
    if is_reranker(ctx):
        return dataclasses.replace(inf.load_spec(ctx, opts, embedding=True), rerank=True)
    return inf.load_spec(ctx, opts, embedding="embedding" in ctx.capabilities and "completion" not in ctx.capabilities)


async def tokenize(
    inf: Inference,
    model: str,
    content: str,
    *,
    add_special: bool,
    with_pieces: bool,
    options: JSONObject,
    keep_alive: KeepAlive,
) -> tuple[list[int], list[Piece] | None]:
    """The token ids of ``content`` and, when asked, each token's text."""
    ctx = await inf.lookup(model)
    spec = await _spec_for(inf, ctx, options)
    async with await inf.acquire(ctx, spec, keep_alive_value(keep_alive)) as lease:
        tokens = await lease.call(lambda runner: runner.tokenize(content, add_special=add_special))
        if not with_pieces:
            return tokens, None
        return tokens, await lease.runner.token_pieces(tokens)


async def detokenize(
    inf: Inference, model: str, tokens: list[int], *, options: JSONObject, keep_alive: KeepAlive
) -> str:
    """The text of ``tokens``, each checked against the model's vocabulary first."""
    ctx = await inf.lookup(model)
    spec = await _spec_for(inf, ctx, options)
    async with await inf.acquire(ctx, spec, keep_alive_value(keep_alive)) as lease:
        n_vocab = lease.runner.info().get("n_vocab")
        if not isinstance(n_vocab, int) or n_vocab <= 0:
            raise InvalidRequest("this model's vocabulary size is unknown; cannot check the token ids")
        for i, t in enumerate(tokens):
            if not 0 <= t < n_vocab:
                raise InvalidRequest(
                    f"invalid token id {t} (tokens[{i}]): this model's vocabulary has ids 0 to {n_vocab - 1}"
                )
        return await lease.call(lambda runner: runner.detokenize(list(tokens))) if tokens else ""
