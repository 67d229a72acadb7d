"""Metrics that cannot go stale or silently read the wrong logits (issue 22, "Silent wrong
results" 1-4) and baselines and padding that cannot mislead (issue 24, items 1-2).

References: TransformerLens's own patching functions (``transformer_lens.patching``) and plain
forward passes. Tolerance 1e-5 absolute (the same float32 arithmetic, summed in another order).
Every test failed on the code before this change except two that guard what must keep working:
the issue's own ``torch.where`` form (right before on this model, by luck of the probe) and
right padding under a metric that reads each prompt's own positions.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from tinymodels import call
from transformer_lens import patching as tl_patching
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app
from circuitkit.patching.results import MIN_GAP_SE, DegenerateBaselineWarning, PatchResult

ATOL = 1e-5
TEACHER = Path(ck.__file__).parent / "assets" / "icd-teacher"


@pytest.fixture(scope="module")
def teacher():
    return ck.load_model("icd-teacher")


@pytest.fixture(scope="module")
def prompts():
    """8 icd10 prompts cut to the shortest one's length: every position is a real token, so a
    metric reading position -1 reads each prompt's own last token."""
    task = ck.load_task("icd10", n_examples=8, split="test", seed=0)
    m = min(len(e.tokens) for e in task.examples)
    return task.clean_tokens[:, :m], task.corrupt_tokens[:, :m]


def tl_heads(model, clean, corrupt, metric):
    """TransformerLens's head-output sweep (denoise: clean z into the corrupt run)."""
    _, cache = model.run_with_cache(clean)
    return tl_patching.get_act_patch_attn_head_out_all_pos(
        model, corrupt, cache, lambda logits: metric(logits).mean())


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)
        return call(fn, *args, **kw)


# --- 1. a metric reading a global that changed is probed again ---------------------------------

POS = -1


def test_a_lambda_reading_a_changed_global_is_probed_again(teacher, prompts):
    """POS = -1, then POS = -4 with the same lambda: the old read positions were kept, the
    metric saw zeros and every value was 0 (5.8e-2 from TransformerLens in the issue)."""
    global POS
    clean, corrupt = prompts

    def metric(logits):
        return logits[:, POS, 5].mean()

    for pos in (-1, -4):
        POS = pos
        res = quiet(ck.patch_heads, teacher, clean, corrupt, metric, progress=False)
        ref = tl_heads(teacher, clean, corrupt, metric)
        torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0, msg=f"POS={pos}")
        with torch.no_grad():
            assert res.clean == pytest.approx(float(metric(teacher(clean))), abs=ATOL)
        assert int(res.values.abs().max()) != 0
    # a new lambda of the same code each call (a notebook cell run twice) reuses the probe only
    # while its values agree: other closure values are probed again
    makers = [lambda p=p: (lambda logits: logits[:, p, 5].mean()) for p in (-1, -4)]
    got = [ck.as_metric(make(), *clean.shape, int(teacher.cfg.d_vocab)).reads[0].tolist()
           for make in makers]
    assert got == [[clean.shape[1] - 1], [clean.shape[1] - 4]]


# --- 2. attribution with a metric that carries no gradient is refused ----------------------------

NO_GRADIENT = {
    ".item()": lambda logits: logits[:, -1, 5].mean().item(),
    "numpy": lambda logits: logits[:, -1, 5].detach().numpy().mean(),
    ".detach()": lambda logits: logits[:, -1, 5].detach().mean(),
}


@pytest.mark.parametrize("form", list(NO_GRADIENT))
@pytest.mark.parametrize("method", ["attribution", "attribution+exact"])
def test_attribution_refuses_a_metric_without_gradient(teacher, prompts, form, method):
    """It returned exactly 0 for every head (attribution+exact: verified one layer, 0 else)."""
    clean, corrupt = prompts
    with pytest.raises(ValueError) as e:
        quiet(ck.patch_heads, teacher, clean, corrupt, NO_GRADIENT[form], method=method,
              progress=False)
    msg = str(e.value)
    assert "carries no gradient" in msg and "'<lambda>'" in msg and "method='exact'" in msg
    assert "\n" not in msg


