"""A hand-built two-layer Llama with a known Phase-1 head, a known Phase-2 head and decoys, and
the small CoT task it solves (weights set by hand; used by test_scoring and test_validate).

Sequence (13 tokens)::

    0 <bos> | 1..6 note: E_a, D_j and 4 fillers (shuffled) | 7 <think> | 8 A_a | 9 <sl> |
    10, 11 shortlist: L_(a,0), L_(a,1) (shuffled) | 12 </think> | 13 L_(a,j) | 14 <eos>

E_a names anchor a (4 anchors), D_j (j in 0, 1) picks the child; label L_(a,j) = 2a + j, its
near-miss is L_(a,1-j). Phase-1 corruption: E_a -> E_b (b != a); phase 2: D_j -> D_(1-j).

Residual (d_model 64): dims 0..31 token one-hot, 32 a constant, 40..43 anchor unembeddings,
44..51 label unembeddings, 56/57 junk, 60 the "which child" feature. MLPs are zero; rotary
theta 1e12 and all query/key signals on head dim 7 (rotation ~1e-11 rad/position: no effect).

* L0H0 (planted Phase-1): from <think> attends to the E token; writes ``u_a`` (the centred
  unembedding of anchor a) -> ranks 1st on coarse_score.
* L0H1 (decoy): from <think> attends (more sharply) to <bos>; writes junk dim 56.
* L0H2 (mover): from every position attends to the D token; writes +-1 on dim 60.
* L0H3 (planted centroid): the attention of L0H0, writes ``c_a``, the centred centroid of anchor
  a's label unembeddings (dims 44..51), which is not its anchor token's column (dims 40..43):
  first under the default label-centroid anchor directions, where L0H0 scores 0, and 0 under
  the token reading, where L0H0 is first. It raises both children of a alike (no margin).
* L1H0 (planted Phase-2): query from dim 60, keys +1 for child-0 labels, -1 for child-1 labels:
  attends to the target's shortlist entry; writes ``W_U[target] - W_U[near_miss]``.
* L1H1 (Phase-2 decoy): the same attention as L1H0; writes junk dim 57.
* L1H2, L1H3: all zero.

``refine_model(kinds)`` / ``refine_task(n)``: a second planted model (Phase 2 only) whose
shortlist holds 2 target entries and 6 near-miss entries, so counts cannot decide a loop-back;
its layer-1 heads are of the ``kinds`` given (``REFINE_KINDS`` below).
"""

from __future__ import annotations

import random

import torch

from circuitkit.tasks.base import Example, Task

V, D, H, DH = 32, 64, 4, 16
BOS, EOS, THINK, SL, END, FILLER = 1, 2, 3, 4, 5, 6
E0, D0, A0, L0 = 7, 11, 13, 17  # first evidence, child marker, anchor, label token
N_ANCHORS = 4
PLANTED_P1, DECOY_P1, MOVER, PLANTED_CENTROID = (0, 0), (0, 1), (0, 2), (0, 3)
PLANTED_P2, DECOY_P2 = (1, 0), (1, 1)
CONFIG = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": 16,
          "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": H,
          "head_dim": DH, "max_position_embeddings": 64, "rope_theta": 1e12,
          "tie_word_embeddings": False, "seed": 0}
QK = 7  # head dim carrying every query/key signal


def anchor_dirs() -> torch.Tensor:
    """[D, 4]: u_a = e_(40+a) - mean_b e_(40+b)."""
    u = torch.zeros(D, N_ANCHORS)
    for a in range(N_ANCHORS):
        u[40 + a, a] = 1.0
    return u - u.mean(1, keepdim=True)


def centroid_dirs() -> torch.Tensor:
    """[D, 4]: c_a = m_a - mean_b m_b with m_a = (e_(44+2a) + e_(44+2a+1)) / 2, the mean
    unembedding column of anchor a's labels."""
    m = torch.zeros(D, N_ANCHORS)
    for a in range(N_ANCHORS):
        m[44 + 2 * a, a] = m[44 + 2 * a + 1, a] = 0.5
    return m - m.mean(1, keepdim=True)


