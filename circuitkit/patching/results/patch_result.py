"""``PatchResult``: the one results type of every patching sweep (exact, attribution, hybrid).

Shapes: ``values`` ``[n_layers, n_heads]`` (heads, all positions), ``[n_layers, n_heads, seq]``
(each position), ``[n_layers, n_heads, n_groups]`` (position groups), ``[n_layers, seq]``
(layer sites) or ``[n_sets]`` (head sets, ``ck.HeadSetUnits``: axes ``("set",)``), named by
``axes``; ``per_prompt`` ``[n_prompts, *values.shape]`` when the metric
has per-prompt values.

``normalized()``: denoise ``(patched - corrupt) / (clean - corrupt)`` (0: no effect, 1: the clean
behaviour restored); noise ``(patched - clean) / (clean - corrupt)`` (-1: fully broken). The
degenerate-baseline rule (docs/metrics.md, section 5): unless the corruption lowers the metric by
more than a margin, ``gap = clean - corrupt > max(MIN_GAP_SE * se, DEGENERATE * max(1, |clean|,
|corrupt|))`` (``se``: the standard error of the per-prompt gaps), the result is ``degenerate``:
``normalized()`` gives the raw effect ``values - baseline``, warns once per result
(``DegenerateBaselineWarning``) and ``meta["normalization"]`` says why; ``weak_prompts()`` flags
the prompts whose own gap is at most the margin.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.inputs import DIRECTIONS, EDGE_METHODS  # (a result holds no "auto")
from circuitkit.patching.results.files import (
    _PATCH_FILE,
    FORMAT,
    FORMAT_VERSION,
    POSITIONS,
    SITES,
    _checked_patch_info,
    _patch_layout,
    load_result,
    result_paths,
    save_result,
)

# |clean - corrupt| below this (relative to their size) makes normalized values meaningless
DEGENERATE = 1e-6
# The corruption must lower the metric by more than this many standard errors of the
# per-prompt gaps (about a one-sided 98% test that it lowers it at all).
MIN_GAP_SE = 2.0


def baseline_margin(clean: float, corrupt: float, gaps: Tensor | None = None) -> float:
    """What ``clean - corrupt`` must exceed for a share of it to mean anything (the
    degenerate-baseline rule, module docstring): ``max(MIN_GAP_SE * se, DEGENERATE * max(1,
    |clean|, |corrupt|))``, ``se`` the standard error of the per-prompt ``gaps`` (when given,
    two or more)."""
    tol = noise_floor(clean, corrupt)
    if gaps is None or gaps.numel() < 2:
        return tol
    se = float(gaps.double().std()) / math.sqrt(gaps.numel())
    return max(MIN_GAP_SE * se, tol) if math.isfinite(se) else tol


def noise_floor(clean: float, corrupt: float) -> float:
    """The degenerate-baseline rule's float tolerance, ``DEGENERATE * max(1, |clean|,
    |corrupt|)``: an effect within it is rounding, not an effect (the whole of a coverage
    share, whose own per-prompt spread is not recorded)."""
    return DEGENERATE * max(1.0, abs(clean), abs(corrupt))


def degenerate_baseline(clean: float, corrupt: float, gaps: Tensor | None = None) -> bool:
    """The one degenerate-baseline rule: the corruption does not lower the metric by more than
    ``baseline_margin`` (then no share of ``clean - corrupt`` is printed anywhere: results show
    raw effects, findings and coverage say there is no share)."""
    gap = clean - corrupt
    return not gap > baseline_margin(clean, corrupt, gaps)  # (NaN: degenerate too)


def share(part: float, whole: float, margin: float) -> float:
    """``part / whole`` when ``|whole|`` exceeds ``margin`` (a whole within the degenerate-
    baseline margin: noise, not a behaviour to take a share of), else NaN."""
    return part / whole if abs(whole) > margin else float("nan")


class DegenerateBaselineWarning(UserWarning):
    """The corruption does not lower the metric by its margin: normalized values mean nothing
    (``PatchResult.degenerate``)."""


def _outside_circuitkit() -> int:
    """``stacklevel`` of ``warnings.warn`` called here that names the first frame outside the
    circuitkit package (the user's call, however deep the library's own calls went)."""
    import os
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def resample_weights(n: int, n_boot: int, seed: int) -> Tensor:
    """``[n_boot, n]`` float64 weights of ``n_boot`` seeded resamples of ``n`` prompts drawn with
    replacement: a resample's mean of ``x`` is ``w @ x`` (its counts over ``n``)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(n_boot, n, dtype=torch.float64)
    counts.scatter_add_(1, torch.randint(0, n, (n_boot, n), generator=g),
                        torch.ones(n_boot, n, dtype=torch.float64))
    return counts / n