def test_auto_skips_its_screen_and_a_hand_built_metric_is_refused_at_run_time(teacher, prompts):
    """``auto`` running the exact sweep on a tiny model reports no screening recall (it would
    have screened with zeros); a PromptMetric without a gradient (its gradient unknown until it
    runs) is refused by attribution when it runs."""
    clean, corrupt = prompts
    detached = NO_GRADIENT[".detach()"]
    res = quiet(ck.patch_heads, teacher, clean, corrupt, detached, method="auto",
                progress=False)
    assert res.meta["auto"]["chose"] == "exact"
    assert res.meta["auto"]["screening"]["recall"] is None
    ref = tl_heads(teacher, clean, corrupt, detached)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
    seq = clean.shape[1]
    argmax = ck.PromptMetric(
        lambda logits, idx, rows: (logits[torch.arange(len(idx)), rows[:, seq - 1]]
                                   .argmax(-1) == 5).float(), "argmax5")
    with pytest.raises(ValueError, match="'argmax5' carries no gradient"):
        quiet(ck.patch_heads, teacher, clean, corrupt, argmax, method="attribution",
              progress=False)


# --- 3. a read position that depends on the logits ----------------------------------------------

WHERE = {
    # the form, and one whose probe (random logits ordering tokens 5 and 6 the same way
    # at every position) found one branch only: the old baseline was -0.7610, the true -0.8667
    "issue (0, 2)": lambda logits: torch.where(logits[:, -1, 0] > logits[:, -1, 2],
                                               logits[:, -1, 1], logits[:, -3, 1]),
    "tokens (5, 6)": lambda logits: torch.where(logits[:, -1, 5] > logits[:, -1, 6],
                                                logits[:, -1, 1], logits[:, -3, 1]),
}


@pytest.mark.parametrize("form", list(WHERE))
def test_a_logits_dependent_read_gets_the_true_baseline(teacher, prompts, form):
    clean, corrupt = prompts
    metric = WHERE[form]
    res = quiet(ck.patch_heads, teacher, clean, corrupt, metric, progress=False)
    with torch.no_grad():
        assert res.clean == pytest.approx(float(metric(teacher(clean)).mean()), abs=ATOL)
        assert res.corrupt == pytest.approx(float(metric(teacher(corrupt)).mean()), abs=ATOL)
    torch.testing.assert_close(res.values, tl_heads(teacher, clean, corrupt, metric),
                               atol=ATOL, rtol=0)
    for method in ("attribution", "attribution+exact"):  # the same baselines
        est = quiet(ck.patch_heads, teacher, clean, corrupt, metric, method=method,
                    progress=False, **({"top_k": 4} if "+" in method else {}))
        assert est.clean == pytest.approx(res.clean, abs=ATOL)


def test_an_exact_sweep_checks_probed_reads_on_its_own_cached_runs(teacher, prompts,
                                                                   monkeypatch):
    """No forward of its own: the engine's cached clean and corrupt runs unembed every position
    for the check, whether the reads hold (POS -1) or not (the torch.where form: restarted
    reading every position)."""
    from circuitkit.patching import inputs

    def no_forward(*args, **kw):
        def forward(tokens):
            raise AssertionError("an unpatched forward besides the engine's cached runs")
        return forward

    monkeypatch.setattr(inputs, "model_logits", no_forward)
    clean, corrupt = prompts
    for metric in (lambda logits: logits[:, -1, 5].mean(), WHERE["tokens (5, 6)"]):
        for run in (ck.patch_heads, ck.patch_layers):
            res = quiet(run, teacher, clean, corrupt, metric, progress=False)
            with torch.no_grad():
                assert res.clean == pytest.approx(float(metric(teacher(clean)).mean()),
                                                  abs=ATOL)
        torch.testing.assert_close(
            quiet(ck.patch_heads, teacher, clean, corrupt, metric, progress=False).values,
            tl_heads(teacher, clean, corrupt, metric), atol=ATOL, rtol=0)


def test_probed_reads_that_fail_on_real_logits_read_every_position(teacher, prompts):
    clean, corrupt = prompts
    pm = ck.as_metric(WHERE["tokens (5, 6)"], *clean.shape, int(teacher.cfg.d_vocab))
    assert pm.probed and pm.reads is not None
    with torch.no_grad():
        assert not pm.reads_hold(teacher(clean))
    res = quiet(ck.patch_heads, teacher, clean, corrupt, pm, progress=False)
    assert "do not give its value on the real" in res.meta["metric_note"]


# --- 4. one vocabulary rule for patch and score -------------------------------------------------


