"""Lambda as the knob it is named (issue 50): with ``balance="share"`` each mechanistic term
enters the step at ``lambda_k`` times the norm of the step's CoT part (its effective share),
measured here from the step's own gradient against autograd run separately on each term; the
old fixed cap (``balance="cap"``, ratio 0.5) is reproduced by the option; every run's shares
are in its history and its ``metrics.json``-bound ``run_shares``."""

from __future__ import annotations

import json

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, hand_scores

from circuitkit.distill import signals
from circuitkit.distill.loss import balanced_gradients, student_terms
from circuitkit.distill.train import (
    HISTORY_COLUMNS,
    DistillConfig,
    build_student,
    prepare_store,
    train_student,
)
from circuitkit.experiments.distill_grid import run_shares, variant_of
from circuitkit.files import write_text
from circuitkit.training import context_length

CFG = dict(pool_size=48, shard_size=24, steps=20, batch_size=8, warmup=2, save_every=100,
           seed=4, lambda_p1=0.3, lambda_p2=0.1, lambda_ns=0.0,
           student={"n_layers": 2, "n_heads": 2, "d_model": 32, "d_mlp": 64})


def _quadratics():
    w = torch.zeros(4, requires_grad=True)
    a = {"cot": torch.tensor([3.0, 0, 0, 0]), "p1": torch.tensor([0, 8.0, 0, 0]),
         "p2": torch.tensor([0, 0, 0.1, 0])}
    return w, {k: 0.5 * (w - v).pow(2).sum() for k, v in a.items()}


def test_rules_by_hand():
    """``L_k = |w - a_k|^2 / 2`` at w = 0 (gradient ``-a_k``): |g_cot| 3 -> c = 1/3, the CoT part
    has norm 1. share: each term at lambda_k x 1; cap 0.5: p1 capped at 0.5, p2 (0.1) as is;
    none: c lambda_k g_k."""
    lam = {"p1": 2.0, "p2": 0.3}
    expect = {
        "share": ([-1, -2.0, -0.3, 0], {"p1": 2.0, "p2": 0.3}),
        "cap": ([-1, -2 * 0.5, -0.3 * 0.1, 0], {"p1": 1.0, "p2": 0.03}),
        "none": ([-1, -2 * 8 / 3, -0.3 * 0.1 / 3, 0], {"p1": 2 * 8 / 3, "p2": 0.01}),
    }
    for rule, (grad, share) in expect.items():
        w, terms = _quadratics()
        g = balanced_gradients(terms, lam, [w], rule, ratio=0.5, clip=1.0)
        assert w.grad.tolist() == pytest.approx(grad, rel=1e-6), rule
        assert (g["sh_p1"], g["sh_p2"], g["sh_ns"]) == pytest.approx(
            (share["p1"], share["p2"], 0.0), rel=1e-6), rule


def test_variant_weights_are_parsed_and_checked():
    assert variant_of("p1+p2") == ("p1+p2", 1.0)
    assert variant_of("p1+p2-causal@0.3") == ("p1+p2-causal", 0.3)
    for bad in ("p3@1", "cot@0.5", "p1+p2@0", "p1+p2@x", "p1+p2@nan"):
        with pytest.raises(ValueError, match="variant"):
            variant_of(bad)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    write_text(folder / "scores.csv", hand_scores(4, 8, TEACHER_P1, TEACHER_P2).to_csv(
        index=False, float_format="%.17g"))
    st, pool = prepare_store(DistillConfig(**CFG, store=str(folder)), folder, progress=False)
    return folder, st, pool


def _flat(grads, params):
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                      for g, p in zip(grads, params, strict=True)])


