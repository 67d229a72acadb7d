"""``ck.circuit`` and what reads its results (``circuit.json``, ``report.html``): issue 33
items 1, 2, 3, 6, 7, 10, 15 and issue 36 items 5 and 13 (kept() and circuit.json agree).

Models: the hand-built planted induction circuit (exact, known edges) and seeded tiny random
bridges. Tolerances are stated where they are used.
"""

from __future__ import annotations

import copy
import json
import random
import re
import warnings

import pytest
import torch
from planted_induction import (
    COPY_HEAD,
    INDUCTION,
    PREV_HEAD,
    planted_induction_model,
    planted_task,
)
from tinymodels import TINY_GPT2, make_model

import circuitkit as ck
from circuitkit.patching.results import (
    CircuitTargetWarning,
    DegenerateBaselineWarning,
    node_name,
    read_circuit_json,
)

PLANTED = {("embed", node_name(PREV_HEAD, 2), "v"),
           (node_name(PREV_HEAD, 2), node_name(INDUCTION, 2), "k"),
           ("embed", node_name(COPY_HEAD, 2), "v"),
           (node_name(COPY_HEAD, 2), node_name(INDUCTION, 2), "v"),
           (node_name(INDUCTION, 2), "logits", "resid")}


@pytest.fixture(scope="module")
def planted():
    model = planted_induction_model()
    task = planted_task(12)
    edges = {d: ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                               direction=d, options=dict(progress=False)) for d in ("denoise",
                                                         "noise")}
    return model, task, edges


def _unhooked(model, tokens, metric) -> float:
    with torch.no_grad():
        return float(metric(model(tokens)))


# --- item 2: signed = helpful first, in both directions ------------------------------------------


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_signed_rank_keeps_the_helpful_edges_first_in_both_directions(planted, direction):
    """Helpful first: by effect, descending, for denoise (restoring the metric); ascending for
    noise (breaking it). On the planted circuit, noise: all 5 planted edges break it, so they
    come first and signed CPR equals abs CPR (before: last, CPR far lower); denoise: the 3
    planted edges that restore it alone (embed -> L0H1 v, L0H1 -> L1H0 v, L1H0 -> logits)
    come first, the 2 prev-token edges (negative alone) do not."""
    model, task, edges = planted
    res = edges[direction]
    circ = ck.circuit(model, task, res, rank="signed", options=dict(progress=False, n_boot=0))
    effects = [e["effect"] for e in circ.items]
    sign = 1 if direction == "denoise" else -1
    assert all(sign * a >= sign * b for a, b in zip(effects, effects[1:], strict=False))
    first = {(e["sender"], e["receiver"], e["input"]) for e in circ.items[:5]}
    if direction == "noise":
        assert first == PLANTED
        abs_circ = ck.circuit(model, task, res, rank="abs", options=dict(progress=False, n_boot=0))
        assert circ.cpr == pytest.approx(abs_circ.cpr, abs=1e-5)  # (1e-5: float32 runs)
    else:
        three = {(e["sender"], e["receiver"], e["input"]) for e in circ.items[:3]}
        assert three == {p for p in PLANTED if "L0H0" not in p[:2]}


# --- items 3 and 36.13: the share of the gap; kept() and circuit.json agree ----------------------


def test_share_of_the_gap_is_stated_for_a_partial_candidate_set(planted, tmp_path):
    """``share = (full - empty) / (clean - corrupt)``: 1 when the edges cover the model (corrupt
    ablation of every edge is the corrupt run), the hand ratio of the unhooked runs and the
    all-ablated circuit for a partial set; stated in the field, circuit.json, repr and the
    faithfulness curve's title."""
    model, task, edges = planted
    clean = _unhooked(model, task.clean_tokens, task.metric)
    corrupt = _unhooked(model, task.corrupt_tokens, task.metric)
    whole = ck.circuit(model, task, edges["denoise"], options=dict(progress=False, n_boot=20))
    assert whole.share == pytest.approx(1.0, abs=1e-5)
    part = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          senders=[COPY_HEAD], receivers=[INDUCTION], options=dict(progress=False))
    circ = ck.circuit(model, task, part, options=dict(progress=False, n_boot=50))
    assert circ.share == pytest.approx((circ.full - circ.empty) / (clean - corrupt), abs=1e-5)
    assert circ.full == pytest.approx(clean, abs=1e-5)
    assert circ.corrupt == pytest.approx(corrupt, abs=1e-5)
    assert abs(circ.share - 1) > 0.1  # a partial set: not the whole gap (here 143%)
    lo, hi = circ.intervals["share"]
    assert lo - 1e-6 <= circ.share <= hi + 1e-6
    data = json.loads(circ.save_json(tmp_path / "c.json").read_text())
    assert data["share"] == pytest.approx(circ.share) and data["share_ci"] == [lo, hi]
    assert f"{circ.share:.1%}" in repr(circ) and "clean-corrupt gap" in repr(circ)
    assert "of the clean-corrupt gap" in ck.viz.faithfulness_curve(circ).layout.title.text


