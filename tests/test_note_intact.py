"""Issue 45: corruptions that keep the note token-identical and edit only the chain of thought,
the metrics that read what each changes, and planted models where the note-editing and the
note-intact corruptions disagree about where the Phase-2 decision is made."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import circuitkit as ck
from circuitkit.corruptions import parse_corruption
from circuitkit.tasks.base import phase_task

CHOICES = ("note", "anchor", "shortlist-swap", "shortlist-sibling")


@pytest.fixture(scope="module")
def tasks():
    return {c: ck.load_task("icd10", n_examples=24, seed=3, split="test", corruption=c)
            for c in CHOICES}


def _think(task, e) -> int:
    return int((e.tokens == task.vocab.index("<think>")).nonzero()[0])


@pytest.mark.parametrize("choice,phase,edits", [
    ("anchor", 1, "anchor"), ("shortlist-swap", 2, "shortlist"),
    ("shortlist-sibling", 2, "shortlist")])
def test_cot_corruptions_leave_the_note_token_identical(tasks, choice, phase, edits):
    tp = phase_task(tasks[choice], phase)
    assert tp.corruption == choice
    for e in tp.examples:
        diff = (e.tokens != e.corrupt_tokens).nonzero()[:, 0].tolist()
        assert diff and min(diff) > _think(tp, e)  # the note (and <think>) untouched
        assert set(diff) <= set(getattr(e, f"{edits}_pos"))
        assert len(diff) == (2 if choice == "shortlist-swap" else 1)
    # the other phase keeps the note-editing corruption, named so
    other = phase_task(tasks[choice], 3 - phase)
    assert other.corruption == "note"
    ref = phase_task(tasks["note"], 3 - phase)
    assert torch.equal(other.corrupt_tokens, ref.corrupt_tokens)
    # same notes, same note-editing corruption of this phase's targets: only the edit differs
    assert torch.equal(tp.clean_tokens, phase_task(tasks["note"], phase).clean_tokens)


def test_what_each_edit_writes(tasks):
    t = tasks["anchor"]
    for e in t.examples:
        pos = int((e.tokens != e.meta["corrupt_tokens_p1"]
                   if isinstance(e.meta["corrupt_tokens_p1"], torch.Tensor)
                   else e.tokens != torch.tensor(e.meta["corrupt_tokens_p1"])).nonzero()[0])
        wrote = e.meta["corrupt_tokens_p1"][pos]
        assert int(wrote) == int(t.anchor_token_ids[t.label_anchor[e.meta["p1_label"]]])
        assert int(e.tokens[pos]) == int(t.anchor_token_ids[t.label_anchor[e.meta["p1_target"]]])
        # the step read: the first shortlist entry of the corrupted target's category
        step = e.meta["p1_shortlist_step"]
        cat = int(t.label_anchor[e.meta["p1_target"]])
        tok2lab = {int(x): i for i, x in enumerate(t.label_token_ids.tolist())}
        same = [p for p in e.shortlist_pos if int(t.label_anchor[tok2lab[int(e.tokens[p])]])
                == cat]
        assert step == min(same)
    for choice in ("shortlist-swap", "shortlist-sibling"):
        t = tasks[choice]
        for e in t.examples:
            c = torch.tensor(e.meta["corrupt_tokens_p2"])
            tgt, riv = (int(t.label_token_ids[e.meta[k]]) for k in ("p2_target", "p2_rival"))
            sl_clean, sl_bad = e.tokens[e.shortlist_pos].tolist(), c[e.shortlist_pos].tolist()
            assert tgt in sl_clean and riv in sl_bad
            if choice == "shortlist-swap":  # the set kept, the two entries' places exchanged
                assert sorted(sl_clean) == sorted(sl_bad) and e.meta["p2_rival"] == \
                    e.meta["p2_label"]
                assert sl_bad.index(tgt) == sl_clean.index(riv) and \
                    sl_bad.index(riv) == sl_clean.index(tgt)
            else:  # the target gone, a sibling in its place
                assert tgt not in sl_bad and sl_bad[sl_clean.index(tgt)] == riv
                assert e.meta["p2_rival"] != e.meta["p2_target"]


def test_metrics_named_and_equal_to_a_hand_computation(tasks):
    """Each metric recomputed from a forward's logits, written from its definition."""
    model = ck.load_model("icd-teacher")
    names = {("note", 1): "anchor_margin", ("note", 2): "sibling_margin",
             ("anchor", 1): "shortlist_anchor_margin",
             ("shortlist-swap", 2): "edited_sibling_margin",
             ("shortlist-sibling", 2): "edited_sibling_margin"}
    for (choice, phase), name in names.items():
        tp = phase_task(tasks[choice], phase)
        m = tp.metric
        assert m.name == name
        with torch.no_grad():
            logits = model(tp.corrupt_tokens)
        got = m.per_prompt(logits)
        lt, la = tp.label_token_ids, tp.label_anchor
        want = []
        for i, e in enumerate(tp.examples):
            if name == "anchor_margin":
                continue
            if name == "shortlist_anchor_margin":
                p = e.meta["p1_shortlist_step"]
                rivals = lt[la == la[e.meta["p1_label"]]]
            else:
                p = e.answer_pos[e.targets.index(e.meta["p2_target"])]
                key = "p2_siblings" if name == "sibling_margin" else "p2_rival"
                rivals = lt[torch.as_tensor(e.meta[key]).reshape(-1)]
            row = logits[i, p - 1].double()
            want.append(row[int(e.tokens[p])] - row[rivals].mean())
        if want:
            torch.testing.assert_close(got.double(), torch.stack(want), atol=1e-4, rtol=1e-5)
    # the all-near-miss margin, kept under its own name: every near-miss, every answer step
    tp = phase_task(tasks["note"], 2)
    m = tp.all_near_miss_metric()
    assert m.name == "all_near_miss_margin"
    with torch.no_grad():
        logits = model(tp.clean_tokens)
    want = torch.stack([torch.stack([
        logits[i, p - 1, int(e.tokens[p])] - logits[i, p - 1, tp.label_token_ids[e.near_misses]]
        .mean() for p in e.answer_pos]).mean() for i, e in enumerate(tp.examples)])
    torch.testing.assert_close(m.per_prompt(logits), want, atol=1e-4, rtol=1e-5)


