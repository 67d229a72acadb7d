"""The experiments' runner (``circuitkit/experiments/runner.py``): named steps run in order, one
resume record (``characterize``'s ``summary.json``, the grid's ``ablation.json``) read strictly,
each step bound to the hash of its inputs and its files' SHA-256; records from before the
version resume, newer ones are refused in one line."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from circuitkit.experiments.runner import (
    RECORD_VERSION,
    Step,
    StepRecord,
    depends_hash,
    options_of,
    read_steps,
    run_steps,
)
from circuitkit.files import sha256_file


def _job(tmp_path, steps):
    """A job of ``steps`` (name -> (depends, text)): each writes ``<name>.txt``; returns the
    record, the document and the list of the steps that ran."""
    doc = {"record_version": RECORD_VERSION, "steps": {}}
    path = tmp_path / "record.json"
    record = StepRecord(tmp_path, doc["steps"], lambda: path.write_text(json.dumps(doc)),
                        "test", path)
    ran: list[str] = []

    def make(name, text):
        def run(at):
            ran.append(name)
            (tmp_path / f"{name}.txt").write_text(text)
            return [f"{name}.txt"]
        return run

    return record, doc, ran, [Step(n, make(n, t), d) for n, (d, t) in steps.items()]


def test_steps_run_once_are_reused_and_a_modified_file_is_said_and_redone(tmp_path):
    a, b = depends_hash({"x": 1}), depends_hash({"x": 2})
    record, doc, ran, steps = _job(tmp_path, {"one": (a, "1"), "two": (b, "2")})
    said = []
    run_steps(steps, record, said.append)
    assert ran == ["one", "two"] and record.ran == ["one", "two"] and not said
    saved = json.loads((tmp_path / "record.json").read_text())
    assert saved["steps"]["one"] == dict(seconds=saved["steps"]["one"]["seconds"],
                                         files=["one.txt"], depends=a,
                                         sha256={"one.txt": sha256_file(tmp_path / "one.txt")})
    steps_again = read_steps(saved, tmp_path / "record.json", "delete it")
    record2, _, ran2, steps2 = _job(tmp_path, {"one": (a, "1"), "two": (b, "2")})
    record2.steps.update(steps_again)
    (tmp_path / "two.txt").write_text("edited")
    with pytest.warns(UserWarning, match="test step two is recorded as done in .*record.json, "
                                         "but its file .*two.txt was modified"):
        run_steps(steps2, record2, said.append)
    assert ran2 == ["two"] and said == ["[1/2] one: reused"]
    assert (tmp_path / "two.txt").read_text() == "2"
    # inputs changed: forgotten silently, run again
    assert record2.forget_stale({"one": depends_hash({"x": 3}), "two": b}) == ["one"]
    assert "one" not in record2.steps and "two" in record2.steps


def test_the_record_is_read_strictly_and_versions_are_named(tmp_path):
    path = tmp_path / "summary.json"
    hexd = "a" * 64
    good = dict(seconds=1.5, files=["x.csv"], sha256={"x.csv": hexd}, depends=hexd)
    assert read_steps({"record_version": 1, "steps": {"s": good}}, path, "R") == {"s": good}
    for doc, said in (
            ([], "expected a JSON object; got list; R."),
            ({"record_version": 2}, "resume record version 2 is not one this circuitkit reads"),
            ({"record_version": "1"}, "resume record version '1' is not"),
            ({"record_version": 1, "steps": []}, "field 'steps' must map step names"),
            ({"record_version": 1, "steps": {"s": dict(good, extra=1)}},
             "steps.s has unknown field(s) ['extra']"),
            ({"record_version": 1, "steps": {"s": {k: v for k, v in good.items()
                                                   if k != "depends"}}}, "steps.s has no"),
            ({"record_version": 1, "steps": {"s": dict(good, seconds=True)}},
             "steps.s.seconds must be a number"),
            ({"record_version": 1, "steps": {"s": dict(good, files=["/etc/x"])}},
             "steps.s.files must list file names inside the folder"),
            ({"record_version": 1, "steps": {"s": dict(good, files=["a/../../x"])}},
             "steps.s.files must list file names inside the folder"),
            ({"record_version": 1, "steps": {"s": dict(good, sha256={"x.csv": "zz"})}},
             "steps.s.sha256 must map its files"),
            ({"record_version": 1, "steps": {"s": dict(good, sha256={"y.csv": hexd})}},
             "steps.s.sha256 must map its files"),
            ({"record_version": 1, "steps": {"s": dict(good, depends="x")}},
             "steps.s.depends must be a SHA-256")):
        with pytest.raises(ValueError) as e:
            read_steps(doc, path, "R")
        assert said in str(e.value) and str(path) in str(e.value), str(e.value)
        assert "\n" not in str(e.value) and str(e.value).endswith("R.")


def test_a_record_from_before_the_version_resumes_with_derived_depends(tmp_path):
    """No ``record_version``, no ``depends`` (today's records before this one), and a step from
    before checksums (no ``sha256``): each step's ``depends`` comes from the job's ``legacy``;
    the one without digests is reused by its files and gets them, so the record it saves
    reads back as version 1."""
    (tmp_path / "x.csv").write_text("1\n")
    doc = {"steps": {"s": dict(seconds=1.0, files=["x.csv"]), "old": dict(seconds=2.0,
                                                                         files=[])}}
    dep = depends_hash("s")
    steps = read_steps(doc, tmp_path / "summary.json", "R",
                       lambda name: dep if name == "s" else None)
    assert steps["s"]["depends"] == dep and steps["old"]["depends"] is None
    doc["record_version"] = RECORD_VERSION
    record = StepRecord(tmp_path, steps, lambda: None, "test", tmp_path / "summary.json")
    assert record.reusable("s")
    assert steps["s"]["sha256"] == {"x.csv": sha256_file(tmp_path / "x.csv")}
    again = read_steps(json.loads(json.dumps(doc)), tmp_path / "summary.json", "R")
    assert again == steps


def test_options_of_takes_an_instance_a_dict_or_keywords():
    @dataclass(frozen=True)
    class Opts:
        a: int = 1
        b: str = "x"

    assert options_of(Opts, None, {}, "job") == Opts()
    assert options_of(Opts, {"a": 2}, {"b": "y"}, "job") == Opts(2, "y")
    assert options_of(Opts, Opts(3), {"a": 4}, "job") == Opts(4)
    with pytest.raises(ValueError, match="unknown job options 'c', 'd'; the options are: a, "
                                         "b.$"):
        options_of(Opts, {"c": 1}, {"d": 2}, "job")
    with pytest.raises(ValueError, match="job options must be a Opts or a dict"):
        options_of(Opts, [1], {}, "job")
    assert depends_hash({"b": 1, "a": [1, 2]}) == depends_hash({"a": [1, 2], "b": 1})
    assert depends_hash({"a": 1}) != depends_hash({"a": 1.5})
