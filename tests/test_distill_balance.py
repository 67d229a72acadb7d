"""Loss balancing (issue 25): the mechanistic terms cannot throttle L_CoT. ``balanced_gradients``
by hand on a quadratic; 200 steps of p1+p2 from the shipped CoT student keep its CoT loss within
15% of CoT-only's from the same start and seed, where the old global clip does not; every step's
per-term gradient norms are in the history, the first equal to a plain HF model's."""

from __future__ import annotations

import json
import math

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, hand_scores

from circuitkit.distill.loss import balanced_gradients
from circuitkit.distill.train import HISTORY_COLUMNS, DistillConfig, prepare_store, train_student
from circuitkit.files import write_text

# from the shipped CoT-only student (its CoT gradient is small, its P2 gradient large: issue 25
# measured 1.12 against 5.32), same seed, same batches; 1024 notes, so 200 steps of 8 see each
# about 1.6 times (on 256 notes every variant memorises them: CoT losses of ~0.003, whose ratios
# say little). Measured (OMP_NUM_THREADS=1): L_CoT on the 1024 notes after training, CoT-only
# 0.0882, cap 0.1000 (1.13x), global clip 0.1354 (1.53x); p1 0.51 -> 0.15, p2 3.2 -> 1.2
CFG = dict(pool_size=1024, shard_size=1024, steps=200, batch_size=8, warmup=10,
           save_every=1000, seed=0, init="icd-student-cot", student="student")
VARIANTS = {"cot": dict(lambda_p1=0.0, lambda_p2=0.0), "cap": dict(balance="cap"),
            "global_clip": dict(balance="global_clip")}


def test_balanced_gradients_by_hand():
    """Three quadratics ``L_k = |w - a_k|^2 / 2`` (gradient ``w - a_k``): the cap keeps the CoT
    part at CoT-only's clip and caps each mechanistic term at ``ratio`` times it; the global
    clip scales the sum."""
    w = torch.zeros(4, requires_grad=True)
    a = {"cot": torch.tensor([-3.0, 0, 0, 0]), "p1": torch.tensor([0, 8.0, 0, 0]),
         "p2": torch.tensor([0, 0, 0.1, 0])}
    terms = {k: 0.5 * (w - v).pow(2).sum() for k, v in a.items()}
    lam = dict(p1=2.0, p2=1.0, ns=0.0)
    g = balanced_gradients(terms, lam, [w], "cap", ratio=0.5, clip=1.0)
    # CoT part: gradient (3, 0, 0, 0) clipped to norm 1 -> (1, 0, 0, 0); p1: its gradient
    # (0, -8, 0, 0) capped at 0.5 x 1 -> (0, -0.5, 0, 0), times lambda 2; p2: (0, 0, -0.1, 0)
    # under the cap: as is, times lambda 1
    assert torch.allclose(w.grad, torch.tensor([1.0, -1.0, -0.1, 0.0]))
    assert (g["gn_cot"], g["gn_p1"], g["gn_p2"], g["gn_ns"]) == pytest.approx((3, 8, 0.1, 0))
    assert (g["s_p1"], g["s_p2"], g["s_ns"]) == pytest.approx((0.5 / 8, 1.0, 0.0))
    assert g["cos"] == pytest.approx(0.0) and g["norm"] == pytest.approx(math.sqrt(2.01))
    w.grad = None
    terms = {k: 0.5 * (w - v).pow(2).sum() for k, v in a.items()}  # the graphs were freed
    g = balanced_gradients(terms, lam, [w], "global_clip", clip=1.0)
    total = torch.tensor([3.0, -16.0, -0.1, 0.0])  # grad of L_cot + 2 L_p1 + L_p2
    assert torch.allclose(w.grad, total / total.norm())
    assert g["norm"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="balance must be one of"):
        balanced_gradients({k: 0.5 * (w - v).pow(2).sum() for k, v in a.items()}, lam, [w],
                           "pcgrad")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("balance")
    store = root / "signals"
    store.mkdir()
    write_text(store / "scores.csv", hand_scores(4, 8, TEACHER_P1, TEACHER_P2).to_csv(
        index=False, float_format="%.17g"))
    prepare_store(DistillConfig(**CFG, store=str(store)), store, progress=False)
    out = {}
    for name, kw in VARIANTS.items():
        folder = train_student(DistillConfig(**CFG, store=str(store), **kw), root / name,
                               progress=False)
        out[name] = (folder, json.loads((folder / "distill.json").read_text()))
    return store, out


