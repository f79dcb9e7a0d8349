"""Scripted test models for the browser tests: a tiny llama GGUF whose greedy (and near-greedy) decoding emits a
fixed list of pieces, in order, whatever the prompt.

How: every attention-output and FFN-down weight is zero, so each layer adds nothing to the residual stream and the
last position's hidden state is its token's embedding alone; the logits are then ``output · rmsnorm(embedding)``,
a function of the last token only. Each scripted piece is its own vocabulary token with a one-hot embedding
(dimension ``i + 1`` for piece ``i``); every other token (the prompt's bytes, BOS) shares dimension 0. The output
row of piece 0 reads dimension 0, the row of piece ``i`` reads piece ``i - 1``'s dimension, and end-of-text reads
the last piece's, so a prompt ending in any non-scripted token starts the script and each piece is followed by the
next one (by a margin of about 80 in the logits: any sampling temperature in common use stays on script).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

MARGIN = 10.0  # output weight of a successor; times rmsnorm's sqrt(n_embd) = 8 for one-hot embeddings


def write_scripted_gguf(
    path: Path | str, script: Sequence[str], *, loop: bool = False, chat_template: str | None = None
) -> Path:
    """Write a GGUF that answers ``"".join(script)`` (then ends, or with ``loop`` starts the script again forever).

    Pieces are SentencePiece tokens: a space is written as "▁" in the vocabulary and comes back as a space. Each
    piece must be unique (one token per position in the script)."""
    import gguf

    pieces = [p.replace(" ", "\u2581") for p in script]
    if not pieces or len(set(pieces)) != len(pieces):
        raise ValueError("the script needs at least one piece and no piece twice")
    path = Path(path)
    n_script = len(pieces)
    n_embd = max(64, -(-(n_script + 1) // 32) * 32)  # a dimension per piece plus the shared one
    n_head, n_head_kv, n_ff, n_layer = 2, 1, 64, 1
    head_dim = n_embd // n_head
    byte_tokens = [f"<0x{b:02X}>".encode() for b in range(256)]
    tokens = [b"<unk>", b"<s>", b"</s>", *byte_tokens, *(p.encode() for p in pieces)]
    first = 3 + len(byte_tokens)  # id of piece 0
    vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("corral-ui-scripted")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * len(byte_tokens) + [1] * n_script)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    embd = np.zeros((vocab, n_embd), np.float32)
    embd[:, 0] = 1.0
    out = np.zeros((vocab, n_embd), np.float32)
    out[first, 0] = MARGIN
    for i in range(n_script):
        tok = first + i
        embd[tok, 0] = 0.0
        embd[tok, i + 1] = 1.0
        successor = first + i + 1 if i + 1 < n_script else (first if loop else 2)
        out[successor, i + 1] = MARGIN
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", out)
    rng = np.random.default_rng(0)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for name, rows in (("attn_q", n_embd), ("attn_k", n_head_kv * head_dim), ("attn_v", n_head_kv * head_dim)):
            w.add_tensor(f"blk.{i}.{name}.weight", (rng.standard_normal((rows, n_embd)) * 0.02).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((n_embd, n_embd), np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", (rng.standard_normal((n_ff, n_embd)) * 0.02).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", (rng.standard_normal((n_ff, n_embd)) * 0.02).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((n_embd, n_ff), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
