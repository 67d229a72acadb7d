"""Short prompts: one prompt, and 1-token prompts, on a Llama-form model (issue 33 items 12,
17). References: TransformerLens's own patching functions (``transformer_lens.patching``:
``get_act_patch_*`` for heads and layers, ``get_act_patch_direct_path_all_sources`` for exact
edges). Every test builds a fresh model: what breaks here is a per-model check made on the
model's first call (the fused cached run's, the site's patchability), so the first call must be
the short one. Tolerances: 1e-4 absolute (heads, layers; as the conformance matrix), 1e-5
(edges), float32 metrics of size ~1-10."""

from __future__ import annotations

import pytest
import torch
from tinymodels import SMALL, call
from transformer_lens import patching as tlp

import circuitkit as ck
from circuitkit import hooks
from circuitkit.metrics import token_logprob_metric
from circuitkit.patching.exact import fused

# random tiny models barely separate clean from corrupt: that warning is not what these check
pytestmark = pytest.mark.filterwarnings("ignore::circuitkit.patching.results."
                                        "DegenerateBaselineWarning")
ATOL = 1e-4
LLAMA = dict(SMALL, model_type="llama", intermediate_size=64, num_key_value_heads=2)
LLAMA_MHA = dict(LLAMA, num_key_value_heads=4)  # TransformerLens's direct path refuses GQA k/v
TL_FN = {("z", "all"): tlp.get_act_patch_attn_head_out_all_pos,
         ("q", "all"): tlp.get_act_patch_attn_head_q_all_pos,
         ("attn_out", "each"): tlp.get_act_patch_attn_out,
         ("mlp_out", "each"): tlp.get_act_patch_mlp_out,
         ("resid_pre", "each"): tlp.get_act_patch_resid_pre}


def fresh(cfg: dict):
    torch.set_num_threads(1)
    model = ck.load_model(dict(cfg))
    assert fused.fused_form(model) is not None  # the Llama form: the fused path is in play
    return model