@torch.no_grad()
def planted_model():
    from tinymodels import make_model

    model = make_model(CONFIG)
    hf = model.original_model
    for p in hf.parameters():
        p.zero_()
    for norm in [hf.model.norm] + [m for layer in hf.model.layers
                                   for m in (layer.input_layernorm,
                                             layer.post_attention_layernorm)]:
        norm.weight.fill_(1.0)
    emb = hf.model.embed_tokens.weight  # [V, D]
    emb[:, :V] = torch.eye(V)
    emb[:, 32] = 1.0
    W_U = hf.lm_head.weight  # [V, D] (logits = x @ W_U.T)
    for a in range(N_ANCHORS):
        W_U[A0 + a, 40 + a] = 1.0
    for k in range(2 * N_ANCHORS):
        W_U[L0 + k, 44 + k] = 1.0
    u = anchor_dirs()
    c = centroid_dirs()

    def attn(layer):
        return hf.model.layers[layer].self_attn

    def row(h, i):
        return h * DH + i

    a0, a1 = attn(0), attn(1)
    # L0H0: <think> -> E tokens; value a -> u_a
    h = 0
    a0.q_proj.weight[row(h, QK), THINK] = 1.5
    for a in range(N_ANCHORS):
        a0.k_proj.weight[row(h, QK), E0 + a] = 1.0
        a0.v_proj.weight[row(h, a), E0 + a] = 1.0
        a0.o_proj.weight[:, row(h, a)] = u[:, a]
    # L0H3 planted centroid: the attention of L0H0; value a -> c_a (label centroid, not u_a)
    h = 3
    a0.q_proj.weight[row(h, QK), THINK] = 1.5
    for a in range(N_ANCHORS):
        a0.k_proj.weight[row(h, QK), E0 + a] = 1.0
        a0.v_proj.weight[row(h, a), E0 + a] = 1.0
        a0.o_proj.weight[:, row(h, a)] = c[:, a]
    # L0H1 decoy: <think> -> <bos>, sharper; writes junk
    h = 1
    a0.q_proj.weight[row(h, QK), THINK] = 3.0
    a0.k_proj.weight[row(h, QK), BOS] = 1.0
    a0.v_proj.weight[row(h, 0), BOS] = 1.0
    a0.o_proj.weight[56, row(h, 0)] = 1.0
    # L0H2 mover: everywhere -> D token; writes +-1 on dim 60
    h = 2
    a0.q_proj.weight[row(h, QK), 32] = 1.5
    a0.k_proj.weight[row(h, QK), D0] = a0.k_proj.weight[row(h, QK), D0 + 1] = 1.0
    a0.v_proj.weight[row(h, 0), D0] = 1.0
    a0.v_proj.weight[row(h, 0), D0 + 1] = -1.0
    a0.o_proj.weight[60, row(h, 0)] = 1.0
    # L1H0 planted Phase-2 and L1H1 decoy: query dim 60, key +1 child 0 / -1 child 1
    for h in (0, 1):
        a1.q_proj.weight[row(h, QK), 60] = 4.0
        for k in range(2 * N_ANCHORS):
            a1.k_proj.weight[row(h, QK), L0 + k] = 1.0 if k % 2 == 0 else -1.0
    for k in range(2 * N_ANCHORS):
        sib = k + 1 if k % 2 == 0 else k - 1
        a1.v_proj.weight[row(0, k), L0 + k] = 1.0
        a1.o_proj.weight[44 + k, row(0, k)] = 4.0
        a1.o_proj.weight[44 + sib, row(0, k)] = -4.0
        a1.v_proj.weight[row(1, 0), L0 + k] = 1.0
    a1.o_proj.weight[57, row(1, 0)] = 1.0
    return model.eval()


