"""Distillation faults of issue 22, each of which once trained or saved a wrong student with exit
status 0 (or lost a finished one): non-finite lambdas, a loss or gradient going non-finite, a
signal store whose shards or manifest were changed, a finished folder rerun with another config,
the training state deleted at the end, temporaries left by a killed save, a full disk."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, TINY_STUDENT, hand_scores
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit import files
from circuitkit.cli import app
from circuitkit.distill import signals as S
from circuitkit.distill import train as T
from circuitkit.distill.train import DistillConfig, prepare_store, train_student
from circuitkit.training import load_train_state

CFG = dict(pool_size=48, shard_size=24, steps=12, batch_size=8, warmup=2, save_every=4,
           lambda_p1=1.0, lambda_p2=1.0, seed=2,
           student={"n_layers": 2, "n_heads": 2, "d_model": 32, "d_mlp": 64})
DEAD = 2 ** 22 + 4321  # above the default pid_max: no such process


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("signals")
    frame = hand_scores(4, 8, TEACHER_P1, TEACHER_P2)
    files.write_text(folder / "scores.csv", frame.to_csv(index=False, float_format="%.17g"))
    prepare_store(DistillConfig(**CFG, store=str(folder)), folder, progress=False)
    return folder


def _cfg(store_dir, **kw):
    return DistillConfig(**{**CFG, "store": str(store_dir), **kw})


def _boom(*a, **k):
    raise AssertionError("trained (or built a store) although nothing was left to do")


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


# --- non-finite lambdas; a loss or gradient that goes non-finite ---------------------------------


@pytest.mark.parametrize("field,value", [("lambda_p2", float("inf")), ("lambda_p1", -float("inf")),
                                         ("lambda_ns", float("nan")), ("lr", float("inf")),
                                         ("weight_decay", float("nan"))])
def test_non_finite_numbers_are_refused(tmp_path, field, value):
    """Before: ``lambda_p2=inf`` was accepted (NaN refused) and trained a NaN student."""
    with pytest.raises(ValueError, match=f"{field} must be a number .*\\(finite\\), got"):
        train_student(DistillConfig(**{field: value}), tmp_path)


def test_cli_refuses_an_infinite_lambda(tmp_path):
    r = CliRunner().invoke(app, ["distill", "--quick", "--lambda-p2", "inf", "--out",
                                 str(tmp_path / "d")])
    assert r.exit_code == 2 and "lambda_p2 must be a number >= 0 (finite), got inf" in r.output
    assert not (tmp_path / "d" / "model.safetensors").exists()


def _poisoned(monkeypatch, at_call: int, how: str):
    """``student_terms`` as it is, except its ``at_call``-th call (1-based): the P2 term becomes
    infinite (``how="loss"``), or a term of value 0 whose gradient is NaN is added to the CoT
    term and the total (``how="grad"``: d sqrt(x)/dx at 0 is inf, times 0; the trainer takes
    each term's gradient on its own)."""
    real, calls = T.student_terms, [0]

    def terms(student, *a, **k):
        out = real(student, *a, **k)
        calls[0] += 1
        if calls[0] == at_call:
            if how == "loss":
                out = dict(out, p2=out["p2"] * float("inf"))
                out["total"] = out["cot"] + out["p1"] + out["p2"]
            else:
                w = next(student.parameters())
                poison = (w.sum() * 0).clamp(min=0).sqrt()
                out = dict(out, cot=out["cot"] + poison, total=out["total"] + poison)
        return out

    monkeypatch.setattr(T, "student_terms", terms)


@pytest.mark.parametrize("how,what", [("loss", "the loss is not finite \\(total inf.*p2 inf"),
                                      ("grad", "the gradient is not finite \\(norm nan")])
def test_a_non_finite_step_stops_keeping_the_last_good_state(tmp_path, store_dir, monkeypatch,
                                                             how, what):
    """Before: the run went on, saved a student whose every weight was NaN and exited 0. Now
    step 7 stops it with one error; the state saved at step 4 stays, no student is saved, and
    the same command (the fault gone) resumes from step 4 to the uninterrupted run's weights."""
    ref = train_student(_cfg(store_dir), tmp_path / "ref", progress=False)
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _poisoned(m, 7, how)
        with pytest.raises(ValueError, match=f"stopped at step 7 of 12: {what}") as err:
            train_student(_cfg(store_dir), out, progress=False)
    assert "last good training state (step 4) is kept" in str(err.value)
    assert not (out / "model.safetensors").exists() and not (out / T.RECORD).exists()
    state = load_train_state(out / T.STATE_FILE)
    assert state["step"] == 4
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    train_student(_cfg(store_dir), out, progress=False)
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_evaluate_refuses_a_model_with_nan_weights(tmp_path):
    """Before: ``evaluate`` printed ``focus nan`` and ``exact_match 0.0`` without a word."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from circuitkit.tasks.base import word_tokenizer

    task = ck.load_task("icd10", n_examples=4, seed=0, split="test")
    cfg = {k: v for k, v in TINY_STUDENT.items() if k not in ("model_type", "seed")}
    hf = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    hf.save_pretrained(tmp_path / "nan")
    word_tokenizer(task.vocab, str(tmp_path / "nan"))
    with pytest.raises(ValueError, match="weights hold NaN/inf in 1 parameter"):
        ck.evaluate(ck.load_model(str(tmp_path / "nan")), task)
    r = CliRunner().invoke(app, ["evaluate", "--model", str(tmp_path / "nan"), "-n", "4"])
    assert r.exit_code == 2 and "NaN/inf" in r.output and "focus" not in r.output, r.output


# --- a finished folder: kept state, no-op rerun, refused change, --overwrite, repair ------------


def test_a_finished_folder_is_kept_refused_or_replaced(tmp_path, store_dir, monkeypatch):
    """Before: the identical command retrained from scratch (the state was deleted at the end)
    and a changed one silently overwrote the finished student."""
    out = tmp_path / "run"
    train_student(_cfg(store_dir), out, progress=False)
    record = json.loads((out / T.RECORD).read_text())
    assert load_train_state(out / T.STATE_FILE)["step"] == CFG["steps"]  # kept
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    first = (out / "model.safetensors").read_bytes()
    with monkeypatch.context() as m:  # identical rerun: nothing is trained or built
        m.setattr(T, "student_terms", _boom)
        m.setattr(T, "prepare_store", _boom)
        assert train_student(_cfg(store_dir), out, progress=False) == out
    with pytest.raises(ValueError, match="finished student of another distillation config "
                                         "\\(lambda_p1: 1.0 -> 0.5\\); pass --overwrite"):
        train_student(_cfg(store_dir, lambda_p1=0.5), out, progress=False)
    assert (out / "model.safetensors").read_bytes() == first
    # a damaged student is rewritten from the kept state, without training
    (out / "model.safetensors").unlink()
    with monkeypatch.context() as m, pytest.warns(UserWarning, match="model.safetensors is "
                                                                     "missing"):
        m.setattr(T, "student_terms", _boom)
        train_student(_cfg(store_dir), out, progress=False)
    assert (out / "model.safetensors").read_bytes() == first
    # --overwrite: the other config is trained in its place
    train_student(_cfg(store_dir, lambda_p1=0.5), out, progress=False, overwrite=True)
    assert json.loads((out / T.RECORD).read_text())["config"]["lambda_p1"] == 0.5
    assert (out / "model.safetensors").read_bytes() != first


def test_an_unfinished_state_of_another_config_names_the_difference(tmp_path, store_dir,
                                                                    monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _poisoned(m, 7, "loss")
        with pytest.raises(ValueError, match="stopped at step 7"):
            train_student(_cfg(store_dir), out, progress=False)
    with pytest.raises(ValueError, match="different distillation config \\(lr: 0.001 -> "
                                         "0.0005\\); pass --overwrite"):
        train_student(_cfg(store_dir, lr=5e-4), out, progress=False)
    train_student(_cfg(store_dir, lr=5e-4), out, progress=False, overwrite=True)
    assert load_train_state(out / T.STATE_FILE)["config"]["lr"] == 5e-4


def test_temporaries_of_a_killed_save_are_removed_on_resume(tmp_path, store_dir):
    """Before: ``.staging.PID`` and ``.NAME.PID.tmp`` from a kill during the final save stayed."""
    out = tmp_path / "run"
    train_student(_cfg(store_dir), out, progress=False)
    (out / f".staging.{DEAD}").mkdir()
    (out / f".staging.{DEAD}" / "model.safetensors").write_bytes(b"half")
    (out / f".model.safetensors.{DEAD}.tmp").write_bytes(b"half")
    train_student(_cfg(store_dir), out, progress=False)
    assert not [p.name for p in out.iterdir() if "staging" in p.name or p.name.endswith(".tmp")]


def test_a_full_disk_at_the_final_save_is_one_error_and_the_rerun_repairs_it(tmp_path, store_dir,
                                                                            monkeypatch):
    from safetensors import SafetensorError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr("transformers.modeling_utils.safe_save_file", full)
        with pytest.raises(files.WriteError, match=f"could not write {out}: No space left on "
                                                   "device; free some space") as err:
            train_student(_cfg(store_dir), out, progress=False)
    assert err.value.errno == errno.ENOSPC
    assert not (out / "model.safetensors").exists() and not (out / T.RECORD).exists()
    with monkeypatch.context() as m:  # the rerun saves from the kept final state: no training
        m.setattr(T, "student_terms", _boom)
        train_student(_cfg(store_dir), out, progress=False)
    ref = train_student(_cfg(store_dir), tmp_path / "ref", progress=False)
    a, b = _weights(ref), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- the signal store: SHA-256 per shard, strict manifest ----------------------------------------


def _damaged(store_dir, tmp_path, fault):
    dest = tmp_path / "store"
    shutil.copytree(store_dir, dest)
    s0, s1 = dest / "shard-00000.safetensors", dest / "shard-00001.safetensors"
    man = dest / S.MANIFEST
    if fault == "swap":
        a, b = s0.read_bytes(), s1.read_bytes()
        s0.write_bytes(b)
        s1.write_bytes(a)
    elif fault in ("p2_effect", "tokens"):
        t = load_file(str(s0))
        t[fault] = t[fault] * 10 if fault == "p2_effect" else (t[fault] * 7) % 3000
        save_file(t, str(s0))
    elif fault == "bytes":  # random bytes in float data, same size
        data = bytearray(s0.read_bytes())
        g = torch.Generator().manual_seed(0)
        for p in torch.randint(len(data) // 2, len(data), (200,), generator=g).tolist():
            data[p] ^= 0x5A
        s0.write_bytes(bytes(data))
    elif fault == "truncated":
        s1.write_bytes(s1.read_bytes()[:1000])
    elif fault == "missing":
        s1.unlink()
    elif fault == "truncated-manifest":
        man.write_text(man.read_text()[:300])
    else:  # a manifest field
        m = json.loads(man.read_text())
        fault(m)
        man.write_text(json.dumps(m))
    return dest


@pytest.mark.parametrize("fault,message", [
    ("swap", "shard-00000.safetensors (does not match its SHA-256|has \\d+ bytes)"),
    ("p2_effect", "shard-00000.safetensors (does not match its SHA-256|has \\d+ bytes)"),
    ("tokens", "shard-00000.safetensors (does not match its SHA-256|has \\d+ bytes)"),
    ("bytes", "shard-00000.safetensors does not match its SHA-256"),
    ("truncated", "shard-00001.safetensors has 1000 bytes, the manifest says"),
    ("missing", "shard-00001.safetensors is missing"),
    ("truncated-manifest", "manifest.json: not valid JSON \\(truncated\\?\\) at line"),
    (lambda m: m["shards"][0].__setitem__("n_examples", 4800), "field 'n_examples' must be the "
                                                               "sum of the shards' n_examples"),
    (lambda m: m["weights"]["p1"][0].__setitem__(2, float("nan")), "field 'weights.p1'"),
    (lambda m: m["weights"]["p2"][0].__setitem__(0, 9), "field 'weights.p2'"),
    (lambda m: m["shards"][1].pop("sha256"), "field 'shards\\[1\\].sha256' must be 64 hex"),
    (lambda m: m["shards"][1].__setitem__("file", "../x.safetensors"),
     "field 'shards\\[1\\].file' must be a name shard-NNNNN.safetensors"),
    (lambda m: m["options"].__setitem__("nonselective", "yes"), "options.nonselective"),
    (lambda m: m.__setitem__("pad_id", 10 ** 6), "field 'pad_id' must be a token id"),
    (lambda m: m.__setitem__("anchor_token_ids", True), "field 'anchor_token_ids'"),
    (lambda m: m.__setitem__("format", "circuitkit.distill.signals/1"),
     "field 'format' is 'circuitkit.distill.signals/1'"),
    # issue 33 item 8: edits that keep every type and range trained another student, exit 0
    (lambda m: m["weights"]["p1"].reverse(), "field 'weights.p1' must be the value it was "
                                             "built with"),
    (lambda m: [r.__setitem__(2, r[2] * 100) for r in m["weights"]["p2"]],
     "field 'weights.p2' must be .* whose weights sum to 1"),
    (lambda m: m.__setitem__("anchor_token_ids", m["anchor_token_ids"][1:]
                             + m["anchor_token_ids"][:1]), "field 'anchor_token_ids' must be "
                                                           "the value it was built with"),
    (lambda m: m["shards"][0].__setitem__("width", m["shards"][0]["width"] + 1),
     "field 'shards\\[0\\]' must be the value it was built with"),
    (lambda m: m.__setitem__("extra", 1), "field 'extra' must be a field the store was built"),
])
def test_a_damaged_store_is_refused_naming_the_file(store_dir, tmp_path, fault, message):
    """Before: swapped shards, a rescaled p2_effect, changed tokens and random bytes each
    trained a different student with exit 0; a truncated manifest or shard was a traceback."""
    store = _damaged(store_dir, tmp_path, fault)
    with pytest.raises(S.StoreProblem, match=message) as err:
        S.SignalStore.open(store)
    assert str(store) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(S.StoreProblem, match=message):  # and training on it refuses too
        train_student(_cfg(store), tmp_path / "out", progress=False)


def _leaves(v, path=()):
    """Every path into a JSON value (objects by key, lists by index), the value's own first."""
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _leaves(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _leaves(x, path + (i,))


def _mutate(man, rng):
    """One seeded edit of a manifest: a field's type, range or shape changed, two values
    swapped, a field removed or added, a list reversed or rotated (``(what, manifest)``)."""
    import copy

    m = copy.deepcopy(man)
    paths = [p for p in _leaves(m) if p]
    path = paths[rng.randrange(len(paths))]
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    key, v = path[-1], parent[path[-1]]
    kinds = ["type", "range", "swap", "drop"]
    if isinstance(v, list):
        kinds += ["shape", "reverse", "rotate", "empty"]
    if isinstance(v, dict):
        kinds += ["add"]
    kind = rng.choice(kinds)
    if kind == "type":
        parent[key] = rng.choice([None, True, "0.5", 1.5, 7, [], {}, [v]])
    elif kind == "range":
        if isinstance(v, bool) or not isinstance(v, int | float):
            parent[key] = rng.choice([-1, 10 ** 9, float("nan"), float("inf")])
        else:
            parent[key] = rng.choice([-v - 1, v * 100, v + 1, float(v) + 1e-9])
    elif kind == "swap":
        sibs = list(range(len(parent))) if isinstance(parent, list) else list(parent)
        other = sibs[rng.randrange(len(sibs))]
        parent[key], parent[other] = parent[other], parent[key]
    elif kind == "drop":
        del parent[key]
    elif kind == "shape":
        if v and rng.random() < 0.5:
            v.pop()
        else:
            v.append(copy.deepcopy(v[-1]) if v else 0)
    elif kind == "reverse":
        v.reverse()
    elif kind == "rotate" and v:
        parent[key] = v[1:] + v[:1]
    elif kind == "empty":
        parent[key] = []
    elif kind == "add":
        v["extra"] = 1
    return f"{kind} at {list(path)}", m


def test_manifest_fuzz_is_refused_naming_the_field_or_changes_nothing(store_dir, tmp_path):
    """Seeded mutations of manifest.json's fields (types, ranges, shapes, swaps, removals,
    additions, reversals, rotations) and truncations of its text: each is refused in one line
    naming the file and the field (the position, for broken JSON), or, when it changed nothing,
    opens to the identical manifest. Before (format /3): a reversed weights.p1, weights x100 or
    rotated anchor_token_ids opened without a word."""
    import random

    rng = random.Random(33)
    man_path = store_dir / S.MANIFEST
    original = json.loads(man_path.read_text())
    dest = tmp_path / "store"
    shutil.copytree(store_dir, dest)
    refused = 0
    for trial in range(160):
        if trial % 8 == 7:  # truncated text
            text = man_path.read_text()
            what, body, m = "truncated", text[: rng.randrange(1, len(text) - 1)], None
        else:
            what, m = _mutate(original, rng)
            body = json.dumps(m)
        (dest / S.MANIFEST).write_text(body)
        try:
            opened = S.SignalStore.open(dest)
        except S.StoreProblem as e:
            msg = str(e)
            assert "\n" not in msg and str(dest / S.MANIFEST) in msg, (what, msg)
            assert "field '" in msg or (m is None and "not valid JSON" in msg), (what, msg)
            refused += 1
            continue
        assert m == original and opened.manifest == original, (what, m)
    assert refused >= 140  # a mutation that changes nothing is rare


def test_a_rewritten_manifest_is_refused_against_what_the_run_derives(store_dir, tmp_path):
    """A manifest rewritten whole, checksums recomputed (reversed Phase-1 heads), passes its own
    checks; training refuses it: the heads and weights are derived again from the score table
    and compared field by field."""
    dest = tmp_path / "store"
    shutil.copytree(store_dir, dest)
    m = json.loads((dest / S.MANIFEST).read_text())
    m["weights"]["p1"].reverse()
    m["checksums"] = S.manifest_checksums(m)
    (dest / S.MANIFEST).write_text(json.dumps(m))
    S.SignalStore.open(dest)  # consistent with itself
    with pytest.raises(S.StoreProblem, match="field 'weights' is not what this run derives"):
        train_student(_cfg(dest), tmp_path / "out", progress=False)


def test_cli_names_a_damaged_manifest_in_one_line(store_dir, tmp_path):
    store = _damaged(store_dir, tmp_path, "truncated-manifest")
    r = CliRunner().invoke(app, ["distill", "--quick", "--store", str(store), "--out",
                                 str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "manifest.json: not valid JSON (truncated?) at line" in errors[0]
    assert "Traceback" not in r.output and "Expecting" not in r.output


def test_a_resumed_build_keeps_listed_shards_and_recomputes_changed_ones(store_dir, tmp_path,
                                                                         monkeypatch):
    teacher = ck.load_model("icd-teacher")
    pool = ck.load_task("icd10", n_examples=CFG["pool_size"], seed=0, split="train")
    out = tmp_path / "s"
    shutil.copytree(store_dir, out)
    full = S.SignalStore.open(out).manifest
    head = {k: v for k, v in full.items() if k not in ("shards", "n_examples", "bytes")}
    (out / S.MANIFEST).unlink()  # as if killed after shard 1: the partial lists shards 0 and 1
    files.write_json(out / S.PARTIAL, dict(head, shards=full["shards"][:2]))
    first = (out / "shard-00000.safetensors").read_bytes()
    t = load_file(str(out / "shard-00001.safetensors"))
    t["p2_effect"] = t["p2_effect"] * 10  # ...and shard 1 changed since
    save_file(t, str(out / "shard-00001.safetensors"))
    rows = []
    real = S.teacher_rows
    monkeypatch.setattr(S, "teacher_rows", lambda teacher, sub, folder=None: rows.append(
        len(sub)) or real(teacher, sub, folder))
    scores = hand_scores(4, 8, TEACHER_P1, TEACHER_P2)
    lc = DistillConfig(**CFG).loss_config()
    again = S.build_store(teacher, pool, scores, out, S.StoreOptions(
        top_k1=lc.top_k1, top_k2=lc.top_k2, nonselective=True, topk_logits=lc.topk_logits,
        shard_size=CFG["shard_size"]), teacher_name="icd-teacher", progress=False)
    assert rows == [24]  # shard 1 only: shard 0 kept, as listed
    assert (out / "shard-00000.safetensors").read_bytes() == first
    assert again.manifest["shards"] == full["shards"]
