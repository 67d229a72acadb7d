"""Synthetic hierarchy task of any size, and the note/CoT generator shared with ``icd10``.

Hierarchy: ``n_anchors = ceil(n_labels / children)`` anchors ``A<i>``; label ``L<j>`` sits under
anchor ``j // children``; its near-miss siblings are the other children of that anchor. Evidence of
label j (3 tokens) = the anchor word ``a<i>`` + two distinguishing words ``x<c // m>``, ``y<c % m>``
(c = child index, ``m = ceil(sqrt(children))``), unique within the anchor, so the label is
decodable.
Everything per label is a tensor (no per-label Python objects): 1M labels build in about a second.

Sequence (see ``circuitkit.tasks.base``)::

    <bos> ev(t1) [distractor] | ev(t2) [distractor] ... <think> anchors <sl> shortlist </think>
    answer <eos>

The note lists the targets' evidence groups in random order separated by ``|``; a group is the
label's evidence (``E`` tokens, the last ``n_dist`` of them distinguishing) plus, with probability
``distractor_rate``, one distractor word (a filler, or a distinguishing word of a near-miss sibling
shown in the shortlist). Anchors and answer follow label-id order; the shortlist is the targets plus
up to ``max_near_misses`` siblings per target, sorted by label id (its order does not leak the
answer).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit.corruptions import corruption_name, parse_corruption
from circuitkit.tasks.base import SPECIAL_TOKENS, Example, Task

STRUCT_TOKENS = ["<think>", "<sl>", "</think>", "|"]
FILLERS = ["patient", "reports", "history", "noted", "today", "denies", "presents", "seen",
           "follow", "exam"]
# a note is in the test split iff crc32(note tokens) % HOLDOUT_MOD == 0: the splits never share
# a note, whatever the seeds
HOLDOUT_MOD = 8


@dataclass
class Hierarchy:
    """A label space with per-label evidence, shared by ``icd10`` and ``synthetic``.

    ``evidence[i]``: token ids of label i's evidence (E tokens; the last ``n_dist`` distinguish it
    from its siblings). ``siblings(i)``: near-miss label ids of label i (same parent, never i).
    ``has_siblings(i)``: whether ``siblings(i)`` is non-empty (first target is drawn from those).
    """

    name: str
    vocab: list[str]
    label_names: list[str]
    anchor_names: list[str]
    label_token_ids: Int[Tensor, " n_labels"]
    anchor_token_ids: Int[Tensor, " n_anchors"]
    label_anchor: Int[Tensor, " n_labels"]
    evidence: Int[Tensor, "n_labels E"]
    n_dist: int
    siblings: Callable[[int], list[int]]
    has_siblings: Callable[[int], bool]
    filler_ids: list[int]


def _struct_id(word: str) -> int:
    # structural tokens always follow the specials, in STRUCT_TOKENS order
    return len(SPECIAL_TOKENS) + STRUCT_TOKENS.index(word)


def split_rng(name: str, seed: int, split: str) -> random.Random:
    # str seeds hash with sha512: deterministic across processes (unlike hash())
    return random.Random(f"{name}:{seed}:{split}")


def note_in_split(note: list[int], split: str) -> bool:
    raw = torch.tensor(note, dtype=torch.int64).numpy().tobytes()
    held_out = zlib.crc32(raw) % HOLDOUT_MOD == 0
    return held_out == (split == "test")


def make_examples(h: Hierarchy, n_examples: int, seed: int, split: str,
                  labels_per_note: tuple[int, int] = (1, 3), distractor_rate: float = 0.3,
                  max_near_misses: int = 3) -> list[Example]:
    """Draw ``n_examples`` notes (deterministic in ``seed``/``split``; splits never share a note).

    Each example's ``meta`` holds ``corrupt_tokens_p1``/``corrupt_tokens_p2`` (lists of ids),
    ``corrupt_anchors`` (anchor id of the phase-1 corrupting label), ``p1_label``/``p1_target``,
    ``p2_label``/``p2_target`` (corrupting label and the target whose evidence it replaced) and
    ``note_order`` (targets in note order). ``corrupt_tokens`` starts as phase 2's.
    """
    lo, hi = labels_per_note
    n_labels, n_anchors = len(h.label_names), len(h.anchor_names)
    if lo < 1 or hi < lo:
        raise ValueError(
            f"labels_per_note must be (lo, hi) with 1 <= lo <= hi, got {labels_per_note}.")
    if hi >= n_anchors:
        raise ValueError(
            f"labels_per_note max {hi} needs more than {hi} anchors; have {n_anchors}.")
    rng = split_rng(h.name, seed, split)
    think, sl, end, sep = (_struct_id(w) for w in STRUCT_TOKENS)
    la = h.label_anchor
    E, nd = h.evidence.shape[1], h.n_dist
    examples: list[Example] = []
    while len(examples) < n_examples:
        k = rng.randint(lo, hi)
        first, tries = rng.randrange(n_labels), 0
        while not h.has_siblings(first):  # phase 2 needs a target with a near-miss
            first, tries = rng.randrange(n_labels), tries + 1
            if tries > 100_000:
                raise ValueError(f"{h.name}: (almost) no label has a near-miss sibling; choose "
                                 "labels in groups of siblings.")
        targets, used = [first], {int(la[first])}
        while len(targets) < k:
            t = rng.randrange(n_labels)
            if int(la[t]) not in used:  # distinct anchors: anchors in the CoT are unambiguous
                targets.append(t)
                used.add(int(la[t]))
        near: dict[int, list[int]] = {}
        for t in targets:
            sib = sorted(h.siblings(t))
            near[t] = sorted(rng.sample(sib, min(max_near_misses, len(sib))))
        order = targets[:]
        rng.shuffle(order)
        note, ev_pos, group_start = [SPECIAL_TOKENS.index("<bos>")], [], {}
        for i, t in enumerate(order):
            if i:
                note.append(sep)
            group_start[t] = len(note)
            ev_pos += range(len(note), len(note) + E)
            note += h.evidence[t].tolist()
            if rng.random() < distractor_rate:
                if near[t] and rng.random() < 0.5:  # a word pointing at a near-miss sibling
                    s = rng.choice(near[t])
                    note.append(int(h.evidence[s, E - nd + rng.randrange(nd)]))
                else:
                    note.append(rng.choice(h.filler_ids))
        if not note_in_split(note, split):
            continue
        answer = sorted(targets)
        anchors = [int(la[t]) for t in answer]
        shortlist = sorted(set(answer).union(*near.values()))
        seq = note + [think]
        anchor_pos = list(range(len(seq), len(seq) + len(anchors)))
        seq += h.anchor_token_ids[anchors].tolist() + [sl]
        shortlist_pos = list(range(len(seq), len(seq) + len(shortlist)))
        seq += h.label_token_ids[shortlist].tolist() + [end]
        answer_pos = list(range(len(seq), len(seq) + len(answer)))
        seq += h.label_token_ids[answer].tolist() + [SPECIAL_TOKENS.index("<eos>")]
        # phase 1: one target's whole evidence -> evidence of a label under another anchor
        t1 = rng.choice(order)
        m = rng.randrange(n_labels)
        while int(la[m]) in used:
            m = rng.randrange(n_labels)
        c1 = seq[:]
        s1 = group_start[t1]
        c1[s1:s1 + E] = h.evidence[m].tolist()
        # phase 2: one target's distinguishing words -> a near-miss sibling's (same anchor word)
        t2 = rng.choice([t for t in order if near[t]])
        n2 = rng.choice(near[t2])
        c2 = seq[:]
        s2 = group_start[t2] + E - nd
        c2[s2:s2 + nd] = h.evidence[n2, E - nd:].tolist()
        near_misses = sorted(set().union(*near.values()) - set(answer))
        examples.append(Example(
            tokens=torch.tensor(seq), corrupt_tokens=torch.tensor(c2), evidence_pos=ev_pos,
            anchor_pos=anchor_pos, shortlist_pos=shortlist_pos, answer_pos=answer_pos,
            targets=answer, near_misses=near_misses, anchors=anchors,
            meta=dict(corrupt_tokens_p1=c1, corrupt_tokens_p2=c2, corrupt_anchors=[int(la[m])],
                      p1_label=m, p1_target=t1, p2_label=n2, p2_target=t2,
                      p2_siblings=list(near[t2]), note_order=order)))
    return examples


def corrupt_cot(h: Hierarchy, examples: list[Example], choice: dict[int, str]) -> None:
    """Replace each example's ``corrupt_tokens_p{phase}`` by the chain-of-thought corruption
    ``choice`` names for that phase (in place; "note" leaves the phase as built). The note is
    token-identical to the clean one; what a metric reads is stored in ``meta``:

    * Phase 1 "anchor": the corrupted target ``p1_target``'s anchor token (in the anchor list)
      becomes the anchor of ``p1_label`` (another category, the one "note" points to);
      ``p1_shortlist_step``: the position of the first shortlist entry of ``p1_target``'s
      category (where the model must choose which category the shortlist turns to next).
    * Phase 2 "shortlist-swap": ``p2_target`` and ``p2_label`` (a shortlisted sibling) exchange
      their shortlist positions; "shortlist-sibling": ``p2_target``'s shortlist token becomes
      a sibling, one not in the shortlist when it has one (else a shortlisted one, written
      twice). ``p2_rival``: that sibling.
    No random draws: the notes and the "note" corruptions are those of every other choice.
    """
    for e in examples:
        toks = e.tokens.tolist()
        sl = {toks[p]: p for p in e.shortlist_pos}  # label token -> its shortlist position
        if choice[1] == "anchor":
            t1, m = e.meta["p1_target"], e.meta["p1_label"]
            c = toks[:]
            c[e.anchor_pos[e.anchors.index(int(h.label_anchor[t1]))]] = \
                int(h.anchor_token_ids[h.label_anchor[m]])
            group = [sl[int(h.label_token_ids[s])] for s in [t1, *h.siblings(t1)]
                     if int(h.label_token_ids[s]) in sl]
            e.meta.update(corrupt_tokens_p1=c, p1_shortlist_step=min(group))
        if choice[2] != "note":
            t2, n2 = e.meta["p2_target"], e.meta["p2_label"]
            tok_t, c = int(h.label_token_ids[t2]), toks[:]
            if choice[2] == "shortlist-swap":
                rival = n2
                c[sl[tok_t]], c[sl[int(h.label_token_ids[n2])]] = \
                    int(h.label_token_ids[n2]), tok_t
            else:
                sib = sorted(h.siblings(t2))
                free = [s for s in sib if int(h.label_token_ids[s]) not in sl]
                pool = free or sib  # deterministic pick: a hash of the note, not the RNG
                rival = pool[zlib.crc32(str(toks).encode()) % len(pool)]
                c[sl[tok_t]] = int(h.label_token_ids[rival])
            e.meta.update(corrupt_tokens_p2=c, p2_rival=int(rival))


def task_from(h: Hierarchy, examples: list[Example], phase: int, config: dict) -> Task:
    task = Task(name=h.name, examples=examples, label_names=h.label_names,
                anchor_names=h.anchor_names, label_token_ids=h.label_token_ids,
                anchor_token_ids=h.anchor_token_ids, label_anchor=h.label_anchor, vocab=h.vocab,
                phase=2, config=config)
    return task.with_phase(phase)


def decode_note(h: Hierarchy, tokens: list[int]) -> list[int]:
    """Label ids named by a note's evidence groups (first E tokens after ``<bos>`` or ``|``)."""
    think, sep = _struct_id("<think>"), _struct_id("|")
    note = tokens[1:tokens.index(think)]
    cuts = [-1] + [i for i, t in enumerate(note) if t == sep] + [len(note)]
    groups = [note[a + 1:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    lookup = evidence_lookup(h)
    E = h.evidence.shape[1]
    return [lookup.get(tuple(g[:E]), -1) for g in groups]


def evidence_lookup(h: Hierarchy) -> dict[tuple[int, ...], int]:
    return {tuple(e): i for i, e in enumerate(h.evidence.tolist())}


# --- the synthetic hierarchy ------------------------------------------------------------------
def hierarchy(n_labels: int = 1000, children: int = 8) -> Hierarchy:
    """Vectorised synthetic hierarchy (vocab depends only on ``n_labels`` and ``children``)."""
    if children < 2:
        raise ValueError("children must be >= 2 so that every label has a near-miss sibling.")
    n_anchors = math.ceil(n_labels / children)
    m = math.ceil(math.sqrt(children))
    base = SPECIAL_TOKENS + STRUCT_TOKENS + FILLERS
    words = ([f"a{i}" for i in range(n_anchors)] + [f"x{i}" for i in range(m)]
             + [f"y{i}" for i in range(m)])
    anchor_names = [f"A{i}" for i in range(n_anchors)]
    label_names = [f"L{i}" for i in range(n_labels)]
    vocab = base + words + anchor_names + label_names
    o_a = len(base)
    o_x, o_y = o_a + n_anchors, o_a + n_anchors + m
    o_anc = o_y + m
    o_lab = o_anc + n_anchors
    j = torch.arange(n_labels)
    anchor = j // children
    c = j % children
    evidence = torch.stack([o_a + anchor, o_x + c // m, o_y + c % m], 1)

    def siblings(i: int) -> list[int]:
        a = i // children
        return [s for s in range(a * children, min((a + 1) * children, n_labels)) if s != i]

    def has_siblings(i: int) -> bool:
        a = i // children
        return min((a + 1) * children, n_labels) - a * children >= 2

    return Hierarchy(
        name="synthetic", vocab=vocab, label_names=label_names, anchor_names=anchor_names,
        label_token_ids=o_lab + j, anchor_token_ids=o_anc + torch.arange(n_anchors),
        label_anchor=anchor, evidence=evidence, n_dist=2, siblings=siblings,
        has_siblings=has_siblings, filler_ids=list(range(len(SPECIAL_TOKENS) + len(STRUCT_TOKENS),
                                                         o_a)))


def build(n_examples: int = 256, seed: int = 0, split: str = "train", phase: int = 2,
          n_labels: int = 1000, children: int = 8, labels_per_note: tuple[int, int] = (1, 3),
          distractor_rate: float = 0.3, max_near_misses: int = 3,
          corruption: str = "note") -> Task:
    """Synthetic task: ``n_labels`` labels under ``ceil(n_labels / children)`` anchors.
    ``corruption``: what each phase's corrupt tokens edit (``parse_corruption``)."""
    choice = parse_corruption(corruption)
    h = hierarchy(n_labels, children)
    ex = make_examples(h, n_examples, seed, split, tuple(labels_per_note), distractor_rate,
                       max_near_misses)
    corrupt_cot(h, ex, choice)
    config = dict(name="synthetic", n_labels=n_labels, children=children,
                  labels_per_note=list(labels_per_note), distractor_rate=distractor_rate,
                  max_near_misses=max_near_misses, seed=seed, split=split)
    return task_from(h, ex, phase, with_corruption(config, choice))


def with_corruption(config: dict, choice: dict[int, str]) -> dict:
    """``config`` naming its corruption when it is not the default ("note" for both phases,
    left out so configs recorded before the option existed still match)."""
    name = corruption_name(choice)
    return config if name == "note" else {**config, "corruption": name}
