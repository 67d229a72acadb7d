"""Exact activation patching, batched and restarted at the patched layer.

A patch at layer ``l`` cannot change anything upstream of ``l``. So one cached run of the *base*
tokens stores ``resid_pre(l)`` for every layer, one run of the *source* tokens stores the source
activations at the patched site, and each patched run re-enters the model at block ``l`` from
the cached residual. Variants (heads, or heads x positions) of one layer are stacked in the batch
dimension, ``[n_variants * n_prompts, seq, d_model]``, and a forward hook at the site of layer
``l`` writes the source activation into variant ``i``'s head slice only. Direction: ``denoise`` =
base corrupt, source clean; ``noise`` = base clean, source corrupt.

TransformerLens 4.3's ``TransformerBridge.forward(start_at_layer=l)`` still executes blocks
``0..l-1`` (it discards their output when block ``l`` swaps the residual in; measured: every
block's forward ran). ``shortcuts.skipped_blocks`` therefore turns blocks below ``l`` into
identities for the duration of the run, so only embedding lookup (needed by HF to size
positions/masks; rotary positions come from the sequence length as in a normal run) and blocks
``l..L-1`` run.

The *fast path* skips two more pieces of work the patch cannot change, by replacing module
``forward``s for one run (``patching/shortcuts.py``, so any block layout holds):

* sites ``z``, ``attn_out``, ``mlp_out``: block ``l``'s attention is not re-run; its output is
  known. For ``z``: ``attn_out = o(z_base) + (z_source - z_base)[:, :, h] @ W_O[h]`` (``o`` the
  affine output projection); for ``attn_out`` the cached base output with the patched position
  from the source; for ``mlp_out`` the base one, and the MLP returns its cached output with the
  patched position from the source;
* with a metric that declares ``reads`` (``PromptMetric.reads``), the last block's MLP and the
  unembedding are computed at those positions only, and so are the last block's attention
  queries where ``shortcuts`` can reproduce its attention (rotary Llama form).

On a Llama-form model with no hook attached the cached runs and every patched suffix run as plain
tensor code, packed to the positions each row can change (``patching/exact/fused.py``,
docs/speed.md).
Each fast-path piece is checked against the plain hooked path on a probe chunk of the model at
hand and falls back (with a warning) if they differ by more than ``FAST_PATH_TOL``. Causal
models: nothing after a prompt's last read position can change its metric, so runs stop there
(``Sweep.run_length``, prompts swept in order of that length); a bidirectional model
(``hooks.facts(model).causal`` False, e.g. a Tracr program) runs whole.

This module is the engines' public import path; each lives in a file named for it:
``ExactEngine`` (``exact_engine.py``: a chunk's result ``[n_variants, n_prompts]``,
``run_chunk``; any subset of one layer's variants, ``run_variants``), ``HeadSetRuns``
(``head_sets.py``: head sets patched together, ``run_head_sets``, with the source run's ``z`` or,
for ablations of the base run, zeros, the mean base ``z`` or another prompt's), ``EdgeEngine``
(``edges.py``: the same cached runs, restart, chunks and read-position logits; an edge
adds the sender's write ``delta_s`` to the receiver's own copy of ``resid_pre(l)`` at one input,
computed by the module itself, ``shortcuts.run_until``; docs/edges.md, "The engine") and the
metric and fast-path checks (``checks.py``); path patching's ``PathEngine`` (``paths.py``); the
fused Llama form (``fused.py``); every head's write through its MLP (``head_mlp.py``); nnsight as an
engine (``nnsight.py``: ``NnsightEngine``, its chunks as traces); a head sender's node run
(``nodes.py``: ``NodeRuns``, the edge and path engines' coverage denominators); ``ck.circuit``'s
ablated circuits (``circuits.py``: ``CircuitEngine``). What to patch: ``patching/sweep.py``;
running a whole sweep (checkpoints, ranks, progress): ``patching/exact/sweeps.py``.
"""

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "ExactEngine": "circuitkit.patching.exact.engine:ExactEngine",
    "ATTN_OUTPUT_SITES": "circuitkit.patching.exact.engine:ATTN_OUTPUT_SITES",
    "EdgeEngine": "circuitkit.patching.exact.edges:EdgeEngine",
    "PathEngine": "circuitkit.patching.exact.paths:PathEngine",
    "CircuitEngine": "circuitkit.patching.exact.circuits:CircuitEngine",
    "NodeRuns": "circuitkit.patching.exact.nodes:NodeRuns",
    "HeadSetRuns": "circuitkit.patching.exact.head_sets:HeadSetRuns",
    "HEAD_SET_SOURCES": "circuitkit.patching.exact.head_sets:HEAD_SET_SOURCES",
    "derangement": "circuitkit.patching.exact.head_sets:derangement",
    "evaluate_metric": "circuitkit.patching.exact.checks:evaluate_metric",
    "FAST_PATH_TOL": "circuitkit.patching.exact.checks:FAST_PATH_TOL",
    "_FAST_PATH_VERDICTS": "circuitkit.patching.exact.checks:_FAST_PATH_VERDICTS",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