def test_patch_refuses_what_score_refuses(tmp_path):
    """A word-level tokenizer that spells one task word differently ("<Think>"): patch rendered
    the task as text, most of it <unk>, and swept it with exit 0; score refused."""
    folder = tmp_path / "respelled"
    shutil.copytree(TEACHER, folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["<Think>"] = vocab.pop("<think>")
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    runner = CliRunner()
    out = {}
    for command in ("patch", "score"):
        r = runner.invoke(app, [command, "--model", str(folder), "--task", "icd10", "-n", "4",
                                *(["--out", str(tmp_path / "o")] if command == "patch" else [])])
        assert r.exit_code == 2, r.output
        out[command] = r.output
    for text in out.values():
        line = next(x for x in text.splitlines() if x.startswith("error:"))
        assert "'<Think>' to the model but '<think>' to the task" in line
        assert re.search(r"reads \d+ of the \d+ tokens of the task written as text as its "
                         r"unknown token '<unk>'", line)
    assert not (tmp_path / "o" / "result.json").exists()


# --- 5. the degenerate-baseline rule ------------------------------------------------------------


@pytest.fixture(scope="module")
def raised():
    """icd10 (Phase 2 only) with clean and corrupt swapped: the corruption raises the teacher's
    margin."""
    task = ck.load_task("icd10", n_examples=6, split="test", seed=0)
    import dataclasses

    examples = [dataclasses.replace(e, tokens=e.corrupt_tokens, corrupt_tokens=e.tokens,
                                    anchor_pos=[], anchors=[], meta={}) for e in task.examples]
    return dataclasses.replace(task, examples=examples)


@pytest.mark.parametrize("call", ["exact", "attribution", "attribution+exact", "auto",
                                  "layers"])
def test_a_raised_metric_warns_once_at_the_api(teacher, raised, call):
    args = (teacher, raised.clean_tokens, raised.corrupt_tokens, raised.metric)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "layers":
            res = ck.patch_layers(*args, options=dict(progress=False))
        else:
            res = ck.patch_heads(*args, method=call, options=dict(
                progress=False, **{"top_k": 4} if call == "attribution+exact" else {}))
        assert res.corrupt > res.clean and res.degenerate
        normalized = res.normalized()
        res.top(3)
        res.to_frame()
        fig = res.heatmap()
    said = [w for w in caught if issubclass(w.category, DegenerateBaselineWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    line = str(said[0].message)
    assert "raises metric 'all_near_miss_margin'" in line and "\n" not in line
    assert said[0].filename == __file__  # the warning names the caller's line
    torch.testing.assert_close(normalized, res.effect())
    assert res.meta["normalization"].startswith("raw effect")
    assert fig.layout.coloraxis.colorbar.title.text == "raw effect"
    unwrapped = re.sub(r"</sup><br><sup>|<br>", " ", fig.layout.title.text)  # wrap_title's
    assert "raw effect" in unwrapped


def test_a_raised_metric_warns_once_in_the_cli(teacher, raised, tmp_path):
    path = tmp_path / "raised.jsonl"
    raised.to_jsonl(path)
    r = CliRunner().invoke(app, ["patch", "--model", "icd-teacher", "--task", str(path),
                                 "--method", "exact", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    lines = [x for x in r.output.splitlines() if "the corruption" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: the corruption raises"), lines
    assert "raw effect = value - baseline" in r.output
    saved = PatchResult.load(tmp_path / "o")
    assert saved.meta["normalization"].startswith("raw effect")


def test_characterize_warns_once_per_phase(teacher, raised, tmp_path):
    from circuitkit.experiments.characterize import characterize

    path = tmp_path / "raised.jsonl"
    raised.to_jsonl(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        characterize(teacher, str(path), tmp_path / "c", dict(n_examples=6, k=2, n_random=2,
                                                              progress=False, report=True))
    said = [str(w.message) for w in caught if issubclass(w.category, DegenerateBaselineWarning)]
    assert len(said) == 1 and "phase 2 (patch-p2-denoise, patch-p2-noise)" in said[0], said
    html = (tmp_path / "c" / "report.html").read_text()
    assert html.count("The corruption did not lower the metric here") == 1


def planted(clean_pp, corrupt_pp) -> PatchResult:
    clean_pp, corrupt_pp = torch.tensor(clean_pp), torch.tensor(corrupt_pp)
    n = len(clean_pp)
    return PatchResult(values=torch.zeros(2, 2), clean=float(clean_pp.mean()),
                       corrupt=float(corrupt_pp.mean()), direction="denoise", method="exact",
                       site="z", positions="all", per_prompt=torch.zeros(n, 2, 2),
                       clean_per_prompt=clean_pp, corrupt_per_prompt=corrupt_pp,
                       meta=dict(metric="m"))


def test_the_margin_is_two_standard_errors_of_the_per_prompt_gaps():
    """Hand-computed: gaps g, margin = 2 * std(g, ddof=1) / sqrt(n)."""
    import statistics

    cases = {  # (clean, corrupt) per prompt -> degenerate?
        "clear": ([3.0, 3.1, 2.9, 3.0], [1.0, 1.1, 0.9, 1.2], False),
        "noise": ([3.0, -2.0, 2.9, -2.8], [0.0, 0.9, 0.1, 0.0], True),
        "raised": ([1.0, 1.0, 1.0, 1.0], [1.5, 1.4, 1.6, 1.5], True),
    }
    for name, (c, k, want) in cases.items():
        res = planted(c, k)
        gaps = [a - b for a, b in zip(c, k, strict=True)]
        margin = MIN_GAP_SE * statistics.stdev(gaps) / len(gaps) ** 0.5
        assert res.gap_margin == pytest.approx(margin, rel=1e-6), name
        assert res.degenerate == want == (statistics.mean(gaps) <= margin), name
    res = planted([2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 0.1, 0.0, 1.99, 0.0])
    assert not res.degenerate
    assert res.weak_prompts().tolist() == [False, False, False, True, False]
    kept = res.select_prompts(~res.weak_prompts())
    assert kept.corrupt == pytest.approx(0.025) and kept.meta["prompts_kept"] == [0, 1, 2, 4]


# --- 6. padding ---------------------------------------------------------------------------------


def test_right_padded_prompts_are_refused_where_the_metric_reads_padding(teacher):
    """model.to_tokens right-pads prompts of different lengths; a metric reading -1 then read
    the pad positions of the shorter ones (a wrong-sign clean score in the issue)."""
    clean = teacher.to_tokens(["heart failure", "heart failure acute chronic"])
    corrupt = teacher.to_tokens(["kidney failure", "kidney failure acute chronic"])
    assert clean[0, -1] == teacher.tokenizer.pad_token_id  # right padding
    for method in ("exact", "attribution", "attribution+exact"):
        with pytest.raises(ValueError) as e:
            ck.patch_heads(teacher, clean, corrupt, lambda logits: logits[:, -1, 5].mean(),
                           method=method, options=dict(progress=False))
        msg = str(e.value)
        assert "right-padded" in msg and "prompt 0 has 3 tokens" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="right-padded"):
        ck.patch_layers(teacher, clean, corrupt, lambda logits: logits[:, -1, 5].mean(),
                        options=dict(progress=False))
    # reads unknown (an argmax): its values on the unpatched runs change when the padding's
    # logits are replaced by the last real token's, so it reads padding: refused
    with torch.no_grad():
        a = int(teacher(clean)[0, 2].argmax())  # prompt 0's last real token predicts a
    with pytest.raises(ValueError, match="reads positions that are unknown .* change with the "
                                         "logits at the padding"):
        ck.patch_heads(teacher, clean, corrupt,
                       lambda logits: (logits[:, -1].argmax(-1) == a).float(),
                       options=dict(progress=False))


def test_right_padding_is_fine_where_each_prompt_reads_its_own_positions(teacher):
    """A task's metric reads each prompt's own answer positions: the padded batch gives each
    prompt the value its unpadded run gives (a hand loop over prompts)."""
    task = ck.load_task("icd10", n_examples=6, split="test", seed=1)
    lengths = Counter(len(e.tokens) for e in task.examples)
    assert len(lengths) > 1  # padded
    res = quiet(ck.patch_heads, teacher, task.clean_tokens, task.corrupt_tokens, task.metric,
                progress=False)
    for i, e in enumerate(task.examples):
        one = task.subset([i])
        with torch.no_grad():
            want = float(one.metric(teacher(e.tokens[None])))
        assert float(res.clean_per_prompt[i]) == pytest.approx(want, abs=ATOL)
    # the same metric without declared reads: checked on the unpatched runs (its values do not
    # move with the padding's logits), then swept reading every position
    blind = ck.PromptMetric(task.metric.per_prompt_fn, "blind")
    got = quiet(ck.patch_heads, teacher, task.clean_tokens, task.corrupt_tokens, blind,
                progress=False)
    torch.testing.assert_close(got.values, res.values, atol=ATOL, rtol=0)


def test_a_task_position_in_its_own_padding_is_refused(teacher):
    """Examples built from padded rows with answer positions in the padding: score_heads and
    evaluate refuse them, naming the example."""
    import dataclasses

    task = ck.load_task("icd10", n_examples=3, split="test", seed=1)
    e = task.examples[0]
    pad = torch.full((4,), task.pad_id)
    bad = dataclasses.replace(e, tokens=torch.cat([e.tokens, pad]),
                              corrupt_tokens=torch.cat([e.corrupt_tokens, pad]),
                              answer_pos=[len(e.tokens) + 1])
    task = dataclasses.replace(task, examples=[bad, *task.examples[1:]])
    for fn in (ck.score_heads, ck.evaluate):
        with pytest.raises(ValueError, match=r"example 0's answer_pos \[\d+\] point\(s\) into "
                                             r"its right padding"):
            fn(teacher, task)
