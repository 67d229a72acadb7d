"""docs/from-transformerlens.md runs as written, and its circuitkit calls give TransformerLens's
numbers. Every fenced ``python`` block of the page runs in order in one namespace (as a reader
pastes them); each ``bash`` block runs at its place as a command (``circuitkit`` ->
``python -m circuitkit.cli``). References: ``transformer_lens.patching``'s own functions,
called here on the page's inputs (not the page's copies), and one-prompt-at-a-time runs for
right-padded pairs. Tolerance: 1e-4 absolute (float32 logit differences of size ~10; observed
~2e-6), as tests/test_conformance.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformer_lens import patching as tlp

import circuitkit as ck

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "from-transformerlens.md"
ATOL = 1e-4
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the page, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.S)


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "circuitkit.cli", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The namespace the page's Python blocks leave, its commands run in the same folder."""
    folder = tmp_path_factory.mktemp("doc")
    ns: dict = {"__name__": "__doc__"}
    here = os.getcwd()
    os.chdir(folder)
    try:
        for lang, code in blocks():
            if lang == "python":
                exec(compile(code, str(DOC), "exec"), ns)  # noqa: S102 (the page's own code)
            elif lang == "bash":
                for line in code.strip().splitlines():
                    args = shlex.split(line)
                    assert args[0] == "circuitkit", line
                    out = cli(args[1:], folder)
                    assert out.returncode == 0, out.stderr[-3000:]
    finally:
        os.chdir(here)
    ns["folder"] = folder
    return ns


def test_the_page_has_the_blocks_it_promises():
    langs = [lang for lang, _ in blocks()]
    assert langs.count("bash") == 1 and langs.count("python") >= 6, langs


def test_the_map_names_every_transformer_lens_patching_function():
    text = DOC.read_text()
    missing = [n for n in dir(tlp) if n.startswith("get_act_patch") and f"`{n}" not in text]
    assert not missing, missing


@pytest.mark.slow
def test_heads_equal_transformer_lens(page):
    """``ck.patch_heads`` = ``get_act_patch_attn_head_out_all_pos``, and its baselines are the
    unpatched runs' metric."""
    model, clean, corrupt, metric = (page[k] for k in ("model", "clean", "corrupt",
                                                        "logit_diff"))
    with torch.no_grad():
        ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt,
                                                      model.run_with_cache(clean)[1], metric)
        base = float(metric(model(clean))), float(metric(model(corrupt)))
    res = page["res"]
    assert res.values.shape == ref.shape == (2, 4)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
    assert (res.clean, res.corrupt) == pytest.approx(base, abs=ATOL)
    assert base[0] > 5 > -5 > base[1]  # the pairs do what the page says: clean "e", corrupt "f"
    assert (res.values - res.corrupt).abs().max() > 1  # some head matters: not a vacuous match


