"""Patch and edge result files: one strict load, every method's file reloads, and a seeded fuzz
of both (issue 33 items 5 and 11; issue 32's "one result type, one strict load").

* Every damage issue 33 lists for ``EdgeResult.load`` is refused in one line naming the file
  and the field; the damages both kinds of file can have are refused by the same checks, for
  ``PatchResult.load`` too (``test_the_same_damage_is_refused_by_both_loads``).
* Each method's result (edges: exact, eap, eap*, EAP-IG inputs/activations, attribution+exact;
  heads: exact, attribution, attribution+exact), saved, loads back with the same numbers and
  baselines stored as JSON numbers; also from the CLI (``circuitkit edges --method
  attribution``).
* ``tests/fuzzing.py`` mutates saved files (types, ranges, shapes, swaps, truncation): each
  mutation is refused in one line naming the file and a field, or the loaded result behaves
  the same: values, per-prompt values, baselines and ``normalized()`` within the loader's own
  agreement tolerance ``MEAN_RTOL`` x scale (scale: the largest of 1, |clean|, |corrupt| and
  any stored value), the same NaN cells, and equal labels (direction, method, site, axes,
  senders, receivers, inputs).
"""

from __future__ import annotations

import json
import re
import warnings

import fuzzing
import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import TINY_GPT2, make_model

import circuitkit as ck
from circuitkit.patching.results import MEAN_RTOL, EdgeResult, PatchResult
from circuitkit.patching.results.files import _nulls_as_nan, json_ready, result_digest

pytestmark = pytest.mark.filterwarnings("ignore::circuitkit.patching.results."
                                        "DegenerateBaselineWarning")


def _pair(n: int = 3, seq: int = 7, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 64, (n, seq), generator=g),
            torch.randint(1, 64, (n, seq), generator=g))


