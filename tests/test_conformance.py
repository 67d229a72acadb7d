"""Conformance matrix: every decoder layout TransformerLens 4.3 bridges or boots natively, times
every public entry point. Each cell either equals a reference written apart from the code under
test or is refused in one line that names what the layout lacks (``REFUSED``).

Layouts (tiny, seeded, built offline; ``tinymodels``): the HF block layouts of ``ARCHS``;
TransformerLens-native configs (``NATIVE``: attention-only with and without LayerNorm, no
normalization, LN, RMS (rotary, gated MLP, GQA), LNPre, RMSPre, an output vocabulary smaller
than the input one, ``parallel_attn_mlp`` (native blocks run in sequence whatever the flag),
attention and logit soft-caps, bidirectional attention); and a Tracr-compiled program
(``tracr_model``: bidirectional, no normalization, ``d_vocab_out < d_vocab``).

References and tolerances (float32 metrics of size ~1-10):

* exact, all 13 site/position modes: every cell against ``hooked_sweep`` (a plain
  ``run_with_hooks`` forward of the whole model), and a sample of cells of each mode against
  TransformerLens's own ``transformer_lens.patching`` function for that mode; 1e-4 absolute;
* attribution: every estimator runs or is refused; exact by construction, 1e-4 absolute:
  AtP* with its exact tail on last-layer heads (every layout), every estimator on last-layer
  heads where the last layer is linear in the site (no final norm, no MLP, a metric linear in
  the logits), ``block`` on last-layer heads where only the MLP is not (no final norm);
  ``ig``'s noise estimate mirrors its denoise one (same path reversed), 1e-5;
* the hybrid: its verified cells against ``hooked_sweep``, 1e-4;
* ``characterize`` on a small JSONL task (``small_task``, through ``Task.to_jsonl`` /
  ``from_jsonl``): its sweeps against ``hooked_sweep``; its ``scores.csv`` margin widening
  against an intervention (each head's write, from the attention's own output projection,
  subtracted from the final residual with the final norm's scale held at the run's: the
  frozen-scale direct effect), 2e-4; its ``validation.csv`` top-set effects against a hooked
  forward patching the top heads together, 1e-4 (``score_heads`` and ``validate_heads`` are the
  functions characterize calls on the same task).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pytest
import torch
from tinymodels import ARCHS, NATIVE, SMALL, hooked_sweep, native_model, with_random_post_norms
from transformer_lens import patching as tlp

import circuitkit as ck
from circuitkit import hooks
from circuitkit.experiments.characterize import characterize
from circuitkit.patching.api import verified_mask
from circuitkit.patching.estimators.attribution import ESTIMATORS
from circuitkit.tasks.base import Example, Task, phase_task

ATOL = 1e-4
N, SEQ = 2, 8
LAYOUTS = [*(f"hf-{a}" for a in ARCHS), *(f"native-{n}" for n in NATIVE), "tracr"]
HEAD_MODES = [(site, pos) for site in hooks.PATCH_HEAD_SITES for pos in ("all", "each")]
LAYER_MODES = [(site, "each") for site in hooks.PATCH_LAYER_SITES]
NOISE_MODES = [("z", "all"), ("z", "each"), ("pattern", "all"), ("k", "all")]
TL_FN = {
    ("z", "all"): tlp.get_act_patch_attn_head_out_all_pos,
    ("z", "each"): tlp.get_act_patch_attn_head_out_by_pos,
    ("q", "all"): tlp.get_act_patch_attn_head_q_all_pos,
    ("q", "each"): tlp.get_act_patch_attn_head_q_by_pos,
    ("k", "all"): tlp.get_act_patch_attn_head_k_all_pos,
    ("k", "each"): tlp.get_act_patch_attn_head_k_by_pos,
    ("v", "all"): tlp.get_act_patch_attn_head_v_all_pos,
    ("v", "each"): tlp.get_act_patch_attn_head_v_by_pos,
    ("pattern", "all"): tlp.get_act_patch_attn_head_pattern_all_pos,
    ("pattern", "each"): tlp.get_act_patch_attn_head_pattern_by_pos,
    ("resid_pre", "each"): tlp.get_act_patch_resid_pre,
    ("attn_out", "each"): tlp.get_act_patch_attn_out,
    ("mlp_out", "each"): tlp.get_act_patch_mlp_out,
}

# (layout, entry point) -> the one line it is refused with (a regex). Everything else must equal
# its reference. Entry points: a site ("z", "pattern", "mlp_out", ...) or "estimator:<name>".
POST_HOC = "does not change this model's output"
NO_MLP = r"no 'blocks.0.hook_mlp_out': its blocks have no MLP \(an attention-only model\)"
QK_NEEDS_PATTERN = "needs the gradient at the attention pattern"
NO_RERUN = "re-runs single layers"
REFUSED: dict[tuple[str, str], str] = {
    ("hf-gptj", "pattern"): POST_HOC,
    ("hf-opt", "pattern"): POST_HOC,
    ("hf-gptj", "estimator:qk"): QK_NEEDS_PATTERN,
    ("hf-gptj", "estimator:atp*"): QK_NEEDS_PATTERN,
    ("hf-opt", "estimator:qk"): QK_NEEDS_PATTERN,
    ("hf-opt", "estimator:atp*"): QK_NEEDS_PATTERN,
    ("hf-opt", "estimator:block"): NO_RERUN,
    ("native-attn-only", "mlp_out"): NO_MLP,
    ("native-attn-only-ln", "mlp_out"): NO_MLP,
}
# Layouts whose last layer is linear in its heads' z (no MLP, no final norm, no logit cap): every
# first-order estimator is exact there. LINEAR_BUT_MLP: only the MLP is not (block is exact).
LINEAR_LAST = {"native-attn-only"}
LINEAR_BUT_MLP = {"native-no-norm", "native-parallel"}


@dataclass
class Case:
    name: str
    model: Any
    clean: torch.Tensor
    corrupt: torch.Tensor
    metric: Any  # a plain callable: logits [n, seq, d_vocab_out] -> [n], linear in the logits
    task: Task


def logit_diff(reads: list[list[tuple[int, int, int]]]):
    """A plain lambda (what a user writes): per prompt, the sum over its ``(pos, good, bad)``
    reads of ``logits[pos, good] - logits[pos, bad]``; linear in the logits."""
    return lambda logits: torch.stack([sum(logits[i, p, g] - logits[i, p, b] for p, g, b in r)
                                       for i, r in enumerate(reads)])


def random_case(name: str, model: Any) -> Case:
    f = hooks.facts(model)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, f.d_vocab, (N, SEQ), generator=g)
    corrupt = torch.randint(0, f.d_vocab, (N, SEQ), generator=g)
    out = f.d_vocab_out
    reads = [[(p, int(clean[i, p + 1]) % out, (int(corrupt[i, p + 1]) + 1) % out)
              for p in (3, 6)] for i in range(N)]
    return Case(name, model, clean, corrupt, logit_diff(reads), small_task(f.d_vocab, out))


def small_task(d_vocab: int, d_vocab_out: int, n: int = 4, seed: int = 0) -> Task:
    """Both phases in 8 tokens: ``<bos> E f A_a L L f L_(a,j)``. ``E`` (evidence) names anchor
    ``a`` and child ``j``; ``A_a`` at anchor_pos 3, the shortlist ``L_(a,0), L_(a,1)`` at 4, 5, the
    answer at 7. Labels 4..7, anchors 8, 9 (read from the logits: below ``d_vocab_out``),
    evidence 10..13, fillers above. Phase-2 corruption flips ``j``, phase-1 corruption ``a``."""
    assert d_vocab_out >= 10 and d_vocab >= 16
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        a, j = i % 2, (i // 2) % 2
        fill = torch.randint(14, d_vocab, (2,), generator=g).tolist()
        short = [4 + 2 * a, 5 + 2 * a][:: 1 if i % 3 else -1]
        seq = [1, 10 + 2 * a + j, fill[0], 8 + a, *short, fill[1], 4 + 2 * a + j]
        p2 = list(seq)
        p2[1] = 10 + 2 * a + 1 - j
        p1 = list(seq)
        p1[1] = 10 + 2 * (1 - a) + j
        examples.append(Example(
            tokens=torch.tensor(seq), corrupt_tokens=torch.tensor(p2), evidence_pos=[1],
            anchor_pos=[3], shortlist_pos=[4, 5], answer_pos=[7], targets=[2 * a + j],
            near_misses=[2 * a + 1 - j], anchors=[a],
            meta=dict(corrupt_tokens_p1=p1, corrupt_anchors=[1 - a])))
    vocab = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(4, d_vocab)]
    return Task(name="conformance", examples=examples, label_names=[f"L{k}" for k in range(4)],
                anchor_names=["A0", "A1"], label_token_ids=torch.arange(4, 8),
                anchor_token_ids=torch.tensor([8, 9]), label_anchor=torch.tensor([0, 0, 1, 1]),
                vocab=vocab, phase=2)


@functools.cache
def case(name: str) -> Case:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("hf-"):
            return random_case(name, with_random_post_norms({**SMALL, **ARCHS[name[3:]]}))
        if name.startswith("native-"):
            return random_case(name, native_model(**NATIVE[name[7:]]))
        return tracr_case()


# --- Tracr ---------------------------------------------------------------------------------------


@functools.cache
def tracr_program():
    """``out[q] = (tokens[q + 1] + tokens[q - 1]) % 3``, compiled by Tracr (bidirectional, no
    normalization): one layer whose two heads read the next and the previous token, an MLP that
    adds them. Returns (bridge, Tracr's compiled model, the heads reading next / previous)."""
    pytest.importorskip("tracr", reason="tracr-pypi (the dev extra) compiles the program")
    from tracr.compiler import compiling
    from tracr.rasp import rasp
    from transformer_lens.utilities import tracr as tl_tracr

    def shifted(offset: int, name: str):
        sel = rasp.Select(rasp.indices, rasp.indices, lambda k, q: k == q + offset)
        return rasp.categorical(rasp.Aggregate(sel, rasp.tokens)).named(name)

    out = rasp.categorical(rasp.SequenceMap(lambda x, y: (x + y) % 3, shifted(1, "next"),
                                            shifted(-1, "prev"))).named("out")
    compiled = compiling.compile_rasp_to_model(out, vocab={0, 1, 2}, max_seq_len=5,
                                               compiler_bos="BOS")
    label = next(lab.split(":")[0] for lab in compiled.residual_labels if lab.startswith("out"))
    model = ck.load_model(tl_tracr.make_tracr_transformer_bridge_config(compiled))
    model.load_state_dict(tl_tracr.make_tracr_transformer_bridge_state_dict(compiled, label),
                          strict=False)
    # which head reads which neighbour: from the attention pattern (query 2 -> key 3 or 1)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[3, 0, 1, 2, 2, 1]]))
    pat = cache[hooks.pattern(0)][0, :, 2]
    heads = (int(pat[:, 3].argmax()), int(pat[:, 1].argmax()))
    return model.eval(), compiled, heads


def tracr_case() -> Case:
    """Clean ``BOS a 0 c t e``: the output at 3 is ``t``; corrupt ``BOS a 1 c t e``: ``t + 1``.
    Metric (a plain lambda): ``logit[3, t] - logit[3, t + 1]``, 1 clean, -1 corrupt. Phase-2
    JSONL task: the same tokens, answer_pos 4 (read at 3), its near-miss ``t + 1``."""
    model, _, _ = tracr_program()
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 3, (N, 6), generator=g)
    rows[:, 0], rows[:, 2] = 3, 0  # BOS; the previous token of position 3 is 0 ...
    corrupt = rows.clone()
    corrupt[:, 2] = 1  # ... and 1: the output at 3 moves from t to t + 1
    reads = [[(3, int(t), (int(t) + 1) % 3)] for t in rows[:, 4]]
    examples = [Example(tokens=r, corrupt_tokens=c, evidence_pos=[2], anchor_pos=[],
                        shortlist_pos=[1, 5], answer_pos=[4], targets=[int(r[4])],
                        near_misses=[(int(r[4]) + 1) % 3], anchors=[])
                for r, c in zip(rows.repeat(2, 1), corrupt.repeat(2, 1), strict=True)]
    task = Task(name="tracr", examples=examples, label_names=["0", "1", "2"], anchor_names=["A"],
                label_token_ids=torch.arange(3), anchor_token_ids=torch.tensor([4]),
                label_anchor=torch.zeros(3, dtype=torch.long), vocab=["0", "1", "2", "BOS", "pad"],
                phase=2, pad_id=4, bos_id=3, eos_id=4)
    return Case("tracr", model, rows, corrupt, logit_diff(reads), task)


