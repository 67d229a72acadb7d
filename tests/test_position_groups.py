"""Position groups (``positions=`` a bool mask [batch, seq] or {name: mask}): one sweep gives
``[layer, head, group]``, each prompt patched at its own positions of the group at once.

Checked against ``positions="each"`` / ``"all"`` of the same engine, against a hand-written
TransformerLens hook reference, on a planted two-stage circuit, and through a strict save/load.
"""

from __future__ import annotations

import json

import pytest
import torch
from planted_circuit import planted_model, planted_task

import circuitkit as ck
from circuitkit import hooks

ATOL = 1e-4
pytestmark = pytest.mark.filterwarnings(
    "ignore::circuitkit.patching.results.DegenerateBaselineWarning")


@pytest.fixture(scope="module")
def task():
    return ck.load_task("induction", n_examples=4, seg_len=4, vocab_size=64, seed=1)


def check_against_each_and_all(model, clean, corrupt, metric, real, direction, site="z"):
    n, seq = clean.shape
    upto = real - 1  # one position per prompt inside its own tokens
    pos = torch.minimum(torch.randperm(seq, generator=torch.Generator().manual_seed(3))[:n],
                        upto)
    one = torch.zeros(n, seq, dtype=torch.bool)
    one[torch.arange(n), pos] = True
    whole = torch.arange(seq)[None] < real[:, None]
    kw = dict(direction=direction, site=site, options=dict(progress=False))
    res = ck.patch_heads(model, clean, corrupt, metric, positions={"one": one, "all": whole},
                         **kw)
    each = ck.patch_heads(model, clean, corrupt, metric, positions="each", **kw)
    allpos = ck.patch_heads(model, clean, corrupt, metric, positions="all", **kw)
    assert res.axes == ("layer", "head", "group")
    assert res.values.shape == (*allpos.values.shape, 2)
    assert res.meta["group_names"] == ["one", "all"]
    own = each.per_prompt[torch.arange(n), :, :, pos]  # [n, layer, head]: each prompt's own
    torch.testing.assert_close(res.per_prompt[..., 0], own, atol=ATOL, rtol=0)
    torch.testing.assert_close(res.values[..., 0], own.mean(0), atol=ATOL, rtol=0)
    torch.testing.assert_close(res.values[..., 1], allpos.values, atol=ATOL, rtol=0)
    return res


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gpt2"])
def test_one_position_equals_each_and_all_equals_all(request, task, which, direction):
    model = request.getfixturevalue(which)
    n, seq = task.clean_tokens.shape
    check_against_each_and_all(model, task.clean_tokens, task.corrupt_tokens,
                               task.prompt_metric(), torch.full((n,), seq), direction)


@pytest.mark.parametrize("site", ["q", "v", "pattern"])
def test_other_sites_one_position_equals_each(tiny_llama, task, site):
    n, seq = task.clean_tokens.shape
    check_against_each_and_all(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                               task.prompt_metric(), torch.full((n,), seq), "denoise", site)


def test_teacher_one_position_equals_each_and_all_equals_all():
    model = ck.load_model("icd-teacher")
    t = ck.load_task("icd10", n_examples=16, split="test")
    real = torch.tensor([len(e.tokens) for e in t.examples])
    res = check_against_each_and_all(model, t.clean_tokens, t.corrupt_tokens, t.metric, real,
                                     "noise")
    assert res.meta["groups_hash"] and len(res.meta["group_sizes"]) == 2


