"""backend="nnsight" (nnsight 0.8, local tracing) gives the TransformerLens backend's numbers, on a
tiny random 8:1 GQA Llama saved with save_pretrained and on SmolLM2-135M; --remote says what it
needs (NDIF is not reachable from here)."""

from __future__ import annotations

import pytest
import torch
from _scale import induction, save_tiny
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app

pytest.importorskip("nnsight")

TOL = 1e-5  # fp32: both run HF's eager attention on the same weights (seen: <= 1e-6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-gqa8-nnsight"), seed=2, qk_scale=8)


@pytest.fixture(scope="module")
def bridge(folder):
    return ck.load_model(str(folder), device="cpu")


@pytest.fixture(scope="module")
def lm(folder):
    from circuitkit.patching.exact import nnsight as nnsight_backend

    return nnsight_backend.load(str(folder))


@pytest.mark.parametrize("site,positions,direction", [
    ("z", "all", "denoise"), ("v", "all", "noise"), ("q", "each", "denoise"),
    ("k", "each", "noise")])
def test_nnsight_equals_transformer_lens(bridge, lm, site, positions, direction):
    task = induction(n=3, seed=4)
    kw = dict(site=site, positions=positions, direction=direction)
    tl = ck.patch_heads(bridge, task.clean_tokens, task.corrupt_tokens, task.metric, **kw,
                        options=dict(progress=False))
    nn = ck.patch_heads(lm, task.clean_tokens, task.corrupt_tokens, task.metric, **kw,
                        options=dict(backend="nnsight", batch_size=12, progress=False))
    assert nn.meta["backend"] == "nnsight" and nn.values.shape == tl.values.shape
    assert nn.values.shape[1] == (2 if site in ("k", "v") else 16)  # KV heads under GQA
    assert abs(nn.clean - tl.clean) <= TOL and abs(nn.corrupt - tl.corrupt) <= TOL
    assert (nn.values - tl.values).abs().max() <= TOL
    assert (nn.per_prompt - tl.per_prompt).abs().max() <= TOL
    base = tl.corrupt if direction == "denoise" else tl.clean
    assert (tl.values - base).abs().max() > 1e-3  # real effects, not a no-op on both sides


def test_a_bridge_from_a_folder_is_reloaded_for_nnsight(bridge, folder):
    task = induction(n=2, seed=6)
    nn = ck.patch_heads(bridge, task.clean_tokens, task.corrupt_tokens, task.metric,
                        options=dict(backend="nnsight", progress=False))
    tl = ck.patch_heads(bridge, task.clean_tokens, task.corrupt_tokens, task.metric,
                        options=dict(progress=False))
    assert (nn.values - tl.values).abs().max() <= TOL


def test_one_layer_source_trace_equals_the_all_layers_trace(lm):
    from circuitkit.patching.exact import nnsight as nb

    source = induction(n=2, seed=7).clean_tokens
    with torch.no_grad():
        every = nb._source_activations(lm, source, 2, "z")
        one = nb._source_activation(lm, source, 1, "z", remote=False)  # as remote runs fetch it
    assert every[1].shape == (2, source.shape[1], 16 * 8) and torch.equal(every[1], one)


def test_unsupported_requests_are_refused(lm):
    task = induction(n=2)
    args = (lm, task.clean_tokens, task.corrupt_tokens, task.metric)
    with pytest.raises(ValueError, match="site='pattern' is not supported by backend='nnsight'"):
        ck.patch_heads(*args, site="pattern", options=dict(backend="nnsight", progress=False))
    with pytest.raises(ValueError, match="method='attribution' is not supported"):
        ck.patch_heads(*args, method="attribution", options=dict(backend="nnsight", progress=False))
    with pytest.raises(ValueError, match="needs backend='nnsight'"):
        ck.patch_heads(*args, options=dict(remote=True, progress=False))