def test_tracr_program_computes_its_known_answer_and_patching_finds_its_heads():
    """The bridge computes ``(tokens[q + 1] + tokens[q - 1]) % 3`` at every inner position of
    every input (as Tracr's own model does); exact patching of the previous-token head restores
    a corruption of the previous token fully and the next-token head not at all (normalized 1
    and 0), and the reverse for the next token: the heads the compiled program uses."""
    model, compiled, (nxt, prv) = tracr_program()
    enc, dec = compiled.input_encoder.encoding_map, compiled.output_encoder.encoding_map
    inv = {v: k for k, v in dec.items()}
    grid = torch.cartesian_prod(*[torch.arange(3)] * 5)  # every input of length 5
    tokens = torch.cat([torch.full((len(grid), 1), enc["BOS"]), grid], 1)
    with torch.no_grad():
        got = model(tokens).argmax(-1)[:, 2:5]
    want = (grid[:, 2:] + grid[:, :-2]) % 3
    assert got.tolist() == [[inv[int(v)] for v in r] for r in want.tolist()] == want.tolist()
    theirs = compiled.apply(["BOS", *grid[17].tolist()]).decoded[2:5]
    assert theirs == want[17].tolist()
    c = case("tracr")
    res = ck.patch_heads(model, c.clean, c.corrupt, c.metric, options=dict(progress=False))
    assert (res.clean, res.corrupt) == pytest.approx((1.0, -1.0), abs=1e-5)
    assert res.normalized()[0].tolist() == pytest.approx(
        [1.0 if h == prv else 0.0 for h in range(2)], abs=1e-5)
    nxt_corrupt = c.clean.clone()
    nxt_corrupt[:, 4] = (nxt_corrupt[:, 4] + 1) % 3  # the next token of position 3
    res = ck.patch_heads(model, c.clean, nxt_corrupt, c.metric, options=dict(progress=False))
    assert res.normalized()[0].tolist() == pytest.approx(
        [1.0 if h == nxt else 0.0 for h in range(2)], abs=1e-5)


