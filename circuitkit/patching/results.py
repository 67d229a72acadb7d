"""``PatchResult``: the one results type of every patching sweep (exact, attribution, hybrid).

Shapes: ``values`` is ``[n_layers, n_heads]`` (heads, all positions), ``[n_layers, n_heads, seq]``
(heads, each position) or ``[n_layers, seq]`` (layer sites); ``axes`` names them.
``per_prompt`` is ``[n_prompts, *values.shape]`` when the metric had a per-prompt view.

Normalisation (``normalized()``), with ``clean``/``corrupt`` the unpatched baselines:

* denoise (clean activation into the corrupt run): ``(patched - corrupt) / (clean - corrupt)``;
  0 = no effect, 1 = the clean behaviour fully restored.
* noise (corrupt activation into the clean run): ``(patched - clean) / (clean - corrupt)``;
  0 = no effect, -1 = the behaviour fully broken (the patched run scores like the corrupt run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

TENSOR_FIELDS = ("values", "per_prompt", "clean_per_prompt", "corrupt_per_prompt")


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
    positions: str  # "all" | "each"
    per_prompt: Float[Tensor, "n_prompts ..."] | None = None
    clean_per_prompt: Float[Tensor, " n_prompts"] | None = None
    corrupt_per_prompt: Float[Tensor, " n_prompts"] | None = None
    axes: tuple[str, ...] | None = None  # default: inferred from values.ndim and positions
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.axes is None:
            if self.values.ndim == 3:
                self.axes = ("layer", "head", "pos")
            elif self.positions == "each" and self.site not in ("z", "pattern", "q", "k", "v"):
                self.axes = ("layer", "pos")
            else:
                self.axes = ("layer", "head")
        self.axes = tuple(self.axes)
        self.clean, self.corrupt = float(self.clean), float(self.corrupt)

    # --- normalisation and intervals -----------------------------------------------------------
    def _normalize(self, patched: Tensor, clean: Tensor | float, corrupt: Tensor | float) -> Tensor:
        ref = corrupt if self.direction == "denoise" else clean
        return (patched - ref) / (clean - corrupt)

    def normalized(self) -> Float[Tensor, "..."]:
        """Denoise: ``(v - corrupt) / (clean - corrupt)``; noise: ``(v - clean) / (same)``."""
        return self._normalize(self.values, self.clean, self.corrupt)

    def confidence_interval(
        self, level: float = 0.95, n_boot: int = 1000, seed: int = 0
    ) -> tuple[Tensor, Tensor] | None:
        """Percentile bootstrap over prompts of ``normalized()``: ``(low, high)``, values-shaped.

        Each resample draws prompts with replacement and recomputes the ratio of means
        (patched, clean and corrupt means over the same resample), so the interval is that of
        the reported statistic. TransformerLens's ``PatchingResult.bootstrap_ci`` bootstraps a
        single per-example statistic and cannot express this ratio of means, hence our own.
        Returns None without per-prompt values.
        """
        if self.per_prompt is None or self.clean_per_prompt is None:
            return None
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
            norm = self._normalize(patched, clean[:, None], corrupt[:, None])
            ql = torch.quantile(norm, q, dim=0)
            lo.append(ql[0])
            hi.append(ql[1])
        shape = self.values.shape
        return (torch.cat(lo).reshape(shape).float(), torch.cat(hi).reshape(shape).float())

    # --- views -----------------------------------------------------------------------------------
    def to_frame(self, ci: bool = True):
        """pandas DataFrame, one row per cell: axes..., value, normalized[, ci_low, ci_high]."""
        import pandas as pd

        idx = torch.cartesian_prod(*[torch.arange(s) for s in self.values.shape])
        idx = idx.reshape(-1, len(self.axes))
        cols = {a: idx[:, i].numpy() for i, a in enumerate(self.axes)}
        cols["value"] = self.values.reshape(-1).float().numpy()
        cols["normalized"] = self.normalized().reshape(-1).float().numpy()
        interval = self.confidence_interval() if ci else None
        if interval is not None:
            cols["ci_low"] = interval[0].reshape(-1).numpy()
            cols["ci_high"] = interval[1].reshape(-1).numpy()
        return pd.DataFrame(cols)

    def top(self, k: int = 10):
        """The ``k`` cells with the largest ``|normalized|`` (DataFrame, strongest first)."""
        df = self.to_frame()
        order = df["normalized"].abs().sort_values(ascending=False).index[:k]
        return df.loc[order].reset_index(drop=True)

    def heatmap(self, title: str | None = None, **kw):
        """plotly Figure of ``normalized()``: ``circuitkit.viz.heatmaps.patch_heatmap``."""
        from circuitkit.viz.heatmaps import patch_heatmap  # patching never imports viz at load

        return patch_heatmap(self, title, **kw)

    # --- persistence ----------------------------------------------------------------------------
    @staticmethod
    def _paths(path: str | Path) -> tuple[Path, Path]:
        p = Path(path)
        base = p.with_suffix("") if p.suffix in (".safetensors", ".json") else p
        return base.with_name(base.name + ".safetensors"), base.with_name(base.name + ".json")

    def save(self, path: str | Path) -> Path:
        """Write ``<path>.safetensors`` (tensors) and ``<path>.json`` (metadata); return the 1st."""
        from safetensors.torch import save_file

        st, js = self._paths(path)
        st.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: getattr(self, k).detach().cpu().contiguous() for k in TENSOR_FIELDS
                   if getattr(self, k) is not None}
        save_file(tensors, str(st))
        info = dict(clean=self.clean, corrupt=self.corrupt, direction=self.direction,
                    method=self.method, site=self.site, positions=self.positions,
                    axes=list(self.axes), meta=self.meta)
        js.write_text(json.dumps(info, indent=2, default=str))
        return st

    @classmethod
    def load(cls, path: str | Path) -> PatchResult:
        from safetensors.torch import load_file

        st, js = cls._paths(path)
        tensors = load_file(str(st))
        info = json.loads(js.read_text())
        info["axes"] = tuple(info["axes"])
        return cls(**{k: tensors.get(k) for k in TENSOR_FIELDS}, **info)

    def __repr__(self) -> str:
        return (f"PatchResult(method={self.method!r}, direction={self.direction!r}, "
                f"site={self.site!r}, positions={self.positions!r}, "
                f"values={tuple(self.values.shape)} over {self.axes}, clean={self.clean:.4f}, "
                f"corrupt={self.corrupt:.4f})")
