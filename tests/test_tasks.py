"""Tasks: icd10 facts, synthetic, determinism/splits, positions, corruptions, JSONL, text."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

import circuitkit as ck
from circuitkit.tasks import Task, icd10, load_task, synthetic
from circuitkit.tasks.synthetic import decode_note, evidence_lookup
from circuitkit.tasks.text import render_text


@pytest.fixture(scope="module")
def task():
    return load_task("icd10", n_examples=48, seed=0, split="train", phase=2)


@pytest.fixture(scope="module")
def h():
    return icd10.hierarchy()


def _row(code):
    return next(r for r in icd10.icd_table()["leaves"] if r[0] == code)


# --- real ICD-10-CM facts -----------------------------------------------------------------------
def test_icd_parent_chain_and_siblings():
    code, parent, cat, block, chapter, desc = _row("I50.22")
    assert (parent, cat, block, chapter) == ("I50.2", "I50", "I30-I5A", "9")
    assert desc == "Chronic systolic (congestive) heart failure"
    sib = icd10.hierarchy(labels=("I50.20", "I50.21", "I50.22", "I50.23", "I50.1", "I10", "E11.9",
                                  "E11.65"))
    i = sib.label_names.index("I50.22")
    assert sorted(sib.label_names[s] for s in sib.siblings(i)) == ["I50.20", "I50.21", "I50.23"]
    assert sib.anchor_names[int(sib.label_anchor[i])] == "I50"
    blk = icd10.hierarchy(labels=("I50.22", "I10", "E11.9"), anchor_level="block")
    assert blk.anchor_names[int(blk.label_anchor[0])] == "E08-E13"  # package order: E11.9 first
    assert blk.label_names[0] == "E11.9"


def test_all_leaf_codes_and_unique_evidence():
    t0 = time.perf_counter()
    ha = icd10.hierarchy(labels="all")
    assert time.perf_counter() - t0 < 30
    assert len(ha.label_names) == 74719 == len(set(ha.label_names))
    assert len(evidence_lookup(ha)) == len(ha.label_names)  # every label decodable
    assert len(set(ha.vocab)) == len(ha.vocab)


def test_default_label_set(h):
    assert 2000 <= len(h.label_names) <= 2100
    chapters = {_row(c)[4] for c in h.label_names}
    assert chapters == set(icd10.DEFAULT_CHAPTERS)
    assert all(h.has_siblings(i) for i in range(len(h.label_names)))
    assert len(evidence_lookup(h)) == len(h.label_names)
    assert h.vocab[:8] == ["<pad>", "<bos>", "<eos>", "<unk>", "<think>", "<sl>", "</think>", "|"]


# --- determinism and splits -------------------------------------------------------------------
def test_determinism_and_vocab_independent_of_split(task):
    again = load_task("icd10", n_examples=48, seed=0, split="train", phase=2)
    assert torch.equal(task.clean_tokens, again.clean_tokens)
    assert torch.equal(task.corrupt_tokens, again.corrupt_tokens)
    test = load_task("icd10", n_examples=64, seed=3, split="test")
    assert test.vocab == task.vocab
    assert torch.equal(test.label_token_ids, task.label_token_ids)
    other = load_task("icd10", n_examples=48, seed=1, split="train")
    assert not torch.equal(other.clean_tokens, task.clean_tokens)


def _note(e, vocab):
    toks = e.tokens.tolist()
    return tuple(toks[: toks.index(vocab.index("<think>"))])


def test_splits_disjoint():
    # a small label set makes collisions likely if the splits were not partitioned
    kw = dict(n_examples=300, labels_per_note=(1, 1), distractor_rate=0.0, n_labels=30,
              chapters=["9"])
    tr = load_task("icd10", split="train", **kw)
    te = load_task("icd10", split="test", **kw)
    ntr = {_note(e, tr.vocab) for e in tr.examples}
    nte = {_note(e, te.vocab) for e in te.examples}
    assert len(ntr) > 10 and len(nte) >= 3  # ~1/8 of the note space is held out
    assert not ntr & nte


# --- positions and token kinds ----------------------------------------------------------------
def test_positions_point_at_right_kinds(task, h):
    label_tok = set(task.label_token_ids.tolist())
    anchor_tok = set(task.anchor_token_ids.tolist())
    for e in task.examples:
        toks = e.tokens
        desc_words = set()
        for t in e.targets:
            r = _row(task.label_names[t])
            desc_words |= set(icd10.words(r[5])) | set(icd10.words(icd10.icd_table()["desc"][r[2]]))
        for p in e.evidence_pos:
            w = task.vocab[int(toks[p])]
            assert w in desc_words or w.startswith(icd10.SYNTH), w
        assert len(e.evidence_pos) == 3 * len(e.targets)
        assert toks[e.anchor_pos].tolist() == task.anchor_token_ids[e.anchors].tolist()
        assert set(toks[e.anchor_pos].tolist()) <= anchor_tok
        assert e.anchors == task.label_anchor[e.targets].tolist()
        sl = toks[e.shortlist_pos].tolist()
        assert set(sl) <= label_tok and sl == sorted(sl)
        assert set(task.label_token_ids[e.targets].tolist()) <= set(sl)
        assert toks[e.answer_pos].tolist() == task.label_token_ids[e.targets].tolist()
        assert e.targets == sorted(e.targets) and 1 <= len(e.targets) <= 3
        assert not set(e.near_misses) & set(e.targets)
        for nm in e.near_misses:  # a near-miss is a sibling of some target
            assert any(nm in h.siblings(t) for t in e.targets)
        assert int(toks[0]) == task.bos_id and int(toks[-1]) == task.eos_id


def test_decodable(task, h):
    for e in task.examples:
        assert decode_note(h, e.tokens.tolist()) == e.meta["note_order"]
        assert sorted(e.meta["note_order"]) == e.targets


# --- corruptions per phase --------------------------------------------------------------------
@pytest.mark.parametrize("phase", [1, 2])
def test_clean_corrupt_pairs(task, h, phase):
    t = task.with_phase(phase)
    assert t.phase == phase and t.clean_tokens.shape == t.corrupt_tokens.shape
    think = t.vocab.index("<think>")
    for e in t.examples:
        assert torch.equal(e.corrupt_tokens, torch.tensor(e.meta[f"corrupt_tokens_p{phase}"]))
        diff = (e.tokens != e.corrupt_tokens).nonzero().flatten().tolist()
        assert diff and max(diff) < e.tokens.tolist().index(think)  # only inside the note
        assert set(diff) <= set(e.evidence_pos)
        got = decode_note(h, e.corrupt_tokens.tolist())
        if phase == 1:
            assert e.meta["p1_label"] in got
            assert e.meta["corrupt_anchors"][0] not in e.anchors
        else:
            assert len(diff) <= 2 and e.meta["p2_label"] in got
            assert e.meta["p2_label"] in e.near_misses
    assert not torch.equal(task.with_phase(1).corrupt_tokens, task.with_phase(2).corrupt_tokens)
    assert torch.isfinite(t.metric(torch.randn(len(t), t.clean_tokens.shape[1], len(t.vocab))))


# --- synthetic ----------------------------------------------------------------------------------
def test_synthetic_small_and_1m():
    s = load_task("synthetic", n_examples=32, n_labels=100, children=5, seed=2)
    hs = synthetic.hierarchy(100, 5)
    assert len(s.anchor_names) == 20 and len(evidence_lookup(hs)) == 100
    for e in s.examples:
        assert decode_note(hs, e.tokens.tolist()) == e.meta["note_order"]
        assert all(any(t // 5 == nm // 5 for t in e.targets) for nm in e.near_misses)
        assert e.tokens[e.answer_pos].tolist() == s.label_token_ids[e.targets].tolist()
    t0 = time.perf_counter()
    big = load_task("synthetic", n_examples=16, n_labels=1_000_000)
    assert time.perf_counter() - t0 < 20
    assert len(big.label_names) == 1_000_000 and len(big) == 16


# --- JSONL ----------------------------------------------------------------------------------------
def test_jsonl_round_trip(task, tmp_path):
    p = tmp_path / "t.jsonl"
    task.to_jsonl(p)
    back = Task.from_jsonl(p)
    for f in ("name", "label_names", "anchor_names", "vocab", "phase", "config", "pad_id"):
        assert getattr(back, f) == getattr(task, f), f
    for f in ("label_token_ids", "anchor_token_ids", "label_anchor", "clean_tokens",
              "corrupt_tokens"):
        assert torch.equal(getattr(back, f), getattr(task, f)), f
    for a, b in zip(task.examples, back.examples, strict=True):
        assert a.evidence_pos == b.evidence_pos and a.targets == b.targets and a.meta == b.meta
    assert torch.equal(back.with_phase(1).corrupt_tokens, task.with_phase(1).corrupt_tokens)
    q = tmp_path / "u.jsonl"
    back.to_jsonl(q)
    assert q.read_text() == p.read_text()
    assert torch.equal(load_task(str(p), phase=1).corrupt_tokens, task.with_phase(1).corrupt_tokens)


def test_jsonl_round_trip_keeps_an_induction_config(tmp_path):
    task = load_task("induction", n_examples=3, seg_len=(4, 7))
    task.to_jsonl(tmp_path / "i.jsonl")
    back = Task.from_jsonl(tmp_path / "i.jsonl")
    assert back.config == task.config and back.config["seg_len"] == [4, 7]
    assert back.fingerprint() == task.fingerprint()


def test_jsonl_bad_rows_all_reported(task, tmp_path):
    p = tmp_path / "t.jsonl"
    task.subset(range(8)).to_jsonl(p)
    lines = p.read_text().splitlines()
    rows = [json.loads(x) for x in lines[1:]]
    rows[0]["targets"] = [10**6]  # unknown label id           -> line 2
    rows[1]["targets"] = []  # empty label set                  -> line 3
    rows[2]["corrupt_tokens"] = rows[2]["corrupt_tokens"][:-1]  # -> line 4
    rows[3]["answer_pos"] = [999]  # out of range                -> line 5
    bad = [lines[0]] + [json.dumps(r) for r in rows]
    bad[7] = "{not json"  # malformed                           -> line 8
    p.write_text("\n".join(bad) + "\n")
    with pytest.raises(ValueError) as err:
        Task.from_jsonl(p)
    msg = str(err.value)
    for line, what in ((2, "unknown label id"), (3, "empty label set"), (4, "length mismatch"),
                       (5, "out of range"), (8, "malformed JSON")):
        assert any(x.startswith(f"{p}:{line}:") and what in x for x in msg.splitlines()), msg
    assert f"{p}:6:" not in msg and f"{p}:7:" not in msg  # good rows are not flagged


def test_jsonl_steps_must_hold_what_the_row_says(task, tmp_path):
    """An off-by-one answer_pos (or anchor_pos), anchors not paired with anchor_pos, and labels
    sharing a token used to load: every metric then read the wrong token."""
    p = tmp_path / "t.jsonl"
    task.subset(range(4)).to_jsonl(p)
    lines = p.read_text().split("\n")
    head, rows = json.loads(lines[0]), [json.loads(x) for x in lines[1:] if x]
    rows[0]["answer_pos"] = [q - 1 for q in rows[0]["answer_pos"]]  # off by one -> line 2
    rows[1]["anchor_pos"] = [q + 1 for q in rows[1]["anchor_pos"]]  # off by one -> line 3
    rows[2]["anchors"] = []  # not paired with anchor_pos             -> line 4
    p.write_text("\n".join([json.dumps(head), *map(json.dumps, rows)]) + "\n")
    with pytest.raises(ValueError) as err:
        Task.from_jsonl(p)
    msg = str(err.value)
    assert f"{p}:2: 'answer_pos'" in msg and "no target's" in msg and "off by one" in msg
    assert f"{p}:3: 'anchor_pos'" in msg and "not anchor" in msg
    assert f"{p}:4: 'anchors' has 0 entries and 'anchor_pos' {len(rows[2]['anchor_pos'])}" in msg
    assert f"{p}:5:" not in msg  # the good row
    dup = dict(head, label_token_ids=[head["label_token_ids"][0]] * len(head["label_token_ids"]))
    p.write_text("\n".join([json.dumps(dup), *map(json.dumps, rows[3:])]) + "\n")
    with pytest.raises(ValueError, match="labels share token ids"):
        Task.from_jsonl(p)


def test_jsonl_typos_overlaps_and_bad_header_types_are_named(task, tmp_path):
    """Unknown keys were dropped (a typo lost its data), a near-miss could be a target, and a
    header of the wrong type crashed later with a bare TypeError or loaded silently."""
    p = tmp_path / "t.jsonl"
    task.subset(range(3)).to_jsonl(p)
    lines = p.read_text().split("\n")
    head, rows = json.loads(lines[0]), [json.loads(x) for x in lines[1:] if x]
    rows[0]["corrupt_anchor"] = [0]  # a typo of corrupt_anchors
    rows[1]["near_misses"] = rows[1]["near_misses"] + rows[1]["targets"][:1]
    p.write_text("\n".join([json.dumps(head), *map(json.dumps, rows)]) + "\n")
    with pytest.raises(ValueError) as err:
        Task.from_jsonl(p)
    msg = str(err.value)
    assert f"{p}:2: unknown field(s) ['corrupt_anchor']" in msg
    assert f"{p}:3: label(s)" in msg and "both targets and near_misses" in msg
    for change, said in ((dict(vocab=5), "'vocab' must be a list of strings"),
                         (dict(config=[1]), "'config' must be an object"),
                         (dict(pad_id="0"), "'pad_id' must be a token id"),
                         (dict(label_token_ids=[-1] + head["label_token_ids"][1:]),
                          "'label_token_ids' holds token ids outside"),
                         (dict(phase=True), "'phase' must be 1 or 2"),
                         (dict(version="2"), "'version' must be an integer"),
                         (dict(lable_names=[]), "unknown field(s) ['lable_names']")):
        p.write_text("\n".join([json.dumps({**head, **change}), lines[1]]) + "\n")
        with pytest.raises(ValueError, match=re.escape(said)):
            Task.from_jsonl(p)


# --- text rendering ------------------------------------------------------------------------------
class CharTokenizer:
    """One token per character: clean/corrupt notes of different character length mismatch."""

    bos_token_id = None
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_render_text_word_tokenizer(task):
    tok = task.tokenizer()
    tt = render_text(task, tok, phase=1)
    assert tt.clean_tokens.shape == tt.corrupt_tokens.shape
    for i, e in enumerate(task.examples):
        codes = [task.label_names[t] for t in e.targets]
        assert tt.clean_text[i].endswith("Answer: " + ", ".join(codes))
        ans = tok.decode(tt.clean_tokens[i, tt.answer_pos[i]].tolist())
        # word-level: "I50.22," is one unknown word, a lone last code is known
        assert ans.split()[-1] == codes[-1]
        assert len(tt.label_pos[i]) == len(codes)


def test_render_text_refuses_mismatch(task):
    with pytest.raises(ValueError, match=r"example \d+ \(targets"):
        render_text(task, CharTokenizer(), phase=1)


def test_label_list_without_siblings_is_refused():
    with pytest.raises(ValueError, match="near-miss sibling"):
        load_task("icd10", n_examples=2, labels=["I50.22", "I10", "E11.9"], labels_per_note=(1, 1))


def test_render_text_bpe_tokenizer(task):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sub = task.subset(range(12))
    texts = render_text(sub, sub.tokenizer(), phase=2)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "~v0" stays one word
    # a vocabulary big enough that every word of these texts is one token: equal lengths
    bpe.train_from_iterator(texts.clean_text + texts.corrupt_text,
                            trainers.BpeTrainer(vocab_size=4000, special_tokens=["<pad>", "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", unk_token="<unk>")
    tt = render_text(sub, tok, phase=2)
    assert tt.clean_tokens.shape == tt.corrupt_tokens.shape
    for i, e in enumerate(sub.examples):
        ids = tt.clean_tokens[i].tolist()
        got = "".join(tok.convert_ids_to_tokens([ids[p] for p in tt.answer_pos[i]]))
        assert got == ",".join(sub.label_names[t] for t in e.targets)
        assert tt.answer_pos[i][0] == tt.prompt_len[i] == tt.label_pos[i][0]
        assert tt.clean_tokens[i].ne(tt.corrupt_tokens[i]).any()


def test_a_phase1_file_loads_as_phase1_and_is_never_relabelled(tmp_path):
    """load_task(path) defaulted to phase 2 and with_phase kept the phase-1 corruption under a
    phase-2 metric, without a word."""
    import json

    t1 = load_task("icd10", n_examples=3, seed=3, phase=1)
    path = tmp_path / "p1.jsonl"
    t1.to_jsonl(path)
    lines = path.read_text().split("\n")
    rows = [json.loads(x) for x in lines[1:] if x]
    for r in rows:
        r.pop("corrupt_tokens_p2", None)  # a user's file with one phase
    path.write_text("\n".join([lines[0], *(json.dumps(r) for r in rows)]) + "\n")
    task = load_task(path)  # a Path works too
    assert task.phase == 1 and torch.equal(task.corrupt_tokens, t1.corrupt_tokens)
    with pytest.raises(ValueError, match="store no phase-2 corruption"):
        task.with_phase(2)
    with pytest.raises(ValueError, match="store no phase-2 corruption"):
        load_task(path, phase=2)
    assert len(load_task(path, n_examples=2)) == 2  # a file's first rows
    with pytest.raises(ValueError, match="more than the 3 examples"):
        load_task(path, n_examples=4)
    with pytest.raises(ValueError, match="phase must be 1"):
        t1.with_phase(3)
    with pytest.raises(ValueError, match="n_examples must be a positive integer"):
        load_task("icd10", n_examples=0)
    for seed in (1.5, 2**64):  # a torch error / an overflow inside the induction builder
        with pytest.raises(ValueError, match="seed must be an integer"):
            load_task("induction", n_examples=2, seed=seed)


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    """splitlines() broke rows at U+2028 / NEL / form feed inside JSON strings."""
    import json

    task = load_task("synthetic", n_examples=2, seed=0)
    path = tmp_path / "u.jsonl"
    task.to_jsonl(path)
    lines = path.read_text().split("\n")
    rows = [json.loads(x) for x in lines[1:] if x]
    rows[0]["meta"] = {**rows[0].get("meta", {}), "note": "a\u2028b\x85c\x0cd"}
    text = "\n".join([lines[0], *(json.dumps(r, ensure_ascii=False) for r in rows)]) + "\n"
    path.write_text("\ufeff" + text, encoding="utf-8")  # and a BOM, as Windows editors write
    again = ck.Task.from_jsonl(path)
    assert again.examples[0].meta["note"] == "a\u2028b\x85c\x0cd"
    assert torch.equal(again.clean_tokens, task.clean_tokens)


def test_file_level_mistakes_get_a_message_that_says_which(task, tmp_path):
    p = tmp_path / "t.jsonl"
    task.subset(range(2)).to_jsonl(p)
    head, *rows = p.read_text().split("\n")
    cases = [
        ("", "is empty: line 1 must be the header"),
        ("  \n\n", "is empty"),
        ("[1, 2]\n" + rows[0], "the header must be a JSON object; got a list"),
        ("\n".join(rows), "line 1 is an example row; the file needs its header first"),
        (head.replace('"circuitkit.task"', '"other"') + "\n" + rows[0], "not a circuitkit task"),
        (head.replace('"label_names"', '"labels"') + "\n" + rows[0],
         "lacks fields ['label_names']"),
    ]
    for text, said in cases:
        p.write_text(text)
        with pytest.raises(ValueError, match=re.escape(said)):
            Task.from_jsonl(p)
    p.write_text(head.replace('"label_names"', '"labels"') + "\n" + rows[0])
    with pytest.raises(ValueError, match=re.escape("unknown field(s) ['labels']")):
        Task.from_jsonl(p)
    (tmp_path / "t.json").write_text(head)
    with pytest.raises(ValueError, match="needs the .jsonl extension"):
        load_task(str(tmp_path / "t.json"))
    assert repr(task).startswith(f"Task({task.name!r}, phase") and len(repr(task)) < 200


def test_anchor_margin_without_corrupt_anchors_is_against_the_other_anchors():
    """It fell back to the whole vocabulary's mean logit, not the other anchors'."""
    import dataclasses

    t = load_task("synthetic", n_examples=4, n_labels=8, children=4, labels_per_note=(1, 1),
                  phase=1)
    bare = dataclasses.replace(t, examples=[dataclasses.replace(
        e, meta={k: v for k, v in e.meta.items() if k != "corrupt_anchors"})
        for e in t.examples])
    logits = torch.randn(4, t.clean_tokens.shape[1], len(t.vocab),
                         generator=torch.Generator().manual_seed(0))
    got = bare.metric.per_prompt(logits)
    for i, e in enumerate(bare.examples):
        steps = []
        for p in e.anchor_pos:
            a = int(e.tokens[p])
            others = [x for x in t.anchor_token_ids.tolist() if x not in e.tokens[e.anchor_pos]]
            steps.append(logits[i, p - 1, a] - logits[i, p - 1, others].mean())
        assert float(got[i]) == pytest.approx(float(torch.stack(steps).mean()), abs=1e-5)
    # with corrupt_anchors: those, as before
    e = t.examples[0]
    p, a = e.anchor_pos[0], int(e.tokens[e.anchor_pos[0]])
    rivals = t.anchor_token_ids[e.meta["corrupt_anchors"]]
    want = logits[0, p - 1, a] - logits[0, p - 1, rivals].mean()
    assert float(t.metric.per_prompt(logits)[0]) == pytest.approx(float(want), abs=1e-5)