def _final_cot_loss(folder, store) -> float:
    """L_CoT of the trained model (a plain HF model, no bridge) on every note of the store."""
    from transformers import AutoModelForCausalLM

    from circuitkit.distill.signals import SignalStore
    from circuitkit.training import lm_loss

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    b = SignalStore.open(store).batch(0, range(CFG["pool_size"]))
    with torch.no_grad():
        return float(lm_loss(hf(b.tokens).logits, b.tokens, b.mask))


def test_balanced_p1_p2_keeps_cot_within_15_percent_and_the_global_clip_does_not(runs):
    store, out = runs
    cot = {k: _final_cot_loss(folder, store) for k, (folder, _) in out.items()}
    assert cot["cap"] <= 1.15 * cot["cot"], cot
    assert cot["global_clip"] > 1.15 * cot["cot"], cot  # the old trainer fails the test
    # and the mechanistic losses still fall under the cap
    cols = out["cap"][1]["history_columns"]
    hist = out["cap"][1]["history"]
    for k in ("p1", "p2"):
        i = cols.index(k)
        first = sum(r[i] for r in hist[:20]) / 20
        last = sum(r[i] for r in hist[-20:]) / 20
        assert last < 0.8 * first, (k, first, last)


def test_history_logs_each_terms_gradient_norm_every_step(runs):
    from transformers import AutoModelForCausalLM

    from circuitkit.distill.signals import BatchStream, SignalStore
    from circuitkit.models import shipped_path
    from circuitkit.training import lm_loss

    store, out = runs
    for name, (_, rec) in out.items():
        assert rec["history_columns"] == HISTORY_COLUMNS
        h = rec["history"]
        assert [r[0] for r in h] == list(range(1, CFG["steps"] + 1))
        col = {c: [r[i] for r in h] for i, c in enumerate(HISTORY_COLUMNS)}
        assert all(v > 0 for v in col["gn_cot"])
        mech = name != "cot"
        assert all((v > 0) == mech for k in ("gn_p1", "gn_p2") for v in col[k]), name
        assert all(v == 0 for v in col["gn_ns"])
        if name == "cap":  # s_k = min(1, 0.5 c |g_cot| / |g_k|), c = min(1, 1 / |g_cot|)
            for r in h:
                c = dict(zip(HISTORY_COLUMNS, r, strict=True))
                part = min(1.0, 1.0 / c["gn_cot"]) * c["gn_cot"]
                for k in ("p1", "p2"):
                    assert c[f"s_{k}"] == pytest.approx(
                        min(1.0, 0.5 * part / c[f"gn_{k}"]), rel=2e-3, abs=2e-5)
    # step 1's |grad L_CoT| against a plain HF model (no bridge, no hooks) on batch 0
    hf = AutoModelForCausalLM.from_pretrained(shipped_path("icd-student-cot"))
    b = BatchStream(SignalStore.open(store), CFG["batch_size"], CFG["seed"])[0]
    loss = lm_loss(hf(b.tokens).logits, b.tokens, b.mask)
    grads = torch.autograd.grad(loss, list(hf.parameters()))
    ref = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    for _, rec in out.values():
        assert rec["history"][0][HISTORY_COLUMNS.index("gn_cot")] == pytest.approx(ref, rel=1e-3)
