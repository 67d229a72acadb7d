"""``PatchResult``: the one results type of every patching sweep (exact, attribution, hybrid).

Shapes: ``values`` is ``[n_layers, n_heads]`` (heads, all positions), ``[n_layers, n_heads, seq]``
(heads, each position) or ``[n_layers, seq]`` (layer sites); ``axes`` names them.
``per_prompt`` is ``[n_prompts, *values.shape]`` when the metric had a per-prompt view.

Normalisation (``normalized()``), with ``clean``/``corrupt`` the unpatched baselines:

* denoise (clean activation into the corrupt run): ``(patched - corrupt) / (clean - corrupt)``;
  0 = no effect, 1 = the clean behaviour fully restored.
* noise (corrupt activation into the clean run): ``(patched - clean) / (clean - corrupt)``;
  0 = no effect, -1 = the behaviour fully broken (the patched run scores like the corrupt run).

The degenerate-baseline rule (one rule for every entry point, view and figure; docs/metrics.md):
the corruption must *lower* the metric (higher = more of the clean behaviour) by more than a
margin, ``gap = clean - corrupt > margin``, with ``margin = max(MIN_GAP_SE * se, tol)``: ``se``
the standard error of the per-prompt gaps ``clean_i - corrupt_i`` (0 without per-prompt values or
with one prompt), ``tol = DEGENERATE * max(1, |clean|, |corrupt|)`` (rounding). Otherwise the
result is ``degenerate``: the ratio over ``clean - corrupt`` is noise (or of the wrong sign), so
``normalized()`` returns the raw effect ``values - baseline`` instead, warns once per result
(``DegenerateBaselineWarning``, one line saying what to do), and ``meta["normalization"]``
records why; every figure then shows raw effects. ``weak_prompts()`` flags the prompts whose own
gap is at most the margin.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.result_files import (  # noqa: F401 (the file format's names, re-exported)
    _EDGE_FILE,
    _PATCH_FILE,
    AXES,
    EDGE_FORMAT,
    EDGE_FORMAT_VERSION,
    FORMAT,
    FORMAT_VERSION,
    MEAN_RTOL,
    POSITIONS,
    SITES,
    TENSOR_FIELDS,
    _check_nodes,
    _check_tensors,
    _checked_edge_info,
    _checked_info,
    _checked_patch_info,
    _load_parts,
    _no_edge,
    _number,
    _patch_shape,
    _read_saved_json,
    _read_saved_tensors,
    json_ready,
)

DIRECTIONS = ("denoise", "noise")
METHODS = ("exact", "attribution", "attribution+exact")
# |clean - corrupt| below this (relative to their size) makes normalized values meaningless
DEGENERATE = 1e-6
# The corruption must lower the metric by more than this many standard errors of the
# per-prompt gaps (about a one-sided 98% test that it lowers it at all).
MIN_GAP_SE = 2.0


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
                                     ("method", self.method, METHODS),
                                     ("positions", self.positions, POSITIONS),
                                     ("site", self.site, SITES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not valid; expected one of "
                                 f"{list(allowed)}.")
        if not isinstance(self.values, Tensor) or self.values.ndim not in (2, 3):
            raise ValueError(f"values must be a 2-D or 3-D tensor (layer x head[ x pos], or "
                             f"layer x pos); got {type(self.values).__name__} of shape "
                             f"{tuple(getattr(self.values, 'shape', ()))}.")
        if self.axes is None:
            if self.positions == "groups":
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
        tol = DEGENERATE * max(1.0, abs(self.clean), abs(self.corrupt))
        gaps = self._prompt_gaps()
        if gaps is None or gaps.numel() < 2:
            return tol
        se = float(gaps.std()) / math.sqrt(gaps.numel())
        return max(MIN_GAP_SE * se, tol) if math.isfinite(se) else tol

    @property
    def degenerate(self) -> bool:
        """True when the corruption does not lower the metric by more than ``gap_margin``
        (clean and corrupt score the same, the corruption raises the metric, or the gap is
        within the noise of the per-prompt gaps): normalized values are then meaningless and
        ``normalized()`` returns raw effects."""
        return self.gap <= self.gap_margin

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
        return PatchResult(values=pp.mean(0), clean=float(cl.mean()), corrupt=float(co.mean()),
                           direction=self.direction, method=self.method, site=self.site,
                           positions=self.positions, per_prompt=pp, clean_per_prompt=cl,
                           corrupt_per_prompt=co, axes=self.axes, meta=meta)

    def warn_if_degenerate(self) -> bool:
        """Warn ``degenerate_reason()`` (``DegenerateBaselineWarning``, at the caller's line
        outside circuitkit), once per result. Entry points call it as they return;
        ``normalized()`` and the views call it too. Returns ``degenerate``."""
        reason = self.degenerate_reason()
        if reason is not None and not self._baseline_said:
            self._baseline_said = True
            warnings.warn(DegenerateBaselineWarning(reason), stacklevel=_outside_circuitkit())
        return reason is not None

    def said_as(self, other: PatchResult) -> PatchResult:
        """This result, counting ``other``'s degenerate-baseline warning as its own (a result
        made from ``other``, with the same baselines, says it once). Returns self."""
        self._baseline_said = self._baseline_said or other._baseline_said
        return self

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
        """Denoise: ``(v - corrupt) / (clean - corrupt)``; noise: ``(v - clean) / (same)``.

        A ``degenerate`` result (the corruption does not lower the metric by its margin) gives
        the raw effect ``values - baseline`` (``effect()``) instead, with one warning per result
        and ``meta["normalization"]`` saying why.
        """
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
        g = torch.Generator().manual_seed(seed)
        # Resample counts [n_boot, n]: mean over a resample = counts @ x / n.
        counts = torch.zeros(n_boot, n, dtype=torch.float64)
        counts.scatter_add_(1, torch.randint(0, n, (n_boot, n), generator=g),
                            torch.ones(n_boot, n, dtype=torch.float64))
        w = counts / n
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
        """pandas DataFrame, one row per cell: axes..., value, normalized[, ci_low, ci_high]
        [, verified: for ``attribution+exact``, True where the value is exact, not an
        estimate]."""
        import pandas as pd

        idx = torch.cartesian_prod(*[torch.arange(s) for s in self.values.shape])
        idx = idx.reshape(-1, len(self.axes))
        cols = {a: idx[:, i].numpy() for i, a in enumerate(self.axes)}
        names = (self.meta or {}).get("group_names")
        if "group" in cols and isinstance(names, list) and len(names) == self.values.shape[
                self.axes.index("group")]:
            cols["group"] = [names[g] for g in cols["group"]]  # the groups by name
        cols["value"] = self.values.reshape(-1).float().numpy()
        cols["normalized"] = self.normalized().reshape(-1).float().numpy()  # (warns once)
        interval = self.confidence_interval() if ci else None
        if interval is not None:
            cols["ci_low"] = interval[0].reshape(-1).numpy()
            cols["ci_high"] = interval[1].reshape(-1).numpy()
        if self.verified is not None:  # attribution+exact: which are exact
            cols["verified"] = self.verified.reshape(-1).numpy()
        frame = pd.DataFrame(cols)
        if self.degenerate:  # its "normalized" column holds raw effects: say so
            frame.attrs["normalization"] = self.meta["normalization"]
        return frame

    @property
    def verified(self) -> Tensor | None:
        """``attribution+exact``: a bool tensor shaped like ``values``, True where the value is
        exact (``meta["verified"]``); None for results of other methods (every cell as its
        method computed it)."""
        mask = (self.meta or {}).get("verified")
        return torch.tensor(mask, dtype=torch.bool) if isinstance(mask, list) else None

    def top(self, k: int = 10):
        """The ``k`` cells with the largest ``|normalized|`` (DataFrame, strongest first): by
        ``|effect|`` for a ``degenerate`` result (its ``normalized`` column holds raw effects,
        and it warns once)."""
        df = self.to_frame()
        order = df["normalized"].abs().sort_values(ascending=False,
                                                   na_position="last").index[:k]
        return df.loc[order].reset_index(drop=True)

    def heatmap(self, title: str | None = None, **kw):
        """plotly Figure of ``normalized()``: ``circuitkit.viz.heatmaps.patch_heatmap``."""
        from circuitkit.viz.heatmaps import patch_heatmap  # patching never imports viz at load

        return patch_heatmap(self, title, **kw)

    # --- persistence ----------------------------------------------------------------------------
    @staticmethod
    def _paths(path: str | Path) -> dict[str, Path]:
        """The files of a result at ``path`` (a folder holding ``result.*``, or a base path with
        or without a suffix)."""
        p = Path(path)
        if p.is_dir():
            p = p / "result"
        elif p.suffix in (".safetensors", ".json", ".csv", ".html"):
            p = p.with_suffix("")
        return {ext: p.with_name(p.name + "." + ext) for ext in ("safetensors", "json", "csv",
                                                                   "html")}

    def save(self, path: str | Path, *, views: bool = True) -> list[Path]:
        """Write ``<path>.safetensors`` (tensors), ``<path>.json`` (metadata), ``<path>.csv``
        (``to_frame()``) and ``<path>.html`` (``heatmap()``, a page that loads the folder's one
        ``plotly.min.js``, written beside it once: ``write_page``), each atomically; ``path``
        may be a folder (then ``<folder>/result.*``). Returns the paths written. The CLI's ``--out``
        writes exactly these. ``views=False``: the first two only (all ``load`` reads)."""
        from circuitkit import files

        paths = self._paths(path)
        paths["json"].parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: getattr(self, k) for k in TENSOR_FIELDS if getattr(self, k) is not None}
        files.write_tensors(paths["safetensors"], tensors)
        self._record_baseline()  # (fields may have been changed since it was made)
        info = dict(format=FORMAT, version=FORMAT_VERSION, clean=self.clean,
                    corrupt=self.corrupt, direction=self.direction, method=self.method,
                    site=self.site, positions=self.positions, axes=list(self.axes),
                    meta=self.meta)
        files.write_text(paths["json"], json.dumps(json_ready(info), indent=2))
        if not views:
            return [paths["safetensors"], paths["json"]]
        files.atomic_write(paths["csv"], lambda p: self.to_frame().to_csv(p, index=False))
        write_page(self.heatmap(), paths["html"])  # + the folder's one plotly.min.js
        return list(paths.values())

    @classmethod
    def load(cls, path: str | Path) -> PatchResult:
        """Read a result written by ``save`` or the CLI's ``--out``: ``path`` is the folder, the
        base path, or any of its files. Every field is validated (``_checked_info``,
        ``_check_tensors``: the checks ``EdgeResult.load`` applies too); a bad file is named
        with the field that is wrong (``ValueError``)."""
        paths = cls._paths(path)
        js, st = paths["json"], paths["safetensors"]
        kw, tensors = _load_parts(path, paths, _PATCH_FILE)
        kw = _checked_patch_info(kw, js)
        _check_tensors(tensors, kw, st, js, shape=_patch_shape(kw))
        try:
            return cls(**{k: tensors.get(k) for k in TENSOR_FIELDS}, **kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{js}: {e}") from None

    def __repr__(self) -> str:
        return (f"PatchResult(method={self.method!r}, direction={self.direction!r}, "
                f"site={self.site!r}, positions={self.positions!r}, "
                f"values={tuple(self.values.shape)} over {self.axes}, clean={self.clean:.4f}, "
                f"corrupt={self.corrupt:.4f})")


PLOTLY_BUNDLE = "plotly.min.js"


def plotly_bundle(folder: Path) -> Path:
    """``folder/plotly.min.js`` for pages written with ``include_plotlyjs=PLOTLY_BUNDLE``,
    written atomically unless a complete copy is there (plotly's own
    ``include_plotlyjs="directory"`` writes it in place and keeps whatever it finds, so a write
    cut short by a full disk left every later page blank). Returns its path."""
    from plotly.offline import get_plotlyjs

    from circuitkit import files

    js, dest = get_plotlyjs(), folder / PLOTLY_BUNDLE
    try:
        if dest.stat().st_size == len(js.encode()) and dest.read_text(encoding="utf-8") == js:
            return dest
    except (OSError, UnicodeDecodeError):
        pass
    return files.atomic_write(dest, lambda p: p.write_text(js, encoding="utf-8"))


# What a page shows in place of its figure when plotly.min.js is not beside it (a page copied
# out of its folder): a plain sentence, not a blank page or a console error.
_NO_BUNDLE = (
    "<script>if(!window.Plotly){window.Plotly={newPlot:function(id){"
    "var d=document.getElementById(id);if(d){d.style.height='auto';d.innerHTML="
    "'<p style=\"font-family:sans-serif;color:#b00020;padding:12px\">This figure is drawn by "
    "plotly.min.js, which is not in this page\\'s folder: copy the results folder\\'s "
    "plotly.min.js beside the page, or open the folder\\'s report.html (self-contained).</p>';}"
    "return Promise.resolve();}};}</script>")


def write_page(fig: Any, path: str | Path) -> Path:
    """Write plotly figure ``fig`` as the page ``path`` (atomically) that loads plotly.js
    from ``plotly.min.js`` in the same folder, written there once (``plotly_bundle``).

    The one rule for every page circuitkit writes beside results (``PatchResult.save``'s
    ``result.html``, ``EdgeResult.save``'s ``edges.html``, the CLI's ``circuit.html`` and
    ``faithfulness.html``, ``characterize``'s sweep pages): a folder holds one copy of plotly.js
    (~4.6 MB) however many pages it has. ``report.html`` is the one self-contained page (plotly.js
    inlined once: it opens alone, offline, and can be mailed). A page copied out of its folder
    says so in place of its figure; ``fig.write_html(path)`` writes a page that inlines
    plotly.js instead."""
    from circuitkit import files

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plotly_bundle(path.parent)
    tag = f'<script charset="utf-8" src="{PLOTLY_BUNDLE}"></script>'
    page = fig.to_html(include_plotlyjs=PLOTLY_BUNDLE, full_html=True)
    page = page.replace(tag, tag + _NO_BUNDLE, 1)
    return files.atomic_write(path, lambda p: p.write_text(page, encoding="utf-8"))


def verified_mask(result: PatchResult) -> Tensor:
    """``result.verified`` of an ``attribution+exact`` result (a bool tensor)."""
    mask = result.verified
    if mask is None:
        raise ValueError(f"verified_mask: a {result.method!r} result has no verified mask (only "
                         "attribution+exact results do).")
    return mask


# --- edges ---------------------------------------------------------------------------------------

EDGE_TENSORS = TENSOR_FIELDS  # the same four, with edge-shaped values (kept: a public name)


node_name = hooks.node_name  # (re-exported: the one spelling of node names is hooks')


@dataclass
class EdgeResult:
    """Metric after patching each edge (``patch_edges``), plus baselines and provenance.

    ``values[s, r, i]``: mean over prompts of the metric after sender ``senders[s]``'s write
    reaches receiver ``receivers[r]`` at input ``inputs[i]`` only. Nodes are ``(layer, head)``:
    the senders include the embeddings as ``(-1, -1)`` ("embed"), the receivers the logits as
    ``(n_layers, -1)`` ("logits": the final residual the unembedding reads; it has one input,
    stored at input index 0 and shown as input "resid"). NaN where ``(s, r, i)`` is no edge:
    the receiver's layer is not after the sender's, the logits' other input slots, and under
    GQA a k/v receiver ``(l, g)`` with ``g >= n_kv_heads`` (k/v receivers are KV heads:
    ``meta["kv_heads"]``). ``per_prompt``: ``[n_prompts, n_senders, n_receivers, n_inputs]``.
    Normalisation and intervals are ``PatchResult``'s (one definition: ``_as_patch_result``).
    """

    values: Float[Tensor, "sender receiver input"]
    clean: float
    corrupt: float
    direction: str
    method: str
    senders: tuple[tuple[int, int], ...]
    receivers: tuple[tuple[int, int], ...]
    inputs: tuple[str, ...]
    n_layers: int
    per_prompt: Float[Tensor, "n_prompts sender receiver input"] | None = None
    clean_per_prompt: Float[Tensor, " n_prompts"] | None = None
    corrupt_per_prompt: Float[Tensor, " n_prompts"] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # whether the degenerate baseline was said (warned) for this result: once per result
    _baseline_said: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.senders = tuple((int(a), int(b)) for a, b in self.senders)
        self.receivers = tuple((int(a), int(b)) for a, b in self.receivers)
        self.inputs = tuple(self.inputs)
        self.n_layers = int(self.n_layers)
        self.clean, self.corrupt = float(self.clean), float(self.corrupt)  # (a 0-d tensor too)
        self.meta = dict(self.meta or {})
        canonical = tuple(i for i in hooks.EDGE_INPUTS if i in self.inputs)
        if not self.inputs or self.inputs != canonical:
            raise ValueError(f"inputs={list(self.inputs)} must be distinct names from "
                             f"{list(hooks.EDGE_INPUTS)}, in that order (as patch_edges gives "
                             "them).")
        shape = (len(self.senders), len(self.receivers), len(self.inputs))
        if not isinstance(self.values, Tensor) or tuple(self.values.shape) != shape:
            raise ValueError(f"values must be a [senders, receivers, inputs] = {list(shape)} "
                             f"tensor; got shape {tuple(getattr(self.values, 'shape', ()))}.")
        facts = self.meta.get("facts")
        n_heads = facts.get("n_heads") if isinstance(facts, dict) else None
        _check_nodes(self.senders, self.receivers, self.n_layers,
                     n_heads if isinstance(n_heads, int) else None)
        pp = self.per_prompt
        if pp is not None and (not isinstance(pp, Tensor) or tuple(pp.shape[1:]) != shape):
            raise ValueError(f"per_prompt must be a [n_prompts, {', '.join(map(str, shape))}] "
                             f"tensor; got shape {tuple(getattr(pp, 'shape', ()))}.")
        # the rest (direction, method, baselines, per-prompt shapes) as a PatchResult checks it
        self._as_patch_result()

    def _as_patch_result(self, values: Tensor | None = None) -> PatchResult:
        """The same numbers as a ``PatchResult`` over (sender, receiver x input): its
        normalisation, bootstrap and degenerate rule are the edges' too."""
        n_s = len(self.senders)
        pp = self.per_prompt
        view = PatchResult(
            values=(self.values if values is None else values).reshape(n_s, -1),
            clean=self.clean, corrupt=self.corrupt, direction=self.direction,
            method=self.method, site="z", positions="all",
            per_prompt=None if pp is None else pp.reshape(pp.shape[0], n_s, -1),
            clean_per_prompt=self.clean_per_prompt, corrupt_per_prompt=self.corrupt_per_prompt,
            axes=("sender", "receiver_input"), meta=dict(metric=self.meta.get("metric")))
        view._baseline_said = self._baseline_said  # one warning per edge result, not per view
        return view

    @property
    def degenerate(self) -> bool:
        return self._as_patch_result().degenerate

    def warn_if_degenerate(self) -> bool:
        """``PatchResult.warn_if_degenerate``: once per edge result."""
        view = self._as_patch_result()
        said = view.warn_if_degenerate()
        self._baseline_said = view._baseline_said
        return said

    def normalized(self) -> Float[Tensor, "sender receiver input"]:
        """``PatchResult.normalized`` of each edge: denoise ``(v - corrupt) / (clean -
        corrupt)``, noise ``(v - clean) / (clean - corrupt)``; the raw effect for a
        ``degenerate`` result (one warning per result)."""
        view = self._as_patch_result()
        out = view.normalized().reshape(self.values.shape)
        self._baseline_said = view._baseline_said
        return out

    def effect(self) -> Float[Tensor, "sender receiver input"]:
        """``values - baseline`` (corrupt for denoise, clean for noise)."""
        return self.values - (self.corrupt if self.direction == "denoise" else self.clean)

    def confidence_interval(self, level: float = 0.95, n_boot: int = 1000, seed: int = 0,
                            raw: bool | None = None) -> tuple[Tensor, Tensor] | None:
        """``PatchResult.confidence_interval`` (percentile bootstrap over prompts of the
        normalized value, or of the raw effect: ``raw``, default for a ``degenerate`` result)
        of each edge, values-shaped; None without per-prompt values."""
        got = self._as_patch_result().confidence_interval(level, n_boot, seed, raw=raw)
        return None if got is None else tuple(t.reshape(self.values.shape) for t in got)

    def sender_names(self) -> list[str]:
        return [node_name(s, self.n_layers) for s in self.senders]

    def receiver_names(self) -> list[str]:
        return [node_name(r, self.n_layers) for r in self.receivers]

    def edge_mask(self) -> Tensor:
        """Bool ``[senders, receivers, inputs]``: True where the cell is an edge."""
        return ~torch.isnan(self.values)

    def to_frame(self, ci: bool = True):
        """pandas DataFrame, one row per edge: sender_layer, sender_head, receiver_layer,
        receiver_head, input, value, normalized[, ci_low, ci_high][, verified], sender,
        receiver (names: "embed", "L0H1", "logits"). The embeddings are layer -1, the logits
        layer ``n_layers`` (head -1) with input "resid"."""
        import pandas as pd

        idx = self.edge_mask().nonzero()
        s, r, i = idx[:, 0], idx[:, 1], idx[:, 2]
        snd = torch.tensor(self.senders).reshape(-1, 2)[s]
        rcv = torch.tensor(self.receivers).reshape(-1, 2)[r]
        logits = rcv[:, 0] == self.n_layers
        with warnings.catch_warnings():  # said once by normalized() itself, not per view
            if self.degenerate:
                warnings.simplefilter("ignore")
            norm = self.normalized()[s, r, i]
        cols = dict(sender_layer=snd[:, 0].numpy(), sender_head=snd[:, 1].numpy(),
                    receiver_layer=rcv[:, 0].numpy(), receiver_head=rcv[:, 1].numpy(),
                    input=["resid" if lg else self.inputs[k]
                           for lg, k in zip(logits.tolist(), i.tolist(), strict=True)],
                    value=self.values[s, r, i].float().numpy(), normalized=norm.float().numpy())
        interval = self.confidence_interval() if ci else None
        if interval is not None:
            cols["ci_low"] = interval[0][s, r, i].numpy()
            cols["ci_high"] = interval[1][s, r, i].numpy()
        verified = (self.meta or {}).get("verified")
        if isinstance(verified, list):  # attribution+exact: which values are exact
            cols["verified"] = torch.tensor(verified, dtype=torch.bool)[s, r, i].numpy()
        names_s, names_r = self.sender_names(), self.receiver_names()
        cols["sender"] = [names_s[k] for k in s.tolist()]
        cols["receiver"] = [names_r[k] for k in r.tolist()]
        return pd.DataFrame(cols)

    def top(self, k: int = 10, input: str | None = None):
        """The ``k`` edges with the largest ``|normalized|`` (by ``|effect|`` when normalized
        values are undefined), strongest first; ``input``: only edges into that input ("q",
        "k", "v", or "resid" for the logits)."""
        df = self.to_frame()
        if input is not None:
            df = df[df["input"] == input]
        base = self.corrupt if self.direction == "denoise" else self.clean
        key = df["value"] - base if self.degenerate else df["normalized"]
        order = key.abs().sort_values(ascending=False, na_position="last").index[:k]
        return df.loc[order].reset_index(drop=True)

    def heatmap(self, title: str | None = None, **kw):
        """plotly Figure: sender x receiver heatmap of ``normalized()``, one panel per input
        (``circuitkit.viz.heatmaps.edge_heatmap``)."""
        from circuitkit.viz.heatmaps import edge_heatmap  # patching never imports viz at load

        return edge_heatmap(self, title, **kw)

    # --- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path, *, views: bool = True) -> list[Path]:
        """``<path>.safetensors`` (tensors), ``<path>.json`` (metadata, ``json_ready``), and
        with ``views`` ``<path>.csv`` (``to_frame()``) and ``<path>.html`` (``heatmap()``, with
        the folder's one ``plotly.min.js``: ``write_page``), each written atomically; ``path``
        may be a folder (then ``<folder>/edges.*``)."""
        from circuitkit import files

        paths = _edge_paths(path)
        paths["json"].parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: getattr(self, k) for k in TENSOR_FIELDS if getattr(self, k) is not None}
        files.write_tensors(paths["safetensors"], tensors)
        info = dict(format=EDGE_FORMAT, version=EDGE_FORMAT_VERSION, clean=self.clean,
                    corrupt=self.corrupt, direction=self.direction, method=self.method,
                    senders=[list(s) for s in self.senders],
                    receivers=[list(r) for r in self.receivers], inputs=list(self.inputs),
                    n_layers=self.n_layers, meta=self.meta)
        files.write_text(paths["json"], json.dumps(json_ready(info), indent=2))
        if not views:
            return [paths["safetensors"], paths["json"]]
        files.atomic_write(paths["csv"], lambda p: self.to_frame().to_csv(p, index=False))
        write_page(self.heatmap(), paths["html"])  # + the folder's one plotly.min.js
        return list(paths.values())

    @classmethod
    def load(cls, path: str | Path) -> EdgeResult:
        """Read what ``save`` wrote (the folder, the base path or any of its files). Strict,
        with ``PatchResult.load``'s checks (``_checked_info``, ``_check_tensors``: types,
        finite cells, values and baselines the means of their per-prompt values, the verified
        mask) and the edges' own: ``n_layers`` a positive integer, ``inputs`` distinct in
        q, k, v order, senders and receivers distinct, sorted and inside the model
        (``meta["facts"]``, when recorded), and NaN exactly where there is no edge
        (``_no_edge``). A bad file is a ``ValueError`` naming the file and the field."""
        paths = _edge_paths(path)
        js, st = paths["json"], paths["safetensors"]
        kw, tensors = _load_parts(path, paths, _EDGE_FILE)
        kw = _checked_edge_info(kw, js)
        shape = (len(kw["senders"]), len(kw["receivers"]), len(kw["inputs"]))
        _check_tensors(tensors, kw, st, js, shape=shape, empty=_no_edge(kw, tensors, shape))
        try:
            return cls(**{k: tensors.get(k) for k in TENSOR_FIELDS}, **kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{js}: {e}") from None

    def __repr__(self) -> str:
        return (f"EdgeResult(method={self.method!r}, direction={self.direction!r}, "
                f"{len(self.senders)} senders x {len(self.receivers)} receivers x "
                f"inputs {list(self.inputs)}, {int(self.edge_mask().sum())} edges, "
                f"clean={self.clean:.4f}, corrupt={self.corrupt:.4f})")


def _edge_paths(path: str | Path) -> dict[str, Path]:
    p = Path(path)
    if p.is_dir():
        p = p / "edges"
    elif p.suffix in (".safetensors", ".json", ".csv", ".html"):
        p = p.with_suffix("")
    return {ext: p.with_name(p.name + "." + ext) for ext in ("safetensors", "json", "csv", "html")}


# --- circuits ------------------------------------------------------------------------------------

CIRCUIT_FORMAT = "circuitkit.circuit"
CIRCUIT_VERSION = 2  # 2: node names and normalized scores in items, share of the gap
CIRCUIT_KINDS = ("edges", "heads")
# "position-mean": the clean prompts' mean write at each position (ablate_heads' "mean", over
# prompts and positions together, is another quantity: docs/edges.md). "mean" is its old name,
# read from files written before and taken by ck.circuit with a DeprecationWarning.
CIRCUIT_ABLATIONS = ("corrupt", "zero", "position-mean", "resample")
CIRCUIT_OLD_ABLATIONS = {"mean": "position-mean"}
CIRCUIT_RANKS = ("abs", "signed")
CIRCUIT_INPUTS = (*hooks.EDGE_INPUTS, "resid")


class CircuitTargetWarning(UserWarning):
    """No circuit of the curve reaches the faithfulness target (``CircuitResult.target_reached``
    is False): the kept set is the largest circuit of the curve, not one that reaches it."""


node_of = hooks.parse_node  # node_name's inverse (re-exported under its old name)


def gap_percent(share: float) -> str:
    """A share of the clean-corrupt gap in percent, small ones with two decimals so that they
    read as small, not as 0: ``0.40%``, ``12.5%``, ``143.0%``."""
    return f"{share:.{2 if abs(share) < 0.1 else 1}%}"


def share_phrase(share: float | None) -> str:
    """The candidate set's share of the clean-corrupt gap in words: ``"they carry 0.40% of the
    clean-corrupt gap"`` (one wording for the repr the CLI prints, the figures and the
    report)."""
    if share is None or not math.isfinite(share):
        return "their share of the clean-corrupt gap is undefined (degenerate baseline)"
    return f"they carry {gap_percent(share)} of the clean-corrupt gap"


@dataclass
class CircuitResult:
    """A faithfulness curve and the kept set (``patching.faithfulness.circuit``).

    ``kind``: "edges" or "heads"; ``sizes``: shares of the scored items kept (ascending),
    ``n_kept``: how many items that is; ``faithfulness[k] = (m(C_k) - empty) / (full -
    empty)`` with ``full``/``empty`` the metric with every scored item kept / ablated;
    ``per_prompt``: ``[n_sizes, n_prompts]`` metric of each circuit. ``cpr``/``cmd``: MIB's
    areas (under f; between f and 1) over the kept share. ``share``: the scored items' share
    of the whole behaviour, ``(full - empty) / (clean - corrupt)`` (``clean`` = ``full``, the
    clean run; ``corrupt``: the corrupt run): f and CPR are shares of *that* part only.
    ``items``: every scored item, ranked, the same dicts ``kept()`` and ``circuit.json`` give
    (edges: ``sender``/``receiver`` node names as ``node_name``, ``input``; heads: ``name``,
    ``layer``, ``head``; both: ``score``, the item's own normalized effect as
    ``PatchResult.normalized``, and ``effect``, its raw effect ``value - baseline``).
    ``chosen``: index of the kept set, the smallest circuit with faithfulness >= ``target``
    (``target_reached``; else the largest circuit, with a ``CircuitTargetWarning``).
    ``degenerate``: why f is no share (the corruption does not lower the metric by its margin,
    or ablating every scored item does not move it: ``PatchResult.degenerate``'s rule), else
    None; then ``faithfulness`` holds raw effects ``m(C_k) - empty`` and ``cpr``/``cmd``/``share``
    are None. ``intervals``: bootstrap percentile intervals over prompts of faithfulness (per
    size), CPR, CMD and share, or None.
    """

    kind: str
    sizes: tuple[float, ...]
    n_kept: tuple[int, ...]
    faithfulness: Float[Tensor, " n_sizes"]
    full: float
    empty: float
    cpr: float | None
    cmd: float | None
    items: list[dict[str, Any]]
    n_layers: int
    ablation: str
    rank: str
    target: float
    chosen: int
    per_prompt: Float[Tensor, "n_sizes n_prompts"] | None = None
    full_per_prompt: Float[Tensor, " n_prompts"] | None = None
    empty_per_prompt: Float[Tensor, " n_prompts"] | None = None
    intervals: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    corrupt: float | None = None
    share: float | None = None
    target_reached: bool = True
    degenerate: str | None = None

    def kept(self, index: int | None = None) -> list[dict[str, Any]]:
        """The items of circuit ``index`` of the curve (default ``chosen``), strongest first:
        the dicts ``circuit.json``'s ``edges`` (heads: ``nodes``) hold."""
        k = self.chosen if index is None else index
        return [dict(it) for it in self.items[:self.n_kept[k]]]

    def to_frame(self):
        """pandas DataFrame, one row per size: size, n_kept, faithfulness[, ci_low, ci_high]."""
        import pandas as pd

        df = pd.DataFrame(dict(size=list(self.sizes), n_kept=list(self.n_kept),
                               faithfulness=self.faithfulness.float().numpy()))
        band = (self.intervals or {}).get("faithfulness")
        if band:
            df["ci_low"] = [b[0] for b in band]
            df["ci_high"] = [b[1] for b in band]
        return df

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        """The kept set as JSON-ready data: ``nodes`` (name, layer, head; for heads also the
        item's score and effect), ``edges`` (the kept items as ``kept()`` gives them; none for
        heads), its faithfulness, the curve (``to_frame`` rows), CPR, CMD and the share of the
        gap (``read_circuit_json`` checks what it reads back)."""
        k = self.chosen if index is None else index
        kept = self.kept(k)
        nodes: dict[str, dict[str, Any]] = {}

        def node(name: str) -> None:
            layer, head = node_of(name, self.n_layers)
            nodes.setdefault(name, dict(name=name, layer=layer, head=head))

        if self.kind == "edges":
            for e in kept:
                node(e["sender"])
                node(e["receiver"])
            edges = kept
        else:
            edges = []
            for h in kept:
                nodes[h["name"]] = dict(h)
        iv = self.intervals or {}
        band = iv.get("faithfulness")
        curve = self.to_frame().to_dict(orient="records")
        return dict(format=CIRCUIT_FORMAT, version=CIRCUIT_VERSION, kind=self.kind,
                    size=self.sizes[k], n_kept=self.n_kept[k], n_items=len(self.items),
                    faithfulness=float(self.faithfulness[k]),
                    faithfulness_ci=band[k] if band else None, target=self.target,
                    target_reached=self.target_reached, ablation=self.ablation,
                    rank=self.rank, cpr=self.cpr, cmd=self.cmd, cpr_ci=iv.get("cpr"),
                    cmd_ci=iv.get("cmd"), full=self.full, empty=self.empty,
                    corrupt=self.corrupt, share=self.share, share_ci=iv.get("share"),
                    degenerate=self.degenerate, n_layers=self.n_layers, curve=curve,
                    nodes=sorted(nodes.values(), key=lambda d: (d["layer"], d["head"])),
                    edges=edges, meta=self.meta)

    def save_json(self, path: str | Path, index: int | None = None) -> Path:
        """``to_dict(index)`` written atomically as JSON."""
        from circuitkit import files

        return files.write_text(path, json.dumps(self.to_dict(index), indent=1, default=str))

    def __repr__(self) -> str:
        k = self.chosen
        head = f"CircuitResult({self.kind}, ablation={self.ablation!r}, "
        if self.degenerate:
            return head + (f"degenerate: no faithfulness, CPR or CMD ({self.degenerate}); "
                           f"{len(self.items)} items)")
        miss = "" if self.target_reached else f", target {self.target:g} not reached"
        return head + (f"CPR={self.cpr:.3f}, CMD={self.cmd:.3f}, kept {self.n_kept[k]} of "
                       f"{len(self.items)} (faithfulness {float(self.faithfulness[k]):.3f}"
                       f"{miss}); {share_phrase(self.share)}, so CPR and faithfulness are "
                       "shares of that part)")


def read_circuit_json(path: str | Path) -> dict[str, Any]:
    """``circuit.json`` (``CircuitResult.save_json``) read strictly: every field the readers
    use is checked for type, range and shape, nodes and edges against each other; a bad file
    is one ``ValueError`` naming the file and the field. Returns the parsed dict."""
    from circuitkit import files

    p = Path(path)
    data = files.read_json(p, "circuit file")

    def bad(name: str, want: str, got: Any) -> ValueError:
        return ValueError(f"{p}: field {name!r} must be {want}; got {got!r:.80}.")

    def number(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf,
               none: bool = False) -> None:
        if value is None and none:
            return
        if not _number(value) or not math.isfinite(value) or not lo <= value <= hi:
            raise bad(name, f"a finite number in [{lo:g}, {hi:g}]" + (" or null" if none
                                                                       else ""), value)

    def integer(name: str, value: Any, lo: int, hi: float = math.inf) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise bad(name, f"an integer in [{lo}, {hi:g}]", value)

    def band(name: str, value: Any) -> None:
        if value is None:
            return
        if not (isinstance(value, list) and len(value) == 2 and all(
                _number(v) and math.isfinite(v) for v in value) and value[0] <= value[1]):
            raise bad(name, "null or a [low, high] pair of finite numbers, low <= high", value)

    def choice(name: str, value: Any, allowed: tuple) -> None:
        if not isinstance(value, str) or value not in allowed:
            raise bad(name, f"one of {list(allowed)}", value)

    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object (a circuit); got {type(data).__name__}.")
    if data.get("format") != CIRCUIT_FORMAT:
        raise bad("format", repr(CIRCUIT_FORMAT), data.get("format"))
    integer("version", data.get("version"), 1, CIRCUIT_VERSION)
    need = ("kind", "size", "n_kept", "n_items", "faithfulness", "target", "ablation", "rank",
            "cpr", "cmd", "n_layers", "curve", "nodes", "edges")
    missing = [k for k in need if k not in data]
    if missing:
        raise ValueError(f"{p}: missing field(s) {missing}.")
    degenerate = data.get("degenerate")
    if degenerate is not None and not isinstance(degenerate, str):
        raise bad("degenerate", "null or a string (why f is no share)", degenerate)
    choice("kind", data["kind"], CIRCUIT_KINDS)
    if isinstance(data["ablation"], str) and data["ablation"] in CIRCUIT_OLD_ABLATIONS:
        data["ablation"] = CIRCUIT_OLD_ABLATIONS[data["ablation"]]  # a file of an older version
    choice("ablation", data["ablation"], CIRCUIT_ABLATIONS)
    choice("rank", data["rank"], CIRCUIT_RANKS)
    integer("n_layers", data["n_layers"], 1)
    integer("n_items", data["n_items"], 1)
    integer("n_kept", data["n_kept"], 0, data["n_items"])
    number("size", data["size"], 0, 1)
    number("target", data["target"], 0, 1)
    number("faithfulness", data["faithfulness"])
    for k in ("cpr", "cmd", "share"):  # null: a degenerate curve (no share to give)
        number(k, data.get(k), none=degenerate is not None or k == "share")
    for k in ("full", "empty", "corrupt"):
        number(k, data.get(k), none=True)
    for k in ("faithfulness_ci", "cpr_ci", "cmd_ci", "share_ci"):
        band(k, data.get(k))
    if not isinstance(data.get("target_reached", True), bool):
        raise bad("target_reached", "true or false", data["target_reached"])
    if not isinstance(data.get("meta", {}), dict):
        raise bad("meta", "a JSON object", data["meta"])
    curve = data["curve"]
    if not isinstance(curve, list) or not curve:
        raise bad("curve", "a non-empty list of {size, n_kept, faithfulness} rows", curve)
    last = 0.0
    for j, row in enumerate(curve):
        where = f"curve[{j}]"
        if not isinstance(row, dict) or not {"size", "n_kept", "faithfulness"} <= set(row):
            raise bad(where, "an object with size, n_kept and faithfulness", row)
        number(f"{where}.size", row["size"], 0, 1)
        if row["size"] <= last and j:
            raise bad(f"{where}.size", "larger than the row before's (sizes ascend)",
                      row["size"])
        last = row["size"]
        integer(f"{where}.n_kept", row["n_kept"], 0, data["n_items"])
        number(f"{where}.faithfulness", row["faithfulness"])
        for k in ("ci_low", "ci_high"):
            number(f"{where}.{k}", row.get(k), none=True)
    nodes = data["nodes"]
    if not isinstance(nodes, list):
        raise bad("nodes", "a list of {name, layer, head}", nodes)
    names: set[str] = set()
    for j, n in enumerate(nodes):
        if not isinstance(n, dict) or not isinstance(n.get("name"), str):
            raise bad(f"nodes[{j}]", "an object with a string name", n)
        try:
            where = node_of(n["name"], data["n_layers"])
        except ValueError as e:
            raise ValueError(f"{p}: field 'nodes[{j}].name': {e}") from None
        if [n.get("layer"), n.get("head")] != list(where):
            raise bad(f"nodes[{j}]", f"layer {where[0]} and head {where[1]} (its name "
                      f"{n['name']})", n)
        if data["kind"] == "heads":
            number(f"nodes[{j}].score", n.get("score"))
        names.add(n["name"])
    edges = data["edges"]
    if not isinstance(edges, list):
        raise bad("edges", "a list of {sender, receiver, input, score}", edges)
    if data["kind"] == "edges" and len(edges) != data["n_kept"] or data["kind"] == "heads" \
            and (edges or len(nodes) != data["n_kept"]):
        raise bad("n_kept", f"the number of kept {data['kind']}", data["n_kept"])
    for j, e in enumerate(edges):
        if not isinstance(e, dict):
            raise bad(f"edges[{j}]", "an object", e)
        for k in ("sender", "receiver"):
            if not isinstance(e.get(k), str) or e[k] not in names:
                raise bad(f"edges[{j}].{k}", "the name of one of 'nodes'", e.get(k))
        choice(f"edges[{j}].input", e.get("input"), CIRCUIT_INPUTS)
        number(f"edges[{j}].score", e.get("score"))
        number(f"edges[{j}].effect", e.get("effect"), none=True)
    return data
