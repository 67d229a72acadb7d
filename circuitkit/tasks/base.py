"""``Task`` and ``Example``: token sequences with the positions and labels every analysis needs.

Token layout convention: ``tokens[p]`` is the token at position p; the model's prediction of it is
read from the logits at ``p - 1``. So ``answer_pos`` lists the positions *of* answer tokens, and a
metric reads ``logits[:, p - 1]``.

An example's sequence, for the CoT tasks::

    <bos> note words ... <think> anchors ... <sl> shortlist ... </think> answer labels <eos>

``evidence_pos``: note tokens that point to a target; ``anchor_pos``: anchor tokens in the early CoT
(Phase 1); ``shortlist_pos``: candidate labels in the late CoT; ``answer_pos``: final answer labels
(Phase 2). ``corrupt_tokens`` has the same length: for phase 1 the evidence of another anchor, for
phase 2 the target's distinguishing evidence swapped for a near-miss sibling's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import (
    PromptMetric,
    logit_positions,
    pad_rows,
    token_logprob_metric,
    token_margin_metric,
)
from circuitkit.tasks import jsonl

# The CoT tasks that can be rendered as plain text for a pretrained LLM (``tasks.text``); a JSONL
# task is read as the token ids it stores.
TEXT_TASKS = ("icd10", "synthetic")
ID_FIELDS = ("label_token_ids", "anchor_token_ids", "label_anchor")  # tensors here, lists in files


@dataclass
class Example:
    tokens: Int[Tensor, " seq"]
    corrupt_tokens: Int[Tensor, " seq"]
    evidence_pos: list[int]
    anchor_pos: list[int]
    shortlist_pos: list[int]
    answer_pos: list[int]
    targets: list[int]  # label ids
    near_misses: list[int]  # label ids (siblings of the targets, never a target)
    anchors: list[int]  # anchor ids of the targets
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    """A batch of examples over one vocabulary, plus the label space they are drawn from.

    ``label_token_ids[i]`` / ``anchor_token_ids[j]``: token of label i / anchor j;
    ``label_anchor[i]``: anchor id of label i. ``phase`` selects which clean/corrupt pair
    ``clean_tokens``/``corrupt_tokens`` stack and which default ``metric`` is used.
    """

    name: str
    examples: list[Example]
    label_names: list[str]
    anchor_names: list[str]
    label_token_ids: Int[Tensor, " n_labels"]
    anchor_token_ids: Int[Tensor, " n_anchors"]
    label_anchor: Int[Tensor, " n_labels"]
    vocab: list[str]  # token id -> word (the task's word-level vocabulary)
    phase: int = 2
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    config: dict[str, Any] = field(default_factory=dict)

    # --- batched views --------------------------------------------------------------------------
    def __repr__(self) -> str:  # not every example: a task holds thousands of tensors
        return (f"Task({self.name!r}, phase {self.phase}, {len(self.examples)} examples, "
                f"{len(self.vocab)} tokens, {len(self.label_names)} labels, "
                f"{len(self.anchor_names)} anchors)")

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def clean_tokens(self) -> Int[Tensor, "batch seq"]:
        return self._stack("tokens")

    @property
    def corrupt_tokens(self) -> Int[Tensor, "batch seq"]:
        return self._stack("corrupt_tokens")

    def _stack(self, attr: str) -> Tensor:
        rows = [getattr(e, attr) for e in self.examples]
        width = max(r.shape[0] for r in rows)
        out = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r  # right padding never changes earlier positions (causal)
        return out

    def subset(self, idx: list[int] | range) -> Task:
        return replace(self, examples=[self.examples[i] for i in idx])

    def with_phase(self, phase: int) -> Task:
        """This task at ``phase``: examples that store per-phase corruptions
        (``meta["corrupt_tokens_p1"]`` / ``meta["corrupt_tokens_p2"]``) get that phase's
        ``corrupt_tokens``; others keep theirs."""
        if phase not in (1, 2):
            raise ValueError(f"phase must be 1 (anchors) or 2 (shortlist/answer), got {phase!r}.")
        key = f"corrupt_tokens_p{phase}"
        lacking = [i for i, e in enumerate(self.examples) if key not in e.meta]
        if phase != self.phase and lacking:  # its corrupt_tokens are another phase's
            raise ValueError(
                f"task {self.name!r} is phase {self.phase} and example(s) {lacking[:5]} store no "
                f"phase-{phase} corruption ({key!r}): their corrupt_tokens are phase "
                f"{self.phase}'s. Use the task at phase {self.phase} (--phase {self.phase}), or "
                f"add {key} to the rows.")
        examples = [
            replace(e, corrupt_tokens=torch.as_tensor(e.meta[key], dtype=torch.long))
            if key in e.meta else e
            for e in self.examples
        ]
        return replace(self, phase=phase, examples=examples)

    # --- JSONL (file format: circuitkit.tasks.jsonl, docs/jsonl.md) -----------------------------
    @classmethod
    def from_jsonl(cls, path: str | Path) -> Task:
        """Load a task from JSONL; every bad row is reported in one ``ValueError`` with file and
        line number."""
        head, rows = jsonl.read_jsonl(path)
        phase = head.get("phase", 2)
        examples = []
        for row in rows:
            meta = dict(row.get("meta", {}))
            meta[jsonl.PHASE_CORRUPT[phase]] = row["corrupt_tokens"]
            meta.update({k: row[k] for k in jsonl.OPTIONAL_INT_LISTS if k in row})
            examples.append(Example(
                tokens=torch.tensor(row["tokens"], dtype=torch.long),
                corrupt_tokens=torch.tensor(row["corrupt_tokens"], dtype=torch.long),
                **{k: row[k] for k in jsonl.INT_LIST_FIELDS[2:]}, meta=meta))
        return cls(name=head["name"], examples=examples, label_names=head["label_names"],
                   anchor_names=head["anchor_names"], vocab=head["vocab"], phase=phase,
                   pad_id=head.get("pad_id", 0), bos_id=head.get("bos_id", 1),
                   eos_id=head.get("eos_id", 2), config=head.get("config", {}),
                   **{k: torch.tensor(head[k], dtype=torch.long) for k in ID_FIELDS})

    def to_jsonl(self, path: str | Path) -> None:
        """Write this task as JSONL (header line + one line per example); exact round trip.
        ``corrupt_tokens`` is written once: the other phase's corruption, if known, goes in
        ``corrupt_tokens_p{other}``."""
        head = {k: getattr(self, k) for k in ("name", "phase", "vocab", "label_names",
                                              "anchor_names", *ID_FIELDS, "pad_id", "bos_id",
                                              "eos_id", "config")}
        head.update({k: head[k].tolist() for k in ID_FIELDS})
        other = jsonl.PHASE_CORRUPT[3 - self.phase]
        rows = []
        for e in self.examples:
            row: dict[str, Any] = {k: getattr(e, k) for k in jsonl.INT_LIST_FIELDS}
            row["tokens"], row["corrupt_tokens"] = e.tokens.tolist(), e.corrupt_tokens.tolist()
            for k in (other, "corrupt_anchors"):
                if k in e.meta:
                    row[k] = [int(t) for t in e.meta[k]]
            row["meta"] = {k: v for k, v in e.meta.items() if k not in jsonl.OPTIONAL_INT_LISTS}
            rows.append(row)
        jsonl.write_jsonl(path, head, rows)

    # --- metrics -------------------------------------------------------------------------------
    @property
    def metric(self) -> PromptMetric:
        """The task's metric for ``self.phase``, a ``PromptMetric`` (``task.metric(logits)`` is
        the mean over prompts; ``.per_prompt``, ``.reads``).

        Each reads what its phase's corruption (``config["corruption"]``, default "note") changes:

        * Phase 2, "note" (``sibling_margin``): at the corrupted target's answer step
          (``meta["p2_target"]``), ``logit[target] - mean(logit[its own shortlisted siblings])``
          (``meta["p2_siblings"]``). A task whose rows lack those (a JSONL without them) gets
          ``all_near_miss_margin``: the mean over answer steps of ``logit[target] -
          mean(logit[every near-miss of the note])``, other categories' near-misses included
          (``task.all_near_miss_metric()``, named so in every case).
        * Phase 2, "shortlist-swap" / "shortlist-sibling" (``edited_sibling_margin``): at the
          same step, ``logit[target] - logit[the sibling the shortlist edit wrote in its
          place]`` (``meta["p2_rival"]``).
        * Phase 1, "note" (``anchor_margin``): the mean over anchor steps of
          ``logit[anchor] - mean(logit[anchors of the corrupt evidence])`` (a row without
          ``corrupt_anchors``: the mean over every other anchor).
        * Phase 1, "anchor" (``shortlist_anchor_margin``): at the first shortlist step of the
          corrupted target's category (``meta["p1_shortlist_step"]``), ``logit[the label written
          there] - mean(logit[labels under the anchor written in its place])``.
        """
        return self.prompt_metric()

    def prompt_metric(self) -> PromptMetric:
        """Same as ``task.metric`` (kept for code written before ``metric`` was a property)."""
        # labelled: a patching result of this metric names its task and phase (figure titles)
        return replace(self._metric(), labels=(("task", self.name), ("phase", self.phase)))

    @property
    def answer_positions(self) -> Int[Tensor, "batch k"]:
        """The logit positions ``task.metric`` reads, one row per example: those predicting
        this phase's steps (phase 2: ``answer_pos - 1``; phase 1: ``anchor_pos - 1``), -1
        padding. Each example's own positions, so they never fall in the right padding of
        ``clean_tokens``: the per-prompt ``-1`` of the TransformerLens idiom
        ``l[:, -1, tgt]``, for ``ck.metrics.at_answers`` (docs/metrics.md)."""
        return logit_positions(self._step_pos())

    @property
    def answer_tokens(self) -> Int[Tensor, "batch k"]:
        """The token at each of ``answer_positions``' steps (what it predicts: the target),
        ``[batch, k]``, 0 where a row is padded (its position is -1 there)."""
        return pad_rows(self._step_tokens(), fill=0)

    def position_groups(self, at: str = "tokens") -> dict[str, Tensor]:
        """The task's stages as position groups for ``ck.patch_heads(..., positions=...)``:
        ``{"evidence", "anchor", "shortlist", "answer"}``, each a bool mask ``[batch, seq]``
        aligned to ``clean_tokens`` (each example's own positions; never its right padding).

        ``at="tokens"`` (default): each group at its tokens' own positions (``evidence_pos``,
        ``anchor_pos``, ``shortlist_pos``, ``answer_pos``): where a head processes those tokens (and
        where later heads read them as keys/values). ``at="steps"``: anchor, shortlist and answer at
        the positions that *predict* those tokens (``pos - 1``: where the chain of thought writes
        them; "answer" is then where ``task.metric`` reads). In a causal model an answer token's own
        position comes after its step's read: patching there changes only later steps (nothing for a
        one-answer note). A group no example has is left out."""
        if at not in ("steps", "tokens"):
            raise ValueError(f"at={at!r}: expected 'steps' or 'tokens'.")
        n, seq = len(self.examples), max(len(e.tokens) for e in self.examples)
        out = {}
        for name in ("evidence", "anchor", "shortlist", "answer"):
            shift = 1 if at == "steps" and name != "evidence" else 0
            mask = torch.zeros(n, seq, dtype=torch.bool)
            for i, e in enumerate(self.examples):
                pos = [p - shift for p in getattr(e, f"{name}_pos") if p - shift >= 0]
                mask[i, pos] = True
            if bool(mask.any()):
                out[name] = mask
        return out

    @property
    def last_positions(self) -> Int[Tensor, " batch"]:
        """Each example's last token position (``len(tokens) - 1``), ``[batch]``: where
        ``logits[:, -1]`` reads in a prompt of its own length. ``clean_tokens`` pads shorter
        examples on the right, so ``-1`` reads padding there; ``logits[torch.arange(n),
        task.last_positions]`` reads each prompt's own last position."""
        return torch.tensor([len(e.tokens) - 1 for e in self.examples], dtype=torch.long)

    def all_near_miss_metric(self) -> PromptMetric:
        """Phase 2's metric before the sibling margin (``all_near_miss_margin``): the mean over
        answer steps of ``logit[target] - mean(logit[near_misses])``, every near-miss of the
        note (other categories' included; the vocabulary's mean when a row has none)."""
        ex = self.examples
        return replace(token_margin_metric(
            [e.answer_pos for e in ex], [e.tokens[e.answer_pos].tolist() for e in ex],
            [self.label_token_ids[e.near_misses].tolist() for e in ex],
            name="all_near_miss_margin"), labels=(("task", self.name), ("phase", 2)))

    @property
    def corruption(self) -> str:
        """What this phase's ``corrupt_tokens`` edit: "note" (the evidence; the default),
        "anchor" (Phase 1), "shortlist-swap" or "shortlist-sibling" (Phase 2)."""
        from circuitkit.corruptions import parse_corruption

        return parse_corruption(self.config.get("corruption"))[self.phase]

    def _metric_kind(self) -> str:
        """Which metric ``task.metric`` is (its name; docstring of ``metric``)."""
        if self.config.get("metric") == "logprob":
            return "answer_logprob"
        kind = self.corruption
        if self.phase == 1:
            return "shortlist_anchor_margin" if kind == "anchor" else "anchor_margin"
        if kind != "note":
            return "edited_sibling_margin"
        sib = all("p2_target" in e.meta and "p2_siblings" in e.meta for e in self.examples)
        return "sibling_margin" if sib else "all_near_miss_margin"

    def _step_pos(self) -> list[list[int]]:
        """The token positions of the steps ``task.metric`` scores, per example."""
        kind = self._metric_kind()
        if kind == "anchor_margin":
            return [e.anchor_pos for e in self.examples]
        if kind == "shortlist_anchor_margin":
            return [[int(e.meta["p1_shortlist_step"])] for e in self.examples]
        if kind in ("sibling_margin", "edited_sibling_margin"):
            return [[e.answer_pos[e.targets.index(int(e.meta["p2_target"]))]]
                    for e in self.examples]
        return [e.answer_pos for e in self.examples]

    def _step_tokens(self) -> list[list[int]]:
        """The token at each of ``_step_pos``' positions, per example."""
        return [e.tokens[p].tolist() for e, p in zip(self.examples, self._step_pos(), strict=True)]

    def _metric(self) -> PromptMetric:
        ex = self.examples
        steps = self._step_pos()
        tokens = self._step_tokens()
        kind = self._metric_kind()
        if kind == "answer_logprob":
            return token_logprob_metric(steps, tokens, name="answer_logprob")
        if kind == "shortlist_anchor_margin":
            la = self.label_anchor
            rivals = [self.label_token_ids[la == la[int(e.meta["p1_label"])]].tolist()
                      for e in ex]
            return token_margin_metric(steps, tokens, rivals, name=kind)
        if kind in ("sibling_margin", "edited_sibling_margin"):
            key = "p2_siblings" if kind == "sibling_margin" else "p2_rival"
            rivals = [self.label_token_ids[torch.as_tensor(e.meta[key]).reshape(-1)].tolist()
                      for e in ex]
            return token_margin_metric(steps, tokens, rivals, name=kind)
        if kind == "all_near_miss_margin":
            return self.all_near_miss_metric()
        if self.phase == 1:
            anchors = self.anchor_token_ids.tolist()

            def rivals(e: Example) -> list[int]:
                # the anchors the corrupt evidence points to; a row without them (a JSONL
                # leaving corrupt_anchors out) is compared with every other anchor, not with
                # the whole vocabulary's mean
                if e.meta.get("corrupt_anchors"):
                    return self.anchor_token_ids[e.meta["corrupt_anchors"]].tolist()
                own = set(e.tokens[e.anchor_pos].tolist())
                return [t for t in anchors if t not in own]
            return token_margin_metric(steps, tokens, [rivals(e) for e in ex],
                                       name="anchor_margin")
        raise AssertionError(f"unhandled metric kind {kind!r}")

    # --- identity -------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Short hash of the token content (recorded in results to tie them to their inputs)."""
        h = hashlib.sha256()
        h.update(json.dumps([self.name, self.phase], sort_keys=True).encode())
        for t in (self.clean_tokens, self.corrupt_tokens):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    def tokenizer(self):
        """A HF ``PreTrainedTokenizerFast`` over ``self.vocab`` (word level)."""
        return word_tokenizer(self.vocab)

    def vocabulary_problem(self, tokenizer: Any) -> str | None:
        """Why ``tokenizer`` does not read this task's token ids as the task's words (a model
        trained on another vocabulary, or a pretrained LLM), or None when it does. Only the ids
        the task uses are compared; a tokenizer that is absent, or circuitkit's numbered
        placeholder (``t0 .. tN``, random models built from a config), names no words and is
        not held against the task."""
        if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens"):
            return None
        used = sorted(set(self.clean_tokens.flatten().tolist())
                      | set(self.corrupt_tokens.flatten().tolist()))
        try:
            theirs = tokenizer.convert_ids_to_tokens(used)
        except (IndexError, KeyError, TypeError, ValueError, OverflowError):
            return None  # ids beyond the tokenizer: the size check speaks for them
        if theirs == [f"t{i}" for i in used]:  # the numbered placeholder
            return None
        bad = [(i, t, self.vocab[i]) for i, t in zip(used, theirs, strict=True)
               if i < len(self.vocab) and t != self.vocab[i]]
        if bad and hasattr(tokenizer, "decode"):  # a vocab written as decoded text (" heart"
            bad = [(i, t, w) for i, t, w in bad  # for BPE's "Ġheart") names the same token
                   if tokenizer.decode([i]).strip() != w.strip()]
        if not bad:
            return None
        shown = ", ".join(f"id {i} is {t!r} to the model but {w!r} to the task"
                          for i, t, w in bad[:3])
        said = (f"the model's tokenizer reads {len(bad)} of the {len(used)} token ids the task "
                f"uses as other words ({shown}): it was not trained on this task's vocabulary. ")
        if self.name in TEXT_TASKS:
            return said + (
                f"Use a model trained on it (e.g. icd-teacher for {self.name}), or have the task "
                "rendered as text for a pretrained LLM: circuitkit patch does so by itself, "
                "score and characterize with --text auto (their default) or --text yes, "
                "Python with text=True (characterize, circuitkit.scoring.text.load_for); "
                "evaluate reads the task's own ids.")
        return said + (
            "A task read from a file is given to the model as the token ids it stores (it is "
            "not rendered as text): use a model trained on its vocabulary, e.g. "
            "circuitkit.training.train(TrainConfig(task='your.jsonl', preset='teacher'), "
            "'runs/my-model'), then --model runs/my-model (docs/jsonl.md).")

    def check_model(self, model: Any) -> None:
        """Refuse a model whose vocabulary cannot hold this task's token ids, or whose
        tokenizer reads them as other words (``vocabulary_problem``)."""
        d_vocab = int(model.cfg.d_vocab)
        low = min(int(self.clean_tokens.min()), int(self.corrupt_tokens.min()))
        if low < 0:
            raise ValueError(f"task {self.name!r} holds a negative token id ({low}); token ids "
                             f"must lie in 0..{d_vocab - 1}: check the JSONL or the tokenizer "
                             f"that produced them.")
        top = max(int(self.clean_tokens.max()), int(self.corrupt_tokens.max()))
        if top >= d_vocab:
            raise ValueError(
                f"task {self.name!r} uses token ids up to {top} but the model's vocabulary has "
                f"{d_vocab} tokens: use a model trained on this task's vocabulary (e.g. "
                f"icd-teacher for icd10), or render the task as text for a pretrained LLM "
                f"(circuitkit.tasks.text.render_text).")
        problem = hooks.context_problem(model, int(self.clean_tokens.shape[1]),
                                        f"task {self.name!r}'s notes")
        if problem:
            raise ValueError(problem)
        out = hooks.vocab_out(model)
        phases = task_phases(self)
        read = [int(t) for p, ids in ((1, self.anchor_token_ids), (2, self.label_token_ids))
                if p in phases for t in ids.tolist()]
        read += [int(e.tokens[p]) for e in self.examples for p in e.anchor_pos + e.answer_pos]
        if read and max(read) >= out:
            raise ValueError(
                f"task {self.name!r}: its metrics read the logits of token ids up to {max(read)} "
                f"(its label and anchor tokens) but the model's unembedding has {out} outputs "
                f"(its own output vocabulary, d_vocab_out < d_vocab, as a Tracr model's); give "
                f"the labels and anchors token ids below {out}.")
        problem = self.vocabulary_problem(getattr(model, "tokenizer", None))
        if problem:
            raise ValueError(f"task {self.name!r}: {problem}")

    def padding_problem(self) -> str | None:
        """Why a step position of some example lies in its own right padding (a trailing run
        of ``pad_id`` in its tokens, e.g. rows of ``model.to_tokens`` of prompts of different
        lengths), or None. Stacked views pad every example to one length and each metric reads
        its own example's positions, so padding is only wrong where a position points into it."""
        for i, e in enumerate(self.examples):
            for name, toks in (("tokens", e.tokens), ("corrupt_tokens", e.corrupt_tokens)):
                real = len(toks) - int((toks.flip(0) == self.pad_id).long().cumprod(0).sum())
                if real == len(toks):
                    continue
                for field_ in ("evidence_pos", "anchor_pos", "shortlist_pos", "answer_pos"):
                    bad = [p for p in getattr(e, field_) if p >= real]
                    if bad:
                        return (f"example {i}'s {field_} {bad} point(s) into its right padding "
                                f"(its {name} end in {len(toks) - real} pad tokens, id "
                                f"{self.pad_id}, after {real} tokens): give each example its "
                                "own unpadded tokens, with positions inside them.")
        return None

    def decode(self, ids: Tensor | list[int]) -> str:
        return " ".join(self.vocab[int(i)] for i in ids)