# --- the matrix ----------------------------------------------------------------------------------


def refused(name: str, what: str):
    """``pytest.raises`` for the expected one-line refusal, or None where none is expected."""
    want = REFUSED.get((name, what))
    return None if want is None else pytest.raises((ValueError, NotImplementedError), match=want)


def one_line(excinfo) -> None:
    assert "\n" not in str(excinfo.value), str(excinfo.value)


def tl_sample(c: Case, site: str, positions: str, got: torch.Tensor, cache: Any
              ) -> tuple[Any, Any]:
    """TransformerLens's own function for this mode on three cells (the first, the last, the
    largest effect), as (its values, ours)."""
    kind_layers = site in hooks.PATCH_LAYER_SITES
    flat = (got - got.flatten()[0]).abs().flatten()
    cells = sorted({0, flat.numel() - 1, int(flat.argmax())})
    idx = [list(torch.unravel_index(torch.tensor(i), got.shape)) for i in cells]
    if kind_layers:
        cols, rows = ("layer", "pos"), [(int(a), int(b)) for a, b in idx]
    elif positions == "all":
        cols = ("layer", "head_index" if site == "pattern" else "head")
        rows = [(int(a), int(b)) for a, b in idx]
    elif site == "pattern":  # TL: (layer, head_index, dest_pos), as ours
        cols, rows = ("layer", "head_index", "dest_pos"), [tuple(int(x) for x in i) for i in idx]
    else:  # TL: (layer, pos, head); ours (layer, head, pos)
        cols, rows = ("layer", "pos", "head"), [(int(a), int(p), int(h)) for a, h, p in idx]
    theirs = TL_FN[(site, positions)](c.model, c.corrupt, cache, lambda lg: c.metric(lg).mean(),
                                      index_axis_names=None, index_df=pd.DataFrame(rows,
                                                                                   columns=cols))
    return theirs, got.flatten()[cells]