@contextlib.contextmanager
def quiet_baseline() -> Iterator[None]:
    """Silence ``DegenerateBaselineWarning`` inside (a caller that says it another way: the
    CLI's one line, characterize's one line per phase, the report's note)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)
        yield


@dataclass
class PatchResult:
    """Metric after patching each component, plus baselines and provenance.

    ``values``: mean over prompts of the metric after the patch, shaped by ``axes``;
    ``clean``/``corrupt``: the metric on the unpatched clean / corrupt runs.
    """

    values: Float[Tensor, "..."]
    clean: float
    corrupt: float
    direction: str  # "denoise" | "noise"
    method: str  # "exact" | "attribution" | "attribution+exact"
    site: str  # "z" | "pattern" | "q" | "k" | "v" | "resid_pre" | "attn_out" | "mlp_out"
    positions: str  # "all" | "each" | "groups" (meta["group_names"]: the group axis)
    per_prompt: Float[Tensor, "n_prompts ..."] | None = None
    clean_per_prompt: Float[Tensor, " n_prompts"] | None = None
    corrupt_per_prompt: Float[Tensor, " n_prompts"] | None = None
    axes: tuple[str, ...] | None = None  # default: inferred from values.ndim and positions
    meta: dict[str, Any] = field(default_factory=dict)
    # whether the degenerate baseline was said (warned) for this result: once per result
    _baseline_said: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value, allowed in (("direction", self.direction, DIRECTIONS),
                                     ("method", self.method, EDGE_METHODS),
                                     ("positions", self.positions, POSITIONS),
                                     ("site", self.site, SITES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not valid; expected one of "
                                 f"{list(allowed)}.")
        ndim = getattr(self.values, "ndim", None)
        if not isinstance(self.values, Tensor) or ndim not in (1, 2, 3) or (
                ndim == 1 and self.axes not in (None, ("set",), ["set"])):
            raise ValueError(f"values must be a 2-D or 3-D tensor (layer x head[ x pos], or "
                             f"layer x pos), or 1-D over head sets (axes ('set',)); got "
                             f"{type(self.values).__name__} of shape "
                             f"{tuple(getattr(self.values, 'shape', ()))}.")
        if self.axes is None:
            if self.values.ndim == 1:
                self.axes = ("set",)
            elif self.positions == "groups":
                self.axes = ("layer", "head", "group")
            elif self.values.ndim == 3:
                self.axes = ("layer", "head", "pos")
            elif self.site in hooks.PATCH_LAYER_SITES:
                self.axes = ("layer", "pos")
            else:
                self.axes = ("layer", "head")
        self.axes = tuple(self.axes)
        if len(self.axes) != self.values.ndim:
            raise ValueError(f"axes {self.axes} name {len(self.axes)} dimensions but values has "
                             f"{self.values.ndim} (shape {tuple(self.values.shape)}).")
        self.clean, self.corrupt = float(self.clean), float(self.corrupt)
        if not (math.isfinite(self.clean) and math.isfinite(self.corrupt)):
            raise ValueError(f"clean ({self.clean}) and corrupt ({self.corrupt}) baselines must "
                             "be finite.")
        if self.per_prompt is not None:
            n = self.per_prompt.shape[0]
            if tuple(self.per_prompt.shape[1:]) != tuple(self.values.shape):
                raise ValueError(f"per_prompt has shape {tuple(self.per_prompt.shape)}; expected "
                                 f"[n_prompts, {', '.join(map(str, self.values.shape))}].")
            for name in ("clean_per_prompt", "corrupt_per_prompt"):
                t = getattr(self, name)
                if t is not None and tuple(t.shape) != (n,):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [{n}] (one "
                                     "value per prompt of per_prompt).")
        self.meta = dict(self.meta or {})
        if self.positions == "groups":
            n_groups = self.values.shape[-1] if self.values.ndim == 3 else -1
            for key in ("group_names", "group_sizes"):
                got = self.meta.get(key)
                if (got is not None or key == "group_names") and (
                        not isinstance(got, list) or len(got) != n_groups):
                    raise ValueError(f"field 'meta.{key}' ({got!r:.60}) must hold one entry "
                                     f"per group of values (shape "
                                     f"{tuple(self.values.shape)}).")
        self._record_baseline()

    # --- the degenerate-baseline rule (module docstring) ------------------------------------
    def _prompt_gaps(self) -> Tensor | None:
        """``clean_i - corrupt_i`` per prompt (float64), or None without per-prompt values."""
        if self.clean_per_prompt is None or self.corrupt_per_prompt is None:
            return None
        return self.clean_per_prompt.double() - self.corrupt_per_prompt.double()

    @property
    def gap(self) -> float:
        """``clean - corrupt``: how much the corruption lowers the metric."""
        return self.clean - self.corrupt

    @property
    def gap_margin(self) -> float:
        """What ``gap`` must exceed: ``max(MIN_GAP_SE * se, tol)`` (module docstring)."""
        return baseline_margin(self.clean, self.corrupt, self._prompt_gaps())

    @property
    def degenerate(self) -> bool:
        """True when the corruption does not lower the metric by more than ``gap_margin``
        (clean and corrupt score the same, the corruption raises the metric, or the gap is
        within the noise of the per-prompt gaps): normalized values are then meaningless and
        ``normalized()`` returns raw effects."""
        return degenerate_baseline(self.clean, self.corrupt, self._prompt_gaps())

    @property
    def value_column(self) -> str:
        """The name of ``normalized()``'s column in ``to_frame()``, ``result.csv``, the CLI
        and the report: "normalized", or "raw_effect" for a ``degenerate`` result (whose
        ``normalized()`` is the raw effect: a column is named for what it holds)."""
        return "raw_effect" if self.degenerate else "normalized"

    def degenerate_reason(self) -> str | None:
        """One line saying why the result is ``degenerate`` and what to do; None if it is not."""
        if not self.degenerate:
            return None
        name = (self.meta or {}).get("metric")
        metric = f"metric {name!r}" if name else "the metric"
        gaps, margin = self._prompt_gaps(), self.gap_margin
        if abs(self.gap) <= DEGENERATE * max(1.0, abs(self.clean), abs(self.corrupt)):
            how = f"does not change {metric}"
        elif self.gap < 0:
            how = f"raises {metric}"
        else:
            how = (f"lowers {metric} by {self.gap:.3g} only, within {MIN_GAP_SE:g} standard "
                   f"errors of the per-prompt gaps ({margin:.3g}, {gaps.numel()} prompts)")
        return (f"circuitkit: the corruption {how} (clean {self.clean:.4g}, corrupt "
                f"{self.corrupt:.4g}), so normalized values are not shares of the behaviour: "
                "raw effects (value - baseline) are shown instead. Use a corruption that "
                "removes the behaviour, more prompts, or the negated metric if lower means "
                "more of it.")

    def weak_prompts(self) -> Tensor | None:
        """Bool ``[n_prompts]``: prompts whose own gap ``clean_i - corrupt_i`` is at most
        ``gap_margin`` (their corruption does not lower their metric); None without per-prompt
        values. ``result.select_prompts(~result.weak_prompts())`` drops them."""
        gaps = self._prompt_gaps()
        return None if gaps is None else gaps <= self.gap_margin

    def select_prompts(self, keep: Tensor) -> PatchResult:
        """This result over the prompts ``keep`` (a bool mask or indices) only: values, clean
        and corrupt recomputed from the per-prompt values (needs them)."""
        if self.per_prompt is None or self.clean_per_prompt is None:
            raise ValueError("select_prompts needs per-prompt values; this result has none (a "
                             "metric that returns one value for the whole batch).")
        keep = torch.as_tensor(keep)
        idx = keep.nonzero()[:, 0] if keep.dtype == torch.bool else keep.long()
        if idx.numel() == 0:
            raise ValueError("select_prompts: no prompt kept.")
        pp, cl, co = self.per_prompt[idx], self.clean_per_prompt[idx], \
            self.corrupt_per_prompt[idx]
        meta = dict(self.meta, n_prompts=int(idx.numel()), prompts_kept=idx.tolist())
        if meta.get("extra_per_prompt"):  # a head-set result's other metrics: the same prompts
            meta["extra_per_prompt"] = {k: torch.as_tensor(v)[idx]
                                        for k, v in meta["extra_per_prompt"].items()}
        return replace(self, values=pp.mean(0), clean=float(cl.mean()), corrupt=float(co.mean()),
                       per_prompt=pp, clean_per_prompt=cl, corrupt_per_prompt=co, meta=meta)

    def warn_if_degenerate(self) -> bool:
        """Warn ``degenerate_reason()`` (``DegenerateBaselineWarning``, at the caller's line
        outside circuitkit), once per result. Entry points call it as they return;
        ``normalized()`` and the views call it too. Returns ``degenerate``."""
        reason = self.degenerate_reason()
        if reason is not None and not self._baseline_said:
            self._baseline_said = True
            warnings.warn(DegenerateBaselineWarning(reason), stacklevel=_outside_circuitkit())
        return reason is not None

    def _record_baseline(self) -> None:
        """``meta["normalization"]``: why values are shown raw (a degenerate result), else
        absent."""
        reason = self.degenerate_reason()
        if reason is None:
            self.meta.pop("normalization", None)
        else:
            self.meta["normalization"] = "raw effect: " + reason.removeprefix("circuitkit: ")

    # --- normalisation and intervals -----------------------------------------------------------
    def _normalize(self, patched: Tensor, clean: Tensor | float, corrupt: Tensor | float) -> Tensor:
        ref = corrupt if self.direction == "denoise" else clean
        return (patched - ref) / (clean - corrupt)

    def normalized(self) -> Float[Tensor, "..."]:
        """Denoise: ``(v - corrupt) / (clean - corrupt)``; noise: ``(v - clean) / (same)``; the
        raw effect (``effect()``) for a ``degenerate`` result (module docstring)."""
        if self.warn_if_degenerate():
            return self.effect()
        return self._normalize(self.values, self.clean, self.corrupt)

    def effect(self) -> Float[Tensor, "..."]:
        """Raw change of the metric by each patch: ``values - baseline`` (corrupt for denoise,
        clean for noise)."""
        return self.values - (self.corrupt if self.direction == "denoise" else self.clean)

    def confidence_interval(
        self, level: float = 0.95, n_boot: int = 1000, seed: int = 0, raw: bool | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """Percentile bootstrap over prompts of ``normalized()``: ``(low, high)``, values-shaped.

        Each resample draws prompts with replacement and recomputes the ratio of means
        (patched, clean and corrupt means over the same resample), so the interval is that of
        the reported statistic. TransformerLens's ``PatchingResult.bootstrap_ci`` bootstraps a
        single per-example statistic and cannot express this ratio of means, hence our own.
        ``raw``: the interval of the raw effect ``values - baseline`` instead (default: for a
        ``degenerate`` result, whose ``normalized()`` is that effect). Returns None without
        per-prompt values.
        """
        if self.per_prompt is None or self.clean_per_prompt is None:
            return None
        raw = self.degenerate if raw is None else raw
        n = self.per_prompt.shape[0]
        w = resample_weights(n, n_boot, seed)
        clean = w @ self.clean_per_prompt.double()  # [n_boot]
        corrupt = w @ self.corrupt_per_prompt.double()
        flat = self.per_prompt.double().reshape(n, -1)
        lo, hi = [], []
        q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
        for start in range(0, flat.shape[1], 4096):  # bounded memory: [n_boot, 4096] at a time
            patched = w @ flat[:, start:start + 4096]
            if raw:
                norm = patched - (corrupt if self.direction == "denoise" else clean)[:, None]
            else:
                norm = self._normalize(patched, clean[:, None], corrupt[:, None])
            ql = torch.quantile(norm, q, dim=0)
            lo.append(ql[0])
            hi.append(ql[1])
        shape = self.values.shape
        return (torch.cat(lo).reshape(shape).float(), torch.cat(hi).reshape(shape).float())

    # --- views -----------------------------------------------------------------------------------
    def to_frame(self, ci: bool = True):
        """pandas DataFrame, one row per cell: axes..., value, normalized (named raw_effect for
        a ``degenerate`` result: ``value_column``)[, ci_low, ci_high]
        [, verified: for ``attribution+exact``, True where the value is exact, not an
        estimate]."""
        import pandas as pd

        idx = torch.cartesian_prod(*[torch.arange(s) for s in self.values.shape])
        idx = idx.reshape(-1, len(self.axes))
        cols = {a: idx[:, i].numpy() for i, a in enumerate(self.axes)}
        for axis, names in self.labels.items():  # labelled axes by name (groups, nodes)
            if len(names) == self.values.shape[self.axes.index(axis)]:
                cols[axis] = [names[j] for j in cols[axis]]
        cols["value"] = self.values.reshape(-1).float().numpy()
        cols[self.value_column] = self.normalized().reshape(-1).float().numpy()  # (warns once)
        interval = self.confidence_interval() if ci else None
        if interval is not None:
            cols["ci_low"] = interval[0].reshape(-1).numpy()
            cols["ci_high"] = interval[1].reshape(-1).numpy()
        if self.verified is not None:  # attribution+exact: which are exact
            cols["verified"] = self.verified.reshape(-1).numpy()
        frame = pd.DataFrame(cols)
        if self.degenerate:  # its "raw_effect" column holds raw effects: say why
            frame.attrs["normalization"] = self.meta["normalization"]
        return frame

    @property
    def labels(self) -> dict[str, list[str]]:
        """The labels of each labelled axis: "group" by ``meta["group_names"]`` (a path
        result's: ``meta["path_groups"]``), a path result's "sender" / "receiver" by
        ``meta["senders"]`` / ``["receivers"]`` (an ``EdgeResult``: its nodes and inputs), a
        head-set result's "set" by its heads' names (``meta["sets"]``; "none": the empty set);
        layer, head and pos are their indices."""
        meta = self.meta or {}
        sets = meta.get("sets") if "set" in self.axes else None
        named = dict(group=meta.get("group_names") or meta.get("path_groups"),
                     sender=meta.get("senders"), receiver=meta.get("receivers"),
                     set=None if sets is None else [
                         " ".join(hooks.head_name(la, h) for la, h in s) or "none"
                         for s in sets])
        return {a: list(named[a]) for a in self.axes if named.get(a) is not None}

    @property
    def verified(self) -> Tensor | None:
        """``attribution+exact``: a bool tensor shaped like ``values``, True where the value is
        exact (``meta["verified"]``); None for results of other methods (every cell as its
        method computed it)."""
        mask = (self.meta or {}).get("verified")
        return torch.tensor(mask, dtype=torch.bool) if isinstance(mask, list) else None

    def top(self, k: int = 10):
        """The ``k`` cells with the largest ``|normalized|`` (DataFrame, strongest first): by
        ``|effect|`` for a ``degenerate`` result (its column is ``raw_effect``, and it warns
        once). ``k``: a positive integer (a negative one dropped the last rows,
        before)."""
        check_top(k)
        df = self.to_frame()
        df = df[df["value"].notna()]  # (a path result's NaN: no route, no cell)
        order = df[self.value_column].abs().sort_values(ascending=False,
                                                   na_position="last").index[:k]
        return df.loc[order].reset_index(drop=True)

    def heatmap(self, title: str | None = None, **kw):
        """plotly Figure of ``normalized()``: ``circuitkit.viz.heatmaps.patch_heatmap``; a
        head-set result (no layer x head grid): one bar per set (``_set_bars``)."""
        if tuple(self.axes) == ("set",):
            return _set_bars(self, title)
        from circuitkit.viz.heatmaps import patch_heatmap  # patching never imports viz at load

        return patch_heatmap(self, title, **kw)

    # --- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path, *, views: bool = True) -> list[Path]:
        """Write ``<path>.safetensors`` (tensors), ``<path>.json`` (metadata), ``<path>.csv``
        (``to_frame()``) and ``<path>.html`` (``heatmap()``, a page that loads the folder's one
        ``plotly.min.js``, written beside it once: ``write_page``), each atomically; ``path``
        may be a folder (then ``<folder>/result.*``). Returns the paths written. The CLI's ``--out``
        writes exactly these. ``views=False``: the first two only (all ``load`` reads)."""
        self._record_baseline()  # (fields may have been changed since it was made)
        info = dict(format=FORMAT, version=FORMAT_VERSION, clean=self.clean,
                    corrupt=self.corrupt, direction=self.direction, method=self.method,
                    site=self.site, positions=self.positions, axes=list(self.axes),
                    meta=self.meta)
        return save_result(self, result_paths(path, "result"), info, views)

    @classmethod
    def load(cls, path: str | Path) -> PatchResult:
        """Read a result written by ``save`` or the CLI's ``--out``: ``path`` is the folder, the
        base path, or any of its files. Every field is validated (``_checked_info``,
        ``_check_tensors``: the checks ``EdgeResult.load`` applies too); a bad file is named
        with the field that is wrong (``ValueError``)."""
        return load_result(cls, path, result_paths(path, "result"), _PATCH_FILE,
                           _checked_patch_info, _patch_layout)

    def __repr__(self) -> str:
        return (f"PatchResult(method={self.method!r}, direction={self.direction!r}, "
                f"site={self.site!r}, positions={self.positions!r}, "
                f"values={tuple(self.values.shape)} over {self.axes}, clean={self.clean:.4f}, "
                f"corrupt={self.corrupt:.4f})")


def _set_bars(result: PatchResult, title: str | None):
    """A head-set result's figure: ``normalized()`` (or the raw effect) of each set, one bar,
    named by its heads."""
    import plotly.graph_objects as go

    names = result.labels.get("set") or [str(i) for i in range(result.values.shape[0])]
    fig = go.Figure(go.Bar(x=names, y=result.normalized().float().tolist()))
    fig.update_layout(title=title or f"head sets patched together ({result.direction}, "
                                     f"{result.site})", yaxis_title=result.value_column,
                      xaxis_title="set")
    return fig


def check_top(k: Any) -> None:
    """``top(k)``'s ``k``: a positive integer, else one ``ValueError`` line."""
    import numbers

    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"top: k must be a positive integer (how many cells to show); got "
                         f"{k!r:.40}.")


def verified_mask(result: PatchResult) -> Tensor:
    """``result.verified`` of an ``attribution+exact`` result (a bool tensor)."""
    mask = result.verified
    if mask is None:
        raise ValueError(f"verified_mask: a {result.method!r} result has no verified mask (only "
                         "attribution+exact results do).")
    return mask

