"""Patching the shipped, trained induction model singles out the right heads.

The head sets are found from attention patterns (never named): an *induction head* puts most
of its attention (> 0.5) at a second-copy query q on the token after the previous occurrence of
the current token (q - S + 1, S = segment length); a *previous-token head* puts > 0.5 on q - 1.
"""

from __future__ import annotations

import pytest
import torch

import circuitkit as ck
from circuitkit import hooks


@pytest.fixture(scope="module")
def setup():
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=16, vocab_size=64, split="test", seed=0)
    return model, task


def head_sets(model, task) -> tuple[set, set]:
    f = hooks.facts(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(task.clean_tokens, names_filter=lambda n: "pattern" in n)
    induction, prev = set(), set()
    for layer in range(f.n_layers):
        pat = cache[hooks.pattern(layer)]  # [batch, head, query, key]
        ind_s, prev_s = [], []
        for i, ex in enumerate(task.examples):
            S = len(ex.evidence_pos)
            q = torch.tensor(ex.answer_pos) - 1  # second-copy queries that predict an answer
            ind_s.append(pat[i, :, q, q - S + 1].mean(-1))
            qq = torch.arange(1, 2 * S + 1)
            prev_s.append(pat[i, :, qq, qq - 1].mean(-1))
        for h in range(f.n_heads):
            if torch.stack(ind_s).mean(0)[h] > 0.5:
                induction.add((layer, h))
            if torch.stack(prev_s).mean(0)[h] > 0.5:
                prev.add((layer, h))
    return induction, prev


def cells(mask: torch.Tensor) -> set:
    return {tuple(map(int, ix)) for ix in mask.nonzero()}


def test_denoise_finds_induction_heads_noise_finds_previous_token_head(setup):
    model, task = setup
    induction, prev = head_sets(model, task)
    assert induction and prev and not (induction & prev)
    assert all(layer == 1 for layer, _ in induction) and all(layer == 0 for layer, _ in prev)
    args = (model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric())
    den = ck.patch_heads(*args, direction="denoise", options=dict(progress=False)).normalized()
    # every induction head restores a real share of the log-prob; nothing else does
    assert cells(den > 0.15) == induction, den
    noi = ck.patch_heads(*args, direction="noise", options=dict(progress=False)).normalized()
    # breaking the previous-token head breaks induction (-1 = fully broken); the layer-1
    # induction heads back each other up, so noising any single one barely matters
    assert cells(noi < -0.3) == prev, noi


def test_cli_patch_writes_outputs(tmp_path):
    from typer.testing import CliRunner

    from circuitkit.cli import app
    from circuitkit.patching.results import PatchResult

    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["patch", "--model", "induction-2l", "--task", "induction",
                                 "--n-examples", "8", "--out", str(out), "--checkpoint"])
    assert r.exit_code == 0, r.output
    res = PatchResult.load(out)  # the folder the CLI wrote
    assert {p.name for p in out.iterdir() if p.is_file()} >= {p.name for p in res.save(
        tmp_path / "again" / "result")}  # --out holds exactly what res.save writes (and more:
    # the checkpoint folder)
    assert res.values.shape == (2, 4) and res.meta["task_hash"]
    r = CliRunner().invoke(app, ["patch", "--model", "induction-2l", "--task", "induction",
                                 "--n-examples", "8", "--plan"])
    assert r.exit_code == 0 and "pass-equivalents" in r.output and "time" in r.output


@pytest.mark.parametrize("positions,n", [("all", 8), ("each", 3)])
def test_exact_engine_matches_transformerlens_on_the_teacher(positions, n):
    from transformer_lens import patching as tlp

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=n, split="test", seed=1)
    metric = task.prompt_metric()
    with torch.no_grad():
        _, cache = model.run_with_cache(task.clean_tokens)
        ref_fn = (tlp.get_act_patch_attn_head_out_all_pos if positions == "all"
                  else tlp.get_act_patch_attn_head_out_by_pos)
        ref = ref_fn(model, task.corrupt_tokens, cache, metric)
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, metric,
                         positions=positions, options=dict(progress=False))
    if positions == "each":  # TL: [layer, pos, head]; ours: [layer, head, pos]
        ref = ref.permute(0, 2, 1)
    assert res.values.shape == ref.shape
    torch.testing.assert_close(res.values, ref, atol=1e-4, rtol=0)


def test_length_buckets_keep_the_callers_prompt_order_on_the_teacher():
    """ICD notes differ in length: the sweep runs them sorted, in two length buckets that stop
    after their last read, and returns per-prompt values in the caller's order, equal (1e-4) to
    a sweep that knows no read positions (no sorting, no early stop, full logits)."""
    from circuitkit.metrics import PromptMetric
    from circuitkit.patching.sweep import Sweep, chunked, length_order

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=12, split="test", seed=3)  # lengths 12..34
    pm = task.prompt_metric()
    order, cuts = length_order(pm)
    assert not torch.equal(order, torch.arange(12)) and cuts[0] < cuts[-1]
    sweep = Sweep("heads", "z", "denoise", "all", 4, 8, 1, 12, task.clean_tokens.shape[1], True)
    sweep = chunked(sweep, 1024, cuts)
    assert len({c[3:] for c in sweep.chunks}) == 2  # two prompt buckets
    args = (model, task.clean_tokens, task.corrupt_tokens)
    for direction in ("denoise", "noise"):
        fast = ck.patch_heads(*args, pm, direction=direction, options=dict(progress=False))
        blind = ck.patch_heads(*args, PromptMetric(pm.per_prompt_fn, pm.name), direction=direction,
                               options=dict(progress=False))
        for field in ("per_prompt", "clean_per_prompt", "corrupt_per_prompt"):
            torch.testing.assert_close(getattr(fast, field), getattr(blind, field), atol=1e-4,
                                       rtol=0)