def planted_task(n: int = 24, seed: int = 0) -> Task:
    rng = random.Random(seed)
    vocab = ["<pad>", "<bos>", "<eos>", "<think>", "<sl>", "</think>", "f"] \
        + [f"e{a}" for a in range(N_ANCHORS)] + ["d0", "d1"] \
        + [f"A{a}" for a in range(N_ANCHORS)] + [f"L{k}" for k in range(2 * N_ANCHORS)]
    vocab += [f"u{i}" for i in range(V - len(vocab))]
    examples = []
    for _ in range(n):
        a, j = rng.randrange(N_ANCHORS), rng.randrange(2)
        note = [E0 + a, D0 + j] + [FILLER] * 4
        rng.shuffle(note)
        shortlist = [L0 + 2 * a, L0 + 2 * a + 1]
        rng.shuffle(shortlist)
        seq = [BOS, *note, THINK, A0 + a, SL, *shortlist, END, L0 + 2 * a + j, EOS]
        b = rng.choice([x for x in range(N_ANCHORS) if x != a])
        c1 = [E0 + b if t == E0 + a else t for t in seq]
        c2 = [D0 + 1 - j if t == D0 + j else t for t in seq]
        examples.append(Example(
            tokens=torch.tensor(seq), corrupt_tokens=torch.tensor(c2),
            evidence_pos=[seq.index(E0 + a), seq.index(D0 + j)], anchor_pos=[8],
            shortlist_pos=[10, 11], answer_pos=[13], targets=[2 * a + j],
            near_misses=[2 * a + 1 - j], anchors=[a],
            meta=dict(corrupt_tokens_p1=c1, corrupt_tokens_p2=c2, corrupt_anchors=[b])))
    return Task(name="planted", examples=examples,
                label_names=[f"L{k}" for k in range(2 * N_ANCHORS)],
                anchor_names=[f"A{a}" for a in range(N_ANCHORS)],
                label_token_ids=torch.arange(L0, L0 + 2 * N_ANCHORS),
                anchor_token_ids=torch.arange(A0, A0 + N_ANCHORS),
                label_anchor=torch.arange(2 * N_ANCHORS) // 2, vocab=vocab, phase=2)


# --- Phase 2: two targets against six near-misses ---------------------------------------------
#
# Sequence (20 tokens)::
#
#     0 <bos> | 1..5 note: P_j and 4 fillers (shuffled) | 6 <think> | 7 <sl> |
#     8..15 shortlist: R_0 .. R_7 (shuffled) | 16 </think> | 17 R_2j | 18 R_2j+1 | 19 <eos>
#
# P_j (j in 0..3) makes the pair {R_2j, R_2j+1} the targets; the other six labels are the
# near-misses. One answer step (position 17, read at 16). Phase-2 corruption: P_j -> P_(j+1 % 4).
# Residual (d_model 64): dims 0..47 token one-hot, 48 a constant, 50..57 label unembeddings
# (W_U[R_k, 50 + k] = 1), 58..61 the mover's pair one-hot. MLPs zero; queries and keys on head
# dims 4..7 and 12 (rotary theta 1e12 turns those < 1e-5 rad per position; dims 0, 1, 8, 9 turn).
RV, RH = 48, 16  # vocabulary, d_head
R_BOS, R_EOS, R_THINK, R_SL, R_END, R_FILL, P0, R0 = 1, 2, 3, 4, 5, 6, 7, 11
CONST, LAB, PAIR = 48, 50, 58
# layer-1 head kinds (layer 0: head 0 moves P_j's pair one-hot to every position, others zero):
#   "copy": attends to the two target entries, writes +W_U of the label it reads;
#   "suppress": attends to the six near-miss entries, writes -W_U of the label it reads;
#   "uniform": attends to all eight entries alike, writes +W_U of the label it reads;
#   "never": attends to the note's P_j, writes W_U of both targets (widens the margin most,
#            never looking at the shortlist);
#   "retrieve": attends to the six near-miss entries, reads the pair the mover stored there
#               and writes W_U of both targets (neither copies nor suppresses what it reads);
#   "zero": nothing.
REFINE_KINDS = ("copy", "suppress", "uniform", "never", "retrieve")
SCALE = {"copy": 2.0, "suppress": 2.0, "uniform": 2.0, "never": 3.0, "retrieve": 0.2}


@torch.no_grad()
def blank_llama(cfg: dict, n_ids: int = 0, dtype=None):
    """(bridge, its HF model) of a Llama ``cfg`` whose weights are all zero but for unit norms
    and an identity embedding of the first ``n_ids`` token ids: what a planted circuit is
    written into (every test that plants one starts here)."""
    from tinymodels import make_model

    import circuitkit as ck

    model = make_model(cfg) if dtype is None else ck.load_model(dict(cfg), dtype=dtype)
    hf = model.original_model
    for p in hf.parameters():
        p.zero_()
    for norm in [hf.model.norm] + [m for layer in hf.model.layers
                                   for m in (layer.input_layernorm,
                                             layer.post_attention_layernorm)]:
        norm.weight.fill_(1.0)
    if n_ids:
        hf.model.embed_tokens.weight[:, :n_ids] = torch.eye(n_ids)
    return model, hf


@torch.no_grad()
def refine_model(kinds: tuple[str, ...] = REFINE_KINDS):
    """Layer-1 head ``h`` is of ``kinds[h]`` (zero heads added up to a divisor of d_model)."""
    kinds = tuple(kinds)
    while 64 % len(kinds):  # (d_model must be a multiple of the heads: pad with zero heads)
        kinds += ("zero",)
    H = len(kinds)
    cfg = {"model_type": "llama", "vocab_size": RV, "hidden_size": 64, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": H,
           "head_dim": RH, "max_position_embeddings": 64, "rope_theta": 1e12,
           "tie_word_embeddings": False, "seed": 0}
    model, hf = blank_llama(cfg, RV)
    emb = hf.model.embed_tokens.weight
    emb[:, CONST] = 1.0
    W_U = hf.lm_head.weight
    for k in range(8):
        W_U[R0 + k, LAB + k] = 1.0
    a0, a1 = hf.model.layers[0].self_attn, hf.model.layers[1].self_attn

    def row(h, i):
        return h * RH + i

    # L0H0 mover: every position -> P_j; writes the pair one-hot on dims 58..61
    a0.q_proj.weight[row(0, 4), CONST] = 3.0
    for j in range(4):
        a0.k_proj.weight[row(0, 4), P0 + j] = 1.0
        a0.v_proj.weight[row(0, j), P0 + j] = 1.0
        a0.o_proj.weight[PAIR + j, row(0, j)] = 1.0
    for h, kind in enumerate(kinds):
        s = SCALE.get(kind, 0.0)
        if kind in ("copy", "suppress", "uniform"):
            for k in range(8):  # value: which label the entry is; output: its unembedding
                a1.v_proj.weight[row(h, 8 + k), R0 + k] = 1.0
                a1.o_proj.weight[LAB + k, row(h, 8 + k)] = -s if kind == "suppress" else s
        if kind == "copy":  # query: the pair; key: the pair each label belongs to
            for j in range(4):
                a1.q_proj.weight[row(h, 4 + j), PAIR + j] = 6.0
            for k in range(8):
                a1.k_proj.weight[row(h, 4 + k // 2), R0 + k] = 1.0
        elif kind in ("suppress", "uniform", "retrieve"):  # every label; minus its targets
            a1.q_proj.weight[row(h, 12), CONST] = 6.0
            for k in range(8):
                a1.k_proj.weight[row(h, 12), R0 + k] = 1.0
            if kind == "retrieve":  # value: the pair stored at the entry; output: the targets
                for j in range(4):
                    a1.v_proj.weight[row(h, j), PAIR + j] = 1.0
                    a1.o_proj.weight[LAB + 2 * j, row(h, j)] = s
                    a1.o_proj.weight[LAB + 2 * j + 1, row(h, j)] = s
            if kind in ("suppress", "retrieve"):
                for j in range(4):
                    a1.q_proj.weight[row(h, 4 + j), PAIR + j] = -12.0
                for k in range(8):
                    a1.k_proj.weight[row(h, 4 + k // 2), R0 + k] = 1.0
        elif kind == "never":  # reads the note's P_j, writes both targets' unembeddings
            a1.q_proj.weight[row(h, 4), CONST] = 6.0
            for j in range(4):
                a1.k_proj.weight[row(h, 4), P0 + j] = 1.0
                a1.v_proj.weight[row(h, 8 + j), P0 + j] = 1.0
                a1.o_proj.weight[LAB + 2 * j, row(h, 8 + j)] = s
                a1.o_proj.weight[LAB + 2 * j + 1, row(h, 8 + j)] = s
        elif kind != "zero":
            raise ValueError(kind)
    return model.eval()


def refine_task(n: int = 24, seed: int = 0) -> Task:
    rng = random.Random(seed)
    vocab = ["<pad>", "<bos>", "<eos>", "<think>", "<sl>", "</think>", "f"] \
        + [f"p{j}" for j in range(4)] + [f"R{k}" for k in range(8)] + ["A"]
    vocab += [f"u{i}" for i in range(RV - len(vocab))]
    examples = []
    for _ in range(n):
        j = rng.randrange(4)
        note = [P0 + j] + [R_FILL] * 4
        rng.shuffle(note)
        shortlist = [R0 + k for k in range(8)]
        rng.shuffle(shortlist)
        seq = [R_BOS, *note, R_THINK, R_SL, *shortlist, R_END, R0 + 2 * j, R0 + 2 * j + 1,
               R_EOS]
        corrupt = [P0 + (j + 1) % 4 if t == P0 + j else t for t in seq]
        examples.append(Example(
            tokens=torch.tensor(seq), corrupt_tokens=torch.tensor(corrupt),
            evidence_pos=[seq.index(P0 + j)], anchor_pos=[], shortlist_pos=list(range(8, 16)),
            answer_pos=[17], targets=[2 * j, 2 * j + 1],
            near_misses=[k for k in range(8) if k // 2 != j], anchors=[0],
            meta=dict(corrupt_tokens_p2=corrupt)))
    return Task(name="planted-refine", examples=examples,
                label_names=[f"R{k}" for k in range(8)], anchor_names=["A"],
                label_token_ids=torch.arange(R0, R0 + 8), anchor_token_ids=torch.tensor([19]),
                label_anchor=torch.zeros(8, dtype=torch.long), vocab=vocab, phase=2)
