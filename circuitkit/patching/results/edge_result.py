"""``EdgeResult``: the ``PatchResult`` of an edge sweep (``patch_edges``), with its node labels,
views and strict load (``patching/results/files.py``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.results.files import (
    _EDGE_FILE,
    EDGE_FORMAT,
    EDGE_FORMAT_VERSION,
    _check_nodes,
    _checked_edge_info,
    _no_edge,
    load_result,
    result_paths,
    save_result,
)
from circuitkit.patching.results.patch_result import PatchResult


@dataclass(repr=False)
class EdgeResult(PatchResult):
    """A ``PatchResult`` over edges (``patch_edges``): ``axes`` ("sender", "receiver", "input"),
    each axis labelled by ``senders``, ``receivers``, ``inputs``.

    ``values[s, r, i]``: mean over prompts of the metric after sender ``senders[s]``'s write
    reaches receiver ``receivers[r]`` at input ``inputs[i]`` only; ``per_prompt``:
    ``[n_prompts, n_senders, n_receivers, n_inputs]``. Nodes are ``(layer, head)``, the
    embeddings ``(-1, -1)`` and the logits ``(n_layers, -1)`` (one input, index 0, shown as
    "resid"); NaN where ``(s, r, i)`` is no edge (docs/edges.md, "The tensor"). Normalisation,
    intervals, the degenerate rule and ``select_prompts`` are ``PatchResult``'s; the views, the
    file and its strict load are the edges' own.
    """

    site: str = "z"  # (a sender's write: its z through W_O)
    positions: str = "all"
    senders: tuple[tuple[int, int], ...] = field(kw_only=True)
    receivers: tuple[tuple[int, int], ...] = field(kw_only=True)
    inputs: tuple[str, ...] = field(kw_only=True)
    n_layers: int = field(kw_only=True)

    def __post_init__(self) -> None:
        self.senders = tuple((int(a), int(b)) for a, b in self.senders)
        self.receivers = tuple((int(a), int(b)) for a, b in self.receivers)
        self.inputs = tuple(self.inputs)
        self.n_layers = int(self.n_layers)
        canonical = tuple(i for i in hooks.EDGE_INPUTS if i in self.inputs)
        if not self.inputs or self.inputs != canonical:
            raise ValueError(f"inputs={list(self.inputs)} must be distinct names from "
                             f"{list(hooks.EDGE_INPUTS)}, in that order (as patch_edges gives "
                             "them).")
        shape = (len(self.senders), len(self.receivers), len(self.inputs))
        if not isinstance(self.values, Tensor) or tuple(self.values.shape) != shape:
            raise ValueError(f"values must be a [senders, receivers, inputs] = {list(shape)} "
                             f"tensor; got shape {tuple(getattr(self.values, 'shape', ()))}.")
        facts = (self.meta or {}).get("facts")
        n_heads = facts.get("n_heads") if isinstance(facts, dict) else None
        _check_nodes(self.senders, self.receivers, self.n_layers,
                     n_heads if isinstance(n_heads, int) else None)
        pp = self.per_prompt
        if pp is not None and (not isinstance(pp, Tensor) or tuple(pp.shape[1:]) != shape):
            raise ValueError(f"per_prompt must be a [n_prompts, {', '.join(map(str, shape))}] "
                             f"tensor; got shape {tuple(getattr(pp, 'shape', ()))}.")
        self.axes = ("sender", "receiver", "input")
        super().__post_init__()  # direction, method, baselines, per-prompt shapes

    @property
    def labels(self) -> dict[str, list[str]]:
        """Each axis's labels: node names ("embed", "L0H1", "logits") and input names."""
        return dict(sender=self.sender_names(), receiver=self.receiver_names(),
                    input=list(self.inputs))

    def sender_names(self) -> list[str]:
        return [hooks.node_name(s, self.n_layers) for s in self.senders]

    def receiver_names(self) -> list[str]:
        return [hooks.node_name(r, self.n_layers) for r in self.receivers]

    def edge_mask(self) -> Tensor:
        """Bool ``[senders, receivers, inputs]``: True where the cell is an edge."""
        return ~torch.isnan(self.values)

    def to_frame(self, ci: bool = True):
        """pandas DataFrame, one row per edge: sender_layer, sender_head, receiver_layer,
        receiver_head, input, value, normalized (raw_effect for a degenerate result)[, ci_low,
        ci_high][, verified], sender,
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
                    value=self.values[s, r, i].float().numpy(),
                    **{self.value_column: norm.float().numpy()})  # (raw_effect: degenerate)
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
        from circuitkit.patching.results.patch_result import check_top

        check_top(k)
        df = self.to_frame()
        if input is not None:
            df = df[df["input"] == input]
        key = df[self.value_column]  # (a degenerate result's: its raw effect)
        order = key.abs().sort_values(ascending=False, na_position="last").index[:k]
        return df.loc[order].reset_index(drop=True)

    def heatmap(self, title: str | None = None, **kw):
        """plotly Figure: sender x receiver heatmap of ``normalized()``, one panel per input
        (``circuitkit.viz.heatmaps.edge_heatmap``)."""
        from circuitkit.viz.heatmaps import edge_heatmap  # patching never imports viz at load

        return edge_heatmap(self, title, **kw)

    # --- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path, *, views: bool = True) -> list[Path]:
        """As ``PatchResult.save`` (``result_files.save_result``); ``path`` may be a folder
        (then ``<folder>/edges.*``)."""
        info = dict(format=EDGE_FORMAT, version=EDGE_FORMAT_VERSION, clean=self.clean,
                    corrupt=self.corrupt, direction=self.direction, method=self.method,
                    senders=[list(s) for s in self.senders],
                    receivers=[list(r) for r in self.receivers], inputs=list(self.inputs),
                    n_layers=self.n_layers, meta=self.meta)
        return save_result(self, result_paths(path, "edges"), info, views)

    @classmethod
    def load(cls, path: str | Path) -> EdgeResult:
        """Read what ``save`` wrote (the folder, the base path or any of its files), strictly:
        ``PatchResult.load``'s checks and the edges' own (``_checked_edge_info``, ``_no_edge``:
        NaN exactly where there is no edge; docs/durability.md). A bad file is a
        ``ValueError`` naming the file and the field."""
        paths = result_paths(path, "edges")

        def layout(kw: dict[str, Any], tensors: dict[str, Any]) -> tuple:
            shape = (len(kw["senders"]), len(kw["receivers"]), len(kw["inputs"]))
            return shape, _no_edge(kw, tensors, shape)

        return load_result(cls, path, paths, _EDGE_FILE, _checked_edge_info, layout)

    def __repr__(self) -> str:
        return (f"EdgeResult(method={self.method!r}, direction={self.direction!r}, "
                f"{len(self.senders)} senders x {len(self.receivers)} receivers x "
                f"inputs {list(self.inputs)}, {int(self.edge_mask().sum())} edges, "
                f"clean={self.clean:.4f}, corrupt={self.corrupt:.4f})")