@pytest.mark.parametrize("name", LAYOUTS)
def test_exact_every_site_and_position_mode(name):
    """All 13 modes, denoise, against ``hooked_sweep`` (every cell) and TransformerLens's
    function for the mode (three cells); ``NOISE_MODES`` in the noise direction against
    ``hooked_sweep``; the unpatched baselines against the model's own runs."""
    c = case(name)
    with torch.no_grad():
        _, clean_cache = c.model.run_with_cache(c.clean)  # TransformerLens's functions take it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TransformerLens's notes on these bridges
        for site, positions in [*HEAD_MODES, *LAYER_MODES]:
            kind = "layers" if site in hooks.PATCH_LAYER_SITES else "heads"
            fn = ck.patch_layers if kind == "layers" else ck.patch_heads
            expect = refused(name, site)
            if expect is not None:
                with expect as e:
                    fn(c.model, c.clean, c.corrupt, c.metric, site=site, positions=positions,
                       options=dict(progress=False))
                one_line(e)
                continue
            res = fn(c.model, c.clean, c.corrupt, c.metric, site=site, positions=positions,
                     options=dict(progress=False))
            want = hooked_sweep(c.model, c.corrupt, c.clean, c.metric, kind, site, positions)
            torch.testing.assert_close(res.values, want, atol=ATOL, rtol=0,
                                       msg=f"{name} {site} {positions}")
            theirs, ours = tl_sample(c, site, positions, res.values, clean_cache)
            torch.testing.assert_close(ours, theirs.float(), atol=ATOL, rtol=0,
                                       msg=f"{name} {site} {positions} vs TransformerLens")
        with torch.no_grad():
            clean, corrupt = (float(c.metric(c.model(t)).mean()) for t in (c.clean, c.corrupt))
        assert (res.clean, res.corrupt) == pytest.approx((clean, corrupt), abs=1e-5)
        for site, positions in NOISE_MODES:
            if (name, site) in REFUSED:
                continue
            res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, direction="noise",
                                 site=site, positions=positions, options=dict(progress=False))
            want = hooked_sweep(c.model, c.clean, c.corrupt, c.metric, "heads", site, positions)
            torch.testing.assert_close(res.values, want, atol=ATOL, rtol=0,
                                       msg=f"noise {site} {positions}")


