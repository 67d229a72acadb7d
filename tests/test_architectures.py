"""Every entry point on the block layouts TransformerLens bridges, on tiny random models.

References are independent of the code under test: a plain ``run_with_hooks`` loop for head
patching, TransformerLens's ``get_act_patch_attn_out`` for layer patching. Layouts covered:
pre-norm (Llama, Mistral-style GQA, Qwen2-MoE, Mixtral), GPT-2 (learned positions, LayerNorm),
parallel attention/MLP (GPT-NeoX, GPT-J, Phi, Falcon, Cohere), post-norm (Gemma 2: pre and
post; OLMo 2: post only), multi-query (GPT-BigCode) and bridges that leave attention to HF
(GPT-J, OPT: a post-hoc ``hook_pattern``; OPT's MLP is no module of its own). Tolerances:
1e-5 absolute (float32 metrics of size ~4).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tinymodels import hand_patch_heads, with_random_post_norms
from transformer_lens import patching as tlp

import circuitkit as ck
from circuitkit.metrics import token_logprob_metric
from circuitkit.patching.api import verified_mask

SMALL = dict(vocab_size=64, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
             max_position_embeddings=64, seed=0)
ARCHS = {
    "llama": dict(model_type="llama", intermediate_size=64, num_key_value_heads=2),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=64),
    "gptj": dict(model_type="gptj", n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 rotary_dim=4),
    "phi": dict(model_type="phi", intermediate_size=64),
    "falcon": dict(model_type="falcon"),
    "cohere": dict(model_type="cohere", intermediate_size=64, num_key_value_heads=2),
    "gemma2": dict(model_type="gemma2", intermediate_size=64, num_key_value_heads=2,
                   head_dim=8),
    "olmo2": dict(model_type="olmo2", intermediate_size=64, num_key_value_heads=2),
    "mixtral": dict(model_type="mixtral", intermediate_size=64, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=32, n_layer=2, n_head=4,
                        n_positions=64, multi_query=True),
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32),
}
POST_HOC_PATTERN = {"gptj", "opt"}


def _model(name):
    return with_random_post_norms({**SMALL, **ARCHS[name]})


def _data():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (2, 8), generator=g)
    corrupt = torch.randint(0, 64, (2, 8), generator=g)
    metric = token_logprob_metric([[4, 7]] * 2, [clean[i, [4, 7]].tolist() for i in range(2)])
    return clean, corrupt, metric


@pytest.mark.parametrize("name", list(ARCHS))
def test_every_entry_point_on_this_layout(name):
    model = _model(name)
    clean, corrupt, metric = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TransformerLens's own notes on these bridges
        for site in ("z", "pattern", "k"):
            if site == "pattern" and name in POST_HOC_PATTERN:
                with pytest.raises(ValueError, match="does not change"):
                    ck.patch_heads(model, clean, corrupt, metric, site=site, progress=False)
                continue
            res = ck.patch_heads(model, clean, corrupt, metric, site=site, direction="noise",
                                 progress=False)
            want = hand_patch_heads(model, clean, corrupt, metric, site)
            torch.testing.assert_close(res.values, want, atol=1e-5, rtol=0, msg=site)
        layers = ck.patch_layers(model, clean, corrupt, metric, site="attn_out",
                                 progress=False)
        ref = tlp.get_act_patch_attn_out(model, corrupt, model.run_with_cache(clean)[1], metric)
        torch.testing.assert_close(layers.values, ref, atol=1e-5, rtol=0)
        hybrid = ck.patch_heads(model, clean, corrupt, metric, method="attribution+exact",
                                direction="noise", progress=False)
    assert torch.isfinite(torch.as_tensor(hybrid.meta["attribution_values"])).all()
    done = verified_mask(hybrid)
    assert done.any()
    want = hand_patch_heads(model, clean, corrupt, metric, "z")
    torch.testing.assert_close(hybrid.values[done], want[done], atol=1e-5, rtol=0)
    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", phase=2)
    scores = ck.score_heads(model, task, progress=False)
    assert len(scores) == 2 * 4 and scores["margin_widening"].notna().all()
