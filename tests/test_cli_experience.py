"""Rough edges of the CLI found when tried as a new user would: each fails on the old behaviour."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from circuitkit.cli import app
from circuitkit.patching.engine import ExactEngine
from circuitkit.patching.results import PatchResult

PATCH = ["patch", "--model", "induction-2l", "--task", "induction", "-n", "6"]


def run(args, **kw):
    return CliRunner().invoke(app, args, **kw)


def test_ctrl_c_says_the_exact_command_and_the_rerun_says_it_resumed(tmp_path, monkeypatch):
    out = tmp_path / "runs" / "x"
    real, calls = ExactEngine.run_chunk, []

    def interrupted(self, chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(ExactEngine, "run_chunk", interrupted)
    r = run([*PATCH, "--batch-size", "8", "--direction", "noise", "--out", str(out)])
    assert r.exit_code == 130
    said = r.output.split("Resume with the same command:")[1].strip().splitlines()[0]
    assert said.startswith("circuitkit patch") and "--direction noise" in said
    assert f"--out {out}" in said and "--checkpoint " not in said  # no value for the flag
    monkeypatch.setattr(ExactEngine, "run_chunk", real)
    r = run(said.split()[1:])  # exactly what it said (a new user copies the line)
    assert r.exit_code == 0, r.output
    assert "resumed 2 of" in r.output


def test_patch_says_what_it_found_and_what_it_wrote(tmp_path):
    r = run([*PATCH, "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "strongest cells" in r.output and "normalized" in r.output
    res = PatchResult.load(tmp_path / "o")
    top = res.top(1).iloc[0]
    assert f"{int(top.layer)}" in r.output and f"{top.normalized:.3f}" in r.output
    for name in ("result.safetensors", "result.json", "result.csv", "result.html"):
        assert str(tmp_path / "o" / name) in r.output


def test_plan_follows_the_method():
    exact = run([*PATCH, "--plan"])
    attribution = run([*PATCH, "--plan", "--method", "attribution"])
    assert exact.exit_code == 0 and attribution.exit_code == 0, attribution.output
    assert "method       exact" in exact.output
    assert "method       attribution" in attribution.output

    def passes(out):
        line = next(x for x in out.splitlines() if x.startswith("cost"))
        return float(line.split()[1].replace(",", ""))
    assert passes(attribution.output) == 4 * 6  # 4 pass-equivalents per prompt
    assert passes(exact.output) > passes(attribution.output)
    # attribution+exact: the "block" screen, then ~20% of the 8 heads (2) expected, 4 at most
    hybrid = run([*PATCH, "--plan", "--method", "attribution+exact"])
    fixed = run([*PATCH, "--plan", "--method", "attribution+exact", "--top-k", "2"])
    assert hybrid.exit_code == 0 and fixed.exit_code == 0, hybrid.output
    assert "~2 cells expected" in hybrid.output and "at most 4" in hybrid.output
    assert "2 cells re-checked exactly" in fixed.output
    assert passes(hybrid.output) == pytest.approx(passes(fixed.output))
    # (on 2 layers the screen plus verification costs more than the exact sweep itself)
    assert passes(attribution.output) < passes(hybrid.output)
    bad = run([*PATCH, "--plan", "--method", "attribution+exact", "--top-k", "0"])
    assert bad.exit_code != 0 and "top_k=0: expected a positive integer" in bad.output


def test_missing_weights_message_is_printed_whole(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = run(["patch", "--model", "llama3-8b", "--task", "induction", "--out",
             str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "huggingface-cli download meta-llama/Meta-Llama-3-8B" in r.output
    assert "local checkpoint folder" in r.output and "circuitkit info" in r.output


@pytest.fixture(scope="module")
def evaluated():
    return (run(["evaluate", "--model", "icd-teacher", "-n", "6"]),
            run(["evaluate", "--model", "icd-teacher", "-n", "6", "--json"]))


def test_evaluate_prints_a_table_and_json_says_what_was_evaluated(evaluated):
    table, as_json = evaluated
    assert table.exit_code == 0 and as_json.exit_code == 0, table.output
    assert "icd-teacher on icd10 (6 notes" in table.output
    assert "Reasoning Focus" in table.output and "Near-Miss Confusion" in table.output
    doc = json.loads(as_json.stdout[as_json.stdout.index("{"):])
    assert doc["model"] == "icd-teacher" and doc["task"] == "icd10"
    assert doc["n_examples"] == 6 and doc["seed"] == 0
    assert set(doc["metrics"]) == set(doc["meanings"]) >= {"focus", "confusion", "exact_match"}


def test_progress_counts_patched_prompts_not_token_blocks(tiny_llama, capsys):
    import circuitkit as ck

    task = ck.load_task("induction", n_examples=3, seg_len=5, vocab_size=64, seed=2)
    ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, task.metric,
                   progress=True)
    err = capsys.readouterr().err
    assert "patched-prompt" in err and "token-block" not in err
    assert "36/36" in err  # 3 layers x 4 heads x 3 prompts, with an ETA while it runs


def test_cost_is_said_one_way_everywhere():
    """Attribution's cost is "4 pass-equivalents per prompt" in the info table, the plan and
    the result's metadata; the old wordings are gone."""
    import circuitkit as ck

    info = run(["info", "--model", "llama3-70b"])
    assert "4 pass-equivalents per prompt" in info.output
    plan = run([*PATCH, "--plan", "--method", "attribution"])
    assert "pass-equivalents" in plan.output
    task = ck.load_task("induction", n_examples=2, seg_len=4, vocab_size=64, seed=1)
    res = ck.patch_heads(ck.load_model("induction-2l"), task.clean_tokens, task.corrupt_tokens,
                         task.metric, method="attribution", progress=False)
    assert res.meta["passes"].startswith("4 pass-equivalents per prompt")
    for old in ("2 forward + 1 backward per prompt", "~3 passes", "2 passes"):
        assert old not in info.output + plan.output + res.meta["passes"]