def case(n: int, seq: int, seed: int = 3):
    """``n`` prompts of ``seq`` random tokens (ids from 1) and a metric reading the log-prob of
    the clean tokens at the last two positions (the last one for ``seq == 1``)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 64, (n, seq), generator=g)
    corrupt = torch.randint(1, 64, (n, seq), generator=g)
    at = list(range(max(0, seq - 2), seq))
    metric = token_logprob_metric([at] * n, [clean[i, at].tolist() for i in range(n)])
    return clean, corrupt, metric


def reference(model, site, positions, clean, corrupt, metric):
    with torch.no_grad():
        return TL_FN[(site, positions)](model, corrupt, model.run_with_cache(clean)[1], metric)


def tl_edges(model, res, clean, corrupt, metric):
    """(ours, TransformerLens's) values of every head -> later head edge, per input."""
    f = hooks.facts(model)
    heads = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
    s_ix = [res.senders.index(n) for n in heads]
    r_ix = [res.receivers.index(n) for n in heads]
    later = torch.tensor([[r[0] > s[0] for r in heads] for s in heads])
    with torch.no_grad():
        _, cc = model.run_with_cache(clean)
        _, xc = model.run_with_cache(corrupt)
        for i, name in enumerate(res.inputs):
            ref = tlp.get_act_patch_direct_path_all_sources(
                model, corrupt, cc, xc, metric, component=name,
                verbose=False).reshape(len(heads), len(heads))
            yield name, res.values[s_ix][:, r_ix, i][later], ref[later]


# --- one prompt (item 12) ------------------------------------------------------------------------


@pytest.mark.parametrize("kind,site,positions", [("heads", "z", "all"),
                                                 ("layers", "attn_out", "each"),
                                                 ("layers", "mlp_out", "each"),
                                                 ("layers", "resid_pre", "each")])
def test_one_prompt_equals_transformer_lens(kind, site, positions):
    """One prompt on a fresh Llama-form model (the fused cached run is checked against the
    bridge on the model's first call; its two rows are then the prompt's base and source runs,
    not two prompts): heads and layers equal TransformerLens's patching functions."""
    model = fresh(LLAMA)
    clean, corrupt, metric = case(1, 7)
    fn = ck.patch_heads if kind == "heads" else ck.patch_layers
    res = call(fn, model, clean, corrupt, metric, site=site, positions=positions,
               progress=False)
    assert res.per_prompt.shape[0] == 1
    torch.testing.assert_close(res.values, reference(model, site, positions, clean, corrupt,
                                                     metric), atol=ATOL, rtol=0)


def test_one_prompt_exact_edges_equal_transformer_lens():
    """Exact edges of one prompt on a fresh Llama-form model equal TransformerLens's
    direct-path patching for q, k and v."""
    model = fresh(LLAMA_MHA)
    clean, corrupt, metric = case(1, 7)
    res = ck.patch_edges(model, clean, corrupt, metric, options=dict(progress=False))
    for name, ours, ref in tl_edges(model, res, clean, corrupt, metric):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("command", ["patch", "edges"])
def test_cli_one_prompt(command, tmp_path):
    """``circuitkit patch -n 1`` and ``edges -n 1`` on the shipped Llama-form teacher: exit 0,
    and the saved result loads, with one prompt."""
    from typer.testing import CliRunner

    from circuitkit.cli import app

    args = [command, "--model", "icd-teacher", "--task", "icd10", "-n", "1", "--out",
            str(tmp_path / "o")]
    if command == "edges":
        args += ["--senders", "embed,L0H2", "--receivers", "L2H6,logits"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    load = ck.PatchResult.load if command == "patch" else ck.EdgeResult.load
    assert load(tmp_path / "o").per_prompt.shape[0] == 1


# --- a 1-token first call (item 17) -------------------------------------------------------------


def test_a_one_token_first_call_decides_nothing_for_longer_prompts():
    """A 1-token prompt has one key, so its query changes nothing: ``patch_heads(site="q")``
    on it gives the corrupt baseline everywhere, as TransformerLens does. Made first on a fresh
    model, it must not make the model's q "unpatchable": a 9-token q sweep and q/k/v edges
    afterwards run and equal TransformerLens's."""
    model = fresh(LLAMA_MHA)
    clean1, corrupt1, metric1 = case(2, 1)
    one = ck.patch_heads(model, clean1, corrupt1, metric1, site="q", options=dict(progress=False))
    torch.testing.assert_close(one.values, reference(model, "q", "all", clean1, corrupt1,
                                                     metric1), atol=ATOL, rtol=0)
    torch.testing.assert_close(one.values, torch.full_like(one.values, one.corrupt), atol=ATOL,
                               rtol=0)
    clean, corrupt, metric = case(2, 9)
    nine = ck.patch_heads(model, clean, corrupt, metric, site="q", options=dict(progress=False))
    ref = reference(model, "q", "all", clean, corrupt, metric)
    torch.testing.assert_close(nine.values, ref, atol=ATOL, rtol=0)
    assert float((ref - nine.corrupt).abs().max()) > 1e-5  # q matters at 9 tokens (2.3e-4)
    edges = ck.patch_edges(model, clean, corrupt, metric, options=dict(progress=False))
    for name, ours, want in tl_edges(model, edges, clean, corrupt, metric):
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=0, msg=name)


def test_cached_per_model_probes_never_read_the_callers_prompts(monkeypatch):
    """The verdicts cached once per model (``hooks.check_patchable``, attribution's
    ``layer_reruns``) are computed on ``hooks.probe_tokens`` (8 seeded ids), whatever prompt the
    first call brings: a 1-token first call runs them on 8 positions."""
    from circuitkit.patching.estimators import attribution

    model = fresh(LLAMA)
    seen: list[int] = []
    handle = model.blocks[0].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(args[0].shape[1] if args else
                                              next(iter(kwargs.values())).shape[1]),
        with_kwargs=True)
    one = torch.ones(1, 1, dtype=torch.long)
    hooks.check_patchable(model, "q", one)
    attribution.layer_reruns(model, one)
    handle.remove()
    assert seen and set(seen) == {8}, seen
    assert torch.equal(hooks.probe_tokens(model), hooks.probe_tokens(model))  # seeded
