"""``CircuitResult`` (``ck.circuit``'s faithfulness curve, CPR/CMD, the candidate set's share of
the gap, the kept set) and ``read_circuit_json``, the strict reader of the ``circuit.json`` it
saves; ``gap_percent`` and ``share_phrase``, the one wording of that share."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.results.files import _number

CIRCUIT_FORMAT = "circuitkit.circuit"
CIRCUIT_VERSION = 3  # 2: node names and normalized scores in items, share of the gap
# 3: ``digest`` (``result_files.result_digest`` of the fields): every derived field (share,
# CPR, CMD, the curve, the kept nodes) bound to the others (issue 49)
DIGEST_SINCE = 3
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
    """A faithfulness curve and the kept set (``patching.faithfulness.circuit``; its
    formulas: ``patching/faithfulness.py``, docs/edges.md).

    ``sizes``: shares of the scored items kept (ascending), ``n_kept``: how many items that is;
    ``faithfulness[k] = (m(C_k) - empty) / (full - empty)``; ``per_prompt``: ``[n_sizes,
    n_prompts]`` metric of each circuit; ``cpr``/``cmd``: MIB's areas; ``share``: the scored
    items' share of the clean-corrupt gap (``full`` is the clean run, ``corrupt`` the corrupt
    run). ``items``: every scored item, ranked, as ``kept()`` and ``circuit.json`` give them
    (edges: ``sender``/``receiver`` node names, ``input``; heads: ``name``, ``layer``, ``head``;
    both: ``score``, the item's normalized effect, and ``effect``, its raw effect). ``chosen``:
    the kept set's index (``target_reached``). ``degenerate``: why f is no share, else None
    (then ``faithfulness`` holds raw effects and ``cpr``/``cmd``/``share`` are None).
    ``intervals``: bootstrap percentile intervals of faithfulness, CPR, CMD and share, or None.
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
            layer, head = hooks.parse_node(name, self.n_layers)
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
        from circuitkit.patching.results.files import result_digest

        data = json.loads(json.dumps(self.to_dict(index), default=str))  # (as read back)
        data["digest"] = result_digest(data, {})
        return files.write_text(path, json.dumps(data, indent=1))

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


class _Fields:
    """The field checks of one circuit file: each failure is one ``ValueError`` naming the file
    and the field."""

    def __init__(self, path: Path):
        self.path = path

    def bad(self, name: str, want: str, got: Any) -> ValueError:
        return ValueError(f"{self.path}: field {name!r} must be {want}; got {got!r:.80}.")

    def number(self, name: str, value: Any, lo: float = -math.inf, hi: float = math.inf,
               none: bool = False) -> None:
        if value is None and none:
            return
        if not _number(value) or not math.isfinite(value) or not lo <= value <= hi:
            raise self.bad(name, f"a finite number in [{lo:g}, {hi:g}]" + (
                " or null" if none else ""), value)

    def integer(self, name: str, value: Any, lo: int, hi: float = math.inf) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.bad(name, f"an integer in [{lo}, {hi:g}]", value)

    def band(self, name: str, value: Any) -> None:
        if value is None:
            return
        if not (isinstance(value, list) and len(value) == 2 and all(
                _number(v) and math.isfinite(v) for v in value) and value[0] <= value[1]):
            raise self.bad(name, "null or a [low, high] pair of finite numbers, low <= high",
                           value)

    def choice(self, name: str, value: Any, allowed: tuple) -> None:
        if not isinstance(value, str) or value not in allowed:
            raise self.bad(name, f"one of {list(allowed)}", value)


def read_circuit_json(path: str | Path) -> dict[str, Any]:
    """``circuit.json`` (``CircuitResult.save_json``) read strictly: every field the readers
    use is checked for type, range and shape, nodes and edges against each other; a bad file
    is one ``ValueError`` naming the file and the field. Returns the parsed dict (an older
    file's ablation name read as today's)."""
    import copy

    from circuitkit import files

    p = Path(path)
    data = files.read_json(p, "circuit file")
    f = _Fields(p)
    as_read = copy.deepcopy(data)  # (the checks read an old ablation name as today's)
    _check_header(data, f)
    _check_scalars(data, f)
    _check_curve(data["curve"], data["n_items"], f)
    _check_edges(data, _check_nodes_of(data, f), f)
    _check_circuit_digest(as_read, p)  # last: the checks above name the field they can
    return data


def _check_circuit_digest(data: dict[str, Any], p: Path) -> None:
    """``data["digest"]``: ``result_digest`` of the other fields (required from version
    ``DIGEST_SINCE``; an older file loads with an ``UncheckedResultWarning``)."""
    import warnings

    from circuitkit.patching.results.files import UncheckedResultWarning, result_digest

    digest = data.get("digest")
    if data.get("version", 1) < DIGEST_SINCE and digest is None:
        warnings.warn(f"{p} was written before circuit files carried a digest (version "
                      f"{data.get('version')}): its derived fields load unchecked against each "
                      "other. Recompute it to bind them.", UncheckedResultWarning, stacklevel=3)
        return
    if not isinstance(digest, str) or result_digest(data, {}) != digest:
        raise ValueError(f"{p}: field 'digest' does not match the file's fields: a field (share, "
                         "CPR, CMD, the curve, nodes or edges) was edited after the circuit was "
                         "saved. Recompute the circuit.")


def _check_header(data: Any, f: _Fields) -> None:
    """A circuit object of a known version with every field the readers need."""
    if not isinstance(data, dict):
        raise ValueError(f"{f.path}: expected a JSON object (a circuit); got "
                         f"{type(data).__name__}.")
    if data.get("format") != CIRCUIT_FORMAT:
        raise f.bad("format", repr(CIRCUIT_FORMAT), data.get("format"))
    f.integer("version", data.get("version"), 1, CIRCUIT_VERSION)
    need = ("kind", "size", "n_kept", "n_items", "faithfulness", "target", "ablation", "rank",
            "cpr", "cmd", "n_layers", "curve", "nodes", "edges")
    missing = [k for k in need if k not in data]
    if missing:
        raise ValueError(f"{f.path}: missing field(s) {missing}.")


def _check_scalars(data: dict[str, Any], f: _Fields) -> None:
    """The circuit's own fields: kind, ablation (an old name read as today's), rank, counts,
    size, target, faithfulness, CPR/CMD/share (null only for a degenerate curve), baselines,
    intervals, ``target_reached``, ``meta``."""
    degenerate = data.get("degenerate")
    if degenerate is not None and not isinstance(degenerate, str):
        raise f.bad("degenerate", "null or a string (why f is no share)", degenerate)
    f.choice("kind", data["kind"], CIRCUIT_KINDS)
    if isinstance(data["ablation"], str) and data["ablation"] in CIRCUIT_OLD_ABLATIONS:
        data["ablation"] = CIRCUIT_OLD_ABLATIONS[data["ablation"]]  # a file of an older version
    f.choice("ablation", data["ablation"], CIRCUIT_ABLATIONS)
    f.choice("rank", data["rank"], CIRCUIT_RANKS)
    f.integer("n_layers", data["n_layers"], 1)
    f.integer("n_items", data["n_items"], 1)
    f.integer("n_kept", data["n_kept"], 0, data["n_items"])
    f.number("size", data["size"], 0, 1)
    f.number("target", data["target"], 0, 1)
    f.number("faithfulness", data["faithfulness"])
    for k in ("cpr", "cmd", "share"):  # null: a degenerate curve (no share to give)
        f.number(k, data.get(k), none=degenerate is not None or k == "share")
    for k in ("full", "empty", "corrupt"):
        f.number(k, data.get(k), none=True)
    for k in ("faithfulness_ci", "cpr_ci", "cmd_ci", "share_ci"):
        f.band(k, data.get(k))
    if not isinstance(data.get("target_reached", True), bool):
        raise f.bad("target_reached", "true or false", data["target_reached"])
    if not isinstance(data.get("meta", {}), dict):
        raise f.bad("meta", "a JSON object", data["meta"])


def _check_curve(curve: Any, n_items: int, f: _Fields) -> None:
    """A non-empty list of {size, n_kept, faithfulness[, ci_low, ci_high]} rows, sizes
    ascending."""
    if not isinstance(curve, list) or not curve:
        raise f.bad("curve", "a non-empty list of {size, n_kept, faithfulness} rows", curve)
    last = 0.0
    for j, row in enumerate(curve):
        where = f"curve[{j}]"
        if not isinstance(row, dict) or not {"size", "n_kept", "faithfulness"} <= set(row):
            raise f.bad(where, "an object with size, n_kept and faithfulness", row)
        f.number(f"{where}.size", row["size"], 0, 1)
        if row["size"] <= last and j:
            raise f.bad(f"{where}.size", "larger than the row before's (sizes ascend)",
                        row["size"])
        last = row["size"]
        f.integer(f"{where}.n_kept", row["n_kept"], 0, n_items)
        f.number(f"{where}.faithfulness", row["faithfulness"])
        for k in ("ci_low", "ci_high"):
            f.number(f"{where}.{k}", row.get(k), none=True)


def _check_nodes_of(data: dict[str, Any], f: _Fields) -> set[str]:
    """Each node's name (``hooks.parse_node``) agrees with its layer and head (heads: a score
    too); returns the names."""
    nodes = data["nodes"]
    if not isinstance(nodes, list):
        raise f.bad("nodes", "a list of {name, layer, head}", nodes)
    names: set[str] = set()
    for j, n in enumerate(nodes):
        if not isinstance(n, dict) or not isinstance(n.get("name"), str):
            raise f.bad(f"nodes[{j}]", "an object with a string name", n)
        try:
            where = hooks.parse_node(n["name"], data["n_layers"])
        except ValueError as e:
            raise ValueError(f"{f.path}: field 'nodes[{j}].name': {e}") from None
        if [n.get("layer"), n.get("head")] != list(where):
            raise f.bad(f"nodes[{j}]", f"layer {where[0]} and head {where[1]} (its name "
                        f"{n['name']})", n)
        if data["kind"] == "heads":
            f.number(f"nodes[{j}].score", n.get("score"))
        names.add(n["name"])
    return names


def _check_edges(data: dict[str, Any], names: set[str], f: _Fields) -> None:
    """``n_kept`` edges (heads: none, and ``n_kept`` nodes), each between two of ``names``,
    into a known input, with a score."""
    edges, nodes = data["edges"], data["nodes"]
    if not isinstance(edges, list):
        raise f.bad("edges", "a list of {sender, receiver, input, score}", edges)
    if data["kind"] == "edges" and len(edges) != data["n_kept"] or data["kind"] == "heads" \
            and (edges or len(nodes) != data["n_kept"]):
        raise f.bad("n_kept", f"the number of kept {data['kind']}", data["n_kept"])
    for j, e in enumerate(edges):
        if not isinstance(e, dict):
            raise f.bad(f"edges[{j}]", "an object", e)
        for k in ("sender", "receiver"):
            if not isinstance(e.get(k), str) or e[k] not in names:
                raise f.bad(f"edges[{j}].{k}", "the name of one of 'nodes'", e.get(k))
        f.choice(f"edges[{j}].input", e.get("input"), CIRCUIT_INPUTS)
        f.number(f"edges[{j}].score", e.get("score"))
        f.number(f"edges[{j}].effect", e.get("effect"), none=True)