def test_kept_and_circuit_json_agree_on_names_and_normalized_scores(planted, tmp_path):
    """``kept()`` gives what ``circuit.json``'s ``edges`` hold: node names, the edge's normalized
    value (``EdgeResult.normalized``) as ``score`` and its raw effect as ``effect``."""
    model, task, edges = planted
    res = edges["denoise"]
    circ = ck.circuit(model, task, res, options=dict(progress=False, n_boot=0))
    data = json.loads(circ.save_json(tmp_path / "c.json").read_text())
    assert data["edges"] == circ.kept()
    frame = res.to_frame(ci=False).set_index(["sender", "receiver", "input"])
    for e in circ.kept():
        row = frame.loc[(e["sender"], e["receiver"], e["input"])]
        assert e["score"] == pytest.approx(float(row["normalized"]), abs=1e-6)
        assert e["effect"] == pytest.approx(float(row["value"]) - res.corrupt, abs=1e-6)
    heads = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                           options=dict(progress=False))
    hc = ck.circuit(model, task, heads, options=dict(progress=False, n_boot=0))
    hd = hc.to_dict()
    assert hd["nodes"] == sorted(hc.kept(), key=lambda n: (n["layer"], n["head"]))
    norm = heads.normalized()
    for n in hc.kept():
        assert n["name"] == node_name((n["layer"], n["head"]), 2)
        assert n["score"] == pytest.approx(float(norm[n["layer"], n["head"]]), abs=1e-6)


def test_edge_heatmap_states_its_colour_range_in_percent_of_the_gap(planted):
    model, task, edges = planted
    part = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          senders=[COPY_HEAD], receivers=[INDUCTION], inputs=("v",),
                          options=dict(progress=False))
    fig = part.heatmap()
    m = float(part.normalized()[part.edge_mask()].abs().max())
    title = " ".join(re.sub(r"</?sup>|<br>", " ", fig.layout.title.text).split())  # unwrapped
    assert f"full colour = \u00b1{m:.2%} of the clean\u2212corrupt gap" in title
    assert f"{m:.2%}" in fig.layout.coloraxis.colorbar.title.text


# --- item 6: another model's results ---------------------------------------------------------


def test_another_models_results_are_refused_in_one_line():
    clean = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    corrupt = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))

    def margin(logits):
        return logits[:, -1, 3] - logits[:, -1, 5]

    a = make_model(TINY_GPT2)
    b = make_model(dict(TINY_GPT2, seed=1))  # same shape, other weights
    wide = make_model(dict(TINY_GPT2, n_head=8, n_embd=32))  # 2 x 8 heads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        res = ck.patch_edges(a, clean, corrupt, margin, inputs="v", options=dict(progress=False))
        heads = ck.patch_heads(a, clean, corrupt, margin, options=dict(progress=False))
        big = ck.patch_edges(wide, clean, corrupt, margin, inputs="v", options=dict(progress=False))
        # estimates record their model too (before: only exact sweeps did, so another model's
        # attribution result of the same shape was used without a word)
        eap = ck.patch_edges(a, clean, corrupt, margin, inputs="v", method="attribution",
                             options=dict(progress=False))
        atp = ck.patch_heads(a, clean, corrupt, margin, method="attribution",
                             options=dict(progress=False))
        hyb = ck.patch_edges(a, clean, corrupt, margin, inputs="v", method="attribution+exact",
                             options=dict(top_k=2, progress=False))
        for result in (res, heads, big, eap, atp, hyb):
            target = b if result is not big else a
            with pytest.raises(ValueError, match="another model") as err:
                ck.circuit(target, (clean, corrupt, margin), result, options=dict(progress=False))
            assert "\n" not in str(err.value)
        big.meta.pop("model_fingerprint")  # (an older file): the nodes still tell
        with pytest.raises(ValueError, match=r"L\d+H[4-7].*no edge of this model") as err:
            ck.circuit(a, (clean, corrupt, margin), big, options=dict(progress=False))
        assert "\n" not in str(err.value)
        ck.circuit(a, (clean, corrupt, margin), res,
                   options=dict(progress=False, n_boot=0))  # its own: fine


