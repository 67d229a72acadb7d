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


@torch.no_grad()
def shared_model():
    """``two_stage_model`` with the writer L0H2 also carrying Phase 1: at <think> (its query
    there is 0: uniform over the 8 positions before it) its value reads the note's E token and
    writes ``8 u_a`` (``u_a`` on average, as L0H0 does), so it carries about half the anchor
    margin while still writing the Phase-2 decision at the shortlist."""
    from planted_circuit import DH, E0, N_ANCHORS, anchor_dirs

    model = two_stage_model()
    a0 = model.original_model.model.layers[0].self_attn
    u = anchor_dirs()
    for a in range(N_ANCHORS):
        a0.v_proj.weight[2 * DH + 1 + a, E0 + a] = 1.0
        a0.o_proj.weight[:, 2 * DH + 1 + a] = 8.0 * u[:, a]
    return model.eval()


def test_phase_table_and_report_say_the_same_head_carries_both(tmp_path):
    import json

    from circuitkit.experiments.report import write_report
    from circuitkit.scoring.causal import phase_sentences, phase_table

    table = causal_table(shared_model(), planted_task(24), at="steps")
    pt = phase_table(table, k=2)
    assert set(pt["phase1"]["top_heads"]) == {"L0H0", "L0H2"}
    assert set(pt["phase2"]["top_heads"]) == {"L0H2", "L1H0"}
    same = pt["same_heads"]
    assert same["overlap"] == ["L0H2"] and same["n_overlap"] == 1
    assert 0.2 < same["phase1_by_phase2_heads"] < 0.8  # L0H2's share of Phase 1
    assert pt["phase2"]["carrying_groups"] == ["shortlist", "answer"]
    assert pt["phase1"]["carrying_groups"] == ["anchor"] and pt["phase1"]["carrying_layers"] == [0]
    words = " ".join(phase_sentences(pt))
    assert "The same heads carry both phases: L0H2 is among the top 2" in words
    # the report leads with it (a folder with the phase table and causal.csv only)
    evil = "<script>alert(1)</script>"  # a file-derived head name (L1H0's): escaped
    table.loc[table["name"] == "L1H0", "name"] = evil
    (tmp_path / "causal.csv").write_text(table.to_csv(index=False))
    pt = json.loads(json.dumps(pt).replace("L1H0", evil))
    samples = dict(select=dict(seed=0, n=12, examples=[0, 12], hash="abc"),
                   validate=dict(seed=0, n=12, examples=[12, 24], hash="def"), held_out=True)
    (tmp_path / "summary.json").write_text(json.dumps(dict(phase_table=pt, samples=samples)))
    page = write_report(tmp_path).read_text()
    assert "The same heads carry both phases: L0H2" in page
    assert "Validated on: seed 0, n 12, examples 12..24, hash def" in page
    assert "Phase 2: share of the gap by head and position group" in page
    assert evil not in page and page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 2
    # the console findings lead with the same causal picture, the layer named after the JSON
    # round trip (its keys strings, carrying_layers integers) and both samples said
    from circuitkit.experiments.findings import findings, format_findings

    found = findings(json.loads((tmp_path / "summary.json").read_text()))
    assert found[0].phase == "causal"
    text = format_findings(found, width=10_000)
    assert "Phase 1's decision (" in text and "is made in layer 0 (" in text
    assert "validated on the disjoint 12-23 (12, hash def)" in text
    assert "no single layer" not in text.split("Phase 2")[0]
    assert page.count("The same heads carry both phases: L0H2") == 1  # not again in findings


def test_two_stage_phase_table_says_no_shared_head(two_stage):
    from circuitkit.scoring.causal import phase_sentences, phase_table

    pt = phase_table(two_stage, k=2)
    assert pt["same_heads"]["n_overlap"] == 0
    assert pt["same_heads"]["phase1_by_phase2_heads"] == pytest.approx(0, abs=1e-4)
    assert "No head is among the top 2 of both phases" in " ".join(phase_sentences(pt))


@pytest.mark.filterwarnings("ignore::UserWarning")  # tiny model: tied scores, few random sets
def test_characterize_selects_on_one_sample_and_validates_on_another(tiny_llama, tmp_path):
    import json

    from circuitkit.experiments.characterize import characterize

    kw = dict(n_examples=8, k=2, n_random=4, text=False, progress=False, report=False,
              task_kwargs=dict(n_labels=8, children=4, labels_per_note=(1, 1)))
    characterize(tiny_llama, "synthetic", tmp_path / "run", dict(kw, select_n=5))
    s = json.loads((tmp_path / "run" / "summary.json").read_text())["samples"]
    assert s["held_out"] and s["select"]["examples"] == [0, 5]
    # (issue 49 item 7: a held-out example that repeats a selection example, as 8 notes over 8
    # labels draw, is left out of the validation sample and named)
    left = s["validate"].get("left_out", [])
    assert s["validate"]["examples"] == [5, 8] and s["validate"]["n"] == 3 - len(left)
    assert set(left) <= {5, 6, 7}
    assert s["select"]["hash"] != s["validate"]["hash"]
    val = __import__("pandas").read_csv(tmp_path / "run" / "validation.csv")
    assert set(val["n_prompts"]) <= {1, 2, 3}  # validated on the held-out 3 only
    with pytest.raises(ValueError, match="select_n must be in 1..7"):
        characterize(tiny_llama, "synthetic", tmp_path / "bad", dict(kw, select_n=8))