def margin(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


@pytest.fixture(scope="module")
def gpt2():
    return make_model(TINY_GPT2)


@pytest.fixture(scope="module")
def edges(tiny_llama):
    """Exact edges of the GQA Llama (4 query heads, 2 KV heads: NaN k/v slots), 3 prompts."""
    clean, corrupt = _pair()
    return ck.patch_edges(tiny_llama, clean, corrupt, margin, options=dict(progress=False))


@pytest.fixture(scope="module")
def hybrid_edges(tiny_llama):
    clean, corrupt = _pair()
    return ck.patch_edges(tiny_llama, clean, corrupt, margin, method="attribution+exact",
                          options=dict(top_k=6, progress=False))


@pytest.fixture(scope="module")
def layers(tiny_llama):
    clean, corrupt = _pair()
    return ck.patch_layers(tiny_llama, clean, corrupt, margin, options=dict(progress=False))


@pytest.fixture(scope="module")
def heads(tiny_llama):
    clean, corrupt = _pair()
    return ck.patch_heads(tiny_llama, clean, corrupt, margin, positions="each",
                          options=dict(progress=False))


def saved(result, folder, name="r"):
    result.save(folder / name, views=False)
    return folder / f"{name}.json", folder / f"{name}.safetensors"


def edit_json(js, fn):
    info = json.loads(js.read_text())
    fn(info)
    js.write_text(json.dumps(info))


def edit_tensors(st, fn):
    t = load_file(str(st))
    fn(t)
    save_file(t, str(st))


def first_edge(res):
    """Index (s, r, i) of the first edge cell and of the first non-edge cell."""
    mask = res.edge_mask()
    return tuple(mask.nonzero()[0].tolist()), tuple((~mask).nonzero()[0].tolist())


# --- item 5: every damage the issue lists, refused naming the file and the field ----------------


def _set(key, value):
    return lambda info: info.__setitem__(key, value)


def _cell(name, at, value):
    def fn(t):
        t[name][at] = value
    return fn


EDGE_DAMAGE = {  # name -> (json edit | None, tensor edit(res) | None, message regex)
    "a value edited, per_prompt not": (None, lambda r: _cell("values", first_edge(r)[0], 5.0),
                                       r"r.safetensors: 'values' is not the mean over prompts"),
    "clean disagreeing with clean_per_prompt": (
        lambda r: _set("clean", r.clean + 1.0), None,
        r"r.json field 'clean' and .*r.safetensors: 'clean' is not the mean"),
    "an inf cell": (None, lambda r: lambda t: [t["values"].__setitem__(first_edge(r)[0], 1e999),
                                               t["per_prompt"][0].__setitem__(first_edge(r)[0],
                                                                              1e999)],
                    r"r.safetensors: tensor 'values' holds 1 non-finite value"),
    "a NaN edge cell": (None, lambda r: _cell("per_prompt", (0, *first_edge(r)[0]),
                                              float("nan")),
                        r"r.safetensors: tensor 'per_prompt' holds 1 non-finite value"),
    "a non-edge slot filled": (None, lambda r: lambda t: [
        t["values"].__setitem__(first_edge(r)[1], 0.5),
        t["per_prompt"][:, first_edge(r)[1][0], first_edge(r)[1][1], first_edge(r)[1][2]]
        .fill_(0.5)], r"r.safetensors: tensor 'values' holds 1 value\(s\) where there is no edge"),
    "int values": (None, lambda r: lambda t: t.__setitem__("values", t["values"].nan_to_num()
                                                           .long()),
                   r"r.safetensors: tensor 'values' must be floating point; got torch.int64"),
    "bool values": (None, lambda r: lambda t: t.__setitem__("values", t["values"] > 0),
                    r"r.safetensors: tensor 'values' must be floating point; got torch.bool"),
    "inputs [v, k, q]": (lambda r: _set("inputs", ["v", "k", "q"]), None,
                         r"r.json: field 'inputs' must be .* distinct names from \['q', 'k', "
                         r"'v'\], in that order"),
    "inputs [q, q, v]": (lambda r: _set("inputs", ["q", "q", "v"]), None,
                         r"r.json: field 'inputs' must be"),
    "a sender's head outside the model": (
        lambda r: lambda info: info["senders"].__setitem__(4, [0, 4]), None,
        r"r.json: field senders: \(0, 4\) is not a node of a 3-layer x 4-head model"),
    "a sender's layer outside the model": (
        lambda r: lambda info: info["senders"].__setitem__(4, [3, 0]), None,
        r"r.json: field senders: \(3, 0\) is not a node of a 3-layer"),
    "two senders swapped": (
        lambda r: lambda info: info["senders"].__setitem__(slice(1, 3), info["senders"][2:0:-1]),
        None, r"r.json: field senders must be distinct and sorted"),
    "n_layers as a string": (lambda r: _set("n_layers", "3"), None,
                             r"r.json: field 'n_layers' must be a positive integer .*got '3'"),
    "n_layers another model's": (lambda r: _set("n_layers", 4), None,
                                 r"r.json: field 'n_layers' must be a positive integer \(the "
                                 r"model's layers, 3\); got 4"),
    "version: true": (lambda r: _set("version", True), None,
                      r"r.json: field 'version' must be a positive integer; got True"),
    "a missing corrupt_per_prompt": (None, lambda r: lambda t: t.pop("corrupt_per_prompt"),
                                     r"r.safetensors: 'clean_per_prompt' without its pair"),
    "a missing per_prompt": (None, lambda r: lambda t: t.pop("per_prompt"),
                             r"r.safetensors: tensor 'clean_per_prompt' without 'per_prompt'"),
    "meta.verified wrongly shaped": (
        lambda r: lambda info: info["meta"].__setitem__("verified", [[True, False]]), None,
        r"r.json: field 'meta.verified' must be a nested list of true/false shaped like values "
        r"\[13, 13, 3\]"),
    "clean as the string '0.5'": (lambda r: _set("clean", "0.5"), None,
                                  r"r.json: field 'clean' must be a finite number; got '0.5'"),
    "mixed dtypes": (None, lambda r: lambda t: t.__setitem__("values", t["values"].double()),
                     r"r.safetensors: tensors of mixed dtypes"),
    "an unknown tensor": (None, lambda r: lambda t: t.__setitem__("extra", torch.zeros(1)),
                          r"r.safetensors: expected tensors \['values', 'per_prompt', "),
    "another format": (lambda r: _set("format", "circuitkit.patch_result"), None,
                       r"r.json is not a circuitkit edge result \(format "
                       r"'circuitkit.patch_result'"),
}


@pytest.mark.parametrize("name", list(EDGE_DAMAGE))
def test_edge_load_refuses_each_damage_naming_file_and_field(edges, tmp_path, name):
    """Each damage of issue 33 item 5 (and a few more), on an exact GQA edge result that loads
    before the edit: one line naming the file and the field."""
    js, st = saved(edges, tmp_path)
    assert torch.equal(EdgeResult.load(js).values.nan_to_num(), edges.values.nan_to_num())
    on_json, on_tensors, message = EDGE_DAMAGE[name]
    if on_json is not None:
        edit_json(js, on_json(edges))
    if on_tensors is not None:
        edit_tensors(st, on_tensors(edges))
    with pytest.raises(ValueError, match=message) as err:
        EdgeResult.load(tmp_path / "r")
    assert "\n" not in str(err.value)


def test_a_gqa_slot_filled_is_refused_with_and_without_the_model_facts(edges, tmp_path):
    """Under GQA a k/v slot of a head that is no KV head is no edge: filled, it is refused,
    whether the model's shape is recorded (``meta.facts``) or inferred from the other NaN
    slots (a file without facts)."""
    assert edges.meta["facts"]["n_kv_heads"] == 2
    r = edges.receivers.index((2, 3))  # a query head with no KV head of its own
    s, k = 0, edges.inputs.index("k")
    assert torch.isnan(edges.values[s, r, k])

    def fill(t):
        t["values"][s, r, k] = 0.5
        t["per_prompt"][:, s, r, k] = 0.5

    for drop_facts in (False, True):
        js, st = saved(edges, tmp_path, f"g{drop_facts}")
        if drop_facts:  # a file made without facts (its digest made so too)
            edit_json(js, lambda info: info["meta"].pop("facts"))
            edit_json(js, lambda info, st=st: info.__setitem__("digest", result_digest(
                info, load_file(str(st)))))
            assert torch.equal(EdgeResult.load(js).values.nan_to_num(),
                               edges.values.nan_to_num())
        edit_tensors(st, fill)
        with pytest.raises(ValueError, match=rf"g{drop_facts}.safetensors: tensor 'values' "
                                             r"holds 1 value\(s\) where there is no edge"):
            EdgeResult.load(js)


COMMON_DAMAGE = ["a value edited, per_prompt not", "clean disagreeing with clean_per_prompt",
                 "int values", "bool values", "version: true", "a missing corrupt_per_prompt",
                 "a missing per_prompt", "clean as the string '0.5'", "mixed dtypes",
                 "an unknown tensor", "meta.verified wrongly shaped"]


@pytest.mark.parametrize("name", COMMON_DAMAGE)
def test_the_same_damage_is_refused_by_both_loads(edges, heads, tmp_path, name):
    """One strict load: a damage either kind of file can have is refused by ``PatchResult``'s
    and ``EdgeResult``'s load alike, with the same words (the shared ``_checked_info`` and
    ``_check_tensors``)."""
    on_json, on_tensors, message = EDGE_DAMAGE[name]
    words = []
    for res, load in ((edges, EdgeResult.load), (heads, PatchResult.load)):
        folder = tmp_path / type(res).__name__
        js, st = saved(res, folder)
        if on_json is not None:
            edit_json(js, on_json(res))
        if on_tensors is not None:
            if res is heads:  # the first cell of a head result: every cell is one
                edit_tensors(st, {"a value edited, per_prompt not": _cell("values", (0, 0, 0),
                                                                          5.0)}
                             .get(name) or on_tensors(res))
            else:
                edit_tensors(st, on_tensors(res))
        with pytest.raises(ValueError) as err:
            load(js)
        msg = str(err.value)
        if res is heads:  # (the shape in the message is the result's own)
            message = message.replace(r"\[13, 13, 3\]", r"\[3, 4, 7\]")
        assert re.search(message, msg), (type(res).__name__, msg)
        words.append(re.sub(r"\d[\d.e+-]*", "#", msg.split(": ", 1)[1]))  # numbers aside
    assert words[0] == words[1], words


def test_a_moved_verified_mask_is_refused(hybrid_edges, tiny_llama, tmp_path):
    """attribution+exact: a value not marked verified is the screen's estimate
    (``meta.attribution_values``, within ``MEAN_RTOL`` x scale), so a verified mark moved from
    a cell whose exact value differs from its estimate (by 0.014-0.018 here) onto another cell
    is refused, for edge and head results alike; and such a result without its mask too."""
    clean, corrupt = _pair(seed=5)
    heads = ck.patch_heads(tiny_llama, clean, corrupt, margin, method="attribution+exact",
                           options=dict(top_k=6, progress=False))
    for res in (hybrid_edges, heads):
        load = EdgeResult.load if isinstance(res, EdgeResult) else PatchResult.load
        js, _ = saved(res, tmp_path / type(res).__name__)
        mask = torch.tensor(res.meta["verified"])
        est = torch.tensor(_nulls_as_nan(res.meta["attribution_values"]),
                           dtype=torch.float32)
        gap = (res.values - est).abs().nan_to_num(0) * mask
        on = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
        assert float(gap[on]) > 1e-2
        moved = mask.clone()
        moved[on] = False
        moved[tuple((~mask & ~res.values.isnan()).nonzero()[0].tolist())] = True
        edit_json(js, lambda info, moved=moved: info["meta"].__setitem__("verified",
                                                                     moved.tolist()))
        with pytest.raises(ValueError, match=r"r.json: field 'meta.verified' marks 1 value\(s\) "
                                             r"as estimates that are not the screen's"):
            load(js)
        edit_json(js, lambda info: info["meta"].pop("verified"))
        with pytest.raises(ValueError, match=r"r.json: field 'meta.verified' is missing: an "
                                             r"attribution\+exact result"):
            load(js)


# --- item 11: every method's file reloads -------------------------------------------------------


EDGE_METHODS = [("exact", None), ("attribution", "eap"), ("attribution", "eap*"),
                ("attribution", "eap-ig-inputs"), ("attribution", "eap-ig-activations"),
                ("attribution+exact", None)]


def assert_same_numbers(back, res):
    for k in ("values", "per_prompt", "clean_per_prompt", "corrupt_per_prompt"):
        a, b = getattr(back, k), getattr(res, k)
        assert (a is None) == (b is None), k
        if a is not None:
            assert torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)), k


