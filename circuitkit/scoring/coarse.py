"""Phase-1 components: attention sharpness, anchor alignment and their combination (CoarseScore).
Definitions and why: docs/scores.md.

Shapes: ``N`` Phase-1 query rows (``q = anchor_pos - 1``, where the anchor is predicted), ``H``
heads, ``S`` key positions, ``D`` = d_model, ``A`` anchors.

* ``excess_kurtosis``: ``m4 / m2**2 - 3``, ``m_k = mean((a - mean(a))**k)`` over the keys
  ``0..q`` (``scipy.stats.kurtosis(row[:q + 1], fisher=True, bias=True)``); a zero-variance row
  (scipy: NaN) gets ``FLAT_KURTOSIS = -2``, the smallest any sample can have.
* ``anchor_alignment``: ``cos(w, u_c) - mean_{a != c} cos(w, u_a)``, write ``w`` [N, H, D],
  centred anchor directions ``u`` [D, A]; a zero write scores 0.
* ``coarse_score = tanh(max(sharpness, 0) / SHARPNESS_SCALE) * alignment``.
* Length-invariant beside ``sharpness`` (issue 34): ``concentration = exp(-H)``, ``H`` the
  entropy of the row renormalised over the valid keys (``1 / m`` for a row uniform over ``m``
  keys); ``salient_mass = sum_{s in salient} a_s`` (the note's evidence positions).
* ``anchor_directions``: "labels" ``u_a = m_a - mean_b m_b``, ``m_a`` the mean unembedding
  column of anchor a's labels; "tokens" ``u_a = W_U[:, tok(a)] - mean_b W_U[:, tok(b)]``.
* The paper's form beside them (issue 47): ``coarse_score_paper = E_rows[kurtosis(row) *
  cos(w, m_c)]``, raw excess kurtosis times the cosine with the *uncentred* centroid ``m_c``
  (``anchor_centroids``), the product taken per row, then averaged.
* Nulls (issue 47): ``evidence_normalised = n_ev * exp(-H)`` (1 for a head spread evenly over
  the note's ``n_ev`` evidence words, at any row length and any ``n_ev``); ``group_mass``: the
  mass on the step's own evidence group, and its group-blind null ``salient_mass * |own| / n_ev``.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

FLAT_KURTOSIS = -2.0  # value of a zero-variance row (see module docstring)
SHARPNESS_SCALE = 3.0  # excess kurtosis at which the gate reaches tanh(1) = 0.76


def excess_kurtosis(rows: Float[Tensor, "N H S"], valid: Bool[Tensor, "N S"]
                    ) -> Float[Tensor, "N H"]:
    """Fisher excess kurtosis of each row over its ``valid`` keys (float64 inside)."""
    a = rows.double()
    m = valid[:, None, :].double()
    n = m.sum(-1)  # [N, 1]
    mean = (a * m).sum(-1) / n.clamp(min=1)
    d = (a - mean[..., None]) * m
    m2 = d.pow(2).sum(-1) / n.clamp(min=1)
    m4 = d.pow(4).sum(-1) / n.clamp(min=1)
    # zero variance relative to the row's scale: float noise of an exactly uniform row is ~1e-16
    flat = (m2 <= 1e-12 * mean.pow(2)) | (n < 2)
    k = m4 / torch.where(flat, torch.ones_like(m2), m2).pow(2) - 3.0
    return torch.where(flat, torch.full_like(k, FLAT_KURTOSIS), k).to(rows.dtype)


def concentration(rows: Float[Tensor, "N H S"], valid: Bool[Tensor, "N S"]
                  ) -> Float[Tensor, "N H"]:
    """``exp(-entropy)`` of each row over its ``valid`` keys (module docstring; float64 inside)."""
    a = rows.double() * valid[:, None, :].double()
    p = a / a.sum(-1, keepdim=True).clamp(min=1e-300)
    ent = -(p * torch.log(p.clamp(min=1e-300))).sum(-1)
    return torch.exp(-ent).to(rows.dtype)


def salient_mass(rows: Float[Tensor, "N H S"], salient: Float[Tensor, "N S"]
                 ) -> Float[Tensor, "N H"]:
    """Attention mass on the ``salient`` keys (0/1 per key) of each row (module docstring)."""
    return torch.einsum("nhs,ns->nh", rows.float(), salient.float())


def anchor_directions(W_U: Float[Tensor, "D V"], anchor_token_ids: Int[Tensor, " A"],
                      mode: str = "labels", label_token_ids: Int[Tensor, " L"] | None = None,
                      label_anchor: Int[Tensor, " L"] | None = None) -> Float[Tensor, "D A"]:
    """Centred anchor directions ``u`` [D, A] (module docstring); ``mode`` "tokens" or "labels"."""
    cols = anchor_centroids(W_U, anchor_token_ids, mode, label_token_ids, label_anchor)
    return cols - cols.mean(1, keepdim=True)


def anchor_centroids(W_U: Float[Tensor, "D V"], anchor_token_ids: Int[Tensor, " A"],
                     mode: str = "labels", label_token_ids: Int[Tensor, " L"] | None = None,
                     label_anchor: Int[Tensor, " L"] | None = None) -> Float[Tensor, "D A"]:
    """Uncentred anchor centroids ``m`` [D, A]: "labels" the mean unembedding column of each
    anchor's labels, "tokens" the anchor token's own column (``coarse_score_paper``'s)."""
    if mode == "tokens":
        cols = W_U[:, anchor_token_ids.to(W_U.device)].float()
    elif mode == "labels":
        if label_token_ids is None or label_anchor is None:
            raise ValueError("anchor_directions(mode='labels') needs label_token_ids and "
                             "label_anchor.")
        n_a = int(anchor_token_ids.numel())
        lab = W_U[:, label_token_ids.to(W_U.device)].float()  # [D, L]
        onehot = torch.nn.functional.one_hot(label_anchor.long(), n_a).float().to(W_U.device)
        counts = onehot.sum(0)
        if bool((counts == 0).any()):
            raise ValueError(f"anchor_directions(mode='labels'): anchors "
                             f"{torch.nonzero(counts == 0)[:, 0].tolist()[:10]} have no labels.")
        cols = lab @ onehot / counts  # [D, A]
    else:
        raise ValueError(f"anchor_directions: mode={mode!r}; expected 'tokens' or 'labels'.")
    return cols


def cosines(writes: Float[Tensor, "N H D"], directions: Float[Tensor, "D A"]
            ) -> Float[Tensor, "N H A"]:
    """``cos(writes[n, h], directions[:, a])``; 0 where a write or a direction is zero."""
    w = writes.float()
    wn = w / w.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    u = directions.float()
    un = u / u.norm(dim=0, keepdim=True).clamp(min=1e-30)
    return wn @ un


def anchor_alignment(writes: Float[Tensor, "N H D"], directions: Float[Tensor, "D A"],
                     correct: Int[Tensor, " N"]) -> Float[Tensor, "N H"]:
    """``cos(w, u_c) - mean_{a != c} cos(w, u_a)`` per row and head (``c = correct[n]``)."""
    cos = cosines(writes, directions)  # [N, H, A]
    n_a = cos.shape[-1]
    own = cos.gather(-1, correct.to(cos.device)[:, None, None].expand(-1, cos.shape[1], 1))[..., 0]
    if n_a < 2:
        return own
    return own - (cos.sum(-1) - own) / (n_a - 1)


def paper_coarse(kurtosis: Float[Tensor, "N H"], writes: Float[Tensor, "N H D"],
                 centroids: Float[Tensor, "D A"], correct: Int[Tensor, " N"]
                 ) -> Float[Tensor, "N H"]:
    """The paper's CoarseScore of each row: ``kurtosis * cos(w, m_c)`` (``c = correct[n]``,
    ``m`` uncentred centroids); ``score_heads`` averages it over rows (``coarse_score_paper``)."""
    cos = cosines(writes, centroids)
    own = cos.gather(-1, correct.to(cos.device)[:, None, None].expand(-1, cos.shape[1], 1))[..., 0]
    return kurtosis.float() * own


def evidence_normalised(rows: Float[Tensor, "N H S"], valid: Bool[Tensor, "N S"],
                        n_evidence: Float[Tensor, " N"]) -> Float[Tensor, "N H"]:
    """``n_ev * exp(-H)``: the row's concentration over that of a row spread evenly over the
    note's ``n_ev`` evidence words (NaN where ``n_ev`` is 0)."""
    n = n_evidence.to(rows.device).double()
    c = concentration(rows, valid).double()
    return torch.where(n[:, None] > 0, c * n[:, None], torch.full_like(c, math.nan)).to(rows.dtype)


def group_mass(rows: Float[Tensor, "N H S"], own: Float[Tensor, "N S"],
               evidence: Float[Tensor, "N S"]) -> tuple[Float[Tensor, "N H"], Float[Tensor, "N H"]]:
    """``(mass on own, its group-blind null)``: the attention on the step's own evidence group
    ``own`` (0/1 per key), and what a head spreading its evidence mass evenly over every
    evidence word would put there, ``salient_mass * |own| / |evidence|``."""
    mine = salient_mass(rows, own)
    share = own.float().sum(-1) / evidence.float().sum(-1).clamp(min=1)  # [N]
    return mine, salient_mass(rows, evidence) * share[:, None].to(mine.device)


def coarse_score(sharpness: Tensor, alignment: Tensor) -> Tensor:
    """``tanh(max(sharpness, 0) / SHARPNESS_SCALE) * alignment``: the squashed sharpness, a gate
    in [0, 1)."""
    return torch.tanh(sharpness.clamp(min=0) / SHARPNESS_SCALE) * alignment


def spike_kurtosis(n: int) -> float:
    """Excess kurtosis of a row of ``n`` keys with all mass on one key: ``(n^2 - 3n + 3) /
    (n - 1) - 3`` (a hand formula the tests check ``excess_kurtosis`` against)."""
    return (n * n - 3 * n + 3) / (n - 1) - 3.0 if n > 1 else math.nan
