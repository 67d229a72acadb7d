"""characterize: one results folder, resumable step by step, refusing a different run; the CLI
commands ``score`` and ``characterize`` as thin layers."""

from __future__ import annotations

import dataclasses
import json
import re

import pandas as pd
import pytest
import torch

import circuitkit as ck
from circuitkit.experiments.characterize import CharacterizeOptions, characterize
from circuitkit.experiments.validation import VALIDATION_COLUMNS
from circuitkit.scoring.heads import COLUMNS

TASK = dict(n_labels=8, children=4, labels_per_note=(1, 1))


def run(model, out, **kw):
    return characterize(model, "synthetic", out, dict(n_examples=8, k=2, n_random=4,
                                                      text=False, progress=False,
                                                      task_kwargs=TASK, **kw))


def test_characterize_writes_and_resumes(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "run"
    summary = run(tiny_llama, out, stages=True)
    names = {p.name for p in out.iterdir()}
    for phase in (1, 2):
        for d in ("denoise", "noise"):
            assert {f"patch-p{phase}-{d}.safetensors", f"patch-p{phase}-{d}.json"} <= names
            res = ck.PatchResult.load(out / f"patch-p{phase}-{d}")
            assert res.values.shape == (3, 4) and res.direction == d
    cols = list(pd.read_csv(out / "scores.csv").columns)  # the causal columns after (stages)
    assert cols[:len(COLUMNS)] == COLUMNS and "p2_noise_answer" in cols
    assert list(pd.read_csv(out / "validation.csv").columns) == VALIDATION_COLUMNS
    stored = json.loads((out / "summary.json").read_text())
    # the causal top sets (selected by the stages' noising shares) are validated as well
    from circuitkit.scoring.causal import causal_heads

    cval = pd.read_csv(out / "validation-causal.csv")
    assert list(cval.columns) == VALIDATION_COLUMNS
    assert set(cval["pool"]) == {"all-layers", "layer-stratified"}
    scores = pd.read_csv(out / "scores.csv")
    for phase in (1, 2):
        got = stored["causal_validation"][f"phase{phase}"]
        assert ck.hooks.heads_in(got["heads"]) == causal_heads(scores, phase, 2)
        assert set(got["pools"]) == {"all-layers", "layer-stratified"}
        assert 0 < got["pools"]["layer-stratified"]["p"] <= 1
    assert "causal top set" in (out / "report.html").read_text()
    assert stored["phase_table"]["phase2"]["groups"]["all"]["top"]
    # held out by default: heads selected on the first half, validated on the other
    assert stored["samples"]["held_out"] and stored["samples"]["select"]["examples"] == [0, 4]
    assert stored["samples"]["validate"]["examples"] == [4, 8]
    assert stored["identity"]["select_n"] == 4
    assert stored["identity"] == summary["identity"] and len(stored["steps"]) == 9
    # the lead: where each decision is made (held out), stable heads, the claims table
    for phase in (1, 2):
        lead = stored["lead"][f"phase{phase}"]
        held = 4 - len(stored["samples"]["validate"].get("left_out", []))  # (repeats: issue 49)
        assert lead["where"]["n_held"] == held and lead["where"]["chosen"]
        assert len(lead["heads"]["top"]) == 2 and lead["heads"]["core"]["top"]
        assert lead["precision"]["score"] in ("coarse_score", "refine_score")
        res = ck.PatchResult.load(out / "groups" / f"heldout-patch-p{phase}-noise")
        assert res.per_prompt.shape[0] == held
    assert {r["claim"] for r in stored["claims"]} >= {"early-phase1", "late-phase2",
                                                        "separate-heads", "distill"}
    assert stored["corruption"]["phase1"]["note_edited"] in (True, False)
    # the paper's cumulative bins: capped at the model's 12 heads, both sites and directions
    bins = pd.read_csv(out / "bins" / "summary.csv")
    assert set(bins["bin"]) == {3, 8, 12} and set(bins["site"]) == {"pattern", "z"}
    assert (out / "bins" / "bins.html").is_file()
    # the stages step: [layer, head, group] sweeps over the task's position groups
    for phase in (1, 2):
        for d in ("denoise", "noise"):
            res = ck.PatchResult.load(out / "groups" / f"patch-p{phase}-{d}")
            assert res.axes == ("layer", "head", "group") and res.direction == d
            assert res.meta["group_names"][-1] == "all" and res.values.shape[:2] == (3, 4)
            # causal.csv comes from these very sweeps: one meaning of each group in a run
            causal = pd.read_csv(out / "causal.csv")
            for g, name in enumerate(res.meta["group_names"]):
                torch.testing.assert_close(
                    torch.tensor(causal[f"p{phase}_{d}_{name}"].to_numpy()),
                    res.normalized()[..., g].flatten().double(), rtol=0, atol=1e-9)
            top = stored["stages"][f"phase{phase}"][d]["top"]
            assert len(top) == 5 and top[0]["group"] in res.meta["group_names"]
    assert "Heads by stage" in (out / "report.html").read_text()
    assert stored["identity"]["task_fingerprint_p2"] and stored["versions"]["torch"]
    assert all(s["seconds"] >= 0 for s in stored["steps"].values())

    # a rerun reuses every step: no patching, scoring or validation happens
    def boom(*a, **k):
        raise AssertionError("a finished step was recomputed")
    monkeypatch.setattr(ck, "patch_heads", boom)
    monkeypatch.setattr("circuitkit.scoring.heads.score_heads", boom)
    before = (out / "validation.csv").read_text()
    run(tiny_llama, out, stages=True)
    # an interrupted run (validation not recorded) redoes that step only, identically
    stored["steps"].pop("validation")
    (out / "summary.json").write_text(json.dumps(stored))
    (out / "validation.csv").unlink()
    run(tiny_llama, out, stages=True)
    assert (out / "validation.csv").read_text() == before
    # a different run into the same folder is refused
    with pytest.raises(ValueError, match="different identity"):
        characterize(tiny_llama, "synthetic", out, CharacterizeOptions(
            n_examples=6, k=2, n_random=4, text=False, progress=False, task_kwargs=TASK))


def test_characterize_refuses_bad_input(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="n_examples"):
        characterize(tiny_llama, "synthetic", tmp_path / "x", dict(n_examples=0,
                                                                    progress=False))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        run(tiny_llama, tmp_path / "file")


def test_options_and_the_resume_record_are_read_strictly(tiny_llama, tmp_path):
    """``characterize(model, task, out, options)``: an unknown option is one line naming it
    and the valid ones (before anything loads); keywords are the same options. A resume
    record of a newer version is refused in one line naming it, a malformed one names its
    field, before any step runs."""
    with pytest.raises(ValueError) as e:
        characterize(tiny_llama, "synthetic", tmp_path / "x", dict(n_exampels=8))
    line = str(e.value)
    assert "\n" not in line and "unknown characterize option 'n_exampels'" in line
    assert "the options are: n_examples, seed, split, k, n_random" in line
    with pytest.raises(ValueError, match="unknown characterize option 'kk'"):
        characterize(tiny_llama, "synthetic", tmp_path / "x", CharacterizeOptions(k=2), kk=1)
    assert not (tmp_path / "x").exists()
    out = tmp_path / "run"
    out.mkdir()
    for doc, said in ((dict(record_version=2, steps={}), "resume record version 2 is not one "
                       "this circuitkit reads"),
                      (dict(record_version=1, steps=dict(scores=dict(
                          seconds=1.0, files=["../scores.csv"], sha256={}, depends="0" * 64))),
                       "steps.scores.files must list file names inside the folder"),
                      (dict(steps=dict(scores=dict(seconds="1", files=[]))),
                       "steps.scores.seconds must be a number")):
        (out / "summary.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError) as e:
            run(tiny_llama, out, report=False)
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert str(out / "summary.json") in str(e.value)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "summary.json"]  # nothing ran


def test_cli_score_and_characterize(tmp_path):
    from typer.testing import CliRunner

    from circuitkit.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["score", "--model", "icd-teacher", "-n", "8", "-k", "2", "--out",
                              str(tmp_path / "s.csv")])
    assert res.exit_code == 0, res.output
    assert "top Phase-1 heads by coarse_score (8 examples, test split, seed 0)" in res.output
    assert len(pd.read_csv(tmp_path / "s.csv")) == 32
    res = runner.invoke(app, ["characterize", "--model", "icd-teacher", "-n", "8", "-k", "2",
                              "--n-random", "3", "--select-n", "none", "--out",
                              str(tmp_path / "c")])  # (scores on all 8 notes, as score's)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "c" / "summary.json").exists()
    # the same arguments rank the same heads: characterize's scores are score's (top-k
    # inclusion included: both bootstrap with the same k and seed)
    alone = pd.read_csv(tmp_path / "s.csv")  # (the stage sweeps' causal columns follow)
    pd.testing.assert_frame_equal(alone, pd.read_csv(tmp_path / "c" / "scores.csv")[
        list(alone.columns)])
    said = " ".join(res.output.split())
    assert ("findings (icd-teacher on icd10: 8 test examples, seed 0, exact patching; heads "
            "selected and validated on the same examples):") in said
    for phase in (1, 2):
        top = json.loads((tmp_path / "c" / "summary.json").read_text())["top_heads"][
            f"phase{phase}"]
        names = " and ".join(f"L{la}H{h}" for la, h in top)
        assert f"The top 2 heads by {('coarse', 'refine')[phase - 1]}_score are {names}" in said
    # its outcome: the validation's verdict with the floor of 3 random sets
    assert "With 3 random sets no p can be below 1/4 = 0.25" in said
    # one line per file written; report.html once
    assert said.count("report.html") == 1 and "wrote " + str(tmp_path / "c" / "scores.csv") \
        in said
    assert re.search(r"took [\d.]+ s: [\d.]+ s computing 9 steps, [\d.]+ s loading", said)
    again = runner.invoke(app, ["characterize", "--model", "icd-teacher", "-n", "8", "-k", "2",
                                "--n-random", "3", "--select-n", "none", "--out",
                                str(tmp_path / "c")])
    said = " ".join(again.output.split())
    assert "9 steps reused from the folder (they had taken" in said
    assert "kept (finished by an earlier run): patch-p1-denoise" in said
    res = runner.invoke(app, ["characterize", "--model", "icd-teacher", "--text", "maybe"])
    assert res.exit_code == 2 and "--text" in res.output