@pytest.mark.parametrize("method,estimator", EDGE_METHODS,
                         ids=[m if e is None else e for m, e in EDGE_METHODS])
def test_every_edge_method_round_trips(gpt2, tmp_path, method, estimator):
    """Before the fix, every non-exact edge result saved ``"clean": "tensor(...)"`` and could
    not be loaded. Now its baselines are JSON numbers, its meta plain JSON, and it loads back
    with the same numbers, labels and meta."""
    clean, corrupt = _pair(seed=5)
    res = ck.patch_edges(gpt2, clean, corrupt, margin, method=method,
                         options=dict(estimator=estimator, progress=False))
    assert type(res.clean) is float and type(res.corrupt) is float
    js, _ = saved(res, tmp_path)
    info = json.loads(js.read_text())
    assert isinstance(info["clean"], float) and isinstance(info["corrupt"], float)
    assert "tensor(" not in js.read_text()
    back = EdgeResult.load(js)
    assert_same_numbers(back, res)
    assert (back.clean, back.corrupt, back.method, back.senders, back.receivers, back.inputs) \
        == (res.clean, res.corrupt, res.method, res.senders, res.receivers, res.inputs)
    assert back.meta == json.loads(json.dumps(json_ready(res.meta)))
    torch.testing.assert_close(back.normalized(), res.normalized(), equal_nan=True, atol=0,
                               rtol=0)


