"""What a saved patch or edge result holds, and the one strict load both go through.

A result is two files: ``<name>.json`` (baselines, labels, ``meta``: plain JSON, ``json_ready``)
and ``<name>.safetensors`` (``TENSOR_FIELDS``), written by ``save_result``. ``PatchResult.load``
and ``EdgeResult.load`` read both with ``load_result``: the shared checks (``_checked_info``,
``_check_tensors``) and each kind's own; every refusal is one ``ValueError`` line naming the file
and the field (docs/durability.md, "Strict loading").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuitkit import files, hooks
from circuitkit.patching.results.pages import write_page

TENSOR_FIELDS = ("values", "per_prompt", "clean_per_prompt", "corrupt_per_prompt")
FORMAT = "circuitkit.patch_result"
# version 2: the file carries ``digest`` (``result_digest``), which binds every label and derived
# field of its JSON to the tensors' bytes; version 1 files (written before) load with a warning
FORMAT_VERSION = 2
EDGE_FORMAT = "circuitkit.edge_result"
EDGE_FORMAT_VERSION = 2
DIGEST_SINCE = 2
POSITIONS = ("all", "each", "groups")
SITES = hooks.PATCH_HEAD_SITES + hooks.PATCH_LAYER_SITES
AXES = ("layer", "head", "pos", "group", "sender", "receiver", "set")  # sender, receiver:
# patch_paths; set: head sets (ck.HeadSetUnits)
# values recomputed from per_prompt (float64 mean) agree with the stored float32 means to
# ~1e-7 x scale (measured); this bound refuses an edited file, never a float32 rounding
MEAN_RTOL = 1e-4


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def json_ready(obj: Any) -> Any:
    """``obj`` as plain JSON data: tensors and numpy values as numbers or nested lists (a 0-d
    tensor as its number: ``float(clean)``, never ``"tensor(-0.0440)"``), tuples as lists,
    mapping keys as strings; anything else JSON cannot hold as ``str(obj)``. Every result file
    goes through it (``save``), so what ``load`` reads back is what was meant."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, Tensor):
        return obj.detach().cpu().tolist()
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy arrays and scalars
        return json_ready(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def result_paths(path: str | Path, name: str) -> dict[str, Path]:
    """The files of a result at ``path``: a folder holding ``<name>.*``, or a base path with or
    without a suffix."""
    p = Path(path)
    if p.is_dir():
        p = p / name
    elif p.suffix in (".safetensors", ".json", ".csv", ".html"):
        p = p.with_suffix("")
    return {ext: p.with_name(p.name + "." + ext) for ext in ("safetensors", "json", "csv", "html")}


def result_digest(info: dict[str, Any], tensors: dict[str, Tensor]) -> str:
    """SHA-256 (hex) of a result as written: its JSON fields but ``digest`` (canonical JSON:
    sorted keys, no spaces; ``json_ready`` data, which reads back as the same text) and each
    tensor's name, dtype, shape and bytes, in name order. One binding of every label and
    derived field (group names and their masks' hash, senders, receivers, a path result's
    coverage and node effects, ``meta`` whole) to the values and per-prompt values: an edit of
    either side, or a consistent one of both (values x 10 with their per-prompt values), no
    longer matches. Guards against edits and damage, not forgery (anyone can recompute it)."""
    import hashlib

    h = hashlib.sha256()
    body = {k: v for k, v in info.items() if k != "digest"}
    h.update(json.dumps(json_ready(body), sort_keys=True, separators=(",", ":"),
                        allow_nan=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"\n{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_result(result: Any, paths: dict[str, Path], info: dict[str, Any], views: bool
                ) -> list[Path]:
    """What every result's ``save`` writes, each file atomically: ``TENSOR_FIELDS`` (the ones
    set) to ``.safetensors``, ``info`` (``json_ready``, with its ``digest``: ``result_digest``)
    to ``.json`` and, with ``views``, ``to_frame()`` to ``.csv`` (``with_estimate_column``)
    and ``heatmap()`` to ``.html`` (``write_page``: the folder's one ``plotly.min.js``).
    Returns the paths written."""
    _make_folder(paths["json"].parent)
    tensors = {k: getattr(result, k) for k in TENSOR_FIELDS if getattr(result, k) is not None}
    info = json_ready(info)
    info["digest"] = result_digest(info, tensors)
    files.write_tensors(paths["safetensors"], tensors)
    files.write_text(paths["json"], json.dumps(info, indent=2))
    if not views:
        return [paths["safetensors"], paths["json"]]
    from circuitkit.escape import csv_frame  # (names from files: no spreadsheet formulas)

    frame = csv_frame(with_estimate_column(result, result.to_frame()))
    files.atomic_write(paths["csv"], lambda p: frame.to_csv(p, index=False))
    write_page(result.heatmap(), paths["html"])  # + the folder's one plotly.min.js
    return list(paths.values())


ESTIMATED = ("attribution", "attribution+exact")  # methods whose values are (partly) estimates


def with_estimate_column(result: Any, frame: Any) -> Any:
    """``frame`` (``result.to_frame()``) with an ``estimate`` column where ``result`` holds
    estimates (True: a gradient estimate, not a patched value; ``attribution+exact``: the
    cells it did not verify), so the ``.csv`` ``save`` writes says it once, whole (the CLI
    used to read it back and rewrite it); unchanged for other methods."""
    if getattr(result, "method", None) in ESTIMATED:
        frame["estimate"] = ~frame["verified"].astype(bool) if "verified" in frame else True
    return frame


def _make_folder(folder: Path) -> None:
    """``folder`` made if needed; a file where a folder must be (``save('<a file>/r')``) or a
    folder that cannot be made is one line (``files.WriteError``) naming it, not a raw
    ``FileExistsError``."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise files.WriteError(0, f"cannot save into {folder}: {blocker} is a file, not a "
                               "folder; give a path inside a folder (or a new folder's name).")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise files.WriteError(e.errno, f"cannot make the folder {folder} ({e.strerror}); "
                               "give a path in a folder you can write to.") from None


@dataclass(frozen=True)
class _FileKind:
    """What one kind of result file holds: its ``format`` and newest ``version``, the JSON
    ``fields`` its constructor needs, the words its errors use, and whether old files may lack
    the ``format`` field (patch results written before it existed)."""

    format: str
    version: int
    fields: tuple[str, ...]
    noun: str  # "patching result"
    file_noun: str  # "result" (as in "not a readable result file")
    cls: str
    format_optional: bool = False


_PATCH_FILE = _FileKind(FORMAT, FORMAT_VERSION, ("clean", "corrupt", "direction", "method", "site",
                                                 "positions", "axes"),
                        "patching result", "result", "PatchResult", format_optional=True)


def load_result(cls: type, path: str | Path, paths: dict[str, Path], kind: _FileKind,
                checked: Any, layout: Any) -> Any:
    """The one strict load of every result kind: the shared fields (``_checked_info``), the
    kind's own (``checked(kw, js)``), then the tensors against ``layout(kw, tensors)`` =
    ``(shape, empty cells)`` (``_check_tensors``); a bad file is a ``ValueError`` naming it and
    the field."""
    from safetensors.torch import load_file

    js, st = paths["json"], paths["safetensors"]
    for p in (js, st):
        if not p.exists():
            raise ValueError(f"no {kind.noun} at {path}: {p} does not exist (expected the files "
                             f"{kind.cls}.save writes).")
    info = files.read_json(js, f"{kind.file_noun} file")
    kw = _checked_info(info, js, kind)
    try:
        tensors = load_file(str(st))
    except Exception as e:  # noqa: BLE001 - a corrupt file of any kind
        raise ValueError(f"{st} is not a readable safetensors file ({e}).") from None
    kw = checked(kw, js)
    try:
        shape, empty = layout(kw, tensors)
    except ValueError as e:  # (the layout names the field; the file is named here)
        raise ValueError(f"{js}: {e}") from None
    _check_tensors(tensors, kw, st, js, shape=shape, empty=empty)
    try:
        result = cls(**{k: tensors.get(k) for k in TENSOR_FIELDS}, **kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{js}: {e}") from None
    _check_digest(info, tensors, js, st, kind)  # last: the checks above name what is wrong
    return result


class UncheckedResultWarning(UserWarning):
    """A result file written before results carried a digest (format version 1): its labels
    cannot be checked against its values."""


def _check_digest(info: dict[str, Any], tensors: dict[str, Tensor], js: Path, st: Path,
                  kind: _FileKind) -> None:
    """``info["digest"]`` is ``result_digest`` of what was read (required from format version
    ``DIGEST_SINCE``; an older file loads with an ``UncheckedResultWarning``)."""
    import warnings

    digest = info.get("digest")
    if info.get("version", 1) < DIGEST_SINCE and digest is None:
        warnings.warn(f"{js} was written before result files carried a digest (format version "
                      f"{info.get('version', 1)}): its labels and values load unchecked against "
                      "each other. Save it again (or recompute it) to bind them.",
                      UncheckedResultWarning, stacklevel=4)
        return
    if not isinstance(digest, str) or len(digest) != 64:
        raise ValueError(f"{js}: field 'digest' (the SHA-256 that binds this {kind.noun}'s "
                         f"labels to its values) is missing or malformed; got {digest!r:.40}. "
                         "The file was edited: recompute the result.")
    if result_digest(info, tensors) != digest:
        raise ValueError(f"{js} and {st} do not match their 'digest': a label, a derived field "
                         "or a value was edited after the result was saved (e.g. group names, "
                         "senders, receivers, coverage, or values and per-prompt values scaled "
                         "together). Recompute the result.")


def _checked_info(info: Any, js: Path, kind: _FileKind = _PATCH_FILE) -> dict[str, Any]:
    """The fields every result's JSON shares, each checked for type and range: ``format``,
    ``version``, ``kind.fields`` present, ``clean``/``corrupt`` finite numbers, ``direction``/
    ``method`` strings (their values: the constructor), ``meta`` an object whose ``facts`` (the
    model's shape, when recorded) are positive integers. A bad one is a ``ValueError`` naming
    ``js`` and the field. Returns those fields, raw (each kind checks its own others)."""
    fmt = info.get("format", kind.format if kind.format_optional else None) \
        if isinstance(info, dict) else None
    if fmt != kind.format:
        raise ValueError(f"{js} is not a circuitkit {kind.noun} (format {fmt!r}; expected "
                         f"{kind.format!r}).")
    version = info.get("version", 1)
    if not _integer(version) or version < 1:
        raise ValueError(f"{js}: field 'version' must be a positive integer; got {version!r}.")
    if version > kind.version:
        raise ValueError(f"{js}: format version {version} is newer than this circuitkit reads "
                         f"({kind.version}); upgrade circuitkit.")
    missing = [k for k in kind.fields if k not in info]
    if missing:
        raise ValueError(f"{js}: missing field(s) {missing}.")
    for k in ("clean", "corrupt"):
        if not _number(info[k]) or not math.isfinite(info[k]):
            raise ValueError(f"{js}: field {k!r} must be a finite number; got {info[k]!r:.60}.")
    for k in ("direction", "method", "site", "positions"):
        if k in kind.fields and not isinstance(info[k], str):
            raise ValueError(f"{js}: field {k!r} must be a string; got {info[k]!r:.60}.")
    meta = info.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{js}: field 'meta' must be a JSON object; got {type(meta).__name__} "
                         f"{meta!r:.60}.")
    facts = meta.get("facts")
    if facts is not None:
        bad = [k for k in ("n_layers", "n_heads", "n_kv_heads") if k in facts and not (
            _integer(facts[k]) and facts[k] >= 1)] if isinstance(facts, dict) else ["facts"]
        if bad or isinstance(facts, dict) and facts.get("n_kv_heads", 1) > facts.get(
                "n_heads", math.inf):
            raise ValueError(f"{js}: field 'meta.facts' (the model's shape) must hold positive "
                             f"integers n_layers, n_heads and n_kv_heads <= n_heads; got "
                             f"{facts!r:.80}.")
    out = {k: info[k] for k in kind.fields}
    out.update(clean=float(info["clean"]), corrupt=float(info["corrupt"]), meta=meta)
    return out


def _checked_patch_info(kw: dict[str, Any], js: Path) -> dict[str, Any]:
    """``PatchResult``'s own JSON fields: ``axes``, distinct names from ``AXES``, the ones its
    site and positions give (``_default_axes``)."""
    axes = kw["axes"]
    if not isinstance(axes, list) or not all(isinstance(a, str) and a in AXES for a in axes) \
            or len(set(axes)) != len(axes):
        raise ValueError(f"{js}: field 'axes' must be a list of distinct names from {list(AXES)}; "
                         f"got {axes!r:.60}.")
    kind = kw["meta"].get("kind")
    paths = kind == "paths"  # ``patch_paths``: [sender, receiver(, group)]
    want = (("sender", "receiver") + (("group",) if "path_groups" in kw["meta"] else ())
            if paths else ("set",) if kind == "head_sets"
            else _default_axes(kw["site"], kw["positions"], len(axes)))
    if (paths or kind == "head_sets" or kw["site"] in SITES and kw["positions"] in POSITIONS) \
            and tuple(axes) != want:
        raise ValueError(f"{js}: field 'axes' is {axes} but a site={kw['site']!r}, "
                         f"positions={kw['positions']!r} result has axes {list(want)}; the file "
                         "was edited. Recompute the result.")
    if kw["positions"] == "groups":
        _check_group_meta(kw["meta"], js)
    if kind == "head_sets":
        kw = dict(kw, meta=_checked_set_meta(kw["meta"], js))
    return dict(kw, axes=tuple(axes))


def _checked_set_meta(meta: dict[str, Any], js: Path) -> dict[str, Any]:
    """A head-set result's own meta fields (``ck.HeadSetUnits``): ``sets`` (lists of distinct,
    sorted ``[layer, head]`` integer pairs inside the model of ``meta.facts``), ``set_source``
    (a string) and ``extra_per_prompt`` (``{name: [n_prompts][n_sets]}`` finite numbers, one row
    per prompt, one column per set); returns ``meta`` with those values as float32 tensors. Their
    count against the values: ``_patch_shape``."""
    sets, facts = meta.get("sets"), meta.get("facts") or {}
    top = (facts.get("n_layers", math.inf), facts.get("n_heads", math.inf))
    if not isinstance(sets, list) or not sets or not all(
            isinstance(s, list) and all(isinstance(h, list) and len(h) == 2 and all(
                _integer(x) and 0 <= x < t for x, t in zip(h, top, strict=True)) for h in s)
            and s == sorted(s) and len({tuple(h) for h in s}) == len(s) for s in sets):
        raise ValueError(f"{js}: field 'meta.sets' must be a non-empty list of head sets, each "
                         f"a sorted list of distinct [layer, head] pairs inside the model; got "
                         f"{sets!r:.60}.")
    if not isinstance(meta.get("set_source"), str) or not _integer(meta.get("set_seed")):
        raise ValueError(f"{js}: fields 'meta.set_source' and 'meta.set_seed' must be a string "
                         f"(what the sets' heads got) and an integer; got "
                         f"{meta.get('set_source')!r:.40}, {meta.get('set_seed')!r:.20}.")
    extra = meta.get("extra_per_prompt", {})
    out = {}
    for name, rows in extra.items() if isinstance(extra, dict) else [("", None)]:
        try:
            t = torch.tensor(rows, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            t = None
        if t is None or t.ndim != 2 or t.shape[1] != len(sets) or not bool(
                torch.isfinite(t).all()):
            raise ValueError(f"{js}: field 'meta.extra_per_prompt' must map each metric's name "
                             f"to finite numbers [n_prompts][n_sets={len(sets)}]; {name!r} is "
                             f"not.")
        out[name] = t
    return dict(meta, extra_per_prompt=out)


def _check_group_meta(meta: dict[str, Any], js: Path) -> None:
    """A position-group result's own meta fields: ``group_names`` (distinct non-empty strings),
    ``groups_hash`` (16 hex digits of the masks) and ``group_sizes`` (a non-negative number
    per group); their count against the values' group axis: ``PatchResult`` itself."""
    names = meta.get("group_names")
    if not isinstance(names, list) or not names or not all(
            isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{js}: field 'meta.group_names' must be a list of distinct non-empty "
                         f"strings (one per position group); got {names!r:.60}.")
    h = meta.get("groups_hash")
    if not isinstance(h, str) or len(h) != 16 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"{js}: field 'meta.groups_hash' must be the 16 hex digits of the "
                         f"position groups' masks; got {h!r:.60}.")
    sizes = meta.get("group_sizes")
    if not isinstance(sizes, list) or not all(
            _number(x) and math.isfinite(x) and x >= 0 for x in sizes):
        raise ValueError(f"{js}: field 'meta.group_sizes' must be a list of numbers >= 0 (mean "
                         f"positions per prompt of each group); got {sizes!r:.60}.")


def _patch_shape(kw: dict[str, Any]) -> tuple[int | None, ...] | None:
    """The shape a ``PatchResult``'s values must have by its fields and the model's shape
    (``meta["facts"]``, when recorded): ``[n_layers, heads at the site(, pos)]`` or
    ``[n_layers, pos]``; None entries: any size. None without facts."""
    meta = kw["meta"]
    if meta.get("kind") == "paths":
        return (len(meta.get("senders") or []), len(meta.get("receivers") or []),
                *([None] * (len(kw["axes"]) - 2)))
    if meta.get("kind") == "head_sets":
        return (len(meta["sets"]),)
    facts = meta.get("facts")
    if not isinstance(facts, dict) or "n_layers" not in facts:
        return None
    if kw["site"] in hooks.PATCH_LAYER_SITES:
        return (facts["n_layers"], None)
    heads = facts.get("n_kv_heads" if kw["site"] in hooks.KV_SITES else "n_heads")
    return (facts["n_layers"], heads, *([None] * (len(kw["axes"]) - 2)))


def _patch_layout(kw: dict[str, Any], tensors: dict[str, Tensor]
                  ) -> tuple[tuple[int | None, ...] | None, Tensor | None]:
    """``PatchResult.load``'s ``layout``: (``_patch_shape``, ``_no_path``); a head-set result's
    ``meta.extra_per_prompt`` holds as many prompts as its ``per_prompt`` (and one another)."""
    extra = kw["meta"].get("extra_per_prompt") or {}
    pp = tensors.get("per_prompt")
    rows = {int(t.shape[0]) for t in extra.values()} | (
        {int(pp.shape[0])} if pp is not None and pp.ndim else set())
    if len(rows) > 1:
        raise ValueError(f"field 'meta.extra_per_prompt' and tensor 'per_prompt' hold different "
                         f"numbers of prompts ({sorted(rows)}); the file was edited. Recompute "
                         "the result.")
    return _patch_shape(kw), _no_path(kw)


def _default_axes(site: str, positions: str, ndim: int) -> tuple[str, ...]:
    """The axes of a result's values: ``(layer, pos)`` for layer sites, else ``(layer, head)``
    or ``(layer, head, pos)`` (per position: ``positions == "each"``, or 3-D values)."""
    if site in hooks.PATCH_LAYER_SITES:
        return ("layer", "pos")
    if positions == "groups":
        return ("layer", "head", "group")
    return ("layer", "head", "pos") if positions == "each" or ndim == 3 else ("layer", "head")


def _check_tensors(tensors: dict[str, Tensor], kw: dict[str, Any], st: Path, js: Path,
                   shape: tuple[int, ...] | None = None, empty: Tensor | None = None) -> None:
    """A result's tensors (``TENSOR_FIELDS`` only): ``values`` present (of ``shape``, when
    given; None entries: any size); ``per_prompt`` ``[n, *values.shape]`` and the per-prompt
    baselines ``[n]``, all three or none; every tensor floating, of one dtype; every cell
    finite, except the ``empty`` cells (a bool mask like ``values``: no edge there), which must
    be NaN in ``values`` and in each prompt's ``per_prompt``; ``values``, ``clean`` and
    ``corrupt`` the means of their per-prompt tensors (``_check_means``); the verified
    mask (``_check_verified``). A ``ValueError`` names the file and the field."""
    unknown = sorted(set(tensors) - set(TENSOR_FIELDS))
    if "values" not in tensors or unknown:
        raise ValueError(f"{st}: expected tensors {list(TENSOR_FIELDS)} (with 'values'); got "
                         f"{sorted(tensors)}.")
    for k in TENSOR_FIELDS:
        t = tensors.get(k)
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{st}: tensor {k!r} must be floating point; got {t.dtype}.")
    dtypes = {k: t.dtype for k, t in tensors.items()}
    if len(set(dtypes.values())) > 1:  # one computation wrote them all: one dtype
        raise ValueError(f"{st}: tensors of mixed dtypes {dtypes} (a result's tensors share "
                         "one); the file was edited. Recompute the result.")
    values = tensors["values"]
    if shape is not None and (values.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(values.shape, shape,
                                                                   strict=True))):
        given = ", ".join("any" if d is None else str(d) for d in shape)
        raise ValueError(f"{st}: tensor 'values' has shape {list(values.shape)}; the fields of "
                         f"{js.name} (and the model's shape in its meta.facts) give [{given}].")
    pp = tensors.get("per_prompt")
    if pp is not None and (pp.ndim < 1 or tuple(pp.shape[1:]) != tuple(values.shape)):
        raise ValueError(f"{st}: per_prompt has shape {list(pp.shape)}; expected "
                         f"[n_prompts, {', '.join(map(str, values.shape))}].")
    pair = [k for k in ("clean_per_prompt", "corrupt_per_prompt") if k in tensors]
    if len(pair) == 1:
        raise ValueError(f"{st}: {pair[0]!r} without its pair; the file is damaged.")
    if bool(pair) != (pp is not None):  # a metric with per-prompt values gives all three
        have, lack = (pair[0], "per_prompt") if pair else ("per_prompt", "clean_per_prompt")
        raise ValueError(f"{st}: tensor {have!r} without {lack!r} (a result has all three "
                         "per-prompt tensors or none); the file is damaged.")
    n = None if pp is None else pp.shape[0]
    for k in pair:
        t = tensors[k]
        if t.ndim != 1 or t.numel() == 0 or (n is not None and t.shape[0] != n):
            raise ValueError(f"{st}: tensor {k!r} has shape {list(t.shape)}; expected "
                             f"[{'n_prompts' if n is None else n}] (one value per prompt).")
    hole = torch.zeros(values.shape, dtype=torch.bool) if empty is None else empty
    for k in TENSOR_FIELDS:
        t = tensors.get(k)
        if t is None:
            continue
        cell = hole if k == "values" else hole.expand_as(t) if k == "per_prompt" else \
            torch.zeros(t.shape, dtype=torch.bool)
        filled = int((cell & ~torch.isnan(t)).sum())
        if filled:
            raise ValueError(f"{st}: tensor {k!r} holds {filled} value(s) where there is no "
                             "edge (those slots are NaN: the receiver's layer is not after the "
                             "sender's, the logits' other inputs, a k/v input of a head that is "
                             "no KV head); the file was edited. Recompute the result.")
        bad = int((~cell & ~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{st}: tensor {k!r} holds {bad} non-finite value(s) (NaN/inf) of "
                             f"{t.numel()}; the file is damaged or the sweep's metric was not "
                             "finite. Recompute it.")
    scale = _check_means(tensors, kw, hole, st, js)
    _check_verified(kw["meta"], kw["method"], values, js, MEAN_RTOL * scale)


def _check_means(tensors: dict[str, Tensor], kw: dict[str, Any], hole: Tensor, st: Path,
                 js: Path) -> float:
    """``values`` (outside the ``hole`` cells), ``clean`` and ``corrupt`` the means over prompts
    of their per-prompt tensors, within ``MEAN_RTOL`` x scale (the largest magnitude stored, at
    least 1); returns the scale."""
    values, pp = tensors["values"], tensors.get("per_prompt")
    checks = []
    if pp is not None:
        keep = ~hole
        checks.append(("values", values.double()[keep], pp.double().mean(0)[keep]))
    for k, name in (("clean", "clean_per_prompt"), ("corrupt", "corrupt_per_prompt")):
        if name in tensors:
            checks.append((k, torch.tensor(kw[k], dtype=torch.float64),
                           tensors[name].double().mean()))
    scale = max([1.0, abs(kw["clean"]), abs(kw["corrupt"])]
                + [float(t.nan_to_num(0.0).abs().max()) for t in tensors.values() if t.numel()])
    for k, stored, mean in checks:
        diff = float((stored - mean).abs().max()) if stored.numel() else 0.0
        if diff > MEAN_RTOL * scale:
            where = st if k == "values" else f"{js} field {k!r} and {st}"
            raise ValueError(f"{where}: {k!r} is not the mean over prompts of its per-prompt "
                             f"values (differs by {diff:.3g}; scale {scale:.3g}): one of them "
                             "was changed. Recompute the result.")
    return scale


def _check_verified(meta: dict[str, Any], method: Any, values: Tensor, js: Path, tol: float
                    ) -> None:
    """``meta["verified"]`` (attribution+exact: which values are exact; required there): a nested
    list of booleans shaped like ``values``; with the screen's estimates
    (``meta["attribution_values"]``, values-shaped, null for NaN) every value not marked
    verified is its estimate (within ``tol``), so a mask moved onto other cells is refused."""
    mask = meta.get("verified")
    if mask is None:
        if method == "attribution+exact":
            raise ValueError(f"{js}: field 'meta.verified' is missing: an attribution+exact "
                             "result says which of its values are exact; the file was edited. "
                             "Recompute the result.")
        return
    shape = values.shape
    try:
        ok = _flatten_bools(mask, len(shape)) and torch.tensor(mask).shape == shape
    except (TypeError, ValueError, RuntimeError):
        ok = False
    if not ok:
        raise ValueError(f"{js}: field 'meta.verified' must be a nested list of true/false "
                         f"shaped like values {list(shape)} (which values are exact); the file "
                         "was edited. Recompute the result.")
    est = meta.get("attribution_values")
    if est is None:
        return
    try:
        est = torch.tensor(_nulls_as_nan(est), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        est = None
    if est is None or est.shape != shape:
        raise ValueError(f"{js}: field 'meta.attribution_values' must be numbers (null for no "
                         f"cell) shaped like values {list(shape)}; the file was edited. "
                         "Recompute the result.")
    off = ~torch.tensor(mask, dtype=torch.bool)
    v = values.double()
    differ = off & ~(torch.isnan(v) & torch.isnan(est)) & ~((v - est).abs() <= tol)
    if bool(differ.any()):
        raise ValueError(f"{js}: field 'meta.verified' marks {int(differ.sum())} value(s) as "
                         "estimates that are not the screen's estimates (meta.attribution_values)"
                         "; the mask or the values were edited. Recompute the result.")


def _nulls_as_nan(x: Any) -> Any:
    if x is None:
        return math.nan
    if isinstance(x, bool) or isinstance(x, str):
        raise TypeError("not a number")
    return [_nulls_as_nan(v) for v in x] if isinstance(x, list) else x


def _flatten_bools(x: Any, depth: int) -> bool:
    """Whether ``x`` is nested lists ``depth`` deep holding booleans only."""
    if depth == 0:
        return isinstance(x, bool)
    return isinstance(x, list) and all(_flatten_bools(v, depth - 1) for v in x)


_EDGE_FILE = _FileKind(EDGE_FORMAT, EDGE_FORMAT_VERSION, ("clean", "corrupt", "direction",
                                                          "method", "senders", "receivers",
                                                          "inputs", "n_layers"),
                       "edge result", "edge result", "EdgeResult")


def _check_nodes(senders: Sequence[tuple[int, int]], receivers: Sequence[tuple[int, int]],
                 n_layers: int, n_heads: int | None) -> None:
    """Senders ``(layer, head)`` or the embeddings ``(-1, -1)``, receivers ``(layer, head)`` or
    the logits ``(n_layers, -1)``, inside a model of ``n_layers`` layers (and ``n_heads``
    heads, when known); each list distinct and sorted, as ``patch_edges`` gives them (a swap
    of two nodes would otherwise move values onto other edges). ``ValueError`` naming the
    field."""
    top = math.inf if n_heads is None else n_heads
    heads = "" if n_heads is None else f" x {n_heads}-head"
    for role, nodes, special, what in (("senders", senders, hooks.EMBED_NODE, "embeddings"),
                                       ("receivers", receivers, hooks.logits_node(n_layers),
                                        "logits")):
        for a, b in nodes:
            if not ((a, b) == special or 0 <= a < n_layers and 0 <= b < top):
                raise ValueError(f"{role}: ({a}, {b}) is not a node of a {n_layers}-layer{heads} "
                                 f"model ((layer, head), or {special} for the {what}).")
        if list(nodes) != sorted(set(nodes)):
            raise ValueError(f"{role} must be distinct and sorted (as patch_edges gives them); "
                             f"got {[list(n) for n in nodes][:8]}.")


def _checked_edge_info(kw: dict[str, Any], js: Path) -> dict[str, Any]:
    """``EdgeResult``'s own JSON fields, each checked for type and range (``ValueError`` naming
    ``js`` and the field): ``n_layers`` a positive integer (the model's, when ``meta.facts``
    records it), ``inputs`` distinct names in ``hooks.EDGE_INPUTS`` order, ``senders`` and
    ``receivers`` lists of ``[layer, head]`` integer pairs (``_check_nodes``)."""
    n_layers = kw["n_layers"]
    facts = kw["meta"].get("facts") or {}
    if not _integer(n_layers) or n_layers < 1 or n_layers != facts.get("n_layers", n_layers):
        raise ValueError(f"{js}: field 'n_layers' must be a positive integer (the model's "
                         f"layers{', ' + str(facts['n_layers']) if 'n_layers' in facts else ''});"
                         f" got {n_layers!r:.40}.")
    inputs = kw["inputs"]
    canonical = [i for i in hooks.EDGE_INPUTS if isinstance(inputs, list) and i in inputs]
    if not isinstance(inputs, list) or not inputs or inputs != canonical:
        raise ValueError(f"{js}: field 'inputs' must be a non-empty list of distinct names from "
                         f"{list(hooks.EDGE_INPUTS)}, in that order; got {inputs!r:.60}.")
    nodes = {}
    for role in ("senders", "receivers"):
        given = kw[role]
        if not isinstance(given, list) or not given or not all(
                isinstance(n, list) and len(n) == 2 and all(_integer(x) for x in n)
                for n in given):
            raise ValueError(f"{js}: field {role!r} must be a non-empty list of [layer, head] "
                             f"integer pairs; got {given!r:.60}.")
        nodes[role] = tuple((a, b) for a, b in given)
    try:
        _check_nodes(nodes["senders"], nodes["receivers"], n_layers, facts.get("n_heads"))
    except ValueError as e:
        raise ValueError(f"{js}: field {e}") from None
    return dict(kw, inputs=tuple(inputs), **nodes)


def _no_edge(kw: dict[str, Any], tensors: dict[str, Tensor], shape: tuple[int, int, int]
             ) -> Tensor | None:
    """Bool ``[senders, receivers, inputs]``: True where ``(s, r, i)`` is no edge, by the
    ``EdgeLayout`` a sweep of these nodes has (``EdgeLayout.cells``, the one definition):
    the receiver's layer not after the sender's, the logits' other input slots, and under GQA
    a k/v input of a head ``>= n_kv_heads``. ``n_kv_heads``: ``meta.facts``'s; without facts
    (a result made by hand), the first head whose k/v slots are all NaN where ``meta.kv_heads``
    does not rule GQA out. None when ``values`` cannot be read that way (``_check_tensors``
    then refuses the file)."""
    from circuitkit.patching.sweep import EdgeLayout

    values, L = tensors.get("values"), kw["n_layers"]
    if values is None or tuple(values.shape) != shape or not values.is_floating_point():
        return None
    facts = kw["meta"].get("facts") or {}
    senders, receivers, inputs = kw["senders"], kw["receivers"], kw["inputs"]
    n_heads = facts.get("n_heads", 1 + max(h for _, h in (*senders, *receivers)))
    n_kv = facts.get("n_kv_heads")
    if n_kv is None:
        n_kv = n_heads
        if kw["meta"].get("kv_heads") is not False:
            kv = [i for i, name in enumerate(inputs) if name in hooks.KV_SITES]
            nan = torch.isnan(values)
            for r, (rl, h) in enumerate(receivers):
                before = [s for s, (sl, _) in enumerate(senders) if sl < rl]
                if rl < L and kv and before and bool(nan[before][:, r][:, kv].all()):
                    n_kv = min(n_kv, h)
    layout = EdgeLayout(L, n_heads, max(1, n_kv), senders, receivers, inputs)
    index = layout.receiver_index()
    empty = torch.ones(shape, dtype=torch.bool)
    for layer in range(L + 1):
        cells = layout.cells(layer)
        r = [index[(layer, int(u)) if layer < L else (L, -1)] for u in cells[:, 2]]
        empty[cells[:, 0], torch.tensor(r, dtype=torch.long), cells[:, 1]] = False
    return empty


def _no_path(kw: dict[str, Any]) -> Tensor | None:
    """A path result's cells with no route (receiver not after its sender: NaN by
    ``patch_paths``), bool like its values; None for any other result or unreadable names."""
    meta = kw["meta"]
    if meta.get("kind") != "paths":
        return None
    s = [hooks.parse_head(n) for n in meta.get("senders") or []]
    r = [hooks.parse_head(n) for n in meta.get("receivers") or []]
    if None in s or None in r or not s or not r:
        raise ValueError(f"field 'meta.senders'/'meta.receivers' of a path result must name "
                         f"heads (L<layer>H<head>); got {meta.get('senders')!r:.40}, "
                         f"{meta.get('receivers')!r:.40}.")
    mask = torch.tensor([[b[0] <= a[0] for b in r] for a in s])
    return mask if len(kw["axes"]) == 2 else mask[..., None].expand(
        *mask.shape, len(meta.get("path_groups") or [1]))