def hooked_group_reference(model, base, source, metric, mask, site="z"):
    """Metric (mean over prompts) after patching each head of each layer at ``mask``'s
    positions of each prompt: one ``run_with_hooks`` per (layer, head), the source's ``hook_z``
    (or q/k/v, or the pattern's query rows) written where the mask is set. Written apart from
    the engine."""
    f = hooks.facts(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(source)
    out = torch.zeros(f.n_layers, f.n_heads_at(site))
    for layer in range(f.n_layers):
        name = hooks.head_site(site, layer)
        for h in range(f.n_heads_at(site)):
            def patch(t, hook, src=cache[name], h=h):
                t = t.clone()
                if site == "pattern":  # [b, head, q, k]
                    m = mask[:, :, None]
                    t[:, h] = torch.where(m, src[:, h], t[:, h])
                else:  # [b, pos, head, d]
                    m = mask[:, :, None]
                    t[:, :, h] = torch.where(m, src[:, :, h], t[:, :, h])
                return t

            with torch.no_grad():
                logits = model.run_with_hooks(base, fwd_hooks=[(name, patch)])
            out[layer, h] = torch.as_tensor(metric(logits)).float().mean()
    return out


@pytest.mark.parametrize("site", ["z", "pattern"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_random_mask_equals_hook_reference(tiny_llama, task, direction, site):
    n, seq = task.clean_tokens.shape
    mask = torch.rand(n, seq, generator=torch.Generator().manual_seed(7)) < 0.4
    mask[:, 0] = True  # no prompt empty
    metric = task.prompt_metric()
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric,
                         positions=mask, direction=direction, site=site,
                         options=dict(progress=False))
    base, source = (task.corrupt_tokens, task.clean_tokens) if direction == "denoise" else (
        task.clean_tokens, task.corrupt_tokens)
    ref = hooked_group_reference(tiny_llama, base, source, metric, mask, site)
    assert res.meta["group_names"] == ["group"]
    torch.testing.assert_close(res.values[..., 0], ref, atol=ATOL, rtol=0)


def test_fused_and_plain_paths_agree(tiny_llama, task):
    """The fused fast path (Llama form) and the plain hooked path give the same group values."""
    from circuitkit.patching import exact as engine_module
    from circuitkit.patching import groups
    from circuitkit.patching.sweep import chunked, make_sweep

    n, seq = task.clean_tokens.shape
    mask = torch.rand(n, seq, generator=torch.Generator().manual_seed(5)) < 0.5
    mask[:, 1] = True
    pg = groups.position_groups({"a": mask, "b": ~mask}, task.clean_tokens)
    metric = task.prompt_metric()
    sweep = chunked(make_sweep(tiny_llama, "heads", "z", "denoise", pg, task.clean_tokens,
                               metric), 64)
    eng = engine_module.ExactEngine(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric,
                                    sweep)
    assert eng.fused is not None
    for layer in range(sweep.n_layers):
        v = range(sweep.n_variants)
        fast = eng.run_variants(layer, v, 0, n, fast=True)
        plain = eng.run_variants(layer, v, 0, n, fast=False)
        torch.testing.assert_close(fast, plain, atol=ATOL, rtol=0)


def test_bad_masks_are_refused(tiny_llama, task):
    c, k, m = task.clean_tokens, task.corrupt_tokens, task.prompt_metric()
    n, seq = c.shape
    good = torch.ones(n, seq, dtype=torch.bool)
    cases = [(torch.ones(n, seq + 1, dtype=torch.bool), "shape"),
             (torch.zeros(n, seq, dtype=torch.bool), "empty"),
             (good.long(), "bool"),
             ({"a": good, "b": torch.zeros(n, seq, dtype=torch.bool)}, "'b' is empty"),
             ({}, "non-empty dict")]
    for positions, said in cases:
        with pytest.raises(ValueError, match=said):
            ck.patch_heads(tiny_llama, c, k, m, positions=positions, options=dict(progress=False))
    with pytest.raises(NotImplementedError, match="position groups"):
        ck.patch_heads(tiny_llama, c, k, m, positions=good, method="attribution+exact",
                       options=dict(progress=False))


def test_padding_positions_are_refused():
    model = ck.load_model("icd-teacher")
    t = ck.load_task("icd10", n_examples=8, split="test")
    real = torch.tensor([len(e.tokens) for e in t.examples])
    assert int(real.min()) < t.clean_tokens.shape[1]  # some prompt is right-padded
    whole = torch.ones(t.clean_tokens.shape, dtype=torch.bool)
    with pytest.raises(ValueError, match="marks padding"):
        ck.patch_heads(model, t.clean_tokens, t.corrupt_tokens, t.metric, positions=whole,
                       options=dict(progress=False))


def test_task_position_groups_align_with_examples():
    t = planted_task(6)
    tokens = t.position_groups()
    assert list(tokens) == ["evidence", "anchor", "shortlist", "answer"]
    for i, e in enumerate(t.examples):
        for name, mask in tokens.items():
            assert mask[i].nonzero()[:, 0].tolist() == sorted(getattr(e, f"{name}_pos"))
    g = t.position_groups(at="steps")
    assert list(g) == ["evidence", "anchor", "shortlist", "answer"]
    for name, mask in g.items():
        assert mask.shape == t.clean_tokens.shape and mask.dtype == torch.bool
        for i, e in enumerate(t.examples):
            shift = 0 if name == "evidence" else 1
            assert mask[i].nonzero()[:, 0].tolist() == sorted(
                p - shift for p in getattr(e, f"{name}_pos"))
    # "answer" (steps) is where the metric reads
    reads = t.answer_positions
    assert all(bool(g["answer"][i, reads[i][reads[i] >= 0]].all()) for i in range(6))
    with pytest.raises(ValueError, match="at="):
        t.position_groups(at="reads")


def test_attribution_groups_sum_each_over_the_group(tiny_llama, task):
    n, seq = task.clean_tokens.shape
    mask = torch.rand(n, seq, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[:, 2] = True
    m = task.prompt_metric()
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, m, positions=mask,
                         method="attribution", options=dict(progress=False))
    each = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, m, positions="each",
                          method="attribution", options=dict(progress=False))
    base = each.corrupt_per_prompt[:, None, None]
    want = (base + ((each.per_prompt - base[..., None]) * mask[:, None, None]).sum(-1)).mean(0)
    assert res.method == "attribution" and res.axes == ("layer", "head", "group")
    torch.testing.assert_close(res.values[..., 0], want, atol=1e-5, rtol=0)
    with pytest.raises(NotImplementedError, match="position groups"):
        ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, m, positions=mask,
                       method="attribution", options=dict(estimator="block", progress=False))


