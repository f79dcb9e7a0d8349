"""Fitting a chat into its context (num_ctx): the oldest messages dropped, found by binary search over renders and
the runner's tokenizations, and the INFO lines that say what was cut (here and, for a prompt the runner cut, in
:func:`log_prompt_cut`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from daemon import logs
from daemon.chat import pipeline
from daemon.chat.types import Message, ThinkValue, Tool
from daemon.generation.inference import ModelContext
from daemon.runners.base import Truncated
from daemon.scheduling.scheduler import Lease
from daemon.templates.offload import offload
from errors import InvalidRequest

log = logging.getLogger(__name__)

TRUNCATE_SECONDS = 30.0  # the most fitting one chat into its context may take
RAISE_CONTEXT = "raise num_ctx (request options or a Modelfile PARAMETER) or CORRAL_CONTEXT_LENGTH to keep it whole"


def log_prompt_cut(model: str, cut: Truncated) -> None:
    """Say, at INFO, that the runner cut a prompt to fit the context (Ollama's "truncating input prompt")."""
    log.info(
        "truncating input prompt model=%s num_ctx=%d prompt_tokens=%d kept_tokens=%d num_keep=%d "
        "(the first num_keep tokens and the last %d were kept; %s)",
        logs.quote(model),
        cut.num_ctx,
        cut.prompt_tokens,
        cut.kept_tokens,
        cut.num_keep,
        cut.kept_tokens - cut.num_keep,
        RAISE_CONTEXT,
    )


FIT_MARGIN = 4  # tokens the runner's tokenizer may add to a text's own (BOS, EOS, a leading space)


async def render_chat(
    lease: Lease,
    ctx: ModelContext,
    msgs: list[Message],
    tools: Sequence[Tool] | None,
    num_ctx: int,
    truncate: bool,
    think: ThinkValue,
) -> str:
    """Render, dropping the oldest non-system messages until the prompt fits num_ctx (the last always stays; with
    none left to drop, the shortest prompt is used). How many to drop is found by binary search, so a long chat
    takes O(log n) renders and tokenizations rather than n, each render in a worker thread (offload); the
    prompt is the one dropping them one at a time gives, as the prompt never grows when a message is dropped.
    Messages dropped are logged at INFO (Ollama logs it only at debug level); what is still too long after that,
    the runner cuts (and that is logged too: :func:`log_prompt_cut`)."""

    async def render(kept: list[Message]) -> str:
        return await offload(pipeline.render, ctx.chat, kept, tools, think)

    text = await render(msgs)
    if not truncate:
        return text
    droppable = [i for i, m in enumerate(msgs[:-1]) if m.role != "system"]
    if not droppable:
        return text
    if len(text.encode("utf-8")) + FIT_MARGIN <= num_ctx:
        # a token covers at least a byte of the text (a word, a special token's name, a byte-fallback token) and the
        # runner adds at most a few (BOS, a leading space): it fits without a round trip to the runner to count it,
        # which every multi-turn chat paid before its first token
        return text
    total = len(await lease.runner.tokenize(text))
    if total <= num_ctx:
        return text
    deadline = time.monotonic() + TRUNCATE_SECONDS

    def without(k: int) -> list[Message]:
        gone = set(droppable[:k])
        return [m for i, m in enumerate(msgs) if i not in gone]

    lo, hi = 1, len(droppable)  # the fewest drops that fit lie in [lo, hi] (hi: all of them, fitting or not)
    fitting: tuple[int, str, int] | None = None
    while lo < hi:
        if time.monotonic() > deadline:
            raise InvalidRequest(
                f"fitting {len(msgs)} messages into the context (num_ctx {num_ctx}) took longer "
                f"than {TRUNCATE_SECONDS:g}s; send fewer or shorter messages"
            )
        mid = (lo + hi) // 2
        text = await render(without(mid))
        n = len(await lease.runner.tokenize(text))
        if n <= num_ctx:
            hi, fitting = mid, (mid, text, n)
        else:
            lo = mid + 1
    if fitting is not None and fitting[0] == lo:
        text, kept = fitting[1], fitting[2]
    else:  # all of them dropped (whether that fits is known only for a single droppable message)
        text = await render(without(lo))
        kept = len(await lease.runner.tokenize(text))
    model = getattr(getattr(lease, "ref", None), "name", None) or getattr(ctx, "raw", "")
    log.info(
        "truncating input messages model=%s num_ctx=%d messages=%d prompt_tokens=%d kept_messages=%d "
        "kept_tokens=%d (the %d oldest non-system messages were dropped; %s)",
        logs.quote(model),
        num_ctx,
        len(msgs),
        total,
        len(msgs) - lo,
        kept,
        lo,
        RAISE_CONTEXT,
    )
    return text