def test_bad_numbers_and_paths_are_named_before_any_work(tmp_path, monkeypatch):
    """Each of these gave a traceback, nonsense output, or failed after the expensive steps."""
    import circuitkit.patching.api as api

    def no_work(*a, **k):
        raise AssertionError("refused too late: a sweep started")

    monkeypatch.setattr(api, "patch_heads", no_work)
    (tmp_path / "afile").write_text("x")
    cases = [
        (["info", "--model", "llama3-70b", "--gpu-gb", "0"], "--gpu-gb must be a positive"),
        (["info", "--model", "llama3-70b", "--gpu-gb", "nan"], "--gpu-gb must be a positive"),
        (["info", "--model", "llama3-70b", "--seq-len", "-5"], "--seq-len must be a positive"),
        (["info", "--model", str(tmp_path / "nothing")], "no such folder"),
        (["info", "--model", str(tmp_path / "afile")], "is a file"),
        (["score", "--model", "icd-teacher", "-n", "0", "--out", str(tmp_path / "s.csv")],
         "--n-examples must be a positive"),
        (["score", "--model", "icd-teacher", "-n", "2", "--out", str(tmp_path)], "is a folder"),
        (["report", str(tmp_path), "--out", str(tmp_path)], "is a folder"),
        (["characterize", "-n", "2", "-k", "0", "--out", str(tmp_path / "c")],
         "k must be a positive"),
        (["characterize", "-n", "2", "-k", "9999", "--out", str(tmp_path / "c")],
         "k must be in 1..32"),
        (["characterize", "-n", "2", "--n-random", "0", "--out", str(tmp_path / "c")],
         "n_random must be >= 1"),
        (["distill", "--seeds", "2", "--out", str(tmp_path / "d")], "--seeds is the ablation"),
        (["distill", "--quick", "--batch-size", "0", "--out", str(tmp_path / "d")],
         "batch_size must be a positive"),  # --quick no longer overrides what is typed
        (["distill", "--quick", "--lambda-p1", "nan", "--out", str(tmp_path / "d")],
         "lambda_p1 must be a number >= 0"),
    ]
    for args, said in cases:
        r = run(args)
        assert r.exit_code == 2, (args, r.output)
        assert said in r.output.replace("\n", " "), (args, r.output)
    assert not (tmp_path / "c" / "patch-p1-denoise.json").exists()


def test_score_prints_no_top_heads_for_a_phase_the_task_lacks(tmp_path):
    """induction has no anchors: five NaN rows used to be printed as "top Phase-1 heads"."""
    r = run(["score", "--model", "induction-2l", "--task", "induction", "-n", "4", "--out",
             str(tmp_path / "s.csv")])
    assert r.exit_code == 0, r.output
    assert "no Phase-1 scores: the task has no Phase-1 steps" in r.output
    assert "top Phase-1 heads" not in r.output and "top Phase-2 heads" in r.output