# --- a planted two-stage circuit -------------------------------------------------------------


@torch.no_grad()
def two_stage_model():
    """``planted_model`` rewired into two stages at two positions: L0H2 writes the decision
    (dim 60: "this shortlist entry is the note's child") at each *shortlist entry* (its query:
    +child-0 / -child-1 label; its keys: +D_0 / -D_1; values 1 from either D token); L1H0 (and
    its decoy L1H1) reads it at the *answer step* (</think>, position 12): constant query, key
    dim 60, so it attends to the entry L0H2 marked and copies that label's margin."""
    from planted_circuit import D0, DH, L0, N_ANCHORS, QK

    model = planted_model()
    hf = model.original_model
    a0, a1 = hf.model.layers[0].self_attn, hf.model.layers[1].self_attn
    r = 2 * DH + QK
    a0.q_proj.weight[r] = 0.0
    a0.k_proj.weight[r] = 0.0
    for k in range(2 * N_ANCHORS):
        a0.q_proj.weight[r, L0 + k] = 8.0 if k % 2 == 0 else -8.0
    a0.k_proj.weight[r, D0], a0.k_proj.weight[r, D0 + 1] = 1.0, -1.0
    a0.v_proj.weight[2 * DH, D0] = a0.v_proj.weight[2 * DH, D0 + 1] = 1.0
    for h in (0, 1):
        a1.q_proj.weight[h * DH + QK] = 0.0
        a1.q_proj.weight[h * DH + QK, 32] = 8.0
        a1.k_proj.weight[h * DH + QK] = 0.0
        a1.k_proj.weight[h * DH + QK, 60] = 1.0
    return model.eval()


