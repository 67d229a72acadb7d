"""Head sets, each patched as one: ``HeadSetUnits`` (``ck.HeadSetUnits``), and ``set_values``
(every metric's per-prompt values of such a result).

``ck.patch(model, clean, corrupt, metric, ck.HeadSetUnits(sets), method="exact", options=...)``
goes through the entry's checks (tokens, metric wrapping and reads), the exact engine's
head-set runs (``ExactEngine.run_head_sets``: hooked, or fused and packed on a Llama-form model
once checked), the sweep orchestration (``exact.sweeps.run_sweep``: length order, memory fitted,
rows halved on out-of-memory, progress bar) and its checkpoint (``checkpoint.SweepCheckpoint``:
a chunk, a group of sets of one lowest layer on a range of prompts, saved as it finishes,
verified and resumed after a kill; Ctrl-C saves).

The result: a ``PatchResult`` over ``axes == ("set",)``: ``values[j]`` the metric's mean after
set ``j`` is patched, ``per_prompt[i, j]`` prompt ``i``'s value, the clean and corrupt
baselines as every sweep's. ``meta``: ``kind`` "head_sets", ``sets`` (each ``[[layer, head],
...]``, sorted, in the given order), ``set_source``, ``set_seed`` and ``extra_per_prompt``:
``{name: [n_prompts, n_sets]}``, the per-prompt values of each of ``metrics`` read on the same
patched logits (``set_values`` returns them with the metric's own, in one dict).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.exact.head_sets import HEAD_SET_SITES, HEAD_SET_SOURCES
from circuitkit.patching.inputs import (
    check_metric_prompts,
    check_padding,
    choice,
    pad_token_id,
    padded_lengths,
)
from circuitkit.patching.sweep import SetLayout
from circuitkit.patching.units.base import PatchOptions, _exact_only, _Units


def _checked_sets(sets: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``sets`` as sorted tuples of distinct ``(layer, head)`` integer pairs (one line when it is
    not a non-empty list of lists of pairs)."""
    try:
        out = tuple(tuple(sorted({(int(la), int(h)) for la, h in s})) for s in sets)
        ok = len(out) > 0 and not isinstance(sets, str | Tensor) and all(
            not isinstance(s, str) for s in sets)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"sets={sets!r:.80}: expected a non-empty list of head sets, each a list "
                         "of (layer, head) pairs (an empty set is the unpatched base run).")
    return out