@pytest.mark.parametrize("method, flags, said", [
    ("attribution+exact", [], "finished work is in"),
    ("exact", ["--no-checkpoint"], "--no-checkpoint: nothing this command can resume"),
    ("attribution", [], "nothing was saved (--method attribution runs are not checkpointed)"),
])
def test_ctrl_c_says_what_was_kept_for_each_method(tmp_path, monkeypatch, method, flags, said):
    """Ctrl-C used to promise a resume from an empty folder (auto's attribution+exact at
    scale), or to say "nothing was saved" after saving chunks (--no-checkpoint)."""
    import circuitkit.models

    monkeypatch.setattr(circuitkit.models, "CACHE_DIR", tmp_path / "cache")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    if method == "attribution":
        monkeypatch.setattr("circuitkit.patching.attribution.attribution_patch_heads",
                            interrupted)
    else:
        monkeypatch.setattr(ExactEngine, "run_chunk", interrupted)
        monkeypatch.setattr(ExactEngine, "run_variants", interrupted)
    r = run([*PATCH, "--method", method, *flags, "--out", str(tmp_path / "o")])
    assert r.exit_code == 130 and said in r.output, r.output


def test_layer_sites_default_to_each_position_and_all_is_refused_clearly(tmp_path):
    r = run([*PATCH, "--site", "resid_pre", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert PatchResult.load(tmp_path / "a").axes == ("layer", "pos")
    r = run([*PATCH, "--site", "resid_pre", "--positions", "all", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "use --positions each" in r.output.replace("\n", " ")


def test_info_and_plan_refuse_what_they_cannot_price():
    r = run(["info", "--model", "llama3-70b", "--seq-len", "100000"])
    assert r.exit_code == 2 and "longer than llama3-70b's context (8192" in r.output
    r = run(["info", "--model", "icd-teacher"])
    assert r.exit_code == 0 and "64 prompts of 64 tokens" in r.output  # context 64, not 512
    for flags, said in ((["--gpu", "B200"], "--gpu='B200'"), (["--utilisation", "2"],
                                                             "--utilisation 2.0"),
                        (["--gpus-per-replica", "1"], "needs at least 2")):
        r = run(["patch", "--model", "llama3-70b", "--task", "icd10", "--plan", *flags])
        assert r.exit_code == 2 and said in r.output, (flags, r.output)
    r = run(["patch", "--model", "induction-2l", "--task", "induction", "-n", "4", "--plan",
             "--gpu", "B200"])  # with weights too: the flag is checked, not ignored
    assert r.exit_code == 2 and "--gpu='B200'" in r.output
    base = run(["patch", "--model", "llama3-70b", "--task", "icd10", "--plan"]).output
    small = run(["patch", "--model", "llama3-70b", "--task", "icd10", "--plan", "--batch-size",
                 "3"]).output
    row = next(line for line in small.splitlines() if line.startswith("exact "))
    assert base != small and re.search(r"GB\s+3\s", row), row  # chunk: 3 rows per forward


def test_patch_takes_a_files_own_phase_and_renders_icd10_for_an_llm(tmp_path):
    """--phase defaulted to 2 and patched a phase-1 file's phase 2; the new vocabulary check
    must not stop `patch` from rendering icd10 as text for a pretrained LLM."""
    import types

    import circuitkit as ck
    from circuitkit import models
    from circuitkit.cli import _check_vocabulary

    task = ck.load_task("synthetic", n_examples=4, n_labels=8, children=4,
                        labels_per_note=(1, 1), phase=1)
    task.to_jsonl(tmp_path / "p1.jsonl")
    model = ck.load_model(dict(model_type="llama", vocab_size=len(task.vocab), hidden_size=32,
                               intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, max_position_embeddings=64, seed=0))
    ck.save_model(model, tmp_path / "m", tokenizer=task.tokenizer())
    r = run(["patch", "--model", str(tmp_path / "m"), "--task", str(tmp_path / "p1.jsonl"),
             "--method", "exact", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    res = PatchResult.load(tmp_path / "o")
    assert res.meta["phase"] == 1 and res.meta["metric"] == "anchor_margin"
    tok = models.local_tokenizer("smollm2-135m")
    if tok is None:
        pytest.skip("no SmolLM2 tokenizer here")
    llm = types.SimpleNamespace(cfg=types.SimpleNamespace(d_vocab=len(tok)), tokenizer=tok)
    icd = ck.load_task("icd10", n_examples=2)
    _check_vocabulary(llm, icd, renders=True)  # patch renders it: no refusal
    with pytest.raises(ValueError, match="other words"):
        _check_vocabulary(llm, icd, renders=False)  # evaluate would read raw ids: refused
