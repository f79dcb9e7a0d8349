"""Draft models for speculative decoding (issue 28): a ``draft_model`` name resolved to a model in the store, and the
check that the draft shares its target's vocabulary.

The check follows llama.cpp's ``common_speculative_are_compatible`` (common/speculative.cpp), done here on the two
GGUF headers before any runner starts: the same tokenizer type (``tokenizer.ggml.model``); the same "add BOS" flag
and, when BOS is added, the same BOS id (likewise EOS); token lists of lengths at most 128 apart (converters pad a
vocabulary to a multiple of some size), and the same token texts from id 5 on over the length both have (ids 0-4 are
special tokens that families number differently without changing the text pieces).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.models.catalog import Catalog
from errors import InvalidGGUF, InvalidRequest, ModelNotFound
from registry.gguf import GGUFInfo, read_gguf_file
from registry.manifest import MEDIA_ADAPTER, MEDIA_MODEL
from registry.names import ModelName

VOCAB_SIZE_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
FIRST_CHECKED_TOKEN = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID

# llama.cpp's defaults for a GGUF without the add_bos/add_eos/bos/eos keys, by tokenizer type (llama-vocab.cpp):
# (add_bos, bos id, add_eos, eos id); a type not listed compares the keys as written
_DEFAULTS: dict[str, tuple[bool, int, bool, int]] = {
    "llama": (True, 1, False, 2),
    "gpt2": (False, 11, False, 11),
    "bert": (True, 101, False, -1),
    "t5": (False, -1, True, 1),
}


@dataclass(frozen=True)
class Vocab:
    """What of a model's tokenizer decides whether another model can draft for it."""

    model: str  # tokenizer.ggml.model: llama (SentencePiece), gpt2 (BPE), bert (WordPiece), t5 (Unigram)...
    add_bos: bool | None
    bos: int | None
    add_eos: bool | None
    eos: int | None
    tokens: tuple[str, ...]