@pytest.mark.parametrize("method", ["exact", "attribution", "attribution+exact"])
def test_every_head_method_round_trips(gpt2, tmp_path, method):
    clean, corrupt = _pair(seed=5)
    res = ck.patch_heads(gpt2, clean, corrupt, margin, method=method, options=dict(progress=False))
    js, _ = saved(res, tmp_path)
    assert "tensor(" not in js.read_text()
    back = PatchResult.load(js)
    assert_same_numbers(back, res)
    assert (back.clean, back.corrupt, back.method, back.axes) == (res.clean, res.corrupt,
                                                                   res.method, res.axes)


def test_cli_edges_attribution_reloads(tmp_path):
    """``circuitkit edges --method attribution`` (the shipped teacher, 2 prompts): its
    ``edges.*`` load back (they could not before)."""
    from typer.testing import CliRunner

    from circuitkit.cli import app

    out = tmp_path / "e"
    r = CliRunner().invoke(app, ["edges", "--model", "icd-teacher", "--task", "icd10", "-n", "2",
                                 "--senders", "embed,L0H2", "--receivers", "L2H6,logits",
                                 "--method", "attribution", "--out", str(out)])
    assert r.exit_code == 0, r.output
    back = EdgeResult.load(out / "edges")
    assert back.method == "attribution" and back.per_prompt.shape[0] == 2
    assert back.meta["estimator"] == "eap"


# --- the fuzz -----------------------------------------------------------------------------------