def hand_path(model, base, source, metric, sender, receiver, site):
    """A path by plain hooks (a reference written apart from ``PathEngine``): the base run with
    ``sender``'s source ``z``, the receiver's ``site`` recorded there; then the base run with
    the receiver's ``site`` replaced by it. Mean metric."""
    (ls, hs), (lr, hr) = sender, receiver
    name = hooks.head_site(site, lr)
    with torch.no_grad():
        _, cache = model.run_with_cache(source, names_filter=[hooks.z(ls)])
        got = {}

        def put_z(t, hook):
            t = t.clone()
            t[:, :, hs] = cache[hooks.z(ls)][:, :, hs]
            return t

        def keep(t, hook):
            got["x"] = t.clone()

        model.run_with_hooks(base, fwd_hooks=[(hooks.z(ls), put_z), (name, keep)])

        def put(t, hook):
            t = t.clone()
            t[:, :, hr] = got["x"][:, :, hr]
            return t

        return float(metric(model.run_with_hooks(base, fwd_hooks=[(name, put)])).mean())


@pytest.mark.parametrize("name", LAYOUTS)
def test_paths(name):
    """``patch_paths`` (q input: every layout has one per query head), both directions, every
    (sender, receiver) cell of the first two layers' first two heads against ``hand_path``; a
    one-layer model (Tracr's) has no path and is refused in one line."""
    c = case(name)
    L = hooks.facts(c.model).n_layers
    nodes = [(la, h) for la in range(min(2, L)) for h in range(2)]
    if L < 2:
        with pytest.raises(ValueError, match="no receiver is in a layer after any sender") as e:
            ck.patch_paths(c.model, c.clean, c.corrupt, c.metric, nodes, nodes, inputs="q",
                           options=dict(progress=False))
        one_line(e)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for direction in ("denoise", "noise"):
            res = ck.patch_paths(c.model, c.clean, c.corrupt, c.metric, nodes, nodes, inputs="q",
                                 direction=direction, options=dict(progress=False))
            base, source = (c.corrupt, c.clean) if direction == "denoise" else (c.clean,
                                                                              c.corrupt)
            for si, s in enumerate(nodes):
                for ri, r in enumerate(nodes):
                    got = float(res.values[si, ri])
                    if r[0] <= s[0]:
                        assert got != got, f"{name}: {s} -> {r} is no path"
                        continue
                    want = hand_path(c.model, base, source, c.metric, s, r, "q")
                    assert abs(got - want) <= ATOL, f"{name} {direction} {s} -> {r}"