def test_remote_needs_a_key_and_a_hub_id(monkeypatch, tmp_path, folder):
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    r = CliRunner().invoke(app, ["patch", "--model", "llama3.1-70b", "--task", "icd10",
                                 "--backend", "nnsight", "--remote", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "NDIF_API_KEY" in r.output and "login.ndif.us" in r.output
    monkeypatch.setenv("NDIF_API_KEY", "test-key")
    r = CliRunner().invoke(app, ["patch", "--model", str(folder), "--task", "induction",
                                 "--backend", "nnsight", "--remote", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "hub id" in r.output
    r = CliRunner().invoke(app, ["patch", "--model", "icd-teacher", "--task", "icd10",
                                 "--remote", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--backend nnsight" in r.output


def test_cli_nnsight_backend_writes_the_same_result(folder, bridge, tmp_path):
    r = CliRunner().invoke(app, ["patch", "--model", str(folder), "--task", "induction", "-n",
                                 "3", "--backend", "nnsight", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    res = ck.PatchResult.load(tmp_path / "o")
    task = ck.load_task("induction", n_examples=3, split="test", phase=2)
    tl = ck.patch_heads(bridge, task.clean_tokens, task.corrupt_tokens, task.metric,
                        options=dict(progress=False))
    assert res.meta["backend"] == "nnsight" and (res.values - tl.values).abs().max() <= TOL


def test_nnsight_takes_the_one_road(bridge, lm, tmp_path, monkeypatch):
    """backend="nnsight" runs behind ``ck.patch``'s checks and in ``run_sweep``'s orchestration
    (issue 53): a plain callable metric is probed and its reads checked on the real logits,
    the sweep is checkpointed (a stopped sweep resumes to the same numbers; another request
    in the same folder is refused), and the numbers are the TransformerLens backend's."""
    from circuitkit.patching.exact.nnsight import NnsightEngine

    task = induction(n=3, seed=4)
    args = (task.clean_tokens, task.corrupt_tokens, lambda lg: lg[:, -1, 3] - lg[:, -1, 5])
    kw = dict(backend="nnsight", batch_size=6, progress=False, checkpoint=tmp_path / "ck")
    calls, real = [], NnsightEngine.run_chunk

    def failing(self, chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(NnsightEngine, "run_chunk", failing)
    with pytest.raises(KeyboardInterrupt):
        ck.patch_heads(lm, *args, site="z", options=kw)
    monkeypatch.setattr(NnsightEngine, "run_chunk", real)
    assert len(list((tmp_path / "ck").glob("chunk_*.safetensors"))) >= 2
    resumed = ck.patch_heads(lm, *args, site="z", options=kw)
    fresh = ck.patch_heads(lm, *args, site="z", options=dict(kw, checkpoint=None))
    assert torch.equal(resumed.values, fresh.values)
    assert resumed.meta["backend"] == "nnsight" and "model_fingerprint" in resumed.meta
    tl = ck.patch_heads(bridge, *args, site="z", options=dict(progress=False))
    assert (fresh.values - tl.values).abs().max() <= TOL
    assert abs(fresh.clean - tl.clean) <= TOL and abs(fresh.corrupt - tl.corrupt) <= TOL
    with pytest.raises(ValueError, match="different sweep"):
        ck.patch_heads(lm, *args, site="q", options=kw)


def test_a_remote_model_is_fingerprinted_by_its_hub_id(lm):
    """On NDIF the weights stay there (the meta device here): the fingerprint a checkpoint
    checks is the hub id's and revision's, and the entry never reads real logits."""
    from circuitkit.identity import model_fingerprint
    from circuitkit.patching.exact.nnsight import NnsightModel

    remote = NnsightModel(lm, remote=True)
    assert remote.logits_of is False
    assert model_fingerprint(remote) == model_fingerprint(NnsightModel(lm, remote=True))
    assert model_fingerprint(remote) != model_fingerprint(NnsightModel(lm))
