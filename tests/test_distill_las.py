"""LAS (Hase et al. 2020): hand-computed values on constructed cases, the leaking / non-leaking
split, the bootstrap interval, the default simulator on a task with a known rule, and
``evaluate(..., las=True)``."""

from __future__ import annotations

import pytest
import torch

import circuitkit as ck
from circuitkit import evaluation as ev


def test_las_score_hand_computed():
    # leaking (e alone right): examples 0-2; non-leaking: 3-7
    xe = [1, 1, 0, 1, 0, 0, 1, 0]
    x = [0, 1, 0, 0, 0, 1, 0, 0]
    e = [1, 1, 1, 0, 0, 0, 0, 0]
    r = ev.las_score(xe, x, e, n_boot=2000, seed=1)
    leak = ((1 - 0) + (1 - 1) + (0 - 0)) / 3
    non = ((1 - 0) + (0 - 0) + (0 - 1) + (1 - 0) + (0 - 0)) / 5
    assert r["las"] == pytest.approx((leak + non) / 2)
    assert (r["n_leaking"], r["n_nonleaking"]) == (3, 5)
    assert r["acc_xe"] == pytest.approx(4 / 8) and r["acc_x"] == pytest.approx(2 / 8)
    assert r["las_ci_low"] < r["las"] < r["las_ci_high"]
    # no variation: the interval collapses; one group empty: LAS is the other group's mean
    flat = ev.las_score([1] * 6, [0] * 6, [0] * 6, n_boot=200)
    assert flat["las"] == flat["las_ci_low"] == flat["las_ci_high"] == 1.0
    with pytest.raises(ValueError, match="equally long"):
        ev.las_score([1], [1, 0], [0])


class CopySimulator:
    """Predicts exactly the labels whose tokens occur in the rationale; nothing without one."""

    def __init__(self, task):
        self.tok2label = {int(t): i for i, t in enumerate(task.label_token_ids.tolist())}
        self.fitted = 0

    def fit(self, xs, es, ys):
        self.fitted += 1
        return self

    def predict(self, xs, es):
        return [set() if e is None else {self.tok2label[t] for t in e if t in self.tok2label}
                for e in es]


@pytest.fixture(scope="module")
def task():
    return ck.load_task("synthetic", n_examples=8, seed=3, split="test", n_labels=60,
                        children=4)


def _generation(task, rationale_labels, answer_labels):
    lt, end = task.label_token_ids, task.vocab.index("</think>")
    return [int(lt[a]) for a in rationale_labels] + [end] + \
        [int(lt[a]) for a in answer_labels] + [task.eos_id]


def test_las_with_a_copying_simulator_hand_computed(task):
    """Rationales that contain the answer verbatim leak (e alone suffices): 3 such notes, 5
    whose rationale names a wrong label. The copier is right with the rationale exactly on the
    leaking notes, never without it: LAS = 1/2 [(1 - 0) + (0 - 0)] = 0.5 (a plain mean of
    acc(x+e) - acc(x) would say 3/8)."""
    gens = []
    for i, e in enumerate(task.examples):
        answer = e.targets[:1]
        wrong = [(answer[0] + 1) % 60]
        gens.append(_generation(task, answer if i < 3 else wrong, answer))
    sim = CopySimulator(task)
    r = ev.las(None, task, generations=gens, simulator=sim, n_boot=500)
    assert r["las"] == pytest.approx(0.5)
    assert (r["n_leaking"], r["n_nonleaking"]) == (3, 5)
    assert r["acc_xe"] == pytest.approx(3 / 8) and r["acc_x"] == 0.0
    # a resample holding both groups gives 0.5; one without leaking notes 0 (p = (5/8)^8)
    assert 0.0 <= r["las_ci_low"] <= 0.5 == r["las_ci_high"]
    # with a disjoint simulator-training task the same numbers come out
    train = ck.load_task("synthetic", n_examples=4, seed=3, split="train", n_labels=60,
                         children=4)
    tg = [_generation(train, e.targets, e.targets) for e in train.examples]
    r2 = ev.las(None, task, train, generations=gens, train_generations=tg, simulator=sim,
                n_boot=100)
    assert r2["las"] == pytest.approx(0.5) and sim.fitted == 0  # las fits copies


def test_signature_simulator_learns_a_known_rule():
    """On icd10 gold data a label is named by its three evidence words (category word + a
    distinguishing pair, ``Hierarchy.evidence``): fitted on notes alone, the simulator's note
    signature of a well-seen label must be exactly that triple, and it must predict held-out
    answers from the note."""
    from circuitkit.tasks.icd10 import hierarchy

    train = ck.load_task("icd10", n_examples=6000, seed=5, split="train")
    test = ck.load_task("icd10", n_examples=200, seed=5, split="test")
    sim = ev.pretrained_simulator(train)
    sig, n_l = sim.signatures(), sim.counts["n_l"]
    evidence = hierarchy().evidence
    well_seen = (n_l >= 6).nonzero()[:, 0].tolist()[:40]
    exact = [set(sig["x"][:, lab].nonzero()[:, 0].tolist()) == set(evidence[lab].tolist())
             for lab in well_seen]
    assert len(well_seen) == 40 and sum(exact) >= 36, sum(exact)
    xs, es, ys = ev.gold_simulation_data(test)
    acc = lambda pred: sum(p == y for p, y in zip(pred, ys, strict=True)) / len(ys)  # noqa: E731
    assert acc(sim.predict(xs, [None] * len(xs))) > 0.6
    assert acc(sim.predict(xs, es)) > 0.6
    # e alone names targets and near-misses alike (the shortlist): it rarely pins the answer
    assert acc(sim.predict([None] * len(xs), es)) < 0.2
    assert sim.predict([None], [None]) == [set()]


