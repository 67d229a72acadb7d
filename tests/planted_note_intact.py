"""Two hand-built two-layer Llamas on a tiny ``synthetic`` task (``task(...)``): one where layer 0
routes the note's evidence and a layer-1 head makes the sibling choice by reading the shortlist
(``two_stage_model``), one where everything goes through layer 0 (``one_bottleneck_model``).

Task (``ck.load_task("synthetic", n_labels=8, children=2, labels_per_note=(1, 1),
distractor_rate=0, max_near_misses=1)``), 12 tokens::

    0 <bos> | 1 a_i | 2 x0 | 3 y_c | 4 <think> | 5 A_i | 6 <sl> | 7, 8 shortlist L_(2i), L_(2i+1)
    | 9 </think> | 10 L_(2i+c) | 11 <eos>

The note's ``a_i`` names anchor i, ``y_c`` the child c; the answer step is read at position 9.
Token ids: ``<think>`` 4, ``</think>`` 6, a0..a3 18..21, x0 22, y0 24, y1 25, A0..A3 26..29,
L0..L7 30..37.

Residual (d_model 64): dims 0..37 token one-hot, 40 a constant, 41 the "child" feature (+1 for
y0, -1 for y1), 44..47 anchor part and 48, 49 child part of the label unembeddings
(``W_U[L_(2a+c)] = e_(44+a) + e_(48+c)``), 56 junk. MLPs zero; rotary theta 1e12 and every
query/key signal on head dim 7 (rotation ~1e-11 rad per position: no effect).

two_stage_model:
* L0H0 (router): from every position attends to the note's y token; writes the child feature.
* L1H0 (chooser): query the child feature, keys +1 for child-0 labels and -1 for child-1
  labels: attends to the shortlist entry of the note's child and writes that entry's label
  unembedding (a copy of what it reads). Editing the shortlist moves it; the note alone does not.
* L1H1 (decoy): attends to both shortlist entries alike; writes junk.

one_bottleneck_model:
* L0H0: attends to the y token; writes the child part ``e_(48+c)``.
* L0H1: attends to the a token; writes the anchor part ``e_(44+a)``.
* L1H1 (decoy): as above. Nothing that writes logits reads the shortlist.
"""

from __future__ import annotations

import torch

V, D, DH, QK = 38, 64, 16, 7
THINK, END = 4, 6
A_WORD, Y0, LAB = 18, 24, 30
CONST, CHILD, ANC_U, CHILD_U, JUNK = 40, 41, 44, 48, 56
ROUTER, CHOOSER, DECOY = (0, 0), (1, 0), (1, 1)
CONFIG = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": 16,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "head_dim": DH, "max_position_embeddings": 64, "rope_theta": 1e12,
          "tie_word_embeddings": False, "seed": 0}


def task(corruption: str = "note", n: int = 16, seed: int = 0):
    import circuitkit as ck

    # split="train": the 8 possible notes are too few for the 1-in-8 held-out split
    return ck.load_task("synthetic", n_examples=n, seed=seed, split="train", n_labels=8,
                        children=2, labels_per_note=(1, 1), distractor_rate=0.0,
                        max_near_misses=1, corruption=corruption)


@torch.no_grad()
def _base():
    from planted_circuit import blank_llama

    model, hf = blank_llama(CONFIG, V)
    emb = hf.model.embed_tokens.weight
    emb[:, CONST] = 1.0
    W_U = hf.lm_head.weight
    for k in range(8):
        W_U[LAB + k, ANC_U + k // 2] = 1.0
        W_U[LAB + k, CHILD_U + k % 2] = 1.0
    return model, hf


def _row(h: int, i: int) -> int:
    return h * DH + i


@torch.no_grad()
def _decoy(a1) -> None:
    """L1H1: every label token alike as key (both shortlist entries); writes junk."""
    h = DECOY[1]
    a1.q_proj.weight[_row(h, QK), CONST] = 6.0
    for k in range(8):
        a1.k_proj.weight[_row(h, QK), LAB + k] = 1.0
        a1.v_proj.weight[_row(h, 8), LAB + k] = 1.0
    a1.o_proj.weight[JUNK, _row(h, 8)] = 1.0


@torch.no_grad()
def _attend_to(attn, h: int, tokens: list[int]) -> None:
    """Head ``h`` attends from every position to ``tokens`` (score 8 against 0)."""
    attn.q_proj.weight[_row(h, QK), CONST] = 8.0
    for t in tokens:
        attn.k_proj.weight[_row(h, QK), t] = 1.0


@torch.no_grad()
def two_stage_model():
    model, hf = _base()
    a0, a1 = hf.model.layers[0].self_attn, hf.model.layers[1].self_attn
    h = ROUTER[1]
    _attend_to(a0, h, [Y0, Y0 + 1])
    a0.v_proj.weight[_row(h, 0), Y0] = 1.0
    a0.v_proj.weight[_row(h, 0), Y0 + 1] = -1.0
    a0.o_proj.weight[CHILD, _row(h, 0)] = 1.0
    h = CHOOSER[1]
    a1.q_proj.weight[_row(h, QK), CHILD] = 10.0
    for k in range(8):  # value dim 8 + k holds label k; output: its unembedding, scaled
        a1.k_proj.weight[_row(h, QK), LAB + k] = 1.0 if k % 2 == 0 else -1.0
        a1.v_proj.weight[_row(h, 8 + k), LAB + k] = 1.0
        a1.o_proj.weight[ANC_U + k // 2, _row(h, 8 + k)] = 4.0
        a1.o_proj.weight[CHILD_U + k % 2, _row(h, 8 + k)] = 4.0
    _decoy(a1)
    return model.eval()


@torch.no_grad()
def one_bottleneck_model():
    model, hf = _base()
    a0, a1 = hf.model.layers[0].self_attn, hf.model.layers[1].self_attn
    h = 0
    _attend_to(a0, h, [Y0, Y0 + 1])
    for c in range(2):
        a0.v_proj.weight[_row(h, c), Y0 + c] = 1.0
        a0.o_proj.weight[CHILD_U + c, _row(h, c)] = 4.0
    h = 1
    _attend_to(a0, h, [A_WORD + a for a in range(4)])
    for a in range(4):
        a0.v_proj.weight[_row(h, a), A_WORD + a] = 1.0
        a0.o_proj.weight[ANC_U + a, _row(h, a)] = 4.0
    _decoy(a1)
    return model.eval()
