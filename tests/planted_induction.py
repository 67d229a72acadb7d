"""A hand-built 2-layer attention-only induction circuit (TransformerLens native bridge: no MLPs,
no norms, learned positions), weights set by hand, and the repeated-tokens task it solves.

Residual (d_model 5V, V tokens, positions < V): ``tok`` one-hot of the token, ``pos`` one-hot of
the position, ``prev`` (the previous token), ``copy`` (the current token, again), ``out`` (the
answer slot the unembedding reads: logit of token t = GAIN x out[t]).

* L0H0, previous-token head (``PREV``): query position i, key position j, scores BETA [j = i-1];
  its value is the token at j, written to ``prev``.
* L0H1, current-token head (``COPY``): attends to itself, writes the token to ``copy``.
* L1H0, induction head (``INDUCTION``): query = the current token (``tok``), key = ``prev``, so
  it attends to the position after an earlier copy of the current token; its value is that
  position's ``copy``, written to ``out``.
* L1H1: zero.

So the L0H0 -> L1H0 edge acts through K only: the induction head's query reads ``tok`` and its
value reads ``copy``, and no W_Q or W_V of layer 1 reads ``prev``: the Q and V edges from L0H0 are
exactly zero. The embeddings -> L0H0 V edge carries the same information as the K edge (L0H0's
value is its only token input, and K is its only reader).
"""

from __future__ import annotations

import torch

V = 16  # tokens (and positions)
D = 5 * V
TOK, POS, PREV, COPY, OUT = (k * V for k in range(5))
PREV_HEAD, COPY_HEAD, INDUCTION = (0, 0), (0, 1), (1, 0)
BETA, GAIN = 40.0, 8.0


@torch.no_grad()
def planted_induction_model():
    from transformer_lens.config import TransformerBridgeConfig

    import circuitkit as ck

    torch.set_num_threads(1)
    cfg = TransformerBridgeConfig(d_model=D, d_head=V, n_layers=2, n_ctx=V, n_heads=2,
                                  d_vocab=V, attn_only=True, normalization_type=None,
                                  positional_embedding_type="standard", act_fn="relu", seed=0)
    model = ck.load_model(cfg).eval()
    for p in model.parameters():
        p.zero_()
    eye = torch.eye(V)
    emb = model.tok_embed.original_component.weight  # [V, D]
    emb[:, TOK:TOK + V] = eye
    model.pos.original_component.weight[:, POS:POS + V] = eye
    model.unembed.original_component.weight[:, OUT:OUT + V] = GAIN * eye  # logits = x @ W.T

    def proj(layer: int, name: str):  # nn.Linear weight [n_heads * d_head, d_model]
        return getattr(model.blocks[layer].attn.original_component, name).original_component

    def rows(h: int) -> slice:
        return slice(h * V, (h + 1) * V)

    # L0H0: query at i asks for position i-1; key at j is position j; value: the token
    q0, k0, v0, o0 = (proj(0, n).weight for n in "qkvo")
    q0[rows(0), POS:POS + V] = BETA * eye.roll(1, 1)  # [r, c] = 1 iff r = c - 1
    k0[rows(0), POS:POS + V] = eye
    v0[rows(0), TOK:TOK + V] = eye
    o0[PREV:PREV + V, rows(0)] = eye
    # L0H1: attends to itself; writes the token to `copy`
    q0[rows(1), POS:POS + V] = BETA * eye
    k0[rows(1), POS:POS + V] = eye
    v0[rows(1), TOK:TOK + V] = eye
    o0[COPY:COPY + V, rows(1)] = eye
    # L1H0: query the current token, key the previous token, value the copy -> out
    q1, k1, v1, o1 = (proj(1, n).weight for n in "qkvo")
    q1[rows(0), TOK:TOK + V] = BETA * eye
    k1[rows(0), PREV:PREV + V] = eye
    v1[rows(0), COPY:COPY + V] = eye
    o1[OUT:OUT + V, rows(0)] = eye
    return model


def planted_task(n: int = 24, seed: int = 0):
    """``<bos> A A`` (segments of 4..6 distinct tokens) with the first copy resampled in the
    corrupt run: ``tasks.induction`` over this model's vocabulary."""
    import circuitkit as ck

    return ck.load_task("induction", n_examples=n, seed=seed, vocab_size=V, seg_len=(4, 6))