def check_task(task: Any, caller: str) -> None:
    """Refuse anything but a non-empty ``Task`` with a message naming ``caller``."""
    if not isinstance(task, Task):
        got = repr(task) if isinstance(task, str) else type(task).__name__
        raise ValueError(f"{caller}: task must be a circuitkit Task (ck.load_task('icd10', ...) "
                         f"or ck.Task.from_jsonl(path)); got {got}.")
    if len(task) == 0:
        raise ValueError(f"{caller}: task has no examples; it needs at least one.")
    padding = task.padding_problem()
    if padding:
        raise ValueError(f"{caller}: task {task.name!r}: {padding}")


def task_phases(task: Task) -> list[int]:
    """The phases ``task`` has steps for: 1 with an ``anchor_pos >= 1``, 2 with an
    ``answer_pos >= 1`` (the logits before a step predict it)."""
    return [p for p in (1, 2) if any(_has_steps(e, p) for e in task.examples)]


def _has_steps(example: Example, phase: int) -> bool:
    """Whether ``example`` has a step of ``phase`` (an anchor, or an answer, at position >= 1)."""
    return any(p >= 1 for p in (example.anchor_pos if phase == 1 else example.answer_pos))


def phase_task(task: Task, phase: int) -> Task:
    """``task.with_phase(phase)`` keeping only the examples with steps of that phase: an
    example without anchor steps has no Phase-1 metric value, and counted as 0 it would dilute
    the mean and add zero-effect prompts to every statistic."""
    tp = task.with_phase(phase)
    keep = [i for i, e in enumerate(tp.examples) if _has_steps(e, phase)]
    return tp if len(keep) == len(tp) else tp.subset(keep)


SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def word_tokenizer(vocab: list[str], path: str | None = None):
    """Word-level HF fast tokenizer over ``vocab`` (ids = list order); saved to ``path`` if given.

    ``vocab`` must start with ``<pad> <bos> <eos> <unk>``. Saved as ``tokenizer.json`` so
    TransformerLens and HF load it like any other tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
        raise ValueError(f"vocab must start with {SPECIAL_TOKENS}; got {vocab[:4]}.")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>")
    if path is not None:
        fast.save_pretrained(path)
    return fast
