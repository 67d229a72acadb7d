"""``HeadSetEngine``: the ``ExactEngine`` of a head-set sweep (``HeadSetUnits``; the sweep's
``SetLayout``, ``patching/sweep.py``). A chunk is a group of sets of one lowest layer on a range
of prompts (``sweep.chunked``): one ``run_head_sets`` forward, every metric of the layout read on
its logits; its values ``[n_sets * n_reads, n_p]``, set-major, the sweep's own metric first."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact import fused
from circuitkit.patching.exact.engine import ExactEngine
from circuitkit.patching.exact.head_sets import resample_pairing
from circuitkit.patching.sweep import Chunk, Sweep


class HeadSetEngine(ExactEngine):
    """``ExactEngine`` whose chunks are head sets (module docstring). ``fast=None``: only a z
    sweep on an unhooked Llama-form model probes the fast path (its sets run fused and packed once
    ``_head_sets_agree``); any other runs hooked (it gains nothing else from the fast path). A
    resample sweep pairs its prompts once (``resample_pairing``), whatever the chunks."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, fast: bool | None = None, rows: int | None = None):
        if fast is None and not (sweep.site == "z" and fused.unhooked(model)
                                 and fused.fused_form(model) is not None):
            fast = False
        super().__init__(model, clean, corrupt, metric, sweep, fast=fast, rows=rows)
        if sweep.sets.source == "resample":
            self._pairing = resample_pairing(sweep.n_prompts, sweep.sets.seed)

    def _chunk_sets(self, chunk: Chunk) -> list[int]:
        """The sets (indices into ``sweep.sets.sets``) of ``chunk``."""
        m = self.sweep.per_patch
        return list(self.sweep.sets.at(chunk.layer)[chunk.v0 // m:chunk.v1 // m])

    def run_chunk(self, chunk: Chunk) -> Float[Tensor, "n_var n_p"]:
        """Every metric of the layout after patching each set of ``chunk``, one forward:
        ``[n_sets * n_reads, n_p]``, row ``j * n_reads + m`` set ``j``'s metric ``m``."""
        c = Chunk(*chunk)
        lay, n_p = self.sweep.sets, c.p1 - c.p0
        idx = self._chunk_sets(c)
        got = self.run_head_sets([lay.sets[i] for i in idx], c.p0, c.p1,
                                 metrics=[self.metric, *lay.metrics], rows=len(idx) * n_p,
                                 source=lay.source, seed=lay.seed)  # [n_reads, n_sets, n_p]
        return got.transpose(0, 1).reshape(len(idx) * lay.n_reads, n_p)

    def per_metric(self, done: dict[int, Tensor]) -> Float[Tensor, "n_reads n_prompts n_sets"]:
        """Chunk results -> every metric's value per prompt (sweep order) and set."""
        sw = self.sweep
        m = sw.per_patch
        grid = torch.full((m, sw.n_prompts, len(sw.sets.sets)), float("nan"))
        for cid, c in enumerate(sw.chunks):
            idx = torch.tensor(self._chunk_sets(c), dtype=torch.long)
            grid[:, c.p0:c.p1, idx] = done[cid].view(len(idx), m, -1).permute(1, 2, 0)
        return grid

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """(values ``[n_sets]``, per_prompt ``[n_prompts, n_sets]`` or None) of the sweep's own
        metric."""
        own = self.per_metric(done)[0]
        return own.mean(0), own if self.metric.per_prompt_values else None
