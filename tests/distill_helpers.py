"""Shared pieces of the distillation tests: hand-made score tables (no scorer involved)."""

from __future__ import annotations

SCORE_COLUMNS = ["layer", "head", "sharpness", "anchor_alignment", "coarse_score",
                 "anchor_alignment_tokens", "coarse_score_tokens", "shortlist_share",
                 "key_preference", "loopback", "margin_widening", "refine_score", "phase1_rank",
                 "phase1_rank_tokens", "phase2_rank"]


def hand_scores(n_layers: int, n_heads: int, p1: dict[tuple[int, int], float],
                p2: dict[tuple[int, int], float]):
    """A ``ck.score_heads``-shaped frame: ``coarse_score`` and ``coarse_score_tokens`` (both
    Phase-1 readings) / ``refine_score`` are the given values on the named heads (0
    elsewhere); ranks follow the scores (ties by (layer, head)); the other columns are
    filler."""
    import pandas as pd

    rows = [dict(layer=lay, head=h, sharpness=1.0, anchor_alignment=0.1,
                 coarse_score=p1.get((lay, h), 0.0), anchor_alignment_tokens=0.1,
                 coarse_score_tokens=p1.get((lay, h), 0.0), shortlist_share=0.5,
                 key_preference=0.0, loopback=0.0, margin_widening=0.1,
                 refine_score=p2.get((lay, h), 0.0))
            for lay in range(n_layers) for h in range(n_heads)]
    frame = pd.DataFrame(rows)
    for rank_col, col in (("phase1_rank", "coarse_score"),
                          ("phase1_rank_tokens", "coarse_score_tokens"),
                          ("phase2_rank", "refine_score")):
        order = sorted(range(len(frame)), key=lambda i: (-frame[col][i], i))
        rank = [0] * len(frame)
        for r, i in enumerate(order):
            rank[i] = r + 1
        frame[rank_col] = rank
    return frame[SCORE_COLUMNS]


# the teacher's Phase-1 heads in layer 0 and Phase-2 heads in layer 2 (where ck.score_heads puts
# them for icd-teacher): a 2-layer student maps them to its layers 0 and 1
TEACHER_P1 = {(0, 2): 0.15, (0, 0): 0.13, (0, 3): 0.12, (0, 5): 0.11}
TEACHER_P2 = {(2, 6): 0.29, (2, 0): 0.28, (2, 3): 0.18, (2, 4): 0.17}
TINY_STUDENT = {"model_type": "llama", "vocab_size": 3516, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 4, "max_position_embeddings": 64, "seed": 3}