@dataclass(frozen=True, eq=False)
class HeadSetUnits(_Units):
    """Head sets, each patched *together*: every ``(layer, head)`` of a set gets its value from
    ``source`` at ``site``, at every position, in one run (module docstring for the result).

    ``sets``: lists of ``(layer, head)`` pairs (the empty set: the unpatched base run).
    ``site``: "z" (the heads' outputs) or "pattern" (their attention patterns, the paper's
    cumulative bins; ``source`` "source" only, on the hooked path). ``source``: "source" (the
    source run's: ``options.direction`` "denoise" or "noise"), or an ablation of the base run:
    "zero", "mean" (the head's mean base ``z`` over every prompt and position up to its last
    read) or "resample" (another prompt's base ``z``, ``exact.head_sets.resample_pairing``
    seeded by ``seed``). ``metrics``: ``PromptMetric``s with per-prompt values read on the same
    patched logits besides ``ck.patch``'s metric (names distinct from it and each other); the
    engine reads the logit positions of all of them (``covering``). Exact only."""

    sets: Any
    site: str = "z"
    source: str = "source"
    seed: int = 0
    metrics: Any = ()
    kind: ClassVar[str] = "head_sets"
    methods: ClassVar[tuple[str, ...]] = ("exact",)
    estimators: ClassVar[tuple[str, ...]] = ()
    axes: ClassVar[tuple[str, ...]] = ("set",)
    positions: ClassVar[str] = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sets", _checked_sets(self.sets))
        choice("site", self.site, HEAD_SET_SITES)
        choice("source", self.source, HEAD_SET_SOURCES)
        if self.site != "z" and self.source != "source":
            raise ValueError(f"source={self.source!r} ablates z; site {self.site!r} takes the "
                             "source run's pattern only (source='source').")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an integer.")
        metrics = (self.metrics,) if isinstance(self.metrics, PromptMetric) else tuple(
            self.metrics)
        for i, m in enumerate(metrics):
            if not isinstance(m, PromptMetric) or not m.per_prompt_values:
                raise ValueError(f"metrics[{i}] must be a PromptMetric with per-prompt values "
                                 f"(each is read per prompt on the patched logits); got "
                                 f"{type(m).__name__}.")
        if len({m.name for m in metrics}) != len(metrics):
            raise ValueError(f"metrics: names {[m.name for m in metrics]} must be distinct "
                             "(each names its values in the result).")
        object.__setattr__(self, "metrics", metrics)

    def check_method(self, method: str, opts: PatchOptions) -> str:
        return _exact_only(method, opts, "head-set", (
            f"HeadSetUnits are patched exactly (method='exact'); got method={method!r}."))

    def entry(self, method: str) -> dict[str, Any]:
        """What the entry's checks (``api._check``) take of these units."""
        return dict(site=self.site, positions="all", sites=HEAD_SET_SITES, engine_checks=True)

    def checked(self, model: Any, clean: Tensor, corrupt: Tensor) -> HeadSetUnits:
        """The sets' heads inside the model, enough prompts to resample, and each extra metric
        fit for the (checked) tokens: its prompt count, reads inside them, none at padding."""
        f = hooks.facts(model)
        n_layers, n_heads = f.n_layers, f.n_heads_at(self.site)
        bad = [h for s in self.sets for h in s
               if not (0 <= h[0] < n_layers and 0 <= h[1] < n_heads)]
        if bad:
            raise ValueError(f"sets: {bad[:4]} outside the model's {n_layers} layers x {n_heads} "
                             "heads.")
        n, seq = clean.shape
        if self.source == "resample" and n < 2:
            raise ValueError(f"source='resample' takes each prompt's z from another prompt; the "
                             f"tokens hold {n}. Pass at least 2 prompts.")
        pad = pad_token_id(model)
        real = padded_lengths(clean, corrupt, pad)
        for m in self.metrics:
            check_metric_prompts(m, n)
            m.check_reads(seq)
            if m.read_positions() is not None:
                check_padding(clean, corrupt, m, real, pad)
        return self

    def layout(self, model: Any) -> SetLayout:
        return SetLayout(hooks.facts(model).n_layers, self.sets, self.site, self.source,
                         self.seed, self.metrics)

    def exact(self, model, clean, corrupt, pm, opts: PatchOptions, meta) -> Any:
        """``exact.run_sets`` of these sets, the metric reading every extra metric's positions
        too (``covering``)."""
        if pm.name in {m.name for m in self.metrics}:
            raise ValueError(f"metrics: {pm.name!r} is the name of ck.patch's metric too; give "
                             "each metric its own name.")
        return exact.run_sets(model, clean, corrupt, covering(pm, self.metrics),
                              self.layout(model), opts, meta)

    def checkpoint_in(self, root: str | Path, label: str, model: Any, clean: Tensor,
                      corrupt: Tensor, metric: PromptMetric, direction: str,
                      fingerprint: str | None = None) -> Path:
        """A checkpoint folder for one run of these units under ``root`` (a folder holding many
        such runs, e.g. a validation's): ``root / "<label>-<key>"``, ``key`` the hash of what
        the run depends on (the model's weights, tokens, direction, site, source, seed, sets,
        every metric by behaviour), so another run never meets this one's folder and the same
        run resumes it. ``fingerprint``: ``model_fingerprint(model)``, when the caller has it
        (it reads every weight)."""
        from circuitkit.identity import identity_key, model_fingerprint, tokens_hash

        n, seq = clean.shape
        d_vocab = hooks.facts(model).d_vocab_out
        key = identity_key(dict(
            model=fingerprint or model_fingerprint(model), tokens=tokens_hash(clean, corrupt),
            direction=direction, site=self.site, source=self.source, seed=self.seed,
            sets=[[list(h) for h in s] for s in self.sets],
            metrics=[[m.name, m.fingerprint(n, seq, d_vocab)] for m in (metric, *self.metrics)]))
        return Path(root) / f"{label}-{key[:16]}"


def covering(metric: PromptMetric, others: Sequence[PromptMetric]) -> PromptMetric:
    """``metric`` reading the logit positions of ``others`` too: each prompt's reads, its own
    and theirs, joined (its values are unchanged: a metric reads its positions through
    ``rows``). A metric reading every position stays so; one of ``others`` that does: so does
    ``metric`` (``reading_every_position``)."""
    if metric.reads is None or not others:
        return metric
    extra = [m.read_positions() for m in others]
    if any(e is None for e in extra):
        names = [m.name for m, e in zip(others, extra, strict=True) if e is None]
        return metric.reading_every_position(f"metrics {names} read every position")
    joined = torch.cat([metric.read_positions(), *extra], 1)
    if metric.prompt_idx is None:
        return replace(metric, reads=joined)
    # reads are indexed by the prompts the metric was made for; its selection's rows get theirs
    pad = metric.reads[:, :1].expand(-1, joined.shape[1] - metric.reads.shape[1])
    full = torch.cat([metric.reads, pad], 1).clone()
    full[metric.prompt_idx] = joined
    return replace(metric, reads=full)


def set_values(result: Any) -> dict[str, Tensor]:
    """``{metric name: per-prompt values [n_prompts, n_sets]}`` of a head-set result: its own
    metric's (``per_prompt``) first, then each extra metric's (``meta["extra_per_prompt"]``)."""
    meta = result.meta or {}
    if meta.get("kind") != "head_sets" or result.per_prompt is None:
        raise ValueError("set_values reads a head-set result with per-prompt values (ck.patch "
                         "with ck.HeadSetUnits and a per-prompt metric).")
    return {meta.get("metric", "metric"): result.per_prompt,
            **{k: torch.as_tensor(v) for k, v in meta.get("extra_per_prompt", {}).items()}}
