"""Exact activation patching, batched and restarted at the patched layer.

A patch at layer ``l`` cannot change anything upstream of ``l``. So one cached run of the *base*
tokens stores ``resid_pre(l)`` for every layer, one run of the *source* tokens stores the source
activations at the patched site, and each patched run re-enters the model at block ``l`` from
the cached residual. Variants (heads, or heads x positions) of one layer are stacked in the batch
dimension, ``[n_variants * n_prompts, seq, d_model]``, and a forward hook at the site of layer
``l`` writes the source activation into variant ``i``'s head slice only.

Direction: ``denoise`` = base corrupt, source clean; ``noise`` = base clean, source corrupt.

TransformerLens 4.3's ``TransformerBridge.forward(start_at_layer=l)`` still executes blocks
``0..l-1`` (it discards their output when block ``l`` swaps the residual in; measured: every
block's forward ran). ``shortcuts.skipped_blocks`` therefore turns blocks below ``l`` into
identities for the duration of the run, so only embedding lookup (needed by HF to size
positions/masks; rotary positions come from the sequence length as in a normal run) and blocks
``l..L-1`` run.

Inside the blocks, the *fast path* skips two more pieces of work the patch cannot change:

* sites ``z``, ``attn_out``, ``mlp_out``: block ``l``'s attention is not re-run; its output is
  known. For ``z`` the attention's output is its affine output projection ``o`` of z, so
  ``attn_out = o(z_base) + (z_source - z_base)[:, :, h] @ W_O[h]``; for ``attn_out`` it is the
  cached base output with the patched position from the source; for ``mlp_out`` the base one,
  and the MLP returns its cached output with the patched position from the source;
* with a metric that declares ``reads`` (``PromptMetric.reads``, per prompt), the last block's
  MLP and the unembedding are computed at those positions only, and so are the last block's
  attention queries where ``shortcuts`` can reproduce its attention (rotary Llama form).

Both replace module ``forward``s for the duration of one run (``patching/shortcuts.py``), so
they hold for any block layout (sequential, parallel, post-norm). Before use, the engine checks
the fast path against the plain hooked path on a probe chunk of the model at hand and falls back
(with a warning) if they differ by more than ``FAST_PATH_TOL``.

On a Llama-form model (``fused.fused_form``: Llama, Mistral, Qwen2 blocks) with no hook
attached, the fast path goes further (``patching/fused.py``, docs/speed.md): the cached runs and
every patched suffix run as plain tensor code on the modules' own weights, and each row of a
suffix computes only the positions where it can differ from the base run (from the first
position where the prompt's base and source tokens differ, or a per-position patch's position,
to its last read), packed across rows; the last block and the unembedding run at each row's
distinct reads. The fused cached run is checked once per model against the bridge's
``run_with_cache``; the fused suffix is part of the fast path the probe checks.

Causal models: nothing after a prompt's last read position can change its metric, so runs stop
there (``Sweep.run_length``; prompts are swept in order of that length, ``sweep.length_order``).
A bidirectional model (``hooks.facts(model).causal`` False, e.g. a Tracr program) runs whole.

This module is the engines' public import path; each lives in a file named for it:
``ExactEngine`` (``exact_engine.py``), ``EdgeEngine`` (``edge_engine.py``), head sets patched
together (``head_sets.py``), the metric and fast-path checks (``engine_checks.py``). What to patch
and how it is cut into chunks is ``patching/sweep.py``; running a whole sweep (checkpoints, ranks,
progress) is ``patching/exact.py``.
A chunk's result is a ``[n_variants, n_prompts]`` tensor (``run_chunk``); ``run_variants`` patches
any subset of one layer's variants; ``run_head_sets`` patches whole head sets together, with the
source run's ``z`` or, for ablations of the base run, zeros, the mean base ``z`` or another
prompt's base ``z`` (``source=``).

Edges (``EdgeEngine``, a subclass: same cached runs, restart, chunks, read-position logits,
metric evaluation; only the patch differs). An edge (sender, receiver, input) adds the sender's
write ``delta_s`` (source minus base: ``dz[:, :, h] @ W_O[h]`` of head ``h``, or the embeddings'
``resid_pre(0)`` difference) to the receiver's own copy of the residual at one input (q, k or v)
only; every other reader keeps the base run. Nothing before the receiver's layer ``l`` changes, so
the run re-enters at ``l`` from the cached base ``resid_pre(l)``, with the edges into layer ``l``
stacked in the batch. The receiver's patched input activation (``hook_q/k/v`` of layer ``l``,
head slice) is the module's own computation on ``resid_pre(l) + delta_s``: one partial run per
sender, stopped once block ``l``'s q/k/v hooks fired (``shortcuts.run_until``), whose head
slices a hook then writes into each edge's rows. The logits receiver (layer ``n_layers``) reads
the final residual plus ``delta_s``: the last block returns that value and only the final norm
and the unembedding run. On the fused path (Llama-form models) only the receiving head (a q
edge) or the query heads of the receiving KV head (k/v) attend anew: block ``l``'s attention
output is ``o(z_base) + sum_h (z'_h - z_base_h) @ W_O[h]`` over those heads
(``FusedLlama.edge_attention``), and the packed suffix runs from there.
"""

from circuitkit.patching.edge_engine import EdgeEngine
from circuitkit.patching.engine_checks import _FAST_PATH_VERDICTS, FAST_PATH_TOL, evaluate_metric
from circuitkit.patching.exact_engine import ATTN_OUTPUT_SITES, ExactEngine
from circuitkit.patching.head_sets import HEAD_SET_SOURCES, derangement

__all__ = ["ATTN_OUTPUT_SITES", "FAST_PATH_TOL", "HEAD_SET_SOURCES", "_FAST_PATH_VERDICTS",
           "EdgeEngine", "ExactEngine", "derangement", "evaluate_metric"]