def test_cli_characterize_on_one_prompt_skips_resample_and_says_so(tmp_path):
    """``characterize -n 1``: resample ablation (z from another prompt) cannot run on one
    prompt; it is skipped, said before the first step, in summary.json and in the findings
    (console and report), and the run completes (it used to stop at step 7/7)."""
    from typer.testing import CliRunner

    from circuitkit.cli import app

    out = tmp_path / "c"
    res = CliRunner().invoke(app, ["characterize", "--model", "icd-teacher", "-n", "1", "-k",
                                   "2", "--n-random", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    note = "resample ablation skipped: it takes each head's z from another prompt"
    assert said.index("note: " + note) < said.index("[1/9] patch-p1-denoise")
    assert "Not run. Resample ablation skipped" in said and "-n / n_examples" in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["ablations"] == ["zero", "mean"]
    assert len(summary["skipped"]) == 2 and summary["skipped"][0].startswith(note)
    assert summary["skipped"][1].startswith("held-out validation skipped: one example")
    assert not summary["samples"]["held_out"]
    assert set(pd.read_csv(out / "head-ablation.csv")["ablation"]) == {"zero", "mean"}
    assert "Resample ablation skipped" in (out / "report.html").read_text()


@pytest.mark.parametrize("drop, phase", [("anchor_pos", 2), ("answer_pos", 1)])
def test_characterize_a_task_with_steps_of_one_phase(tiny_llama, tmp_path, drop, phase):
    """A JSONL task without anchor steps (or without answer steps) is characterized in the phase
    it has: that phase's sweeps, scores, validation rows and report sections, and no others. It
    used to be refused whole."""
    task = ck.load_task("synthetic", n_examples=8, seed=0, **TASK)
    task = dataclasses.replace(task, examples=[dataclasses.replace(e, **{drop: []})
                                               for e in task.examples]).with_phase(phase)
    task.to_jsonl(tmp_path / "task.jsonl")
    out = tmp_path / "run"
    summary = characterize(tiny_llama, str(tmp_path / "task.jsonl"), out, dict(
        n_examples=8, k=2, n_random=4, text=False, progress=False))
    other = 3 - phase
    assert summary["phases"] == [phase] and summary["complete"]
    assert summary["steps_expected"] == [f"patch-p{phase}-denoise", f"patch-p{phase}-noise",
                                         "stages", "scores", "validation", "bins", "ablation"]
    assert list(summary["lead"]) == ["direction", "k", "share", "held_out", f"phase{phase}"]
    assert list(summary["top_heads"]) == [f"phase{phase}"]
    assert summary["identity"][f"task_fingerprint_p{other}"] is None
    names = {p.name for p in out.iterdir()}
    assert {f"patch-p{phase}-denoise.json", f"patch-p{phase}-noise.json"} <= names
    assert not any(n.startswith(f"patch-p{other}") for n in names)
    assert set(pd.read_csv(out / "validation.csv")["phase"]) == {phase}
    scores = pd.read_csv(out / "scores.csv")
    assert scores[f"phase{other}_rank"].isna().all() and scores[f"phase{phase}_rank"].notna().all()
    html = (out / "report.html").read_text()
    assert f"Top 10 Phase-{phase} heads" in html and f"Phase-{other} heads" not in html


def test_characterize_refuses_a_task_with_no_steps(tiny_llama, tmp_path):
    task = ck.load_task("synthetic", n_examples=4, seed=0, **TASK)
    task = dataclasses.replace(task, examples=[dataclasses.replace(e, anchor_pos=[], answer_pos=[])
                                               for e in task.examples])
    task.to_jsonl(tmp_path / "task.jsonl")
    with pytest.raises(ValueError, match="Phase-1 anchor steps or Phase-2 answer steps"):
        characterize(tiny_llama, str(tmp_path / "task.jsonl"), tmp_path / "run",
                     dict(n_examples=4, text=False, progress=False))
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_new_k_validates_again_and_reuses_sweeps(tiny_llama, tmp_path, monkeypatch):
    """k and n_random change the scores' top-k inclusion, validation and ablation only: the
    whole folder used to be refused; the sweeps are reused."""
    out = tmp_path / "run"
    run(tiny_llama, out)

    def boom(*a, **k):
        raise AssertionError("a sweep was recomputed")
    monkeypatch.setattr(ck, "patch_heads", boom)
    summary = characterize(tiny_llama, "synthetic", out, dict(
        n_examples=8, k=1, n_random=3, text=False, progress=False, task_kwargs=TASK))
    val = pd.read_csv(out / "validation.csv")
    assert set(val["k"]) == {1} and summary["validation_options"] == dict(
        k=1, n_random=3, n_random_ablation=20)
    assert set(pd.read_csv(out / "head-ablation.csv")["k"]) == {1}
    assert summary["scores_attrs"]["k"] == 1
    assert all(st["k"] == 1 and len(st["top"]) == 1 for st in summary["stability"].values())
    assert all(len(v) == 1 for v in summary["top_heads"].values()) and summary["complete"]


def test_ablation_sets_counted_apart_and_a_new_count_redoes_the_ablation_only(tiny_llama,
                                                                              tmp_path):
    """Validation draws ``n_random`` sets per pool, the ablation ``n_random_ablation``; a new
    ablation count recomputes the ablation and reuses every other step; an older folder, whose
    one ``n_random`` served both, is reused whole when that count is asked for both."""
    out = tmp_path / "run"
    first = run(tiny_llama, out, n_random_ablation=2)
    used = lambda name: pd.read_csv(out / name)["n_random"].max()  # (a small pool holds fewer)
    assert used("validation.csv") == 4 and used("head-ablation.csv") == 2
    again = run(tiny_llama, out, n_random_ablation=3)
    assert again["steps_run_this_call"] == ["ablation"]
    assert used("head-ablation.csv") == 3 and used("validation.csv") == 4
    assert again["steps"]["validation"] == first["steps"]["validation"]
    summary = json.loads((out / "summary.json").read_text())  # as an older version wrote it
    summary["validation_options"] = dict(k=2, n_random=4)
    del summary["record_version"]  # (no version, no step's depends: derived from the options)
    for entry in summary["steps"].values():
        del entry["depends"]
    (out / "summary.json").write_text(json.dumps(summary))
    assert run(tiny_llama, out, n_random_ablation=4)["steps_run_this_call"] == []
    with pytest.raises(ValueError, match="n_random_ablation must be >= 1"):
        run(tiny_llama, tmp_path / "bad", n_random_ablation=0)


def test_a_mixed_task_patches_each_phase_on_the_examples_with_its_steps(tiny_llama, tmp_path):
    """Examples without anchor steps counted as 0 in the Phase-1 metric (half the mean, and
    zero-effect prompts in every statistic)."""
    task = ck.load_task("synthetic", n_examples=8, seed=0, **TASK)
    task = dataclasses.replace(task, examples=[
        dataclasses.replace(e, anchor_pos=[], anchors=[]) if i % 2 else e
        for i, e in enumerate(task.examples)])
    task.to_jsonl(tmp_path / "task.jsonl")
    out = tmp_path / "run"
    characterize(tiny_llama, str(tmp_path / "task.jsonl"), out, dict(
        n_examples=8, k=2, n_random=4, text=False, progress=False, select_n=None))
    p1 = ck.PatchResult.load(out / "patch-p1-noise")
    p2 = ck.PatchResult.load(out / "patch-p2-noise")
    assert p1.per_prompt.shape[0] == 4 and p2.per_prompt.shape[0] == 8
    anchored = task.subset([0, 2, 4, 6]).with_phase(1)
    with torch.no_grad():
        clean = anchored.metric(tiny_llama(anchored.clean_tokens)).item()
    assert p1.clean == pytest.approx(clean, abs=1e-5)
    val = pd.read_csv(out / "validation.csv")
    assert set(val[val.phase == 1]["n_prompts"]) == {4}


def test_a_model_folder_typed_from_another_directory_is_the_same_run(tiny_llama, tmp_path,
                                                                     monkeypatch):
    """The identity held the model path as typed and the fingerprint hashed it: the same
    folder from another working directory was refused; the report from elsewhere lost its
    attention views."""
    from circuitkit.experiments.report import write_report

    task = ck.load_task("synthetic", n_examples=4, seed=0, **TASK)
    ck.save_model(tiny_llama, tmp_path / "m", tokenizer=task.tokenizer())
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    opts = CharacterizeOptions(n_examples=4, k=1, n_random=2, text=False, progress=False,
                               task_kwargs=TASK, report=False)
    characterize("m", "synthetic", tmp_path / "run", opts)

    def boom(*a, **k):
        raise AssertionError("a sweep was recomputed")
    monkeypatch.setattr(ck, "patch_heads", boom)
    monkeypatch.chdir(tmp_path / "sub")
    summary = characterize("../m", "synthetic", tmp_path / "run", opts)
    assert summary["model_path"] == str((tmp_path / "m").resolve())
    html = write_report(tmp_path / "run").read_text()
    assert "Attention views skipped" not in html and "CircuitsVis.render(" in html


def test_cli_names_the_samples_and_a_failed_run_releases_its_folder(tmp_path):
    """The console says which notes each step runs on (the selection sample, the held-out one,
    both for the sweeps); ``--json`` carries the findings; a run refused before it wrote a
    result leaves no claim on its folder (another command may use it), and the parser's own
    refusals are one line (``circuitkit.cli.main``)."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from circuitkit.cli import app

    out = tmp_path / "c"
    res = CliRunner().invoke(app, ["characterize", "--model", "icd-teacher", "-n", "8", "-k", "2",
                                   "--n-random", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "8 prompts (both samples)" in said
    assert "scores on examples 0-3 (the selection sample)" in said
    assert "patched together on examples 4-7 (held out)" in said
    assert "heads selected on examples 0-3, validated on the held-out 4-7" in said
    again = CliRunner().invoke(app, ["characterize", "--model", "icd-teacher", "-n", "8", "-k",
                                     "2", "--n-random", "3", "--out", str(out), "--json"])
    got = json.loads(again.stdout)
    assert "validated on the held-out 4-7" in got["findings"]["run"]
    assert any("random" in f["headline"] for f in got["findings"]["items"])
    bad = tmp_path / "bad"
    res = CliRunner().invoke(app, ["characterize", "-n", "8", "--select-n", "8", "--out",
                                   str(bad)])
    assert res.exit_code == 2 and "--select-n 8: expected 1..7" in res.output
    assert not bad.exists()  # (it used to stay claimed by characterize: patch was refused)
    for args, said in ((["characterize", "--n-random", "x"], "Invalid value for '--n-random'"),
                       (["score", "--split", "dev"], "'dev': expected test or train")):
        run = subprocess.run([sys.executable, "-m", "circuitkit.cli", *args],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and said in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
