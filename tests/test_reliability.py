"""Nothing silently wrong: each case that once gave a wrong result with exit status 0 now gives a
correct result or one clear message. Bad inputs are a table: add a row, not a function."""

from __future__ import annotations

import json
import os
import stat
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import call
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app
from circuitkit.patching.checkpoint import _take_lock
from circuitkit.patching.results import PatchResult

SWEEP = dict(positions="each", site="z", batch_size=6, progress=False)


@pytest.fixture(scope="module")
def task():
    return ck.load_task("induction", n_examples=3, seg_len=5, vocab_size=64, seed=2)


def sweep(model, task, metric=None, **kw):
    return call(ck.patch_heads, model, task.clean_tokens, task.corrupt_tokens,
                metric if metric is not None else task.metric, **{**SWEEP, **kw})


# --- 1. a checkpoint is tied to its metric by behaviour, not by name ----------------------------


def test_resume_under_another_metric_of_the_same_name_is_refused(tiny_llama, task, tmp_path):
    m = task.metric
    sweep(tiny_llama, task, lambda logits: m(logits), checkpoint=tmp_path / "c")
    with pytest.raises(ValueError, match="different sweep.*metric_behaviour"):
        sweep(tiny_llama, task, lambda logits: -m(logits), checkpoint=tmp_path / "c")
    # the same metric again resumes (nothing recomputed, same numbers)
    again = sweep(tiny_llama, task, lambda logits: m(logits), checkpoint=tmp_path / "c")
    assert torch.equal(again.values, sweep(tiny_llama, task, lambda logits: m(logits)).values)


def test_changed_siblings_change_the_metric_identity(tmp_path):
    """The Phase-2 metric (the sibling margin) reads the corrupted target's siblings: other
    siblings, another metric (the checkpoint refuses to resume)."""
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=4, split="test", seed=5)
    other = task.subset(range(4))
    n = len(task.label_names)
    other.examples = [type(e)(**{**e.__dict__, "meta": {
        **e.meta, "p2_siblings": [(s + 1) % n for s in e.meta["p2_siblings"]]}})
        for e in task.examples]
    args = dict(options=dict(progress=False, checkpoint=tmp_path / "c"))
    ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, **args)
    assert not torch.equal(task.metric(torch.randn(4, task.clean_tokens.shape[1], 3516)),
                           other.metric(torch.randn(4, task.clean_tokens.shape[1], 3516)))
    with pytest.raises(ValueError, match="metric_behaviour"):
        ck.patch_heads(model, other.clean_tokens, other.corrupt_tokens, other.metric, **args)


# --- 2. every chunk is verified before use ------------------------------------------------------


def _truncate(p, files):
    p.write_bytes(p.read_bytes()[:40])


def _resize(p, files):
    meta = json.loads(p.read_bytes()[8:8 + int.from_bytes(p.read_bytes()[:8], "little")])
    save_file({"values": torch.zeros(1, 1)}, str(p), metadata=meta.get("__metadata__"))


def _scale(p, files):
    meta = json.loads(p.read_bytes()[8:8 + int.from_bytes(p.read_bytes()[:8], "little")])
    save_file({"values": load_file(str(p))["values"] * 2}, str(p),
              metadata=meta.get("__metadata__"))


def _flip_byte(p, files):
    b = bytearray(p.read_bytes())
    b[-3] ^= 0xFF
    p.write_bytes(bytes(b))


def _swap(p, files):
    q = files[1]
    a, b = p.read_bytes(), q.read_bytes()
    p.write_bytes(b)
    q.write_bytes(a)


def _delete(p, files):
    p.unlink()


FAULTS = {"truncate": _truncate, "resize": _resize, "scale": _scale, "flip a byte": _flip_byte,
          "swap two files": _swap, "delete": _delete}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_corrupted_chunks_are_named_and_recomputed(tiny_llama, task, tmp_path, fault):
    full = sweep(tiny_llama, task)
    sweep(tiny_llama, task, checkpoint=tmp_path)
    files = sorted(tmp_path.glob("chunk_*.safetensors"))
    FAULTS[fault](files[0], files)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = sweep(tiny_llama, task, checkpoint=tmp_path)
    assert torch.equal(resumed.values, full.values)
    assert torch.equal(resumed.per_prompt, full.per_prompt)
    if fault != "delete":
        assert any(files[0].name in str(w.message) for w in caught), [str(w.message)
                                                                        for w in caught]


# --- 3. JSONL: one source of truth per field ----------------------------------------------------


def _rewrite(path, edit):
    lines = path.read_text().splitlines()
    head, rows = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
    edit(head, rows)
    path.write_text("\n".join(json.dumps(x) for x in [head, *rows]) + "\n")