def test_effective_share_equals_lambda_over_20_steps(store):
    """20 AdamW steps of a tiny student under ``share``: at every step, the step's gradient
    minus its CoT part (autograd of L_CoT alone on a second forward, clipped at 1) is solved for
    the coefficients of grad L_P1 and grad L_P2 (each by autograd alone); each term's share
    ``|a_k g_k| / |c g_CoT|`` equals its lambda within 10% (the rule makes it exact up to
    float32 rounding)."""
    folder, st, pool = store
    cfg = DistillConfig(**CFG, store=str(folder))
    n_ctx = context_length(max(s["width"] for s in st.manifest["shards"]))
    hf, student = build_student(cfg, pool.vocab, n_ctx)
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    stream = signals.BatchStream(st, cfg.batch_size, cfg.seed)
    lam = dict(p1=cfg.lambda_p1, p2=cfg.lambda_p2, ns=0.0)
    lc = cfg.loss_config()
    student.train()
    shares = {"p1": [], "p2": []}
    for step in range(cfg.steps):
        batch = stream[step]
        terms = student_terms(student, batch, st.pooling(), st.anchors, lc, lam["p1"],
                              lam["p2"])
        opt.zero_grad(set_to_none=True)
        balanced_gradients(terms, lam, params, "share")
        step_grad = _flat([p.grad for p in params], params)
        again = student_terms(student, batch, st.pooling(), st.anchors, lc, lam["p1"],
                              lam["p2"])
        g = {k: _flat(torch.autograd.grad(again[k], params, retain_graph=True,
                                          allow_unused=True), params)
             for k in ("cot", "p1", "p2")}
        c = min(1.0, 1.0 / float(g["cot"].norm()))
        rest = step_grad - c * g["cot"]
        basis = torch.stack([g["p1"], g["p2"]], 1)
        coef = torch.linalg.lstsq(basis, rest[:, None]).solution[:, 0]
        assert float((basis @ coef - rest).norm()) < 1e-3 * float(rest.norm())
        for i, k in enumerate(("p1", "p2")):
            shares[k].append(float((coef[i] * g[k]).norm()) / (c * float(g["cot"].norm())))
        opt.step()
    for k in ("p1", "p2"):
        assert all(s == pytest.approx(lam[k], rel=0.1) for s in shares[k]), (k, shares[k])


def test_runs_record_shares_and_the_old_cap_is_an_option(store, tmp_path):
    """train_student: under ``share`` the history's ``sh_k`` and ``run_shares`` (what
    ``metrics.json`` holds) equal lambda within 10%; under ``balance="cap"`` each step's factor
    is the pre-issue-50 cap ``min(1, 0.5 c |g_CoT| / |g_k|)`` and its share ``lambda_k
    min(|g_k| / (c |g_CoT|), 0.5)``, below lambda where the cap binds."""
    folder, _, _ = store
    runs = {}
    for rule in ("share", "cap"):
        out = train_student(DistillConfig(**CFG, store=str(folder), balance=rule),
                            tmp_path / rule, progress=False)
        runs[rule] = (json.loads((out / "distill.json").read_text()), run_shares(out))
    rec, shares = runs["share"]
    assert rec["history_columns"] == HISTORY_COLUMNS
    for k in ("p1", "p2"):
        col = [r[HISTORY_COLUMNS.index(f"sh_{k}")] for r in rec["history"]]
        assert len(col) == CFG["steps"]
        assert all(v == pytest.approx(CFG[f"lambda_{k}"], rel=0.1) for v in col)
        assert shares[f"share_{k}"] == pytest.approx(CFG[f"lambda_{k}"], rel=0.1)
    assert shares["share_ns"] == 0.0
    rec, shares = runs["cap"]
    bound = 0
    for r in rec["history"]:
        row = dict(zip(HISTORY_COLUMNS, r, strict=True))
        part = min(1.0, 1.0 / row["gn_cot"]) * row["gn_cot"]
        for k in ("p1", "p2"):
            assert row[f"s_{k}"] == pytest.approx(min(1.0, 0.5 * part / row[f"gn_{k}"]),
                                                  rel=2e-3, abs=2e-5)
            expect = CFG[f"lambda_{k}"] * min(row[f"gn_{k}"] / part, 0.5)
            assert row[f"sh_{k}"] == pytest.approx(expect, rel=2e-3, abs=2e-5)
            bound += row[f"gn_{k}"] > 0.5 * part
    assert bound > 0  # the cap binds on some steps: its shares are not the lambdas
    assert shares["share_p2"] < CFG["lambda_p2"]