@pytest.mark.parametrize("name", LAYOUTS)
def test_attribution_estimators(name):
    """Every estimator runs (finite, the sweep's shape, the unpatched baselines) or is refused
    in one line; where a layout makes an estimator exact by construction it equals exact."""
    c = case(name)
    f = hooks.facts(c.model)
    exact = hooked_sweep(c.model, c.corrupt, c.clean, c.metric)
    last = f.n_layers - 1
    for est in ESTIMATORS:
        expect = refused(name, f"estimator:{est}")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if expect is not None:
                with expect as e:
                    ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="attribution",
                                   options=dict(estimator=est, progress=False))
                one_line(e)
                continue
            res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="attribution",
                                 options=dict(estimator=est, progress=False))
        notes = [str(w.message) for w in seen if "no MLP" in str(w.message)]
        # block on an attention-only model: a fallback, said once, in one line
        assert len(notes) == (est == "block" and not hooks.has_mlp(c.model)), notes
        assert all("\n" not in m for m in notes)
        assert res.values.shape == exact.shape and torch.isfinite(res.values).all(), est
        with torch.no_grad():
            corrupt = float(c.metric(c.model(c.corrupt)).mean())
        assert res.corrupt == pytest.approx(corrupt, abs=1e-5)
        if name in LINEAR_LAST or (est == "block" and name in LINEAR_BUT_MLP):
            torch.testing.assert_close(res.values[last], exact[last], atol=ATOL, rtol=0,
                                       msg=f"{est}: last layer")
        if est == "ig":  # the same path both ways: noise mirrors denoise
            noise = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="attribution",
                                   direction="noise", options=dict(estimator="ig", progress=False))
            torch.testing.assert_close(noise.values - noise.clean, -(res.values - res.corrupt),
                                       atol=1e-5, rtol=0)
    expect = refused(name, "estimator:qk")
    if expect is None:  # AtP* with its exact tail: last-layer heads patched exactly
        res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="attribution",
                             options=dict(atp_star=True, progress=False))
        torch.testing.assert_close(res.values[last], exact[last], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_block_estimator_at_every_site(name):
    """The default screen, ``block`` (the head's own attention re-run exactly with the patched
    q, k, v or pattern, then its block's MLP), runs at every head site or is refused in one
    line; exact on the last layer where only the MLP, or nothing, is nonlinear after it. On the
    attention-only layout without a norm every estimator is exact on the last layer at the
    sites where the metric is linear in the site (v, pattern) or where it recomputes the head's
    own softmax (``qk`` at q/k); ``qk``/``atp*`` refuse v and pattern in one line."""
    c = case(name)
    last = hooks.facts(c.model).n_layers - 1
    linear = name in LINEAR_LAST or name in LINEAR_BUT_MLP
    for site in ("q", "k", "v", "pattern"):
        exact = None
        for est in ESTIMATORS if name in LINEAR_LAST else ["block"]:
            expect = refused(name, site) or refused(name, f"estimator:{est}")
            if expect is None and est in ("qk", "atp*") and site in ("v", "pattern"):
                expect = pytest.raises(NotImplementedError, match="acts linearly on its own")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if expect is not None:
                    with expect as e:
                        ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, site=site,
                                       method="attribution",
                                       options=dict(estimator=est, progress=False))
                    one_line(e)
                    continue
                res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, site=site,
                                     method="attribution",
                                     options=dict(estimator=est, progress=False))
            exact = hooked_sweep(c.model, c.corrupt, c.clean, c.metric, "heads", site) \
                if exact is None else exact
            assert res.values.shape == exact.shape and torch.isfinite(res.values).all()
            if linear and (est in ("block", "qk") or (site in ("v", "pattern") and est != "ig")):
                torch.testing.assert_close(res.values[last], exact[last], atol=ATOL, rtol=0,
                                           msg=f"{est} at {site}: last layer")