def test_evaluate_adds_las(task):
    model = ck.load_model("icd-student-cot")
    test = ck.load_task("icd10", n_examples=8, seed=0, split="test")
    out = ck.evaluate(model, test, las=True)
    assert {"las", "las_ci_low", "las_ci_high", "exact_match"} <= set(out)
    assert out["las_ci_low"] <= out["las"] <= out["las_ci_high"]
    assert "las" not in ck.evaluate(model, test.subset(range(2)))


def test_cached_decode_equals_greedy_decode():
    from transformers import AutoModelForCausalLM

    from circuitkit.models import shipped_path

    test = ck.load_task("icd10", n_examples=12, seed=2, split="test")
    hf = AutoModelForCausalLM.from_pretrained(shipped_path("icd-student-cot"),
                                              attn_implementation="eager").eval()
    think = test.vocab.index("<think>")
    prompts = [e.tokens[: ev.prompt_end(e, think)] for e in test.examples]
    ref = ev.greedy_decode(ck.load_model("icd-student-cot"), prompts, test.eos_id, 30)
    assert ev.greedy_decode_cached(hf, prompts, test.eos_id, 30) == ref
    assert torch.tensor([len(g) for g in ref]).min() > 3


# --- LAS as Hase et al.: the simulator learns only from the model's own outputs -----------------


def _planted_generations(task, answer_of, leaks, filler):
    """A planted model's continuation of each note: rationale (the answer's label token when
    ``leaks(answer)``, then ``filler``) + ``</think>`` + answer + ``<eos>``."""
    lt, end = task.label_token_ids, task.vocab.index("</think>")
    gens = []
    for i, e in enumerate(task.examples):
        a = answer_of(i, e)
        rationale = ([int(lt[a])] if leaks(a) else []) + [filler]
        gens.append(rationale + [end, int(lt[a]), task.eos_id])
    return gens


def test_hase_las_of_a_planted_leaking_model_is_the_textbook_value():
    """A planted model answers one of 10 labels by the note's index (nothing in the note tells
    which) and its rationale names the answer for labels 0-4 (they leak) and carries a constant
    filler for labels 5-9. A simulator trained only on the model's own outputs (200 train notes,
    disjoint from the 100 test notes) learns the rationale's label token as the signature of a
    leaking label and nothing else: on a leaking note x + e is right and x alone is not (+1), on
    a non-leaking note both are wrong (0). Hase et al.: LAS = 1/2 (1 + 0) = 0.5, with the
    leaking notes exactly those of labels 0-4 (a plain mean of acc(x+e) - acc(x) would say
    0.5 x the leaking share)."""
    train = ck.load_task("icd10", n_examples=200, seed=7, split="train")
    test = ck.load_task("icd10", n_examples=100, seed=7, split="test")
    labels = list(range(10))
    filler = int(train.anchor_token_ids[0])
    answer = lambda i, e: labels[i % 10]  # noqa: E731
    leaks = lambda a: a < 5  # noqa: E731
    tg = _planted_generations(train, answer, leaks, filler)
    gens = _planted_generations(test, answer, leaks, filler)
    r = ev.las(None, test, train, generations=gens, train_generations=tg, n_boot=300)
    n_leak = sum(leaks(answer(i, e)) for i, e in enumerate(test.examples))
    assert (r["n_leaking"], r["n_nonleaking"]) == (n_leak, len(test) - n_leak) == (50, 50)
    assert r["las"] == pytest.approx(0.5, abs=1e-12)
    assert r["acc_xe"] == pytest.approx(0.5) and r["acc_x"] == 0.0 and r["acc_e"] == 0.5
    assert r["las_ci_low"] <= 0.5 <= r["las_ci_high"]


def test_hase_las_of_a_rationale_without_information_is_zero_within_its_interval():
    """A model that answers the note's gold targets (the note tells them) and writes a rationale
    of random label tokens, drawn independently of everything: a simulator trained on its own
    outputs (2000 train notes) predicts from the note, and the rationale changes nothing. LAS
    is 0 and its bootstrap interval contains 0."""
    train = ck.load_task("icd10", n_examples=2000, seed=9, split="train")
    test = ck.load_task("icd10", n_examples=150, seed=9, split="test")
    g = torch.Generator().manual_seed(0)
    end = train.vocab.index("</think>")

    def gens_of(task):
        lt = task.label_token_ids
        out = []
        for e in task.examples:
            noise = lt[torch.randint(0, len(lt), (6,), generator=g)].tolist()
            out.append(noise + [end] + [int(lt[t]) for t in e.targets] + [task.eos_id])
        return out

    r = ev.las(None, test, train, generations=gens_of(test), train_generations=gens_of(train),
               n_boot=500)
    assert r["acc_x"] > 0.15  # the simulator did learn the note -> answer rule
    assert r["las_ci_low"] <= 0.0 <= r["las_ci_high"] and abs(r["las"]) < 0.05, r
