"""Planning a sweep without weights: the real Llama-3-70B config, every figure checked by hand."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit import models
from circuitkit.cli import app
from circuitkit.cli.plan_text import format_sweep_plan
from circuitkit.patching import cost as P

# Llama-3-70B (circuitkit/configs/meta-llama--Meta-Llama-3-70B.json)
L, H, KV, D, DH, DMLP, V = 80, 64, 8, 8192, 128, 28672, 128256


@pytest.fixture(scope="module")
def arch():
    return models.architecture("llama3-70b")


def test_70b_parameters_and_weights_by_hand(arch):
    per_layer = (D * H * DH + 2 * D * KV * DH + H * DH * D  # q, k, v, o
                 + 3 * D * DMLP + 2 * D)  # gate, up, down; two RMSNorms
    n = L * per_layer + 2 * V * D + D  # untied embedding and unembedding, final norm
    assert n == 70_553_706_496 == arch.n_params
    p = P.sweep_plan(arch, [100] * 8)
    assert p["weights_bytes"] == 2 * n  # bf16: 141.1 GB
    assert p["n_gpus"] == 2  # 141.1 GB > 0.9 x 80 GB, <= 2 x 72 GB
    h200 = P.sweep_plan(arch, [100] * 8, options=dict(gpu="H200"))
    assert h200["n_gpus"] == 2  # 141.1 > 0.9 x 141
    budget = (80e9 - n) * 0.7  # per GPU: its half of the weights is n bytes
    assert p["activation_budget_bytes"] == pytest.approx(budget)
    row = 2 * 100 * (8 * D + 3 * DMLP + 3 * H * 100 + 3 * V) * 1.5  # sweep.row_bytes
    assert p["methods"]["exact"]["rows"] == min(1024, int(budget // row))


def test_70b_passes_flops_and_time_by_hand(arch):
    n, S = 8, 100  # equal lengths: one length bucket, every chunk runs all 100 positions
    p = P.sweep_plan(arch, [S] * n, top_k=20)
    ex, at, hy = (p["methods"][m] for m in ("exact", "attribution", "attribution+exact"))
    # exact: a head of layer l runs L - l of L blocks: sum over l = H n (L + 1) / 2, + 2 cached
    assert ex["pass_equivalents"] == pytest.approx(H * n * (L + 1) / 2 + 2 * n)
    assert at["pass_equivalents"] == 4 * n
    # attribution+exact screens with "block": 4 + H x (MLP share of a gated block) per prompt
    mlp, attn = 2 * D * DMLP * 3, 4 * D * DH * (H + KV) + 2 * H * DH * S
    screen = 4 + H * mlp / (attn + mlp)
    assert hy["pass_equivalents"] == pytest.approx(
        screen * n + 20 * n * (L + 1) / (2 * L) + 2 * n)
    assert hy["verified_cells"] == hy["verified_cells_max"] == 20
    per_pass = S * (2 * (arch.n_params - V * D) + 2 * L * H * DH * S)
    assert ex["flops"] == pytest.approx(ex["pass_equivalents"] * per_pass)
    assert ex["seconds"] == pytest.approx(ex["flops"] / (989e12 * 0.4))
    assert P.sweep_plan(arch, [S] * n, options=dict(gpu="A100"))["methods"]["exact"]["seconds"] == \
        pytest.approx(ex["flops"] / (312e12 * 0.4))
    # two replicas share the work
    assert P.sweep_plan(arch, [S] * n, options=dict(replicas=2))["methods"]["exact"]["seconds"] == \
        pytest.approx(ex["seconds"] / 2)
    # host RAM: resid_pre (d) + z base and source (2 H d_head) per layer and token, bf16
    assert p["host_cache_bytes"] == 2 * L * n * S * (D + 2 * H * DH)
    # per-position sweep: seq x as many cells
    each = P.sweep_plan(arch, [S] * n, positions="each")
    assert each["n_cells"] == L * H * S


def test_automatic_budget_is_priced_as_expected_and_capped(arch):
    """top_k=None (the default): ~20% of the cells expected, 50% at most (the hybrid's cap)."""
    n, S = 8, 100
    hy = P.sweep_plan(arch, [S] * n)["methods"]["attribution+exact"]
    cells = L * H
    assert hy["budget"] == "auto"
    assert hy["verified_cells"] == math.ceil(0.2 * cells) == 1024
    assert hy["verified_cells_max"] == cells // 2
    mlp, attn = 2 * D * DMLP * 3, 4 * D * DH * (H + KV) + 2 * H * DH * S
    screen = 4 + H * mlp / (attn + mlp)
    per = lambda k: screen * n + k * n * (L + 1) / (2 * L) + 2 * n  # noqa: E731
    assert hy["pass_equivalents"] == pytest.approx(per(1024))
    assert hy["seconds_max"] == pytest.approx(hy["seconds"] * per(cells // 2) / per(1024))
    assert "at most 2,560" in format_sweep_plan(P.sweep_plan(arch, [S] * n))


def test_auto_threshold(arch):
    # 70B, every head: 2 x 70.6e9 x 64 x 81 / 2 = 3.7e14 FLOPs per prompt token > 5e13
    p = P.sweep_plan(arch, [100] * 8)
    assert p["exact_flops_per_token"] == pytest.approx(2 * arch.n_params * H * (L + 1) / 2)
    assert p["auto"] == "attribution+exact"
    small = models.architecture("llama3-8b")  # 32 x 32 heads: 8.5e12 -> exact
    assert P.sweep_plan(small, [100] * 8)["auto"] == "exact"
    assert P.sweep_plan(small, [100] * 8, positions="each")["auto"] == "attribution+exact"


def test_bad_arguments_are_named(arch):
    with pytest.raises(ValueError, match="gpu='V100'"):
        P.sweep_plan(arch, [10], options=dict(gpu="V100"))
    with pytest.raises(ValueError, match="lengths"):
        P.sweep_plan(arch, [])
    for bad in (0, -3, 2.5):  # a plan of 0 or -3 verified cells would price a run that refuses
        with pytest.raises(ValueError, match=f"top_k={bad!r}: expected a positive integer"):
            P.sweep_plan(arch, [10], top_k=bad)


def test_token_counts_from_a_tokenizer_or_estimated():
    import circuitkit as ck
    from circuitkit.tasks.text import CHARS_PER_TOKEN, prompt_texts, token_counts

    task = ck.load_task("icd10", n_examples=4, split="test")
    texts = prompt_texts(task)
    assert texts[0].startswith("Clinical note: ") and "\nAnswer: " in texts[0]
    est, how = token_counts(texts)
    assert est == [math.ceil(len(t) / CHARS_PER_TOKEN) + 1 for t in texts]
    assert "estimated" in how

    class Words:  # a tokenizer with a known count: one token per word, a BOS
        bos_token_id = 1
        name_or_path = "words"

        def encode(self, text, add_special_tokens=False):
            return text.split()

    counted, how = token_counts(texts, Words())
    assert counted == [len(t.split()) + 1 for t in texts] and "words" in how


def test_cli_plans_70b_offline_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no weights, no tokenizer here
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["patch", "--model", "llama3-70b", "--task", "icd10", "-n", "8",
                                 "--plan", "--gpu", "H200"])
    seconds = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    out = r.output
    assert "no weights on this machine" in out and "estimated at 2 characters" in out
    assert "141.1 GB" in out and "2 x H200 SXM 141 GB" in out
    assert "80 layers x 64 heads = 5,120 cells" in out
    for row in ("exact ", "attribution ", "attribution+exact@~1024"):
        assert any(line.startswith(row) for line in out.splitlines()), row
    assert "--method auto picks attribution+exact" in out
    assert "at most 2,560" in out  # the automatic budget's cap: half the cells
    assert seconds < 30, seconds


def test_icd10_as_text_for_a_pretrained_tokenizer():
    import circuitkit as ck
    from circuitkit.cli import _sweep_inputs
    from circuitkit.tasks.text import prompt_texts, speaks_task_vocab, text_prompts

    task = ck.load_task("icd10", n_examples=16, split="test")
    teacher = ck.load_model("icd-teacher")
    assert speaks_task_vocab(teacher.tokenizer, task)  # a toy trained on the task: its tokens
    clean, _, metric, note = _sweep_inputs(teacher.tokenizer, task)
    assert clean is not None and note == "" and clean.shape == task.clean_tokens.shape
    tok = models.local_tokenizer("smollm2-135m")
    if tok is None:
        pytest.skip("no SmolLM2 tokenizer on this machine")
    assert not speaks_task_vocab(tok, task)
    clean, corrupt, metric, kept = text_prompts(task, tok)
    assert 0 < len(kept) < 16 and clean.shape == corrupt.shape and clean.shape[0] == len(kept)
    texts = prompt_texts(task)
    for row, i in enumerate(kept):
        ids = [t for t in clean[row].tolist() if t != (tok.pad_token_id or 0)]
        assert tok.decode(ids, skip_special_tokens=True).strip() == texts[i]
        answer = texts[i].split("Answer: ")[1]
        reads = sorted(set(metric.read_positions()[row].tolist()))  # before each answer token
        said = tok.decode(clean[row, [r + 1 for r in reads]].tolist())
        assert said.strip() == answer  # the metric scores exactly the answer's tokens


def test_characterize_and_score_render_icd10_as_text_for_a_pretrained_llm():
    """``load_for`` (characterize, score) asked only whether the LLM's vocabulary could HOLD
    the task's ids: SmolLM2's 49k tokens hold icd10's 3.5k, so it read icd10's word ids as its
    own BPE tokens (id 0 '<pad>' as '<|endoftext|>'). Now the ids must mean the same words."""
    import types

    import circuitkit as ck
    from circuitkit.scoring.text import load_for

    tok = models.local_tokenizer("smollm2-135m")
    if tok is None:
        pytest.skip("no SmolLM2 tokenizer on this machine")
    llm = types.SimpleNamespace(cfg=types.SimpleNamespace(d_vocab=len(tok)), tokenizer=tok)
    task = ck.load_task("icd10", n_examples=2, split="test")
    with pytest.raises(ValueError, match="reads .* token ids the task uses as other words"):
        task.check_model(llm)
    rendered, was = load_for(llm, "icd10", 2, 0, "test", None)
    assert was and rendered.name == "icd10-text"
    rendered.check_model(llm)  # the rendered task's ids are the tokenizer's own
    import dataclasses  # a vocab written as decoded text (" heart", not "Ġheart") is the same

    decoded = dataclasses.replace(rendered, vocab=[tok.decode([i])
                                                   for i in range(len(rendered.vocab))])
    decoded.check_model(llm)
    teacher = ck.load_model("icd-teacher")
    with pytest.raises(ValueError, match="other words"):  # another task's vocabulary
        ck.load_task("synthetic", n_examples=2).check_model(teacher)
    task.check_model(teacher)  # its own


def test_plans_equal_those_captured_before_the_pricing_was_shared():
    """``sweep_plan`` and ``edge_plan`` of the teacher, llama3-8b and llama3-70b configs (heads
    and edges, every method, several options) equal the dicts captured before they were made
    wrappers of one ``plan.price``, and since of ``cost.price`` (the one price every route
    takes; tests/fixtures/make_plan_fixture.py wrote them)."""
    import importlib.util
    import json

    here = Path(__file__).parent / "fixtures"
    spec = importlib.util.spec_from_file_location("make_plan_fixture",
                                                  here / "make_plan_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = json.loads((here / "plans-before.json").read_text())
    now = mod.plans()
    assert now.keys() == before.keys()
    for key in before:
        assert now[key] == before[key], key


def test_units_plan_is_the_plan_and_edges_share_the_heads_checks(arch):
    """A units object's ``cost_plan`` is ``sweep_plan`` / ``edge_plan``; both stand on ``basis``,
    so an edge plan refuses what a head plan refuses (too few GPUs per replica, a utilisation
    outside (0, 1], no rows, an unknown option) instead of pricing it."""
    from circuitkit.patching.inputs import check_edge_nodes
    from circuitkit.patching.sweep import EdgeLayout

    lengths = [300] * 8 + [512] * 4
    heads = P.sweep_plan(arch, lengths, top_k=20)
    assert ck.HeadUnits().cost_plan(arch, lengths, top_k=20) == heads
    teacher = models.architecture("icd-teacher")
    s, r, i = check_edge_nodes(teacher, None, None, ("q",))
    layout = EdgeLayout(teacher.n_layers, teacher.n_heads, teacher.n_kv_heads, s, r, i)
    edges = P.edge_plan(teacher, [40, 64], layout, options=dict(gpu="A100"))
    assert list(edges["methods"]) == ["exact", "TL loop", "eap", "eap-ig-inputs",
                                      "eap-ig-activations", "eap*", "attribution+exact"]
    assert ck.EdgeUnits(layout=layout).cost_plan(teacher, [40, 64], options=P.PlanOptions(
        gpu="A100")) == edges
    assert ck.HeadUnits("z", "each").cost_plan(arch, lengths)["methods"]["exact"] == \
        P.sweep_plan(arch, lengths, positions="each")["methods"]["exact"]
    b = P.basis(arch, lengths)
    assert (b.n_gpus, b.weights) == (heads["n_gpus"], heads["weights_bytes"])
    assert (b.n_gpus, b.weights) == (2, 2 * arch.n_params)
    s, r, i = check_edge_nodes(arch, None, None, ("q",))
    big = EdgeLayout(arch.n_layers, arch.n_heads, arch.n_kv_heads, s, r, i)
    for kw, said in ((dict(n_gpus=1), "needs at least 2"), (dict(utilisation=2.0), "utilisation"),
                     (dict(rows=0), "rows=0"), (dict(gpus=2), "plan options \\['gpus'\\]")):
        for plan in (lambda **k: P.sweep_plan(arch, lengths, options=k),
                     lambda **k: P.edge_plan(arch, lengths, big, options=k)):
            with pytest.raises(ValueError, match=said):
                plan(**kw)