@pytest.mark.parametrize("name", LAYOUTS)
def test_hybrid(name):
    """attribution+exact screens (with ``block``, or its stated fallback) and its verified cells
    equal the hooked reference, in both directions; ``method="auto"`` (exact here) equals it
    everywhere; ``plan_patch`` prices the hybrid."""
    c = case(name)
    for direction in ("denoise", "noise"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, direction=direction,
                                 method="attribution+exact", options=dict(progress=False))
        base, src = (c.corrupt, c.clean) if direction == "denoise" else (c.clean, c.corrupt)
        want = hooked_sweep(c.model, base, src, c.metric)
        done = verified_mask(res)
        assert done.any() and torch.isfinite(res.values).all()
        torch.testing.assert_close(res.values[done], want[done], atol=ATOL, rtol=0)
    # method="auto" (a tiny model: exact) and the cost plan of the hybrid
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OPT: "the screen is plain AtP" (auto's hybrid option)
        res = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="auto",
                             options=dict(progress=False))
    assert res.meta["auto"]["chose"] == "exact"
    torch.testing.assert_close(res.values, hooked_sweep(c.model, c.corrupt, c.clean, c.metric),
                               atol=ATOL, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = ck.plan_patch(c.model, c.clean, c.corrupt, c.metric, method="attribution+exact")
    assert cost["pass_equivalents"] > 0 and cost["estimator"] in ESTIMATORS


def frozen_scale_direct_effects(model: Any, task: Task) -> torch.Tensor:
    """Reference margin widening ``[n_layers, n_heads]``: for each head, the change of the
    phase-2 margin (``logit[target] - mean logit[near_misses]`` at ``answer_pos - 1``, logits as
    the unembedding writes them, before a soft-cap or Cohere's logit scale) when the
    head's write, ``o(z with every other head zeroed) - o(0)`` through the attention's own
    output projection, is subtracted from the final residual while the final norm keeps the
    unpatched run's scale (``ln_final.hook_scale``). Mean over steps, then examples."""
    f = hooks.facts(model)
    tokens = task.clean_tokens
    n = tokens.shape[0]
    names = {hooks.z(lay) for lay in range(f.n_layers)} | {"ln_final.hook_scale", hooks.LOGITS}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda x: x in names)
    scale = cache["ln_final.hook_scale"] if "ln_final.hook_scale" in model.hook_dict else None
    lt = task.label_token_ids

    def margins(lg: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(lg.shape[0] // n, n)
        for b, e in enumerate(task.examples):
            for p in e.answer_pos:
                row = lg.view(-1, n, *lg.shape[1:])[:, b, p - 1]
                out[:, b] += (row[:, int(e.tokens[p])] - row[:, lt[e.near_misses]].mean(-1)) \
                    / len(e.answer_pos)
        return out.mean(1)

    base = margins(cache[hooks.LOGITS])  # the unembedding's output: before any cap or scale
    out = torch.zeros(f.n_layers, f.n_heads)
    for lay in range(f.n_layers):
        z = cache[hooks.z(lay)]  # [n, pos, H, d]
        o = model.blocks[lay].attn.o
        with torch.no_grad():
            zeros = o(torch.zeros_like(z).flatten(-2))
            writes = torch.cat([o((z * (torch.arange(f.n_heads) == h)[:, None]).flatten(-2))
                                - zeros for h in range(f.n_heads)])  # head-major rows
            got = {}
            fwd = [(hooks.FINAL_NORM_IN, lambda x, hook, w=writes: x - w),
                   (hooks.LOGITS, lambda x, hook, got=got: got.setdefault("logits", x))]
            if scale is not None:
                fwd.append(("ln_final.hook_scale",
                            lambda s, hook: scale.repeat(f.n_heads, *[1] * (scale.ndim - 1))))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TL: an edited hook_scale is rebuilt, not HF's
                model.run_with_hooks(tokens.repeat(f.n_heads, 1), fwd_hooks=fwd)
        out[lay] = base - margins(got["logits"])
    return out


def head_set_effect(model: Any, base: torch.Tensor, src: torch.Tensor, heads, metric) -> float:
    """Mean over prompts of ``metric(patched) - metric(base)``, the ``heads`` z of ``base``'s run
    replaced by ``src``'s at every position in one hooked forward."""
    _, cache = model.run_with_cache(src)
    fwd = []
    for lay in sorted({la for la, _ in heads}):
        hs = [h for la, h in heads if la == lay]

        def patch(z, hook, lay=lay, hs=hs):
            z = z.clone()
            z[:, :, hs] = cache[hooks.z(lay)][:, :, hs]
            return z
        fwd.append((hooks.z(lay), patch))
    with torch.no_grad():
        patched = metric(model.run_with_hooks(base, fwd_hooks=fwd))
        return float((patched - metric(model(base))).mean())


@pytest.mark.parametrize("name", LAYOUTS)
def test_characterize_score_validate_on_a_jsonl_task(name, tmp_path):
    """``characterize`` on ``small_task`` written to JSONL and read back: every phase's sweeps
    equal the hooked reference; scores.csv's margin widening equals the frozen-scale
    intervention (where the blocks have no post-attention norm); validation.csv's top-set
    effects equal a hooked forward patching those heads together."""
    c = case(name)
    path = tmp_path / "task.jsonl"
    c.task.to_jsonl(path)
    task = Task.from_jsonl(path)
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = characterize(c.model, str(path), out, dict(
            n_examples=len(task), k=1, n_random=2, progress=False, report=False, text=False,
            select_n=None))  # (validated on the task the references use)
    assert summary["complete"]
    phases = summary["phases"]
    assert phases == ([2] if name == "tracr" else [1, 2])
    for phase in phases:
        tp = phase_task(task, phase)
        for direction in ("denoise", "noise"):
            res = ck.PatchResult.load(out / f"patch-p{phase}-{direction}")
            base, src = ((tp.corrupt_tokens, tp.clean_tokens) if direction == "denoise"
                         else (tp.clean_tokens, tp.corrupt_tokens))
            want = hooked_sweep(c.model, base, src, tp.metric)
            torch.testing.assert_close(res.values, want, atol=ATOL, rtol=0,
                                       msg=f"phase {phase} {direction}")
    scores = pd.read_csv(out / "scores.csv")
    f = hooks.facts(c.model)
    assert len(scores) == f.n_layers * f.n_heads and scores["refine_score"].notna().all()
    if all(hooks.post_norm(c.model, lay, "attn") is None for lay in range(f.n_layers)):
        got = torch.tensor(scores["margin_widening"].to_numpy()).view(f.n_layers, f.n_heads)
        torch.testing.assert_close(got.float(), frozen_scale_direct_effects(c.model, task),
                                   atol=2e-4, rtol=1e-4)
    val = pd.read_csv(out / "validation.csv")
    sets = json.loads((out / "summary.json").read_text())["validation_sets"]
    for phase in phases:
        tp = phase_task(task, phase)
        top = [tuple(h) for h in sets[str(phase)]["top"]]
        for direction in ("noise", "denoise"):
            base, src = ((tp.corrupt_tokens, tp.clean_tokens) if direction == "denoise"
                         else (tp.clean_tokens, tp.corrupt_tokens))
            row = val[(val.phase == phase) & (val.direction == direction)
                      & (val.quantity == tp.metric.name)]
            assert float(row.top_effect.iloc[0]) == pytest.approx(
                head_set_effect(c.model, base, src, top, tp.metric), abs=ATOL)


def test_a_task_whose_labels_lie_beyond_the_output_vocabulary_is_refused():
    """A Tracr model writes 3 logits: a task reading the logit of token 4 (a label) is refused
    in one line naming the output vocabulary, before any forward."""
    model, _, _ = tracr_program()
    tokens = torch.tensor([3, 0, 0, 1, 4, 2])
    task = Task(name="beyond", examples=[Example(
        tokens=tokens, corrupt_tokens=tokens, evidence_pos=[2], anchor_pos=[], shortlist_pos=[],
        answer_pos=[4], targets=[2], near_misses=[0], anchors=[])], label_names=["a", "b", "c"],
        anchor_names=["A"], label_token_ids=torch.tensor([0, 1, 4]),
        anchor_token_ids=torch.tensor([0]), label_anchor=torch.zeros(3, dtype=torch.long),
        vocab=["0", "1", "2", "BOS", "pad"])
    for call in (lambda: ck.score_heads(model, task, progress=False),
                 lambda: task.check_model(model)):
        with pytest.raises(ValueError, match="unembedding has 3 outputs") as e:
            call()
        one_line(e)


def test_refusals_name_a_real_layout():
    """Every expected refusal belongs to a layout of the matrix (no stale entries)."""
    assert {n for n, _ in REFUSED} <= set(LAYOUTS)
    assert all(re.compile(v) for v in REFUSED.values())