# --- item 7: degenerate baseline ---------------------------------------------------------------


@pytest.mark.parametrize("ablation", ["corrupt", "zero", "position-mean", "resample"])
def test_degenerate_baseline_warns_and_gives_no_cpr(planted, ablation, tmp_path):
    """clean == corrupt: one DegenerateBaselineWarning, no CPR/CMD/share, finite raw effects
    (before: CPR from float noise, NaN under corrupt ablation)."""
    model, task, edges = planted
    same = (task.clean_tokens, task.clean_tokens.clone(), task.metric)
    with pytest.warns(DegenerateBaselineWarning, match="ck.circuit: the corruption does not "
                                                       "change"):
        circ = ck.circuit(model, same, edges["denoise"], ablation=ablation,
                          options=dict(progress=False))
    assert circ.degenerate and circ.cpr is None and circ.cmd is None and circ.share is None
    assert bool(torch.isfinite(circ.faithfulness).all())
    assert "degenerate" in repr(circ)
    assert read_circuit_json(circ.save_json(tmp_path / "d.json"))["degenerate"]


# --- issue 32 item 7: one meaning of "mean" ---------------------------------------------------


def test_position_mean_is_the_old_mean_and_the_old_name_still_works(planted, tmp_path):
    """ck.circuit's per-position mean ablation is "position-mean" ("mean" is ablate_heads'
    pooled one): the old name gives the same numbers with a DeprecationWarning, is recorded
    under the new name, and a circuit.json written with the old name loads as the new."""
    model, task, edges = planted
    kw = dict(options=dict(progress=False, n_boot=0), sizes=[0.1, 0.5, 1.0])
    new = ck.circuit(model, task, edges["denoise"], ablation="position-mean", **kw)
    with pytest.warns(DeprecationWarning, match="'mean' is now 'position-mean'"):
        old = ck.circuit(model, task, edges["denoise"], ablation="mean", **kw)
    assert old.ablation == new.ablation == "position-mean"
    assert torch.equal(old.faithfulness, new.faithfulness)
    path = new.save_json(tmp_path / "c.json")
    data = json.loads(path.read_text())
    assert data["ablation"] == "position-mean"
    data["ablation"] = "mean"  # as a file of the version before wrote it (no digest then)
    data["version"] = 2
    data.pop("digest")
    path.write_text(json.dumps(data))
    assert read_circuit_json(path)["ablation"] == "position-mean"
    with pytest.raises(ValueError, match="ablation"):
        ck.circuit(model, task, edges["denoise"], ablation="means", **kw)


# --- item 10: sizes that never reach the target -----------------------------------------------


def test_sizes_that_never_reach_the_target_say_so(planted):
    model, task, edges = planted
    with pytest.warns(CircuitTargetWarning, match="no circuit of the curve reaches"):
        circ = ck.circuit(model, task, edges["denoise"], sizes=[0.001, 0.01],
                          options=dict(progress=False, n_boot=0))
    assert circ.target_reached is False and circ.kept() == []
    assert "not reached" in repr(circ)
    assert circ.to_dict()["target_reached"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error", CircuitTargetWarning)
        ok = ck.circuit(model, task, edges["denoise"], options=dict(progress=False, n_boot=0))
    assert ok.target_reached and len(ok.kept()) == 5


# --- items 1, 15 and 36.5: circuit.json and the report ----------------------------------------


@pytest.fixture(scope="module")
def edges_run(tmp_path_factory, tiny_llama):
    from circuitkit.experiments.characterize import characterize

    out = tmp_path_factory.mktemp("circ") / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        characterize(tiny_llama, "synthetic", out, dict(
            edges=True, n_examples=8, k=3, n_random=3, text=False, progress=False,
            report=False, task_kwargs=dict(n_labels=8, children=4, labels_per_note=(1, 1))))
    return out


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "*.lock"))
    return dst


