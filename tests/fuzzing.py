"""A seeded mutator over saved result files, reusable by every file the library writes and
reads: a JSON object (any nesting) and, optionally, a safetensors dict beside it.

``mutations(info, tensors, seed, n)`` draws ``n`` damaged copies (``Mutation``), each one
change of one kind:

* JSON ``type``: a value replaced by one of another type (a number as a string, a bool, None,
  a list, an object); ``range``: a number negated, +1, x2, 0, -1, 1e30, NaN, inf, an integer
  as a float; a string emptied, upper-cased, lengthened or shortened; ``shape``: a list or
  object shortened, emptied, lengthened, reversed, rotated; ``swap``: two sibling values
  exchanged; ``drop``/``add``: a key removed or an unknown one added; ``truncate``: the JSON
  text cut short;
* tensors ``cell``: one element set to NaN, +-inf, +1, x2, -x or 0; ``dtype``: another dtype;
  ``shape``: narrowed, grown, transposed, unsqueezed, flattened; ``swap``/``drop``/``rename``/
  ``add``: across the dict; ``truncate``: the safetensors bytes cut short.

A path is picked by walking down from the top (each level: stop here with probability 1/2, or
descend into a random child), so top-level fields are hit most and every nesting some.
``run(...)`` writes each mutation beside the original and calls the caller's ``check`` on the
outcome: ``load`` raised a ``ValueError`` (its message), or it returned a result. What counts
as "refused well" or "the same behaviour" is the caller's (``assert_refused_well``: one line,
naming the file and a field).
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Path_ = tuple[Any, ...]  # keys and indices from the top of the JSON object


@dataclass
class Mutation:
    """One damaged copy: ``label`` (what was done, e.g. ``"range senders[2][1]: +1"``),
    ``field`` (the top-level field or tensor touched; "" for truncations), and what to write:
    ``info`` (the JSON object) or ``json_text`` (raw text), ``tensors`` or ``st_bytes``."""

    label: str
    field: str
    info: Any = None
    json_text: str | None = None
    tensors: dict[str, Any] | None = None
    st_bytes: bytes | None = None
    kind: str = field(default="")


def _get(obj: Any, path: Path_) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _pick_path(rng: random.Random, obj: Any) -> Path_:
    path: list[Any] = []
    while True:
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj))) \
            if isinstance(obj, list) else []
        if not keys or (path and rng.random() < 0.5):
            return tuple(path)
        k = rng.choice(keys)
        path.append(k)
        obj = obj[k]


def _show(path: Path_) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def _values_like(rng: random.Random, x: Any) -> list[tuple[str, str, Any]]:
    """(kind, what, new value) candidates for a JSON value ``x``."""
    other = [("type", "-> string", str(x)), ("type", "-> true", True), ("type", "-> null", None),
             ("type", "-> list", [x]), ("type", "-> object", {"x": x})]
    if isinstance(x, bool):
        return [("range", "not", not x), ("type", "-> int", int(x)), *other[:1], other[2]]
    if isinstance(x, int | float):
        out = [("range", "negated", -x), ("range", "+1", x + 1), ("range", "x2", x * 2),
               ("range", "0", 0), ("range", "-1", -1), ("range", "1e30", 1e30),
               ("range", "NaN", math.nan), ("range", "inf", math.inf)]
        if isinstance(x, int):
            out.append(("type", "-> float", float(x)))
        return out + other
    if isinstance(x, str):
        return [("range", "empty", ""), ("range", "upper", x.upper() + ("X" if x == x.upper()
                                                                         else "")),
                ("range", "longer", x + "x"), ("range", "shorter", x[:-1]),
                ("type", "-> number", 0.5), *other[1:]]
    if isinstance(x, list):
        out = [("shape", "emptied", []), ("type", "-> string", json.dumps(x)[:40]),
               ("type", "-> null", None), ("type", "-> object", {})]
        if x:
            out += [("shape", "last dropped", x[:-1]), ("shape", "last repeated", x + [x[-1]]),
                    ("shape", "reversed", x[::-1]), ("shape", "rotated", x[1:] + x[:1])]
        return out
    if isinstance(x, dict):
        out = [("shape", "emptied", {}), ("type", "-> list", list(x.values())),
               ("type", "-> null", None), ("add", "unknown key", {**x, "zz_unknown": 1})]
        if x:
            k = rng.choice(list(x))
            out.append(("drop", f"key {k!r} dropped", {a: b for a, b in x.items() if a != k}))
        return out
    return other  # (None)


def json_mutation(rng: random.Random, info: dict, text: str) -> Mutation:
    """One mutation of the JSON object ``info`` (its file text: ``text``)."""
    roll = rng.random()
    if roll < 0.06:  # truncated text
        cut = rng.randrange(0, max(1, len(text) - 1))
        return Mutation(f"truncate json at {cut}/{len(text)}", "", json_text=text[:cut],
                        kind="truncate")
    out = copy.deepcopy(info)
    path = _pick_path(rng, out)
    top = str(path[0]) if path else ""
    parent = _get(out, path[:-1]) if path else None
    if path and roll < 0.16 and isinstance(parent, dict | list) and len(parent) > 1:  # swap
        keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
        other = rng.choice([k for k in keys if k != path[-1]])
        parent[path[-1]], parent[other] = parent[other], parent[path[-1]]
        return Mutation(f"swap {_show(path)} <-> {other}", top, info=out, kind="swap")
    if path and roll < 0.22 and isinstance(parent, dict):
        del parent[path[-1]]
        return Mutation(f"drop {_show(path)}", top, info=out, kind="drop")
    if not path:  # (an empty object: nothing inside to change)
        kind, what, new = rng.choice(_values_like(rng, out))
        return Mutation(f"{kind} whole object: {what}", "", info=new, kind=kind)
    kind, what, new = rng.choice(_values_like(rng, _get(out, path)))
    parent[path[-1]] = new
    return Mutation(f"{kind} {_show(path)}: {what}", top, info=out, kind=kind)


def tensor_mutation(rng: random.Random, tensors: dict[str, Any], st_bytes: bytes) -> Mutation:
    """One mutation of the safetensors dict ``tensors`` (its file bytes: ``st_bytes``)."""
    import torch

    roll = rng.random()
    if roll < 0.08 or not tensors:
        cut = rng.randrange(0, max(1, len(st_bytes) - 1))
        return Mutation(f"truncate safetensors at {cut}/{len(st_bytes)}", "",
                        st_bytes=st_bytes[:cut], kind="truncate")
    out = {k: v.clone() for k, v in tensors.items()}
    name = rng.choice(sorted(out))
    t = out[name]
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if roll < 0.18:  # across the dict
        names = sorted(out)
        what = rng.choice(["drop", "rename", "add"] + (["swap"] if len(names) > 1 else []))
        if what == "drop":
            del out[name]
        elif what == "rename":
            out[name + "_x"] = out.pop(name)
        elif what == "add":
            out["zz_unknown"] = torch.zeros(2)
        else:
            other = rng.choice([n for n in names if n != name])
            out[name], out[other] = out[other], out[name]
            name = f"{name} <-> {other}"
        return Mutation(f"{what} tensor {name}", name.split(" ")[0], tensors=out, kind=what)
    if roll < 0.32:
        dtype = rng.choice([torch.int64, torch.int32, torch.bool, torch.float16, torch.float64,
                            torch.bfloat16])
        out[name] = t.to(dtype) if dtype != torch.bool else t.nan_to_num() > 0
        return Mutation(f"dtype {name} -> {dtype}", name, tensors=out, kind="dtype")
    if roll < 0.46 and t.ndim:
        dim = rng.randrange(t.ndim)
        what = rng.choice(["narrow", "grow", "transpose", "unsqueeze", "flatten"])
        if what == "narrow" and t.shape[dim] > 0:
            new = t.narrow(dim, 0, t.shape[dim] - 1)
        elif what == "grow":
            new = torch.cat([t, t.narrow(dim, 0, min(1, t.shape[dim]))], dim)
        elif what == "transpose" and t.ndim > 1:
            new = t.transpose(0, t.ndim - 1).contiguous()
        elif what == "flatten":
            new = t.flatten()
        else:
            new = t.unsqueeze(0)
        out[name] = new.contiguous()
        return Mutation(f"shape {name} {what} (dim {dim}): {list(t.shape)} -> "
                        f"{list(new.shape)}", name, tensors=out, kind="shape")
    if t.numel() == 0:
        return Mutation(f"unchanged {name}", name, tensors=out, kind="none")
    flat = out[name].view(-1)
    i = int(torch.randint(0, flat.numel(), (1,), generator=g))
    x = float(flat[i])
    what, new = rng.choice([("NaN", math.nan), ("inf", math.inf), ("-inf", -math.inf),
                            ("+1", x + 1), ("x2", x * 2), ("negated", -x), ("0", 0.0)])
    flat[i] = new
    return Mutation(f"cell {name}[{i}] {x:.4g}: {what}", name, tensors=out, kind="cell")


def mutations(info: dict, tensors: dict[str, Any] | None, seed: int, n: int, *,
              json_text: str | None = None, st_bytes: bytes | None = None) -> list[Mutation]:
    """``n`` seeded mutations, about half of the JSON and half of the tensors (all of the
    JSON without tensors). ``json_text``/``st_bytes``: the files as written (for truncation;
    default: ``json.dumps(info)``, no safetensors truncation)."""
    rng = random.Random(seed)
    text = json.dumps(info) if json_text is None else json_text
    out = []
    for _ in range(n):
        if tensors is not None and rng.random() < 0.5:
            out.append(tensor_mutation(rng, tensors, st_bytes or b""))
        else:
            out.append(json_mutation(rng, info, text))
    return out


def write(m: Mutation, js: Path, st: Path | None, json_text: str, st_bytes: bytes | None) -> None:
    """Write mutation ``m`` over the files ``js`` (and ``st``): the changed half from ``m``,
    the other half as originally written."""
    from safetensors.torch import save_file

    if m.json_text is not None:
        js.write_text(m.json_text)
    elif m.tensors is None and m.st_bytes is None:  # a change of the JSON object
        js.write_text(json.dumps(m.info))
    else:
        js.write_text(json_text)
    if st is None:
        return
    if m.st_bytes is not None:
        st.write_bytes(m.st_bytes)
    elif m.tensors is not None:
        save_file(m.tensors, str(st))
    else:
        st.write_bytes(st_bytes)


def assert_refused_well(message: str, m: Mutation, files: tuple[Path, ...],
                        fields: set[str]) -> None:
    """A refusal as the project wants it: one line, naming one of ``files`` (by name), and
    (except for truncated files, which name only the file) one of ``fields``."""
    assert "\n" not in message, (m.label, message)
    assert any(f.name in message for f in files), (m.label, message)
    if m.kind != "truncate" and m.field:
        assert any(f in message for f in fields), (m.label, message)


def run(js: Path, st: Path | None, load: Any, check_same: Any, *, n: int, seed: int,
        fields: set[str]) -> dict[str, int]:
    """Fuzz a saved file pair: ``n`` mutations of ``js`` (and ``st``), each written over the
    originals, then ``load(js)``. A ``ValueError`` must be refused well
    (``assert_refused_well``); any other exception fails; a loaded result must pass
    ``check_same(result, mutation)``. The originals are restored at the end. Returns counts
    per outcome ("refused", "same") and per kind."""
    from safetensors.torch import load_file

    json_text = js.read_text()
    st_bytes = None if st is None else st.read_bytes()
    info = json.loads(json_text)
    tensors = None if st is None else load_file(str(st))
    files = (js,) if st is None else (js, st)
    counts: dict[str, int] = {}
    try:
        for m in mutations(info, tensors, seed, n, json_text=json_text, st_bytes=st_bytes):
            write(m, js, st, json_text, st_bytes)
            try:
                got = load(js)
            except ValueError as e:
                assert_refused_well(str(e), m, files, fields)
                outcome = "refused"
            else:
                check_same(got, m)
                outcome = "same"
            counts[outcome] = counts.get(outcome, 0) + 1
            counts[f"{outcome}:{m.kind}"] = counts.get(f"{outcome}:{m.kind}", 0) + 1
    finally:
        js.write_text(json_text)
        if st is not None:
            st.write_bytes(st_bytes)
    return counts