def test_jsonl_corrupt_tokens_are_the_corruption(tmp_path):
    task = ck.load_task("icd10", n_examples=3, split="test", seed=1)
    p = tmp_path / "t.jsonl"
    task.to_jsonl(p)
    assert "corrupt_tokens_p2" not in p.read_text()  # written once, as corrupt_tokens

    def edit(head, rows):
        rows[0]["corrupt_tokens"][1] = 7
    _rewrite(p, edit)
    assert int(ck.Task.from_jsonl(p).examples[0].corrupt_tokens[1]) == 7


@pytest.mark.parametrize("edit,message", [
    (lambda h, r: r[0].__setitem__("corrupt_tokens_p2", r[0]["corrupt_tokens"]),
     "duplicates 'corrupt_tokens'"),
    (lambda h, r: r[0].__setitem__("corrupt_tokens_p1", [1.5] * len(r[0]["tokens"])),
     "'corrupt_tokens_p1' is not a list of integers"),
    (lambda h, r: (h.__setitem__("version", 1), r[0]["meta"].__setitem__(
        "corrupt_tokens_p2", [1] * len(r[0]["tokens"]))), "disagrees with 'corrupt_tokens'"),
    (lambda h, r: (h.__setitem__("version", 1), r[0]["meta"].__setitem__(
        "corrupt_tokens_p1", [0.5] * len(r[0].pop("corrupt_tokens_p1")))),
     "not a list of integers"),
    (lambda h, r: (h.__setitem__("version", 1), r[0]["meta"].__setitem__(
        "corrupt_tokens_p1", r[0]["corrupt_tokens_p1"])), "given both as a field and in 'meta'"),
    (lambda h, r: r.clear(), "holds no examples"),
])
def test_jsonl_bad_corruptions_are_refused(tmp_path, edit, message):
    task = ck.load_task("icd10", n_examples=3, split="test", seed=1)
    p = tmp_path / "t.jsonl"
    task.to_jsonl(p)
    _rewrite(p, edit)
    with pytest.raises(ValueError, match=message):
        ck.Task.from_jsonl(p)


def test_jsonl_version1_meta_corruptions_still_load(tmp_path):
    task = ck.load_task("icd10", n_examples=3, split="test", seed=1)
    p = tmp_path / "t.jsonl"
    task.to_jsonl(p)

    def to_v1(head, rows):
        head["version"] = 1
        for r in rows:
            r["meta"]["corrupt_tokens_p1"] = r.pop("corrupt_tokens_p1")
            r["meta"]["corrupt_anchors"] = r.pop("corrupt_anchors")
    _rewrite(p, to_v1)
    back = ck.Task.from_jsonl(p)
    assert torch.equal(back.with_phase(1).corrupt_tokens, task.with_phase(1).corrupt_tokens)


# --- 4. NaN metrics and degenerate baselines ----------------------------------------------------


def test_attribution_refuses_a_nan_metric(tiny_llama, task):
    with pytest.raises(ValueError, match="not finite"):
        ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                       lambda logits: logits[:, -1, 0].mean() * float("nan"), method="attribution",
                       options=dict(progress=False))


def test_clean_equal_to_corrupt_warns_once_and_shows_raw_effects(tiny_llama, task):
    """Clean = corrupt: the sweep warns once (at the call), and normalized() and top() give the
    raw effect value - baseline (no further warning) instead of NaN."""
    with pytest.warns(UserWarning, match="does not change") as caught:
        res = ck.patch_heads(tiny_llama, task.clean_tokens, task.clean_tokens, task.metric,
                             options=dict(progress=False))
    assert res.degenerate and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        torch.testing.assert_close(res.normalized(), res.values - res.corrupt)
        low, high = res.confidence_interval()
        assert bool((low <= res.normalized() + 1e-6).all() and (res.normalized() <= high + 1e-6)
                    .all())
        top = res.top(3)
    assert len(top) == 3 and not top["value"].isna().any()
    assert "raw effect" in res.meta["normalization"]
    fake = PatchResult(values=torch.tensor([[0.0, 3.0], [-5.0, 1.0]]), clean=1.0, corrupt=1.0,
                       direction="noise", method="exact", site="z", positions="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # effects against the baseline 1.0: -1, 2, -6, 0 -> strongest (1, 0) then (0, 1)
        assert list(zip(fake.top(2)["layer"], fake.top(2)["head"], strict=True)) == [(1, 0),
                                                                                      (0, 1)]


# --- 5. PatchResult.load validates every field --------------------------------------------------


def _saved(tmp_path):
    res = PatchResult(values=torch.zeros(2, 3), clean=1.0, corrupt=0.0, direction="denoise",
                      method="exact", site="z", positions="all", per_prompt=torch.zeros(4, 2, 3),
                      clean_per_prompt=torch.ones(4), corrupt_per_prompt=torch.zeros(4))
    res.save(tmp_path / "r")
    return tmp_path / "r.json", tmp_path / "r.safetensors"


@pytest.mark.parametrize("edit,message", [
    (lambda info: info.__setitem__("direction", "sideways"), "direction='sideways'"),
    (lambda info: info.__setitem__("site", "nope"), "site='nope'"),
    (lambda info: info.__setitem__("method", "magic"), "method='magic'"),
    (lambda info: info.__setitem__("positions", "some"), "positions='some'"),
    (lambda info: info.__setitem__("axes", ["layer"]), "axes"),
    (lambda info: info.__setitem__("version", 99), "newer"),
    (lambda info: info.pop("clean"), "missing field"),
])
def test_load_names_the_file_and_the_bad_field(tmp_path, edit, message):
    js, _ = _saved(tmp_path)
    info = json.loads(js.read_text())
    edit(info)
    js.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=message) as err:
        PatchResult.load(tmp_path / "r")
    assert str(js) in str(err.value) or "r.json" in str(err.value)