def _resign(run):
    """Record the current files' SHA-256s in summary.json (an edit summary.json agrees with),
    after each result's and circuit's own digest is made again (issue 49: a file's digest binds
    its fields; a hostile author recomputes it, so what a page shows must be safe anyway)."""
    from safetensors.torch import load_file

    from circuitkit import files
    from circuitkit.patching.results.files import result_digest

    for js in [*run.glob("*.json"), *run.glob("edges/*.json")]:
        try:
            data = json.loads(js.read_text())
        except ValueError:
            continue  # (a truncated file stays truncated)
        if isinstance(data, dict) and "digest" in data:
            st = js.with_suffix(".safetensors")
            data["digest"] = result_digest(data, load_file(str(st)) if st.exists() else {})
            js.write_text(json.dumps(data))
    path = run / "summary.json"
    summary = json.loads(path.read_text())
    for record in summary["steps"].values():
        record["sha256"] = {f: files.sha256_file(run / f) for f in record["files"]}
    path.write_text(json.dumps(summary))


def _report(run):
    from typer.testing import CliRunner

    from circuitkit.cli import app

    return CliRunner().invoke(app, ["report", str(run), "--no-attention"])


def test_report_refuses_a_file_changed_since_characterize_wrote_it(edges_run, tmp_path):
    run = _copy_run(edges_run, tmp_path / "run")
    path = run / "edges" / "circuit.json"
    data = json.loads(path.read_text())
    data["faithfulness"] = 0.99  # a valid value: only the digest tells
    path.write_text(json.dumps(data))
    r = _report(run)
    assert r.exit_code == 2, r.output
    assert "circuit.json was modified" in r.output and len(r.output.strip().splitlines()) == 1
    _resign(run)
    assert _report(run).exit_code == 0