def test_a_task_without_sibling_fields_says_all_near_miss(tmp_path, tasks):
    t = tasks["note"]
    bare = t.subset(range(4))  # rows from a file that never stored p2_target / p2_siblings
    bare.examples = [type(e)(**{**e.__dict__, "meta": {k: v for k, v in e.meta.items()
                                                       if not k.startswith("p2_")}})
                     for e in bare.examples]
    assert bare.metric.name == "all_near_miss_margin"
    # a JSONL round trip keeps the fields, so the metric
    t.to_jsonl(tmp_path / "t.jsonl")
    back = ck.load_task(tmp_path / "t.jsonl")
    assert back.metric.name == "sibling_margin"
    a = ck.load_task("icd10", n_examples=6, seed=3, split="test", corruption="anchor", phase=1)
    a.to_jsonl(tmp_path / "a.jsonl")
    back = ck.load_task(tmp_path / "a.jsonl")
    assert back.metric.name == "shortlist_anchor_margin" and torch.equal(
        back.corrupt_tokens, a.corrupt_tokens)


def test_corruption_choices_and_refusals():
    assert parse_corruption("note") == {1: "note", 2: "note"}
    assert parse_corruption("anchor") == {1: "anchor", 2: "note"}
    assert parse_corruption("anchor,shortlist-sibling") == {1: "anchor",
                                                           2: "shortlist-sibling"}
    for bad in ("bogus", "anchor,anchor", "shortlist-swap,shortlist-sibling"):
        with pytest.raises(ValueError, match="expected note") as e:
            parse_corruption(bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="icd10 and synthetic"):
        ck.load_task("induction", corruption="anchor")
    # the default is not recorded (configs from before the option still match)
    assert "corruption" not in ck.load_task("icd10", n_examples=2).config
    assert ck.load_task("icd10", n_examples=2, corruption="anchor").config["corruption"] \
        == "anchor"