def same_behaviour(original):
    """``check_same`` for ``fuzzing.run``: the loaded result behaves as ``original`` (module
    docstring: within ``MEAN_RTOL`` x scale, same NaN cells, equal labels)."""
    tensors = [t for t in (original.values, original.per_prompt, original.clean_per_prompt,
                           original.corrupt_per_prompt) if t is not None]
    scale = max([1.0, abs(original.clean), abs(original.corrupt)]
                + [float(t.nan_to_num(0).abs().max()) for t in tensors])
    tol = MEAN_RTOL * scale
    labels = ("direction", "method") + (("senders", "receivers", "inputs", "n_layers")
                                        if isinstance(original, EdgeResult) else
                                        ("site", "positions", "axes"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norm = original.normalized()

    def check(got, m):
        assert type(got) is type(original), m.label
        for k in labels:
            assert getattr(got, k) == getattr(original, k), (m.label, k)
        assert abs(got.clean - original.clean) <= tol and abs(got.corrupt - original.corrupt) \
            <= tol, m.label
        for k in ("values", "per_prompt", "clean_per_prompt", "corrupt_per_prompt"):
            a, b = getattr(got, k), getattr(original, k)
            assert (a is None) == (b is None), (m.label, k)
            if a is not None:
                torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=0,
                                           equal_nan=True, msg=f"{m.label}: {k}")
        assert got.meta.get("verified") == original.meta.get("verified"), m.label
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got_norm = got.normalized()
        gap = max(abs(original.clean - original.corrupt), 1e-12)
        bound = tol * (1 + 2 * float(norm.nan_to_num(0).abs().max())) / gap
        torch.testing.assert_close(got_norm.double(), norm.double(), atol=bound, rtol=0,
                                   equal_nan=True, msg=f"{m.label}: normalized")
    return check


@pytest.mark.parametrize("which", ["edges", "hybrid_edges", "heads", "layers"])
def test_fuzz_refused_naming_the_file_or_the_same_behaviour(which, request, tmp_path):
    """300 seeded mutations of a saved result (exact GQA edges; attribution+exact edges with
    their verified mask; exact heads per position; exact layers): each is refused in one line
    naming the file and a field, or loads and behaves the same (``same_behaviour``), and every
    kind of mutation is tried. Since result files carry a digest binding their labels to their
    values (issue 49), a mutation that loads is one that changed nothing the digest reads (an
    equal value swapped, a NaN set to NaN): almost all are refused."""
    res = request.getfixturevalue(which)
    js, st = saved(res, tmp_path)
    load = EdgeResult.load if isinstance(res, EdgeResult) else PatchResult.load
    fields = set(json.loads(js.read_text())) | set(res.meta) | set(load_file(str(st))) | {
        "format", "version", "meta", "tensors"}
    counts = fuzzing.run(js, st, load, same_behaviour(res), n=300, seed=0, fields=fields)
    assert counts["refused"] > 250, counts
    kinds = {k.split(":")[1] for k in counts if ":" in k}
    assert {"type", "range", "shape", "swap", "truncate", "cell", "dtype"} <= kinds, counts


SAVED_BY_MAIN = __import__("pathlib").Path(__file__).parent / "data" / "saved-by-main"


def test_files_saved_before_the_strict_load_still_load(tiny_llama):
    """Files written by main before this change (commit 83ec843: an exact GQA edge result, an
    attribution+exact head result, tests/data/saved-by-main/) load, and their values are the
    sweep's on the same model, prompts and metric today (1e-6)."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(1, 64, (3, 7), generator=g)
    corrupt = torch.randint(1, 64, (3, 7), generator=g)
    edges = EdgeResult.load(SAVED_BY_MAIN / "edges")
    now = ck.patch_edges(tiny_llama, clean, corrupt, margin, options=dict(progress=False))
    torch.testing.assert_close(edges.values, now.values, atol=1e-6, rtol=0, equal_nan=True)
    heads = PatchResult.load(SAVED_BY_MAIN / "heads-hybrid.json")
    assert heads.method == "attribution+exact" and heads.verified is not None
    exact = ck.patch_heads(tiny_llama, clean, corrupt, margin, options=dict(progress=False))
    torch.testing.assert_close(heads.values[heads.verified], exact.values[heads.verified],
                               atol=1e-6, rtol=0)


def test_the_mutator_is_seeded_and_generic(edges, tmp_path):
    """``fuzzing.mutations``: the same seed draws the same mutations; a JSON-only file (no
    tensors, as circuit.json or a manifest) gets JSON mutations of every kind."""
    js, st = saved(edges, tmp_path)
    info, tensors = json.loads(js.read_text()), load_file(str(st))
    first = [m.label for m in fuzzing.mutations(info, tensors, seed=3, n=60)]
    assert first == [m.label for m in fuzzing.mutations(info, tensors, seed=3, n=60)]
    assert first != [m.label for m in fuzzing.mutations(info, tensors, seed=4, n=60)]
    only_json = fuzzing.mutations(info, None, seed=0, n=200, json_text=js.read_text())
    assert all(m.tensors is None and m.st_bytes is None for m in only_json)
    assert {m.kind for m in only_json} >= {"type", "range", "shape", "swap", "drop", "truncate"}