@pytest.mark.parametrize("case", ["node", "cpr_ci", "faithfulness", "truncated"])
def test_report_on_a_malformed_circuit_json_is_one_line_naming_file_and_field(edges_run,
                                                                               tmp_path, case):
    """Issue 33.15's four cases (KeyError, IndexError, format error, JSON error before)."""
    run = _copy_run(edges_run, tmp_path / "run")
    path = run / "edges" / "circuit.json"
    data = json.loads(path.read_text())
    field = {"node": "edges[0].sender", "cpr_ci": "cpr_ci", "faithfulness": "faithfulness",
             "truncated": "not valid JSON"}[case]
    if case == "node":
        data["edges"][0]["sender"] = "L0H3x"
    elif case == "cpr_ci":
        data["cpr_ci"] = [0.5]
    elif case == "faithfulness":
        data["faithfulness"] = "high"
    text = json.dumps(data)
    path.write_text(text[:len(text) // 2] if case == "truncated" else text)
    _resign(run)
    r = _report(run)
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1 and str(path) in r.output.replace("\n", "")
    assert field in r.output


def _mutations(data: dict, rng: random.Random, n: int):
    """Seeded mutations of a circuit.json dict: each (label, mutated text)."""
    def paths(x, prefix=()):
        yield prefix
        if isinstance(x, dict):
            for k, v in x.items():
                yield from paths(v, (*prefix, k))
        elif isinstance(x, list):
            for i, v in enumerate(x[:3]):
                yield from paths(v, (*prefix, i))

    every = [p for p in paths(data) if p and p[0] != "meta"]
    values = [None, True, -1, 0, 1e9, float("nan"), float("inf"), "high", "<script>", [],
              [0.5], [1, 2, 3], {}, "L99H0", "embed", 2.5, -0.5]

    def get(d, p):
        for k in p:
            d = d[k]
        return d

    def put(d, p, v):
        for k in p[:-1]:
            d = d[k]
        d[p[-1]] = v

    text = json.dumps(data)
    for _ in range(n):
        kind = rng.choice(["value", "value", "swap", "delete", "truncate"])
        d = copy.deepcopy(data)
        if kind == "truncate":
            cut = rng.randrange(1, len(text))
            yield f"truncate@{cut}", text[:cut]
            continue
        p = rng.choice(every)
        if kind == "value":
            v = rng.choice(values)
            put(d, p, v)
            label = f"{'.'.join(map(str, p))}={v!r}"
        elif kind == "swap":
            q = rng.choice(every)
            if p[:len(q)] == q or q[:len(p)] == p:
                continue
            a, b = copy.deepcopy(get(d, p)), copy.deepcopy(get(d, q))
            put(d, p, b)
            put(d, q, a)
            label = f"swap {'.'.join(map(str, p))} <-> {'.'.join(map(str, q))}"
        else:
            parent = get(d, p[:-1])
            del parent[p[-1]]
            label = f"delete {'.'.join(map(str, p))}"
        yield label, json.dumps(d)


def test_fuzzed_circuit_json_is_refused_naming_file_and_field_or_reads_the_same(edges_run,
                                                                              tmp_path):
    """300 seeded mutations (types, ranges, shapes, swaps, deletions, truncation) of a real
    circuit.json: ``read_circuit_json`` refuses each in one line naming the file (and, but for
    truncation, a field), or what it accepts the report's readers use without error (the edge
    section, the circuit graph and the edge finding are built from it)."""
    from circuitkit.experiments.findings import edge_finding
    from circuitkit.experiments.report import _edges_section
    from circuitkit.viz.edges import circuit_graph

    data = read_circuit_json(edges_run / "edges" / "circuit.json")
    rng = random.Random(0)
    path = tmp_path / "edges" / "circuit.json"
    path.parent.mkdir()
    for name in ("edges.json", "edges.safetensors"):
        (path.parent / name).write_bytes((edges_run / "edges" / name).read_bytes())
    from circuitkit.patching.results.files import result_digest

    accepted = refused = 0
    for label, text in _mutations(data, rng, 300):
        try:  # each mutation digested again (issue 49: as a hostile author would), so the
            # field checks and the readers meet it, not only the digest
            mutated = json.loads(text)
            if isinstance(mutated, dict):
                text = json.dumps(dict(mutated, digest=result_digest(mutated, {})))
        except ValueError:
            pass
        path.write_text(text)
        try:
            got = read_circuit_json(path)
        except ValueError as e:
            msg = str(e)
            assert "\n" not in msg and msg.startswith(str(path)), (label, msg)
            assert "field" in msg or "JSON" in msg or "missing" in msg or "expected" in msg, \
                (label, msg)
            refused += 1
            continue
        accepted += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _edges_section(tmp_path, lambda fig: "", got)  # no exception: identical handling
            edge_finding(None, got)
            if got["edges"]:
                circuit_graph(got)
    assert refused > 100 and accepted > 10, (refused, accepted)


def test_edges_findings_state_the_share_of_the_gap(planted, tmp_path):
    """36.5: the edge finding says what the edges show, with their share of the gap; a small
    share reads as small (and not as 'the phases do not communicate')."""
    from circuitkit.experiments.findings import edge_finding, format_findings

    model, task, _ = planted
    part = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          senders=[COPY_HEAD], receivers=[INDUCTION], options=dict(progress=False))
    part.meta.update(senders_from="phase1", receivers_from="phase2")
    circ = read_circuit_json(ck.circuit(model, task, part, options=dict(progress=False)).save_json(
        tmp_path / "c.json"))
    found = edge_finding(part, circ)
    text = format_findings([found], width=10_000)
    assert found.title == "Edges (Phase-1 heads into Phase-2 heads)"
    assert f"removes {circ['share']:.1%}" in text and "clean\u2212corrupt gap" in text
    assert "small share" not in text and "Strongest single edge: L0H1 \u2192 L1H0" in text
    # the single edge's value is named with its own direction (a denoise value beside the
    # share an ablation of the clean run removes read as one quantity: the recomputation)
    assert "patched alone into the corrupt run (denoise) restores" in text
    noise = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                           senders=[COPY_HEAD], receivers=[INDUCTION], direction="noise",
                           options=dict(progress=False))
    assert "patched alone into the clean run (noise) removes" in format_findings(
        [edge_finding(noise, circ)], width=10_000)
    small = edge_finding(part, dict(circ, share=0.004, share_ci=[0.003, 0.005]))
    assert "removes 0.40% [0.30%, 0.50%] of the clean\u2212corrupt gap" in small.headline
    assert "small share" in small.headline and "does not say that the phases do not " \
        "communicate" in small.headline
    # the edges' coverage of their sender's own effect (issue 34), stated beside the share
    from circuitkit.experiments.findings import _pct2

    cov = part.meta["coverage"]["overall"]
    assert 0 < cov and f"explain {_pct2(cov)} of their senders' own effect" in text


def test_characterize_edges_findings_reach_console_and_report(edges_run, tmp_path):
    """``characterize --edges`` on a random model (its corruption is within noise): the edge
    finding says no share can be given, in the console findings and the report's Findings."""
    from circuitkit.experiments.findings import format_findings
    from circuitkit.experiments.report import findings_in

    line, found = findings_in(edges_run)
    edge = [f for f in found if f.phase == "edges"]
    assert len(edge) == 1 and "Edges (Phase-1 heads into Phase-2 heads)" in format_findings(
        found, line)
    circ = read_circuit_json(edges_run / "edges" / "circuit.json")
    assert ("No share" in edge[0].headline) == bool(circ["degenerate"])
    run = _copy_run(edges_run, tmp_path / "run")
    assert _report(run).exit_code == 0
    page = (run / "report.html").read_text()
    assert "data-phase='edges'" in page