def test_load_refuses_tensors_of_another_shape_and_truncated_files(tmp_path):
    js, st = _saved(tmp_path)
    save_file({"values": torch.zeros(2, 3), "per_prompt": torch.zeros(4, 5, 3)}, str(st))
    with pytest.raises(ValueError, match="per_prompt has shape"):
        PatchResult.load(st)
    js.write_text(js.read_text()[:20])
    with pytest.raises(ValueError, match="r.json is not a readable result"):
        PatchResult.load(js)


# --- 6-8. the CLI: --out first, whole messages, bad arguments as one line -----------------------


def _cli(args):
    return CliRunner().invoke(app, args)


def test_out_that_is_a_file_fails_before_any_work(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    r = _cli(["patch", "--model", "no-such-model", "--task", "induction", "--out", str(f)])
    # refused on --out, before the (unknown) model is even looked at
    assert r.exit_code == 2 and "--out" in r.output and "existing file" in r.output
    r = _cli(["patch", "--model", "no-such-model", "--task", "induction", "--out",
              str(f / "sub")])
    assert r.exit_code == 2 and "--out" in r.output and "not writable" in r.output


def test_cli_shows_every_line_of_a_multi_line_error(tmp_path):
    task = ck.load_task("induction", n_examples=3, seg_len=5, vocab_size=64, seed=2)
    p = tmp_path / "bad.jsonl"
    task.to_jsonl(p)

    def edit(head, rows):
        rows[0]["targets"] = [10**6]
        rows[2]["answer_pos"] = [999]
    _rewrite(p, edit)
    r = _cli(["patch", "--model", "induction-2l", "--task", str(p), "--out",
              str(tmp_path / "o")])
    assert r.exit_code == 2
    assert f"{p}:2: unknown label id" in r.output and f"{p}:4: 'answer_pos'" in r.output


BAD_CLI = [  # (arguments after the command, text the one-line error must contain)
    # (each names the flag as typed, not the Python parameter: "--batch-size 0", not
    # "batch_size=0"; one wording for every positive-integer flag)
    (["patch", "-n", "0"], "--n-examples 0: expected a positive integer"),
    (["patch", "-n", "-3"], "--n-examples -3: expected a positive integer"),
    (["patch", "--batch-size", "0"], "--batch-size 0: expected a positive integer"),
    (["patch", "--batch-size", "-1"], "--batch-size -1: expected a positive integer"),
    (["patch", "--site", "nope"], "--site nope: not one of z, pattern"),
    (["patch", "--method", "magic"], "--method magic: not one of exact"),
    (["patch", "--direction", "denoising"], "--direction denoising: not one of denoise, noise"),
    (["patch", "--method", "attribution+exact", "--top-k", "-5"],
     "--top-k -5: expected a positive integer"),
    (["edges", "--top-k", "-5"], "--top-k -5: expected a positive integer"),
    (["edges", "--direction", "denoising"], "--direction denoising: not one of denoise, noise"),
    (["evaluate", "-n", "0"], "--n-examples 0: expected a positive integer"),
    (["evaluate", "--batch-size", "0"], "--batch-size 0: expected a positive integer"),
    (["score", "-k", "0"], "-k 0: expected a positive integer"),
    (["score", "-k", "99"], "-k 99: expected 1..8 (heads of induction-2l)"),
    (["characterize", "-k", "99"], "-k 99: expected 1..8 (heads of induction-2l)"),
]


@pytest.mark.parametrize("args,message", BAD_CLI)
def test_bad_cli_arguments_are_one_clear_line(tmp_path, monkeypatch, args, message):
    import circuitkit as ck

    def no_load(*a, **k):
        raise AssertionError("refused too late: the model loaded")

    monkeypatch.setattr(ck, "load_model", no_load)  # every flag is checked before it loads
    r = _cli([*args, "--model", "induction-2l", "--task", "induction", *(
        ["--out", str(tmp_path / "o")] if args[0] != "evaluate" else [])])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_n_with_a_jsonl_task_takes_its_first_rows(tmp_path):
    task = ck.load_task("induction", n_examples=5, seg_len=5, vocab_size=64, seed=2)
    p = tmp_path / "t.jsonl"
    task.to_jsonl(p)
    r = _cli(["patch", "--model", "induction-2l", "--task", str(p), "-n", "3", "--out",
              str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    res = PatchResult.load(tmp_path / "o")
    assert res.meta["n_examples"] == 3 and res.meta["n_prompts"] == 3
    r = _cli(["patch", "--model", "induction-2l", "--task", str(p), "-n", "9", "--out",
              str(tmp_path / "o2")])
    assert r.exit_code == 2 and "more than the 5 examples" in r.output


BAD_API = [  # (what to change in the arguments of patch_heads, text of the ValueError)
    (dict(clean=lambda c: c - 100), "token ids must be >= 0"),
    (dict(clean=lambda c: c[:0], corrupt=lambda c: c[:0]), "empty"),
    (dict(clean=lambda c: c[:, :0], corrupt=lambda c: c[:, :0]), "empty"),
    (dict(batch_size=0), "batch_size=0"),
    (dict(batch_size=-1), "batch_size=-1"),
    (dict(batch_size=2.5), "batch_size=2.5"),
    (dict(clean=lambda c: c[None], corrupt=lambda c: c[None]), r"must be 2-D \[batch, seq\]"),
]


@pytest.mark.parametrize("change,message", BAD_API)
def test_bad_api_arguments_are_one_clear_line(tiny_llama, task, change, message):
    clean = change.get("clean", lambda c: c)(task.clean_tokens)
    corrupt = change.get("corrupt", lambda c: c)(task.corrupt_tokens)
    kw = {k: v for k, v in change.items() if k not in ("clean", "corrupt")}
    with pytest.raises(ValueError, match=message):
        call(ck.patch_heads, tiny_llama, clean, corrupt, task.metric, **kw, progress=False)


def test_a_task_metric_for_other_prompts_is_refused_not_an_index_error(tiny_llama, task):
    sub = task.subset(range(2))
    for method in ("exact", "attribution"):
        with pytest.raises(ValueError, match=f"made for {len(task)} prompts but clean_tokens "
                                             "has 2"):
            ck.patch_heads(tiny_llama, sub.clean_tokens, sub.corrupt_tokens, task.metric,
                           method=method, options=dict(progress=False))
    ck.patch_heads(tiny_llama, sub.clean_tokens, sub.corrupt_tokens, sub.metric,
                   options=dict(progress=False))


def test_prompts_past_learned_positions_are_refused_not_an_index_error(tiny_gpt2):
    model = tiny_gpt2  # n_positions 64
    long = torch.randint(0, 50, (1, 70))
    for method in ("exact", "attribution"):
        with pytest.raises(ValueError, match="model.s context is n_ctx=64"):
            ck.patch_heads(model, long, long.flip(1), lambda lg: lg[:, -1, 3], method=method,
                           options=dict(progress=False))


def test_truncated_checkpoint_header_names_the_file(tiny_llama, task, tmp_path):
    sweep(tiny_llama, task, checkpoint=tmp_path)
    header = tmp_path / "header.json"
    header.write_text(header.read_text()[:30])
    with pytest.raises(ValueError, match=f"checkpoint header {header} is unreadable"):
        sweep(tiny_llama, task, checkpoint=tmp_path)


# --- 9. one process per checkpoint folder --------------------------------------------------------


def test_a_checkpoint_folder_in_use_is_refused(tiny_llama, task, tmp_path):
    sweep(tiny_llama, task, checkpoint=tmp_path)
    lock = _take_lock(tmp_path, 0)  # another process's sweep holds the folder
    try:
        with pytest.raises(ValueError, match="in use by another process"):
            sweep(tiny_llama, task, checkpoint=tmp_path)
    finally:
        lock.close()
    sweep(tiny_llama, task, checkpoint=tmp_path)  # free again


# --- 11. result and checkpoint files follow the umask -------------------------------------------


def test_result_and_checkpoint_files_follow_the_umask(tiny_llama, task, tmp_path):
    old = os.umask(0o022)
    try:
        res = sweep(tiny_llama, task, checkpoint=tmp_path / "ckpt")
        written = res.save(tmp_path / "out" / "result")
    finally:
        os.umask(old)
    for p in [*written, *(tmp_path / "ckpt").glob("chunk_*.safetensors"),
              tmp_path / "ckpt" / "header.json"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
