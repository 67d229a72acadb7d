"""Issue 49 ("nothing silently wrong, round five") and issue 44 items 1 and 4: each fault, as a
hostile or careless user meets it, with a test that failed on the code before the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import circuitkit as ck
from circuitkit.tasks import load_task

pytestmark = pytest.mark.filterwarnings("ignore::circuitkit.patching.results."
                                        "DegenerateBaselineWarning")


# --- item 1: evaluate decodes for real whenever the model is not causal ---------------------------


class LookAhead(nn.Module):
    """Logits at ``p`` put 30 on the token at ``p + 1`` of its own input: a perfect score from
    a teacher-forced pass, nothing real to decode (the last position sees no next token)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.v = vocab
        self.w = nn.Parameter(torch.zeros(1))  # (a parameter, as a model has)

    def forward(self, tokens):
        b, s = tokens.shape
        out = torch.zeros(b, s, self.v)
        out[:, :-1].scatter_(-1, tokens[:, 1:, None], 30.0)
        return out


def test_item_1_a_look_ahead_model_is_decoded_for_real():
    """Before: exact match 1.00 from the teacher-forced pass; real greedy decoding of the
    same model gives 0.00. Now evaluate measures causality and decodes a look-ahead model."""
    from circuitkit import evaluation

    task = load_task("synthetic", n_examples=12, seed=1, n_labels=60, children=4)
    model = LookAhead(len(task.vocab))
    prompts, new = evaluation.task_prompts(task)
    real = evaluation.greedy_decode(model, prompts, task.eos_id, new)
    want = evaluation.task_set_metrics(real, task)["exact_match"]
    got = ck.evaluate(model, task)
    assert want == 0.0 and got["exact_match"] == want, got
    assert evaluation.reads_ahead(model, task.clean_tokens)
    # a causal model still takes the shortcut: its probe finds nothing read ahead
    torch.manual_seed(0)
    tiny = ck.load_model(
        {"model_type": "llama", "vocab_size": len(task.vocab), "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 128}, device="cpu")
    assert not evaluation.reads_ahead(tiny, task.clean_tokens)


# --- items 3, 4, 11: every label and derived field a result file carries is bound to its values --


def _pair(n: int = 3, seq: int = 7, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 64, (n, seq), generator=g),
            torch.randint(1, 64, (n, seq), generator=g))


def _margin(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


def _edit_json(js, fn):
    import json

    info = json.loads(js.read_text())
    fn(info)
    js.write_text(json.dumps(info, indent=2))


def _edit_tensors(st, fn):
    from safetensors.torch import load_file, save_file

    t = load_file(str(st))
    fn(t)
    save_file(t, str(st))


def _refused(load, js, edit_json=None, edit_tensors=None):
    """Save-copy of ``js`` edited, then loaded: the ValueError's one line."""
    import shutil

    folder = js.parent / f"edit{len(list(js.parent.iterdir()))}"
    folder.mkdir()
    for f in js.parent.glob(js.stem + ".*"):
        shutil.copy(f, folder / f.name)
    j, s = folder / js.name, folder / (js.stem + ".safetensors")
    if edit_json is not None:
        _edit_json(j, edit_json)
    if edit_tensors is not None:
        _edit_tensors(s, edit_tensors)
    with pytest.raises(ValueError) as err:
        load(j)
    assert "\n" not in str(err.value)
    return str(err.value)


def _swap(key, i, j):
    def fn(info):
        xs = info["meta"][key]
        xs[i], xs[j] = xs[j], xs[i]
    return fn


def test_item_3_edited_group_labels_are_refused(tiny_llama, tmp_path):
    """Before: evidence<->answer swapped in group_names, a renamed group, a replaced
    groups_hash or group_sizes loaded, the values under the wrong labels."""
    from circuitkit.patching.results import PatchResult

    clean, corrupt = _pair()
    first = torch.zeros_like(clean, dtype=torch.bool)
    first[:, :3] = True
    res = ck.patch_heads(tiny_llama, clean, corrupt, _margin,
                         positions={"evidence": first, "answer": ~first},
                         options=dict(progress=False))
    res.save(tmp_path / "r", views=False)
    js = tmp_path / "r.json"
    back = PatchResult.load(js)  # intact: loads, same labels
    assert back.meta["group_names"] == ["evidence", "answer"]
    assert torch.equal(back.values, res.values)
    for edit in (_swap("group_names", 0, 1),
                 lambda i: i["meta"]["group_names"].__setitem__(0, "shortlist"),
                 lambda i: i["meta"].__setitem__("groups_hash", "0123456789abcdef"),
                 lambda i: i["meta"].__setitem__("group_sizes",
                                                 i["meta"]["group_sizes"][::-1])):
        assert "digest" in _refused(PatchResult.load, js, edit_json=edit)


def test_item_4_edited_path_results_are_refused(tiny_llama, tmp_path):
    """Before: two receivers swapped, path_groups reversed, meta.coverage edited, meta.node x10
    all loaded."""
    from circuitkit.patching.results import PatchResult

    clean, corrupt = _pair()
    half = torch.zeros_like(clean, dtype=torch.bool)
    half[:, 3:] = True
    res = ck.patch_paths(tiny_llama, clean, corrupt, _margin, [(0, 0), (0, 1)], [(1, 0), (2, 1)],
                         positions={"all": torch.ones_like(half),
                                                     "late": half},
                         inputs=("q",), options=dict(progress=False))
    res.save(tmp_path / "paths", views=False)
    js = tmp_path / "paths.json"
    PatchResult.load(js)  # intact

    def scale_node(info):
        info["meta"]["node"] = {k: 10 * v for k, v in info["meta"]["node"].items()}

    def edit_coverage(info):
        cov = info["meta"]["coverage"]
        first = next(iter(cov))
        cov[first] = json_bump(cov[first])

    for edit in (_swap("receivers", 0, 1), _swap("path_groups", 0, 1), edit_coverage,
                 scale_node):
        _refused(PatchResult.load, js, edit_json=edit)


def test_item_4_an_edited_circuit_json_is_refused(tmp_path):
    """The same binding for the circuit file: its derived fields (share, CPR, CMD, the curve)
    edited loaded before (only types and ranges were checked)."""
    import json

    from planted_induction import planted_induction_model, planted_task

    from circuitkit.patching.results import read_circuit_json

    model, task = planted_induction_model(), planted_task(8)
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         options=dict(progress=False))
    path = ck.circuit(model, task, res, options=dict(progress=False, n_boot=0)).save_json(
        tmp_path / "c.json")
    read_circuit_json(path)  # intact
    for key in ("cpr", "faithfulness"):
        data = json.loads(path.read_text())
        data[key] = data[key] * 0.5
        bad = tmp_path / f"{key}.json"
        bad.write_text(json.dumps(data))
        with pytest.raises(ValueError, match="field 'digest' does not match"):
            read_circuit_json(bad)


def json_bump(x):
    """``x`` (a JSON number, or lists/objects of them) with every number + 0.5."""
    if isinstance(x, dict):
        return {k: json_bump(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_bump(v) for v in x]
    return x + 0.5 if isinstance(x, int | float) and x == x else x


def test_item_11_an_exact_edge_result_edited_is_refused(tiny_llama, tmp_path):
    """Before: an exact EdgeResult's values cell +5.0 (no per-prompt values to check it
    against) loaded without a word, and so did values and per-prompt values x10 together."""
    from circuitkit.patching.results import EdgeResult

    clean, corrupt = _pair()
    res = ck.patch_edges(tiny_llama, clean, corrupt, _margin, options=dict(progress=False))
    res.save(tmp_path / "edges", views=False)
    js = tmp_path / "edges.json"
    EdgeResult.load(js)
    cell = tuple(res.edge_mask().nonzero()[0].tolist())

    def plus5(t):
        t["values"][cell] += 5.0
        t.pop("per_prompt", None), t.pop("clean_per_prompt", None)
        t.pop("corrupt_per_prompt", None)

    def times10(t):
        t["values"] *= 10
        if "per_prompt" in t:
            t["per_prompt"] *= 10

    assert "digest" in _refused(EdgeResult.load, js, edit_tensors=plus5)
    assert "digest" in _refused(EdgeResult.load, js, edit_tensors=times10)
    # a file written before digests (format 1) still loads, and says it is unchecked
    from circuitkit.patching.results.files import UncheckedResultWarning

    _edit_json(js, lambda i: (i.pop("digest"), i.__setitem__("version", 1)))
    with pytest.warns(UncheckedResultWarning, match="before result files carried a digest"):
        EdgeResult.load(js)


# --- item 2 and the kill -9 claim: one rule for claims and locks ----------------------------------



def _cli(args):
    from typer.testing import CliRunner

    from circuitkit.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_item_2_a_run_refused_by_the_lock_leaves_the_holders_claim_and_lock(tmp_path, holder):
    """Before: run B wrote its claim, A took the lock, B (refused by it) released its claim on
    exit, deleting A's ``.circuitkit.lock`` (and claim) while A ran: a third command then took
    a new lock and wrote beside A. Now the lock comes first and a claim is released only under
    it."""
    from circuitkit.cli.console import RUN_FILE
    from circuitkit.files import LOCK_NAME

    out = tmp_path / "shared"
    proc = holder(out)
    edges = ["edges", "--model", "induction-2l", "--task", "induction", "-n", "2", "--out", out]
    for _ in range(2):  # B, then a third command: both refused, nothing of A's touched
        r = _cli(edges)
        assert r.exit_code == 2 and f"in use by another process (pid {proc.pid})" \
            in r.output, r.output
        assert (out / LOCK_NAME).read_text() == str(proc.pid)
        assert not (out / RUN_FILE).exists()


def test_unclear_a_killed_commands_empty_claim_is_taken_over(tmp_path):
    """Before: after ``kill -9`` of a command that wrote nothing, another command on the folder
    was refused ("holds the results of `circuitkit patch`") until ``.circuitkit-run`` was
    deleted by hand. Now a claim with nothing behind it (under the lock: no run is alive there)
    is stale and taken over; a claim with results behind it still refuses."""
    import json

    from circuitkit.cli.checks import _claim_folder
    from circuitkit.cli.console import FRESH_CLAIMS, RUN_FILE
    from circuitkit.files import LOCK_NAME

    out = tmp_path / "o"
    out.mkdir()
    (out / RUN_FILE).write_text(json.dumps({"command": "patch"}) + "\n")
    (out / LOCK_NAME).write_text("999999")  # the killed command's lock file (no flock held)
    lock = _claim_folder(out, "edges")
    try:
        assert json.loads((out / RUN_FILE).read_text())["command"] == "edges"
    finally:
        lock.close()
        FRESH_CLAIMS.clear()
    (out / "edges.json").write_text("{}")  # a result behind the claim: refused as before
    with pytest.raises(ValueError, match="holds the results of `circuitkit edges`"):
        _claim_folder(out, "patch")


# --- item 5, the crash, item 6, item 8 and the positions= messages: positions that exist -------


def _last(logits_step):
    return logits_step[..., 3]


def test_item_5_a_prompt_whose_positions_are_all_padding_is_refused():
    """Before: ``at_answers(reading, torch.full((n,), -1), tgt)`` read logit position 0 of
    every prompt (only a misleading "the corruption does not change the metric" warning)."""
    from circuitkit.metrics import at_answers

    with pytest.raises(ValueError, match=r"3 of 3 prompts have no position to read .*prompts "
                                         r"0, 1, 2"):
        at_answers(_last, torch.full((3,), -1))
    with pytest.raises(ValueError, match="prompts have no position to read .*prompts 1\\)"):
        at_answers(_last, [[2, 3], [-1, -1]])
    with pytest.raises(ValueError, match="position -2 of prompt 0 is negative"):
        at_answers(_last, torch.tensor([-2, 3]))


def test_crash_positions_past_the_prompts_are_one_line_not_an_index_error(tiny_llama):
    """Before: ``at_answers(positions=20)`` on 20-token unpadded prompts: ``IndexError`` at
    ``fused.py:276``."""
    from circuitkit.metrics import at_answers

    clean, corrupt = _pair(n=2, seq=20)
    m = at_answers(_last, torch.full((2,), 20))
    for method in ("exact", "attribution"):
        with pytest.raises(ValueError, match=r"reads logit position 20 of prompt 0, but the "
                                             r"prompts have 20 tokens \(positions 0..19\)"):
            ck.patch_heads(tiny_llama, clean, corrupt, m, method=method,
                           options=dict(progress=False))
    with pytest.raises(ValueError, match="positions go up to 20 but the logits have 20"):
        m(torch.zeros(2, 20, 64))  # called directly


def test_unclear_positions_as_numpy_or_nested_lists_are_one_short_line(tiny_llama):
    """Before: ``positions=`` a numpy array: numpy's "truth value ... is ambiguous"; a nested
    list: a 269,117-character message echoing the mask."""
    import numpy as np

    clean, corrupt = _pair(n=2, seq=7)
    for given in (np.ones((2, 7), dtype=bool), [[True] * 7] * 2 * 1000):
        with pytest.raises(ValueError) as err:
            ck.patch_heads(tiny_llama, clean, corrupt, _margin, positions=given,
                           options=dict(progress=False))
        msg = str(err.value)
        assert "ambiguous" not in msg and len(msg) < 400 and "torch" in msg, msg
    # at_answers takes a numpy array of positions as the tensor it holds
    from circuitkit.metrics import at_answers

    assert at_answers(_last, np.array([6, 5])).reads.tolist() == [[6], [5]]


def test_item_6_left_padded_prompts_are_refused_and_no_message_advises_left_padding(
        tiny_llama, monkeypatch):
    """Before: the right-padding refusal advised "Left-pad them"; left-padded prompts (no
    attention mask) gave clean values up to 0.49 logits off the unpadded ones, accepted."""
    clean, corrupt = _pair(n=3, seq=8)
    pad = 0
    clean[:, 0], corrupt[:, 0] = 5, 5  # (a first token no prompt pads with)
    left_c, left_x = clean.clone(), corrupt.clone()
    left_c[1, :3], left_x[1, :3] = pad, pad  # prompt 1 left-padded by 3

    from circuitkit.patching import inputs

    last = ck.metrics.at_answers(_last, torch.full((3,), 7))
    # the sweep's entry refuses them (the model's tokenizer pads with id 0 here)
    monkeypatch.setattr(inputs, "pad_token_id", lambda model: pad)
    with pytest.raises(ValueError, match=r"1 of 3 prompts are left-padded with pad token id 0 "
                                         r"\(prompts 1 \(3 pad tokens\)\)") as err:
        ck.patch_heads(tiny_llama, left_c, left_x, last, options=dict(progress=False))
    assert "\n" not in str(err.value)
    right_c, right_x = clean.clone(), corrupt.clone()
    right_c[1, -3:], right_x[1, -3:] = pad, pad
    with pytest.raises(ValueError, match="right-padded") as err:
        ck.patch_heads(tiny_llama, right_c, right_x, last, options=dict(progress=False))
    assert "left-pad them" not in str(err.value).lower()


def test_item_8_prompts_longer_than_the_context_are_refused_for_rotary_models_too(tiny_llama):
    """Before: a 5,020-token note on a model with n_ctx 64 (rotary) was patched, exit 0, while
    ``patch --plan --seq-len`` refused the same length."""
    assert tiny_llama.cfg.n_ctx == 64
    clean, corrupt = _pair(n=1, seq=70)
    with pytest.raises(ValueError, match="70 tokens but the model's context is n_ctx=64"):
        ck.patch_heads(tiny_llama, clean, corrupt, _margin, options=dict(progress=False))
    task = load_task("synthetic", n_examples=2, seed=1, n_labels=60, children=4)
    from circuitkit import hooks

    assert hooks.context_problem(tiny_llama, task.clean_tokens.shape[1]) is None
    assert "n_ctx=64" in hooks.context_problem(tiny_llama, 5020, "task 'x''s notes")


# --- item 10 and the CSV cells: strings from files escaped for the medium they go to ------------


def test_item_10_a_task_name_with_terminal_escapes_is_printed_escaped(tmp_path):
    """Before: a task name holding ``ESC]0;...BEL`` (read from a JSONL file) was printed raw by
    ``circuitkit patch``, retitling the terminal."""
    import json

    path = tmp_path / "t.jsonl"
    ck.load_task("icd10", n_examples=4, split="test").to_jsonl(path)
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["name"] = "evil\x1b]0;pwned\x07\x9b31m"
    path.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    r = _cli(["patch", "--model", "icd-teacher", "--task", path, "--method", "attribution",
              "--out", tmp_path / "o"])
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output and "\x9b" not in r.output
    assert "evil\\x1b]0;pwned\\x07\\x9b31m" in r.output


def test_unclear_group_names_in_result_csv_are_not_spreadsheet_formulas(tiny_llama, tmp_path):
    """Before: group names were written to ``result.csv`` as given (``=HYPERLINK(...)``)."""
    import csv

    from circuitkit.escape import csv_safe

    clean, corrupt = _pair()
    first = torch.zeros_like(clean, dtype=torch.bool)
    first[:, :3] = True
    evil = '=HYPERLINK("http://x","y")'
    res = ck.patch_heads(tiny_llama, clean, corrupt, _margin, positions={evil: first, "-": ~first},
                         options=dict(progress=False))
    res.save(tmp_path / "r")
    groups = {row["group"] for row in csv.DictReader((tmp_path / "r.csv").open())}
    assert groups == {"'" + evil, "-"}
    assert csv_safe("-1.5") == "-1.5" and csv_safe("@SUM(A1)") == "'@SUM(A1)"


# --- issue 44 item 4: top(k) refuses k < 1 --------------------------------------------------------


def test_issue44_item_4_top_refuses_k_below_one(tiny_llama):
    """Before: ``res.top(-3)`` returned every row but the last 3."""
    clean, corrupt = _pair()
    res = ck.patch_heads(tiny_llama, clean, corrupt, _margin, options=dict(progress=False))
    for k in (-3, 0, 2.5, True):
        with pytest.raises(ValueError, match="top: k must be a positive integer"):
            res.top(k)
    assert len(res.top(3)) == 3
    edges = ck.patch_edges(tiny_llama, clean, corrupt, _margin, senders=[(0, 0)],
                           receivers=[(1, 0)], options=dict(progress=False))
    with pytest.raises(ValueError, match="top: k must be a positive integer"):
        edges.top(-1)


# --- item 7: a held-out sample holds no repeat of a selection example ----------------------------


def test_item_7_repeated_rows_are_not_validated_as_held_out():
    """Before: a JSONL task with duplicate rows gave selection and validation samples with the
    same hash in summary.json, and the findings said "validated on the held-out 12-23"."""
    from circuitkit.experiments.characterize import selection_samples
    from circuitkit.experiments.findings import run_line

    task = load_task("synthetic", n_examples=24, seed=1, n_labels=60, children=4)
    twice = task.subset(list(range(12)) * 2)  # rows 12-23 repeat rows 0-11
    with pytest.raises(ValueError, match="every held-out example .* repeats one of the "
                                         "selection sample"):
        selection_samples(twice, 12, 0)
    some = task.subset(list(range(12)) + list(range(6)) + list(range(12, 18)))
    chosen, held, samples = selection_samples(some, 12, 0)
    assert len(held) == 6 and samples["validate"]["left_out"] == list(range(12, 18))
    assert samples["select"]["hash"] != samples["validate"]["hash"]
    keys = {tuple(e.tokens.tolist()) for e in chosen.examples}
    assert not any(tuple(e.tokens.tolist()) in keys for e in held.examples)
    line = run_line(dict(model="m", identity=dict(task="t", n_examples=24), samples=samples))
    assert "held-out 12-23 less 6 that repeat selection examples (6 validated)" in line, line


# --- item 9 and issue 44 item 1: one degenerate-baseline rule for every share printed -----------


def test_issue44_item_1_the_column_is_named_raw_effect_when_the_baseline_is_degenerate(
        tiny_llama, tmp_path):
    """Before: when the corruption did not lower the metric, ``normalized`` in the frame and in
    ``result.csv`` held raw effects (only a stderr warning said so)."""
    import csv

    from circuitkit.patching.results import EdgeResult, PatchResult

    clean, _ = _pair()
    res = ck.patch_heads(tiny_llama, clean, clean.clone(), _margin, options=dict(progress=False))
    frame = res.to_frame()
    assert res.degenerate and "raw_effect" in frame and "normalized" not in frame
    assert res.value_column == "raw_effect"
    assert list(res.top(2).columns) == list(frame.columns)
    res.save(tmp_path / "r")
    header = next(csv.reader((tmp_path / "r.csv").open()))
    assert "raw_effect" in header and "normalized" not in header
    assert "raw_effect" in PatchResult.load(tmp_path / "r").to_frame()
    edges = ck.patch_edges(tiny_llama, clean, clean.clone(), _margin, senders=[(0, 0)],
                           receivers=[(1, 0)], options=dict(progress=False))
    assert "raw_effect" in edges.to_frame() and "normalized" not in edges.to_frame()
    assert isinstance(edges, EdgeResult) and "raw_effect" in edges.top(1)
    # a result whose corruption lowers the metric keeps its "normalized" column
    fine = PatchResult(values=torch.tensor([[0.5]]), clean=1.0, corrupt=0.0, direction="denoise",
                       method="exact", site="z", positions="all")
    assert fine.value_column == "normalized" and "normalized" in fine.to_frame()


def test_item_9_no_share_of_a_gap_the_corruption_does_not_open(tiny_llama):
    """Before, with a corruption identical to clean: "moves anchor_margin by nan% of the gap",
    "made in no single layer at the no single position group positions", and path coverage
    266.7% / 133.3% / 66.7%: the degenerate-baseline rule reached only faithfulness."""
    import math

    import pandas as pd

    from circuitkit.experiments.characterize import causal_validation
    from circuitkit.experiments.findings import causal_validation_lines
    from circuitkit.scoring.causal import phase_sentences

    clean, _ = _pair()
    half = torch.zeros_like(clean, dtype=torch.bool)
    half[:, 3:] = True
    paths = ck.patch_paths(tiny_llama, clean, clean.clone(), _margin, [(0, 0), (0, 1)],
                           [(1, 0), (2, 1)],
                           positions={"all": torch.ones_like(half),
                                                       "late": half},
                           inputs=("q",), options=dict(progress=False))
    assert paths.degenerate
    for row in paths.meta["coverage"].values():
        assert all(math.isnan(v) for v in row.values()), row
    # the causal validation: no share, the raw effect said
    val = pd.DataFrame([dict(direction="noise", phase=1, quantity="anchor_margin",
                             heads="L0H1, L1H0", normalized=float("nan"), n_prompts=8,
                             clean=2.0, corrupt=2.0, top_effect=0.003, pool="all-layers",
                             p_value=0.5, p_low=0.4, p_high=0.6, n_random=100)])
    summary = dict(causal_validation=causal_validation(val))
    (line,) = causal_validation_lines(summary)
    assert "nan" not in line.lower() and "no share of the gap" in line, line
    # where each decision is made: no "no single layer ... no single position group"
    table = dict(direction="noise", k=3, share=0.1, phase1=dict(
        metric="anchor_margin", gap=0.0, degenerate=True, groups={}, carrying_groups=[],
        layers={}, carrying_layers=[], top_heads=[]))
    (line,) = phase_sentences(table)
    assert "no single" not in line and "%" not in line and "cannot be placed" in line, line


# --- the other unclear items: long errors, a NaN that names its prompt ----------------------------


def test_unclear_a_jsonl_with_many_bad_rows_is_a_short_error(tmp_path):
    """Before: a JSONL with 100,000 bad rows gave a 9.1 MB, 100,001-line error."""
    path = tmp_path / "t.jsonl"
    ck.load_task("icd10", n_examples=2, split="test").to_jsonl(path)
    with path.open("a") as f:
        f.write("{not json\n" * 500)
    with pytest.raises(ValueError) as err:
        ck.Task.from_jsonl(path)
    msg = str(err.value)
    assert msg.startswith("500 problem(s) in") and len(msg.splitlines()) <= 22, msg[:300]
    assert "... and 480 more" in msg and len(msg) < 5000


def test_unclear_a_nan_on_some_patched_runs_names_its_prompt_and_variant():
    """Before: the refusal printed the first 8 values (no NaN among them) and named no prompt
    or variant."""
    from circuitkit.metrics import at_answers
    from circuitkit.patching.exact.checks import evaluate_metric

    m = at_answers(_last, torch.full((4,), 2)).select(list(range(4)) * 3)  # 3 variants
    logits = torch.zeros(12, 5, 64)
    logits[9, 2, 3] = float("nan")  # variant 2, prompt 1
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\) \(NaN/inf\) of 12: the first "
                                         r"nan at prompt 1, variant 2 of this call's 3 \(patched "
                                         r"layer 0\)"):
        evaluate_metric(m, logits, "patched layer 0")
