"""ICD-10-CM task: labels are real leaf codes (``simple_icd_10_cm``), anchors categories/blocks.

Hierarchy facts come from ``simple_icd_10_cm`` once, then from a JSON cache
(``~/.cache/circuitkit/icd10cm-<package version>.json``, or ``$CIRCUITKIT_CACHE``) because importing
the package costs seconds. Only codes that are categories/subcategories count as leaves (the package
also lists 12 childless *blocks* as leaves; they are not codes, and lists 5 codes twice).

Label set (``labels``):
  * ``None`` (default): whole categories with 2..``max_leaves_per_category`` leaf codes, taken
    round-robin over ``chapters`` (default ``DEFAULT_CHAPTERS``) in code order until at least
    ``n_labels`` labels (so every label has near-miss siblings);
  * ``"all"``: every leaf code; or a list of leaf codes.

Evidence of a label (3 note words): the *category word* (a word of the category description, unique
among the chosen categories) + two *distinguishing words* (words of the label's description, the
pair unique within its category; ranked rarest-first among the category's labels). Where real words
cannot do it, synthesized tokens ``~k<i>`` (category) / ``~v<i>`` (label) are used, so the triple
identifies the label: the label is decodable from the note (``decode_note``).

Near-misses of a label: the chosen leaf codes with the same parent (siblings); a label that is its
parent's only chosen leaf falls back to the other labels of its category.

Token strings: a label's token is its code (``I50.22``), an anchor's its name (``I50`` or a block
``I30-I5A``). A leaf *category* label (``labels="all"`` only, e.g. ``A33``) would clash with its
anchor token, so its token is the code plus a dot (``A33.``); ``label_names`` keep the plain code.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuitkit.corruptions import parse_corruption
from circuitkit.files import write_text
from circuitkit.tasks.base import SPECIAL_TOKENS, Task
from circuitkit.tasks.synthetic import (
    FILLERS,
    STRUCT_TOKENS,
    Hierarchy,
    corrupt_cot,
    decode_note,
    make_examples,
    task_from,
    with_corruption,
)

# endocrine, circulatory, respiratory, digestive, genitourinary
DEFAULT_CHAPTERS = ("4", "9", "10", "11", "14")
STOPWORDS = frozenset("of and the in on to for by or a an as at from".split())
SYNTH = "~"  # prefix of synthesized evidence tokens (never a real description word)

__all__ = ["build", "Icd10Options", "hierarchy", "icd_table", "words", "decode_note"]


def words(description: str) -> list[str]:
    """Content words of a description: lowercase alphanumeric runs, stopwords dropped, deduped."""
    out: list[str] = []
    for w in re.findall(r"[a-z0-9]+", description.lower()):
        if w not in STOPWORDS and w not in out and (len(w) > 1 or w.isdigit()):  # "'s" -> "s"
            out.append(w)
    return out


def _cache_path() -> Path:
    from importlib.metadata import version

    root = Path(os.environ.get("CIRCUITKIT_CACHE", Path.home() / ".cache" / "circuitkit"))
    return root / f"icd10cm-{version('simple-icd-10-cm')}.json"


@functools.lru_cache(maxsize=1)
def icd_table() -> dict[str, Any]:
    """``{"leaves": [[code, parent, category, block, chapter, description], ...] (package order),
    "desc": {category or block: description}}``, from the cache or the package."""
    path = _cache_path()
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # a corrupt cache is rebuilt below
    import simple_icd_10_cm as cm

    leaves, desc, seen = [], {}, set()
    for c in cm.get_all_codes(True):
        if cm.is_chapter_or_block(c) or cm.is_category(c):
            desc[c] = cm.get_description(c)
        if c in seen or not (cm.is_leaf(c) and cm.is_category_or_subcategory(c)):
            continue  # a few codes (B20, F99, ...) are listed twice
        seen.add(c)
        anc = [c] + cm.get_ancestors(c)
        cat = next(a for a in anc if cm.is_category(a))
        leaves.append([c, cm.get_parent(c), cat, cm.get_parent(cat), anc[-1],
                       cm.get_description(c)])
    table = {"leaves": leaves, "desc": desc}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(table))  # atomic: concurrent processes never read half
    except OSError:
        pass  # read-only home: compute per process
    return table


def _select(labels: Any, chapters: tuple[str, ...] | None, n_labels: int,
            max_leaves_per_category: int) -> list[list[str]]:
    rows = icd_table()["leaves"]
    if isinstance(labels, str) and labels == "all":
        return rows
    if labels is not None:
        by_code = {r[0]: r for r in rows}
        bad = [c for c in labels if c not in by_code]
        if bad:
            raise ValueError(f"Not ICD-10-CM leaf codes: {bad[:20]} ({len(bad)} in all).")
        return [by_code[c] for c in sorted(set(labels), key=[r[0] for r in rows].index)]
    chapters = tuple(chapters or DEFAULT_CHAPTERS)
    by_chapter: dict[str, dict[str, list]] = {ch: {} for ch in chapters}
    for r in rows:
        if r[4] in by_chapter:
            by_chapter[r[4]].setdefault(r[2], []).append(r)
    queues = [[g for g in by_chapter[ch].values() if 2 <= len(g) <= max_leaves_per_category]
              for ch in chapters]
    chosen, total = [], 0
    for group in itertools.chain.from_iterable(itertools.zip_longest(*queues)):
        if group is None:
            continue
        if total >= n_labels:
            break
        chosen.append(group)
        total += len(group)
    order = {r[0]: i for i, r in enumerate(rows)}
    return sorted((r for g in chosen for r in g), key=lambda r: order[r[0]])


@functools.lru_cache(maxsize=8)
def hierarchy(labels: Any = None, chapters: tuple[str, ...] | None = None, n_labels: int = 2000,
              anchor_level: str = "category", max_leaves_per_category: int = 40) -> Hierarchy:
    """The label space for these options (vocabulary depends on nothing else). Cached per process.

    ``labels``: None, ``"all"`` or a tuple of codes (hashable, for the cache).
    """
    if anchor_level not in ("category", "block"):
        raise ValueError(f"anchor_level must be 'category' or 'block', got {anchor_level!r}.")
    rows = _select(labels, chapters, n_labels, max_leaves_per_category)
    desc = icd_table()["desc"]
    codes = [r[0] for r in rows]
    cats = list(dict.fromkeys(r[2] for r in rows))
    # category word: rarest word of the category description among the chosen categories, unused
    cat_words = {c: words(desc[c]) for c in cats}
    df = Counter(w for ws in cat_words.values() for w in ws)
    taken: set[str] = set()
    cat_word: dict[str, str] = {}
    for i, c in enumerate(cats):
        free = sorted((w for w in cat_words[c] if w not in taken), key=lambda w: (df[w], w))
        cat_word[c] = free[0] if free else f"{SYNTH}k{i}"
        taken.add(cat_word[c])
    # distinguishing pair: unique (as a set) within the category, rarest words first
    by_cat: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_cat.setdefault(r[2], []).append(i)
    ev_words: list[tuple[str, str, str]] = [("", "", "")] * len(rows)
    for c, members in by_cat.items():
        lw = {i: [w for w in words(rows[i][5]) if w != cat_word[c]] for i in members}
        cdf = Counter(w for ws in lw.values() for w in ws)
        used: set[frozenset] = set()
        n_synth = 0
        for i in members:
            ranked = sorted(lw[i], key=lambda w: (cdf[w], w))[:8]
            pair = next((p for p in itertools.combinations(ranked, 2)
                         if frozenset(p) not in used), None)
            if pair is None:  # real words cannot tell it apart: add a deterministic token
                pair = (ranked[0] if ranked else f"{SYNTH}v{n_synth + 1000}", f"{SYNTH}v{n_synth}")
                n_synth += 1
            used.add(frozenset(pair))
            ev_words[i] = (cat_word[c], pair[0], pair[1])
    anchor_of = [r[2] if anchor_level == "category" else r[3] for r in rows]
    anchor_names = list(dict.fromkeys(anchor_of))
    base = SPECIAL_TOKENS + STRUCT_TOKENS + FILLERS
    ev_vocab = sorted({w for e in ev_words for w in e} - set(base))
    anchor_set = set(anchor_names)
    label_tokens = [c + "." if c in anchor_set else c for c in codes]
    vocab = base + ev_vocab + anchor_names + label_tokens
    if len(set(vocab)) != len(vocab):
        dup = [w for w, n in Counter(vocab).items() if n > 1][:10]
        # duplicates would silently break the WordLevel tokenizer
        raise AssertionError(f"icd10 vocabulary has duplicate tokens {dup}")
    index = {w: i for i, w in enumerate(vocab)}
    anchor_id = {a: i for i, a in enumerate(anchor_names)}
    label_anchor = torch.tensor([anchor_id[a] for a in anchor_of], dtype=torch.long)
    evidence = torch.tensor([[index[w] for w in e] for e in ev_words], dtype=torch.long)
    # siblings: same parent and same category; only leaf of its parent -> rest of its category
    by_parent: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(rows):
        by_parent.setdefault((r[1], r[2]), []).append(i)
    sib_group = [by_parent[(r[1], r[2])] if len(by_parent[(r[1], r[2])]) > 1 else by_cat[r[2]]
                 for r in rows]

    def siblings(i: int) -> list[int]:
        return [s for s in sib_group[i] if s != i]

    def has_siblings(i: int) -> bool:
        return len(sib_group[i]) > 1

    n_base = len(base)
    o_anchor = n_base + len(ev_vocab)
    o_label = o_anchor + len(anchor_names)
    return Hierarchy(
        name="icd10", vocab=vocab, label_names=codes, anchor_names=anchor_names,
        label_token_ids=torch.arange(o_label, o_label + len(codes)),
        anchor_token_ids=torch.arange(o_anchor, o_label), label_anchor=label_anchor,
        evidence=evidence, n_dist=2, siblings=siblings, has_siblings=has_siblings,
        filler_ids=list(range(len(SPECIAL_TOKENS) + len(STRUCT_TOKENS), n_base)))


@dataclass(frozen=True)
class Icd10Options:
    """The icd10 task's knobs beside ``(n_examples, seed, split, phase)``: what ``build`` (and
    ``load_task("icd10", ...)``) takes as keywords.

    The label space (``hierarchy``): ``n_labels``, ``chapters``, ``labels`` (module docstring),
    ``anchor_level`` ("category" or "block"), ``max_leaves_per_category``. The notes
    (``synthetic.make_examples``): ``labels_per_note``: (min, max) targets per note (targets have
    distinct anchors); ``distractor_rate``: chance a target's evidence group gets one distractor
    word (a filler, or half the time a distinguishing word of a near-miss sibling in the shortlist);
    ``max_near_misses``: siblings per target put in the shortlist. ``corruption``: what each phase's
    corrupt tokens edit: "note" (default: the evidence), "anchor" (Phase 1: the written anchor),
    "shortlist-swap" / "shortlist-sibling" (Phase 2: the shortlist), or one of each phase joined by
    a comma (``parse_corruption``, docs/scores.md).
    """

    n_labels: int = 2000
    chapters: list[str] | tuple[str, ...] | None = None
    labels: str | list[str] | None = None
    anchor_level: str = "category"
    labels_per_note: tuple[int, int] = (1, 3)
    distractor_rate: float = 0.3
    max_near_misses: int = 3
    max_leaves_per_category: int = 40
    corruption: str = "note"


def build(n_examples: int = 256, seed: int = 0, split: str = "train", phase: int = 2,
          **options: Any) -> Task:
    """ICD-10-CM notes -> anchors -> shortlist -> answer (see module docstring); ``options``:
    ``Icd10Options`` fields."""
    o = Icd10Options(**options)
    choice = parse_corruption(o.corruption)
    lab = o.labels if o.labels is None or isinstance(o.labels, str) else tuple(o.labels)
    ch = None if o.chapters is None else tuple(str(c) for c in o.chapters)
    h = hierarchy(lab, ch, o.n_labels, o.anchor_level, o.max_leaves_per_category)
    ex = make_examples(h, n_examples, seed, split, tuple(o.labels_per_note), o.distractor_rate,
                       o.max_near_misses)
    corrupt_cot(h, ex, choice)
    config = dict(name="icd10", n_labels=o.n_labels, chapters=None if ch is None else list(ch),
                  labels=lab if lab is None or isinstance(lab, str) else list(lab),
                  anchor_level=o.anchor_level, labels_per_note=list(o.labels_per_note),
                  distractor_rate=o.distractor_rate, max_near_misses=o.max_near_misses,
                  max_leaves_per_category=o.max_leaves_per_category, seed=seed, split=split)
    return task_from(h, ex, phase, with_corruption(config, choice))
