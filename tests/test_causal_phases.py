"""Phases by causal evidence: ``scoring/causal.py``'s position-resolved columns, checked on a
planted two-stage circuit (a decision written at the shortlist by L0H2, read at the answer step
by L1H0) and against a plain TransformerLens hook recomputation on the teacher."""

from __future__ import annotations

import pytest
import torch
from planted_circuit import PLANTED_P1, planted_task
from test_position_groups import two_stage_model

import circuitkit as ck
from circuitkit.scoring.causal import carried, causal_heads, causal_table

pytestmark = pytest.mark.filterwarnings(
    "ignore::circuitkit.patching.results.DegenerateBaselineWarning")
WRITER, READER = (0, 2), (1, 0)


@pytest.fixture(scope="module")
def two_stage():
    return causal_table(two_stage_model(), planted_task(24), at="steps")


def row(table, head):
    return table[(table["layer"] == head[0]) & (table["head"] == head[1])].iloc[0]


def test_two_stage_circuit_found_at_its_stages(two_stage):
    t = two_stage
    assert list(t.columns[:3]) == ["layer", "head", "name"] and len(t) == 8
    w, r = row(t, WRITER), row(t, READER)
    # the writer carries Phase 2 where it writes (the shortlist steps hold one of the two
    # entries it marks: about half the gap), nothing at the answer step
    assert w["p2_noise_shortlist"] < -0.3 and abs(w["p2_noise_answer"]) < 1e-4
    assert w["p2_denoise_shortlist"] > 0.3 and abs(w["p2_denoise_answer"]) < 1e-4
    # the reader carries all of it at the answer step, nothing at the shortlist
    assert r["p2_noise_answer"] < -0.95 and abs(r["p2_noise_shortlist"]) < 1e-4
    assert causal_heads(t, 2, 1, group="shortlist") == [WRITER]
    assert causal_heads(t, 2, 1, group="answer") == [READER]
    assert causal_heads(t, 2, 1, group="answer", direction="denoise") == [READER]
    assert set(causal_heads(t, 2, 2)) == {WRITER, READER}  # whole heads: both
    # Phase 1: the anchor head at the anchor step, and it carries no Phase 2
    assert causal_heads(t, 1, 1, group="anchor") == [PLANTED_P1]
    assert row(t, PLANTED_P1)["p1_noise_anchor"] < -0.95
    assert abs(carried(t, 2)[t.name == "L0H0"].item()) < 1e-4
    assert int(w["p2_noise_rank_shortlist"]) == 1 and int(r["p2_noise_rank_answer"]) == 1
    assert t.attrs["phase2"]["gap"] > 0 and not t.attrs["phase2"]["degenerate"]


def test_bad_arguments_are_one_line(two_stage):
    with pytest.raises(ValueError, match="no causal column 'p2_noise_rank_nowhere'"):
        causal_heads(two_stage, 2, 1, group="nowhere")
    with pytest.raises(ValueError, match="direction must be one of"):
        causal_heads(two_stage, 2, 1, direction="sideways")
    with pytest.raises(ValueError, match="directions must be"):
        causal_table(None, planted_task(2), directions=("up",))


def hook_column(model, task, mask, direction):
    """The metric's share of the gap after patching each head at ``mask`` (per prompt), by
    plain ``run_with_hooks`` on ``blocks.{l}.attn.hook_z``: noise writes the corrupt run's z
    into the clean run, denoise the clean run's into the corrupt one. ``[layer * head]``."""
    clean, corrupt, metric = task.clean_tokens, task.corrupt_tokens, task.metric
    base, source = (clean, corrupt) if direction == "noise" else (corrupt, clean)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    with torch.no_grad():
        _, cache = model.run_with_cache(source)
        m_clean, m_corrupt = float(metric(model(clean))), float(metric(model(corrupt)))
    out = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        name = f"blocks.{layer}.attn.hook_z"
        for h in range(H):
            def patch(z, hook, src=cache[name], h=h):
                z = z.clone()
                z[:, :, h] = torch.where(mask[:, :, None], src[:, :, h], z[:, :, h])
                return z

            with torch.no_grad():
                v = float(metric(model.run_with_hooks(base, fwd_hooks=[(name, patch)])))
            out[layer, h] = v - (m_clean if direction == "noise" else m_corrupt)
    return (out / (m_clean - m_corrupt)).flatten()


def test_teacher_column_equals_hook_recomputation():
    from circuitkit.tasks.base import phase_task

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=8, split="test", seed=3)
    table = causal_table(model, task, directions=("noise",), at="steps")
    tp = phase_task(task, 2)
    mask = tp.position_groups(at="steps")["shortlist"]
    want = hook_column(model, tp, mask, "noise")
    got = torch.tensor(table["p2_noise_shortlist"].to_numpy())
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    assert float(want.abs().max()) > 1e-3  # the column is not trivially zero