@pytest.mark.slow
def test_by_position_noise_and_resid_pre_equal_transformer_lens(page):
    model, clean, corrupt, metric = (page[k] for k in ("model", "clean", "corrupt",
                                                        "logit_diff"))
    with torch.no_grad():
        clean_cache = model.run_with_cache(clean)[1]
        corrupt_cache = model.run_with_cache(corrupt)[1]
        by_pos = tlp.get_act_patch_attn_head_out_by_pos(model, corrupt, clean_cache, metric)
        noise = tlp.get_act_patch_attn_head_out_all_pos(model, clean, corrupt_cache, metric)
        resid = tlp.get_act_patch_resid_pre(model, corrupt, clean_cache, metric)
    torch.testing.assert_close(page["res_pos"].values, by_pos.permute(0, 2, 1), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(page["res_noise"].values, noise, atol=ATOL, rtol=0)
    torch.testing.assert_close(page["res_resid"].values, resid, atol=ATOL, rtol=0)
    torch.testing.assert_close(page["tl_noise"], noise, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_a_hook_loop_from_an_older_script_gives_the_same_cell(page):
    assert float(page["by_hand"]) == pytest.approx(float(page["res"].values[1, 3]), abs=ATOL)


@pytest.mark.slow
def test_the_pairs_file_from_the_cli_and_python_equals_transformer_lens(page):
    """The command's saved result and ``load_pairs`` both equal TransformerLens's function on
    the page's tensors and lambda (the file holds the same pairs)."""
    model, clean, corrupt, metric = (page[k] for k in ("model", "clean", "corrupt",
                                                        "logit_diff"))
    with torch.no_grad():
        ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt,
                                                      model.run_with_cache(clean)[1], metric)
    saved, pairs = page["saved"], page["pairs"]
    assert torch.equal(pairs.clean_tokens, clean) and torch.equal(pairs.corrupt_tokens, corrupt)
    torch.testing.assert_close(saved.values, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(page["res_file"].values, ref, atol=ATOL, rtol=0)
    assert saved.meta["task"] == "pairs.jsonl" and saved.meta["n_examples"] == 8


def _ragged_rows() -> list[dict]:
    """Induction pairs of 3 lengths (a prefix of k words, a changed word, the prefix again)."""
    rows = []
    for i, k in enumerate((2, 3, 4, 4, 3, 2)):
        w = [f"t{(7 * i + 3 * j) % 60}" for j in range(k + 2)]
        rows.append(dict(clean=" ".join(w[:k] + [w[k]] + w[:k]),
                         corrupt=" ".join(w[:k] + [w[k + 1]] + w[:k]),
                         answer=w[k], wrong=w[k + 1]))
    return rows


@pytest.mark.slow
def test_right_padded_pairs_read_each_prompt_at_its_last_token(tmp_path):
    """Pairs of different lengths: the batch result (padded, one sweep) equals the mean over
    prompts of TransformerLens's function run on each prompt alone, unpadded, with the plain
    ``logits[:, -1]`` logit difference; the plain lambda on the padded batch is refused."""
    from circuitkit.tasks.pairs import load_pairs

    path = tmp_path / "ragged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _ragged_rows()))
    model = ck.load_model("induction-2l")
    pairs = load_pairs(path, model)
    assert pairs.clean_tokens.shape == (6, 10)  # <bos> + 9 words, the longest
    assert pairs.last_positions.tolist() == [5, 7, 9, 9, 7, 5]
    res = ck.patch_heads(model, pairs.clean_tokens, pairs.corrupt_tokens, pairs.metric,
                         options=dict(progress=False))
    one_by_one = []
    with torch.no_grad():
        for r in _ragged_rows():
            c, x = model.to_tokens(r["clean"]), model.to_tokens(r["corrupt"])
            a, w = model.to_single_token(r["answer"]), model.to_single_token(r["wrong"])

            def diff(logits, a=a, w=w):
                return (logits[:, -1, a] - logits[:, -1, w]).mean()

            one_by_one.append(tlp.get_act_patch_attn_head_out_all_pos(
                model, x, model.run_with_cache(c)[1], diff))
    torch.testing.assert_close(res.values, torch.stack(one_by_one).mean(0), atol=ATOL, rtol=0)
    # TransformerLens's function given the padded batch and the pairs' metric: the same
    with torch.no_grad():
        tl = tlp.get_act_patch_attn_head_out_all_pos(
            model, pairs.corrupt_tokens, model.run_with_cache(pairs.clean_tokens)[1],
            pairs.metric)
    torch.testing.assert_close(res.values, tl, atol=ATOL, rtol=0)

    a, w = pairs.answer_tokens, pairs.wrong_tokens
    with pytest.raises(ValueError, match="padding"):
        ck.patch_heads(model, pairs.clean_tokens, pairs.corrupt_tokens,
                       lambda lg: (lg[:, -1].gather(-1, a[:, None])
                                   - lg[:, -1].gather(-1, w[:, None])).mean(),
                       options=dict(progress=False))


def test_bad_pairs_files_are_refused_row_by_row(tmp_path):
    """Every bad row named (``path:line: reason``) before any model loads."""
    from circuitkit.tasks.pairs import read_pairs

    path = tmp_path / "bad.jsonl"
    path.write_text('{"clean": "t1 t2", "corrupt": "t1 t3", "answer": "t4", "wrong": "t5"}\n'
                    '{"clean": "t1", "corupt": "t2", "answer": "t4", "wrong": "t5"}\n'
                    '{"clean": "t1", "corrupt": [1, 2], "answer": "t4", "wrong": true}\n'
                    "not json\n")
    with pytest.raises(ValueError) as e:
        read_pairs(path)
    msg = str(e.value)
    for want in (":2: missing field 'corrupt'", ":2: unknown field(s) ['corupt']",
                 ":3: 'wrong' must be one token", ":4: malformed JSON"):
        assert want in msg, (want, msg)
    assert ":1:" not in msg
    assert len(read_pairs(_good(tmp_path), n_examples=1)) == 1


def _good(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _ragged_rows()))
    return path


def test_pairs_that_do_not_fit_the_model_are_refused(tmp_path):
    """Unequal token counts and a multi-token answer: each row in one message."""
    from circuitkit.tasks.pairs import pairs_inputs, read_pairs

    path = tmp_path / "p.jsonl"
    path.write_text('{"clean": "t1 t2 t1", "corrupt": "t1 t2", "answer": "t2", "wrong": "t3"}\n'
                    '{"clean": "t1 t2 t1", "corrupt": "t1 t3 t1", "answer": "t2 t4", '
                    '"wrong": "t3"}\n'
                    '{"clean": [1, 7, 99], "corrupt": [1, 8, 7], "answer": 5, "wrong": 6}\n')
    model = ck.load_model("induction-2l")
    with pytest.raises(ValueError) as e:
        pairs_inputs(read_pairs(path), model, name="p.jsonl")
    msg = str(e.value)
    assert "p.jsonl:1: clean is 4 tokens and corrupt 3" in msg
    assert "p.jsonl:2: 'answer': 't2 t4' is 2 tokens" in msg
    assert "p.jsonl:3: token id 99 is outside the model's vocabulary [0, 64)" in msg


def test_a_task_loader_given_pairs_says_where_they_go(tmp_path):
    """``ck.load_task`` / ``characterize`` on a pairs file: one line naming ``patch``/``edges``
    and ``load_pairs``; ``patch --phase`` on one: one line."""
    path = _good(tmp_path)
    with pytest.raises(ValueError, match="load_pairs"):
        ck.load_task(str(path))
    out = cli(["characterize", "--model", "induction-2l", "--task", str(path), "--out",
               str(tmp_path / "c")], tmp_path)
    assert out.returncode == 2 and "plain clean/corrupt pairs" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = cli(["patch", "--model", "induction-2l", "--task", str(path), "--phase", "1",
               "--out", str(tmp_path / "p")], tmp_path)
    assert out.returncode == 2 and "--phase 1" in out.stderr and "drop --phase" in out.stderr


def test_a_pairs_file_with_many_bad_rows_is_a_short_error(tmp_path):
    """Thousands of bad rows: their count and the first few, not one line each (as task files)."""
    from circuitkit.tasks.pairs import read_pairs

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"clean": 1}\n' * 5000)
    with pytest.raises(ValueError) as err:
        read_pairs(bad)
    lines = str(err.value).splitlines()
    assert len(lines) < 40 and "more" in lines[-1] and "problem(s)" in lines[0]