def _strings(x, payload):
    """``x`` with ``payload`` appended to every string value (keys kept)."""
    if isinstance(x, dict):
        return {k: _strings(v, payload) for k, v in x.items()}
    if isinstance(x, list):
        return [_strings(v, payload) for v in x]
    return x + payload if isinstance(x, str) else x


MARK = "<script>document.body.setAttribute('data-x','pw'+'ned')</script>"
MARK_IMG = "<img src=x onerror=\"document.body.setAttribute('data-y','pw'+'ned')\">"


def test_report_runs_no_script_from_any_file_it_reads(edges_run, tmp_path):
    """Issue 33.1: every string field of every file the report reads carries a script (and an
    onerror image); where a loader accepts it the page shows it as text, and chromium runs
    none of it. Fields a strict loader refuses (circuit.json's ablation) are refused."""
    import pandas as pd
    from test_report import browser, run_chromium

    run = _copy_run(edges_run, tmp_path / "run")
    payload = MARK + MARK_IMG
    # circuit.json: a closed-set field is refused, naming it
    path = run / "edges" / "circuit.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps(dict(good, ablation="corrupt" + payload)))
    _resign(run)
    r = _report(run)
    assert r.exit_code == 2 and "'ablation'" in r.output
    # every free string: meta, degenerate note, summary, patch/edge results' meta, CSV cells
    bad = dict(good, meta=_strings(good["meta"], payload))
    path.write_text(json.dumps(bad))
    summary = json.loads((run / "summary.json").read_text())
    steps = summary.pop("steps")
    closed = json.loads(json.dumps(summary))  # closed-set fields keep their values (below)
    summary = _strings(summary, payload)
    summary["steps"] = steps
    # closed-set fields of the phase table (a direction) are refused when edited, as circuit.json's
    # ablation above; every free string around them is shown as text
    for key in ("phase_table", "lead"):
        if isinstance(closed.get(key), dict) and "direction" in closed[key]:
            summary[key]["direction"] = closed[key]["direction"]
        for p in (1, 2):
            ph = (closed.get(key) or {}).get(f"phase{p}")
            if isinstance(ph, dict) and "direction" in ph:
                summary[key][f"phase{p}"]["direction"] = ph["direction"]
    for st in (summary.get("stability") or {}).values():  # numbers the page prints, too
        st["k"] = f"{st['k']}{payload}"
    agree = (summary.get("scores_attrs") or {}).get("anchor_agreement")
    if agree:
        agree.update(k=payload, top_k_overlap=payload, spearman=payload)
    (run / "summary.json").write_text(json.dumps(summary))
    for js in [*run.glob("*.json"), run / "edges" / "edges.json"]:
        if js.name == "summary.json":
            continue
        info = json.loads(js.read_text())
        info["meta"] = _strings(info["meta"], payload)
        js.write_text(json.dumps(info))
    for csv in run.glob("*.csv"):
        frame = pd.read_csv(csv)
        for col in frame.columns:
            if frame[col].dtype == object and col not in ("phase", "direction", "pool",
                                                           "quantity", "ablation", "heads"):
                frame[col] = frame[col].astype(str) + payload
        frame.to_csv(csv, index=False)
    _resign(run)
    r = _report(run)
    assert r.exit_code == 0, r.output
    page = (run / "report.html").read_text()
    assert "&lt;script&gt;document.body" in page  # the payload is on the page, as text
    assert "Edges skipped" not in page and "data-phase='edges'" in page  # every part read
    exe = browser()
    probe = tmp_path / "probe.html"  # the detector works: an unescaped payload runs
    probe.write_text(f"<html><body>{MARK}{MARK_IMG}</body></html>")
    dom = run_chromium(exe, tmp_path, probe.as_uri(), "--dump-dom").stdout
    assert 'data-x="pwned"' in dom and 'data-y="pwned"' in dom, dom[-500:]
    dom = run_chromium(exe, tmp_path, (run / "report.html").as_uri(), "--dump-dom").stdout
    assert "<body" in dom
    assert 'data-x="pwned"' not in dom and 'data-y="pwned"' not in dom