def test_planted_two_stage_circuit_found_at_its_stages():
    model, t = two_stage_model(), planted_task(24)
    groups = t.position_groups()  # at the tokens: the shortlist entries themselves
    groups["answer_step"] = t.position_groups(at="steps")["answer"]  # where the metric reads
    res = ck.patch_heads(model, t.clean_tokens, t.corrupt_tokens, t.metric, positions=groups,
                         direction="noise", options=dict(progress=False))
    assert not res.degenerate
    norm = res.normalized()
    g = {name: i for i, name in enumerate(res.meta["group_names"])}
    # stage 1: the writer matters where it writes (the shortlist), not at the answer step
    assert float(norm[0, 2, g["shortlist"]]) < -0.8
    assert abs(float(norm[0, 2, g["answer_step"]])) < 0.1
    # stage 2: the reader matters at the answer step only
    assert float(norm[1, 0, g["answer_step"]]) < -0.8
    assert abs(float(norm[1, 0, g["shortlist"]])) < 0.05
    # the answer token's own position comes after the read: nothing there
    assert float(norm[..., g["answer"]].abs().max()) < 1e-6
    # and no other (head, group) cell carries a comparable effect
    strong = (norm.abs() > 0.5).nonzero().tolist()
    assert sorted(map(tuple, strong)) == [(0, 2, g["shortlist"]), (1, 0, g["answer_step"])]


# --- strict save/load ----------------------------------------------------------------------------


def test_save_load_round_trip_and_damaged_group_fields(tiny_llama, task, tmp_path):
    n, seq = task.clean_tokens.shape
    mask = torch.zeros(n, seq, dtype=torch.bool)
    mask[:, -2:] = True
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                         positions={"late": mask, "early": ~mask}, options=dict(progress=False))
    res.save(tmp_path / "r")
    back = ck.PatchResult.load(tmp_path / "r")
    assert back.axes == res.axes and back.positions == "groups"
    assert back.meta["group_names"] == ["late", "early"]
    assert back.meta["groups_hash"] == res.meta["groups_hash"]
    torch.testing.assert_close(back.values, res.values)
    frame = back.to_frame(ci=False)
    assert set(frame["group"]) == {"late", "early"}
    js = tmp_path / "r.json"
    info = json.loads(js.read_text())
    for field, value in (("group_names", ["late"]), ("group_names", ["late", "late"]),
                         ("groups_hash", "not-a-hash"), ("group_sizes", [1.0])):
        bad = json.loads(json.dumps(info))
        bad["meta"][field] = value
        js.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"meta.{field}"):
            ck.PatchResult.load(tmp_path / "r")
    bad = json.loads(json.dumps(info))
    bad["axes"] = ["layer", "head", "pos"]
    js.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="axes"):
        ck.PatchResult.load(tmp_path / "r")


def test_checkpoint_resumes_and_refuses_other_masks(tiny_llama, task, tmp_path):
    n, seq = task.clean_tokens.shape
    mask = torch.zeros(n, seq, dtype=torch.bool)
    mask[:, :3] = True
    args = (tiny_llama, task.clean_tokens, task.corrupt_tokens, task.prompt_metric())
    first = ck.patch_heads(*args, positions={"a": mask},
                           options=dict(checkpoint=tmp_path / "ck", progress=False))
    again = ck.patch_heads(*args, positions={"a": mask},
                           options=dict(checkpoint=tmp_path / "ck", progress=False))
    torch.testing.assert_close(again.values, first.values, atol=0, rtol=0)
    other = mask.clone()
    other[0, 5] = True
    with pytest.raises(ValueError, match="groups"):
        ck.patch_heads(*args, positions={"a": other},
                       options=dict(checkpoint=tmp_path / "ck", progress=False))