def vocab_from(info: GGUFInfo) -> Vocab:
    """The vocabulary of a GGUF header read with its token list (``keep_arrays``)."""
    meta = info.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = info.array_length("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or len(tokens) != n_tokens:
        raise InvalidRequest(f"the token list of the model ({n_tokens} tokens) is too large to compare")
    model = meta.get("tokenizer.ggml.model")
    model = model if isinstance(model, str) else ""
    defaults = _DEFAULTS.get(model)

    def flag(key: str, at: int) -> bool | None:
        v = meta.get(key)
        if isinstance(v, bool):
            return v
        return None if defaults is None else bool(defaults[at])

    def token_id(key: str, at: int) -> int | None:
        v = meta.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        return None if defaults is None else int(defaults[at])

    return Vocab(
        model=model,
        add_bos=flag("tokenizer.ggml.add_bos_token", 0),
        bos=token_id("tokenizer.ggml.bos_token_id", 1),
        add_eos=flag("tokenizer.ggml.add_eos_token", 2),
        eos=token_id("tokenizer.ggml.eos_token_id", 3),
        tokens=tuple(str(t) for t in tokens),
    )


def mismatch(target: Vocab, draft: Vocab) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (llama.cpp's rule, in words), or None when it can."""
    if target.model != draft.model:
        return f'their tokenizers differ ("{target.model or "none"}" and "{draft.model or "none"}")'
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        return f"their BOS tokens differ (add: {target.add_bos} and {draft.add_bos}, id: {target.bos} and {draft.bos})"
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        return f"their EOS tokens differ (add: {target.add_eos} and {draft.add_eos}, id: {target.eos} and {draft.eos})"
    n_t, n_d = len(target.tokens), len(draft.tokens)
    if abs(n_t - n_d) > VOCAB_SIZE_SLACK:
        return f"their vocabularies differ in size ({n_t} and {n_d} tokens, at most {VOCAB_SIZE_SLACK} apart)"
    common = min(n_t, n_d)
    if target.tokens[FIRST_CHECKED_TOKEN:common] != draft.tokens[FIRST_CHECKED_TOKEN:common]:
        at = next(i for i in range(FIRST_CHECKED_TOKEN, common) if target.tokens[i] != draft.tokens[i])
        return f"their vocabularies differ at token {at} ({_show(target.tokens[at])} and {_show(draft.tokens[at])})"
    return None


def _show(text: str) -> str:
    text = repr(text)
    return text if len(text) <= 40 else text[:37] + "..."


_VOCABS: OrderedDict[str, Vocab] = OrderedDict()  # by blob path: blobs never change
_VERDICTS: dict[tuple[str, str], str | None] = {}  # (target path, draft path) -> mismatch()
_LOCK = threading.Lock()


def vocab_of(path: str) -> Vocab:
    """The vocabulary of the GGUF at ``path`` (the last few remembered: a token list is megabytes)."""
    with _LOCK:
        hit = _VOCABS.get(path)
        if hit is not None:
            _VOCABS.move_to_end(path)
            return hit
    try:
        info = read_gguf_file(path, keep_arrays=True)
    except (InvalidGGUF, OSError) as exc:
        raise InvalidRequest(f"cannot read the vocabulary of {Path(path).name}: {exc}") from None
    vocab = vocab_from(info)
    with _LOCK:
        _VOCABS[path] = vocab
        while len(_VOCABS) > 4:
            _VOCABS.popitem(last=False)
    return vocab


def verdict(target_path: str, draft_path: str) -> str | None:
    """:func:`mismatch` of two model files, remembered per pair (it is asked on every request that drafts)."""
    key = (target_path, draft_path)
    with _LOCK:
        if key in _VERDICTS:
            return _VERDICTS[key]
    result = None if target_path == draft_path else mismatch(vocab_of(target_path), vocab_of(draft_path))
    with _LOCK:
        if len(_VERDICTS) >= 1024:
            _VERDICTS.clear()
        _VERDICTS[key] = result
    return result


@dataclass(frozen=True)
class Draft:
    """A draft model resolved in the store: its name (short) and its GGUF model blob."""

    name: str
    model: ModelName  # as stored (its manifest's name)
    path: Path
    info: GGUFInfo  # its header without the token list (the memory estimate reads it)


def find_draft(catalog: Catalog, raw: str, *, model: str) -> Draft:
    """The model ``raw`` names, as a draft for ``model``: a 400 when it is not in the store, has no GGUF model
    layer, carries an adapter (the runner loads a draft's weights alone) or is an embedding model."""
    try:
        stored = catalog.get(raw)
    except ModelNotFound:
        raise InvalidRequest(
            f"draft model '{raw}' not found (draft_model of '{model}'); pull it or create it first, "
            "or name another draft_model"
        ) from None
    layer = stored.manifest.first(MEDIA_MODEL)
    if layer is None:
        raise InvalidRequest(f"draft model '{raw}' has no GGUF model layer and cannot draft for '{model}'")
    if stored.manifest.first(MEDIA_ADAPTER) is not None:
        raise InvalidRequest(
            f"draft model '{raw}' has an ADAPTER; a draft is loaded without adapters, so name a model without one"
        )
    info = catalog.gguf(layer.digest)
    if info.has_pooling:
        raise InvalidRequest(f"draft model '{raw}' is an embedding model and cannot draft for '{model}'")
    return Draft(name=stored.name.short(), model=stored.name, path=catalog.store.blob_path(layer.digest), info=info)


def check_vocabulary(model: str, model_path: str, draft: Draft, *, raw: str | None = None) -> None:
    """A 400 naming both models when ``draft`` does not share the vocabulary of ``model`` (at ``model_path``)."""
    reason = verdict(model_path, str(draft.path))
    if reason is not None:
        raise InvalidRequest(
            f"draft model '{raw or draft.name}' cannot draft for '{model}': {reason}; a draft model must share "
            "its target's vocabulary (a smaller or more quantized model of the same family)"
        )


def draft_option(params: dict[str, Any]) -> str:
    """The ``draft_model`` of merged options or parameters ("" for none)."""
    value = params.get("draft_model")
    return value.strip() if isinstance(value, str) else ""