def test_cli_refuses_a_bad_corruption_before_any_model_loads(tmp_path):
    r = subprocess.run([sys.executable, "-m", "circuitkit.cli", "patch", "--model",
                        "no-such-model", "--corruption", "shortlist", "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    said = r.stderr + r.stdout
    assert "--corruption" in said and "shortlist-sibling" in said
    assert "no-such-model" not in said  # refused at parse time, before the model is looked up


# --- planted models: where the note-editing and note-intact corruptions disagree ---------------
def _shares(model, task, direction="noise"):
    """Share of the Phase-2 gap each head carries at each position group (steps), positive
    when the head helps: ``{group: [n_layers, n_heads]}``, and the gap."""
    from circuitkit.scoring.causal import causal_groups

    tp = phase_task(task, 2)
    groups = causal_groups(tp)
    res = ck.patch_heads(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric, direction=direction,
                         positions=groups, options=dict(progress=False))
    gap = res.clean - res.corrupt
    eff = res.values - (res.clean if direction == "noise" else res.corrupt)
    sign = -1.0 if direction == "noise" else 1.0
    names = list(groups)
    return {g: sign * eff[..., i] / gap if abs(gap) > 1e-6 else eff[..., i] * 0
            for i, g in enumerate(names)}, gap, tp.metric.name


def test_two_stage_model_note_intact_finds_the_later_head_note_editing_finds_layer_0():
    from planted_note_intact import CHOOSER, ROUTER, task, two_stage_model

    model = two_stage_model()
    intact, gap, name = _shares(model, task("shortlist-sibling"))
    assert name == "edited_sibling_margin" and gap > 1.0
    assert intact["answer"][CHOOSER].item() > 0.9  # the sibling choice, at the answer step
    for g, s in intact.items():  # layer 0 reads only the note: no share anywhere
        assert s[0].abs().max().item() < 1e-4, g
    edited, gap, name = _shares(model, task("note"))
    assert name == "sibling_margin" and gap > 1.0
    assert edited["answer"][ROUTER].item() > 0.9  # evidence routing: layer 0 carries it
    # a swap keeps the shortlist's set: a reader by content does not move
    tp = phase_task(task("shortlist-swap"), 2)
    with torch.no_grad():
        gap = (tp.metric.per_prompt(model(tp.clean_tokens))
               - tp.metric.per_prompt(model(tp.corrupt_tokens)))
    assert gap.abs().max().item() < 1e-4


def test_one_bottleneck_model_reports_no_separate_phase_2_head():
    from planted_note_intact import one_bottleneck_model, task

    model = one_bottleneck_model()
    tp = phase_task(task("shortlist-sibling"), 2)
    with torch.no_grad():  # nothing that writes the answer reads the shortlist: no gap at all
        gap = (tp.metric.per_prompt(model(tp.clean_tokens))
               - tp.metric.per_prompt(model(tp.corrupt_tokens)))
    assert gap.abs().max().item() < 1e-4
    edited, gap, _ = _shares(model, task("note"))
    assert gap > 1.0 and edited["answer"][0, 0].item() > 0.9
    for g, s in edited.items():  # no layer-1 head carries any of it
        assert s[1].abs().max().item() < 1e-4, g


@pytest.mark.slow
def test_cli_patch_with_a_note_intact_corruption_names_its_metric(tmp_path):
    import json

    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "circuitkit.cli", "patch", "-n", "4", "--phase",
                        "1", "--corruption", "anchor", "--method", "exact", "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "result.json").read_text())
    assert meta.get("meta", meta)["metric"] == "shortlist_anchor_margin"


def test_validation_runs_on_note_intact_corruptions():
    """validate_heads reads each phase's metric and its behaviour measure in one engine, though
    they read different steps (shortlist_anchor_margin: a shortlist step, Focus: the anchor
    steps; edited_sibling_margin: one answer step, Confusion: every one)."""
    from circuitkit.experiments.validation import validate_heads
    from circuitkit.scoring import score_heads

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=6, seed=3, split="test",
                        corruption="anchor,shortlist-sibling")
    scores = score_heads(model, task, progress=False, n_boot=0)
    df = validate_heads(model, task, scores, k=2, n_random=2, options=dict(progress=False))
    got = set(zip(df.phase, df.quantity, strict=True))
    assert {(1, "shortlist_anchor_margin"), (1, "focus"), (2, "edited_sibling_margin"),
            (2, "confusion")} <= got
