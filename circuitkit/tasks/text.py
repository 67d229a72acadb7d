"""Render a CoT task as plain-text prompts for pretrained LLMs (labels as code strings).

Each example becomes (``DEFAULT_TEMPLATE``)::

    Clinical note: <note words; evidence groups joined by "; ">
    Candidate codes: <shortlist codes, comma separated>
    Answer: <target codes, comma separated>

The corrupt prompt is the same text with the note taken from the example's ``corrupt_tokens``
for the chosen phase. Under the given HF tokenizer, clean and corrupt must have the same number of
tokens and the prompt (up to ``Answer:``) must tokenize as a prefix of the full text; otherwise
``render_text`` refuses with a ``ValueError`` naming every offending example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit.tasks.base import TEXT_TASKS, Task

DEFAULT_TEMPLATE = "Clinical note: {note}\nCandidate codes: {candidates}\nAnswer:"
# Estimate of characters per token when the model's tokenizer is absent (``token_counts``):
# SmolLM2's BPE, which writes every digit as its own token, gives 2.07 on icd10 prompts (256 test
# examples, measured); tokenizers that merge digits (Llama 3: up to 3 per token) give fewer
# tokens, so the estimate errs long (a plan that over- rather than under-states the cost).
CHARS_PER_TOKEN = 2.0


@dataclass
class TextTask:
    """Rendered prompts. ``answer_pos[i]``: positions of all answer tokens of example i in
    ``clean_tokens[i]``; ``label_pos[i][k]``: position of the first token of its k-th target code
    (targets in ``task.examples[i].targets`` order); ``prompt_len[i]``: tokens before the answer."""

    clean_text: list[str]
    corrupt_text: list[str]
    clean_tokens: Int[Tensor, "batch seq"]
    corrupt_tokens: Int[Tensor, "batch seq"]
    answer_pos: list[list[int]]
    label_pos: list[list[int]]
    prompt_len: list[int]


def _note_text(task: Task, tokens: list[int]) -> str:
    think = task.vocab.index("<think>") if "<think>" in task.vocab else None
    end = tokens.index(think) if think is not None and think in tokens else len(tokens)
    words = [task.vocab[t] for t in tokens[:end] if t not in (task.bos_id, task.pad_id)]
    return " ".join(words).replace(" | ", "; ")


def _texts(task: Task, e: Any, template: str) -> list[tuple[str, str]]:
    """[(prompt, full text)] of example ``e``, clean then corrupt."""
    names = task.label_names
    tok2label = {int(t): i for i, t in enumerate(task.label_token_ids.tolist())}
    shortlist = [tok2label[int(t)] for t in e.tokens[e.shortlist_pos].tolist()
                 if int(t) in tok2label] or sorted(set(e.targets) | set(e.near_misses))
    cands = ", ".join(names[j] for j in shortlist)
    answer = ", ".join(names[j] for j in e.targets)
    out = []
    for toks in (e.tokens.tolist(), e.corrupt_tokens.tolist()):
        prompt = template.format(note=_note_text(task, toks), candidates=cands)
        out.append((prompt, prompt + " " + answer))
    return out


def prompt_texts(task: Task, phase: int | None = None,
                 template: str = DEFAULT_TEMPLATE) -> list[str]:
    """The full clean text (prompt and answer) of every example, as ``render_text`` writes it."""
    if phase is not None and phase != task.phase:
        task = task.with_phase(phase)
    return [_texts(task, e, template)[0][1] for e in task.examples]


def token_counts(texts: list[str], tokenizer: Any = None,
                 add_bos: bool = True) -> tuple[list[int], str]:
    """Tokens per text and how they were counted.

    With ``tokenizer``: its ``encode(text, add_special_tokens=False)`` plus one BOS token (if
    ``add_bos`` and it has one), as ``render_text``. Without: estimated as
    ``ceil(characters / CHARS_PER_TOKEN)`` + 1 (BOS)."""
    if tokenizer is not None:
        bos = int(add_bos and getattr(tokenizer, "bos_token_id", None) is not None)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return ([len(tokenizer.encode(t, add_special_tokens=False)) + bos for t in texts],
                f"token counts from the tokenizer of {name}")
    return ([math.ceil(len(t) / CHARS_PER_TOKEN) + int(add_bos) for t in texts],
            f"token counts estimated at {CHARS_PER_TOKEN:g} characters per token (tokenizer not "
            "on this machine)")


def render_text(task: Task, tokenizer, phase: int | None = None,
                template: str = DEFAULT_TEMPLATE, add_bos: bool = True) -> TextTask:
    """Render ``task`` (at ``phase``, default ``task.phase``) for ``tokenizer`` (anything with
    ``encode(text, add_special_tokens=False)``); prepends its BOS token if ``add_bos`` and it has
    one. Raises ``ValueError`` listing every example whose clean/corrupt token counts differ or
    whose prompt does not tokenize as a prefix of the full text."""
    if phase is not None and phase != task.phase:
        task = task.with_phase(phase)
    bos = getattr(tokenizer, "bos_token_id", None) if add_bos else None
    pre = [bos] if bos is not None else []

    def enc(s: str) -> list[int]:
        return pre + list(tokenizer.encode(s, add_special_tokens=False))

    clean_text, corrupt_text, clean_ids, corrupt_ids = [], [], [], []
    answer_pos, label_pos, prompt_len, errors = [], [], [], []
    for i, e in enumerate(task.examples):
        codes = [task.label_names[j] for j in e.targets]
        (p_clean, full_clean), (_, full_corrupt) = _texts(task, e, template)
        ids, cids, pids = enc(full_clean), enc(full_corrupt), enc(p_clean)
        name = f"example {i} (targets {codes})"
        if len(ids) != len(cids):
            errors.append(f"{name}: clean has {len(ids)} tokens, corrupt {len(cids)}")
        if ids[: len(pids)] != pids:
            errors.append(f"{name}: the prompt does not tokenize as a prefix of the full text")
            continue
        starts = []
        for k in range(len(codes)):
            head = enc(p_clean + " " + ", ".join(codes[:k]) + (", " if k else ""))
            # position of label k's first token = tokens of everything before it (BPE may merge the
            # separator into the label; then the label starts at the merged token)
            starts.append(len(head) - (1 if ids[: len(head)] != head else 0))
        clean_text.append(full_clean)
        corrupt_text.append(full_corrupt)
        clean_ids.append(ids)
        corrupt_ids.append(cids)
        answer_pos.append(list(range(len(pids), len(ids))))
        label_pos.append(starts)
        prompt_len.append(len(pids))
    if errors:
        tname = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"render_text: {len(errors)} example(s) cannot be rendered as "
                         f"equal-length clean/corrupt prompts under tokenizer {tname!r} "
                         f"(drop or edit them):\n"
                         + "\n".join(errors))
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    width = max(len(r) for r in clean_ids) if clean_ids else 0

    def stack(rows: list[list[int]]) -> Tensor:
        out = torch.full((len(rows), width), pad, dtype=torch.long)
        for j, r in enumerate(rows):
            out[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    return TextTask(clean_text, corrupt_text, stack(clean_ids), stack(corrupt_ids), answer_pos,
                    label_pos, prompt_len)


# --- a CoT task as a pretrained LLM's sweep input -----------------------------------------------

# Built-in tasks whose examples read as text (a note, candidate codes, an answer): TEXT_TASKS,
# defined beside Task (its vocabulary check names them) and imported above.


def text_problem(task: Task, tokenizer: Any, template: str = DEFAULT_TEMPLATE) -> str | None:
    """Why rendering ``task`` (at its phase) as text does not give a model with ``tokenizer``
    its words, or None when it does: the tokenizer reads some of the rendered text (clean and
    corrupt) as its unknown token (a word-level tokenizer of another vocabulary). Rendering
    happens only where this is None (``text_prompts``, ``scoring.text.text_task``)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(unk, int) or not hasattr(tokenizer, "encode"):
        return None  # (a byte-level BPE never needs one)
    texts = [t for e in task.examples for _, t in _texts(task, e, template)]
    total, unknown, words = 0, 0, []
    for text in texts:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        total += len(ids)
        hits = [i for i, t in enumerate(ids) if t == unk]
        unknown += len(hits)
        if hits and len(words) < 3:
            words += [w for w in text.split() if w not in words and list(
                tokenizer.encode(w, add_special_tokens=False)) == [unk]][:3 - len(words)]
    if not unknown:
        return None
    shown = f" (e.g. {', '.join(repr(w) for w in words)})" if words else ""
    name = getattr(tokenizer, "unk_token", None) or f"id {unk}"
    return (f"the model's tokenizer reads {unknown} of the {total} tokens of the task written "
            f"as text as its unknown token {name!r}{shown}, so the model would not see the "
            "task's words")


def needs_text(tokenizer: Any, task: Task) -> bool:
    """Whether a model with ``tokenizer`` gets ``task`` rendered as text: a CoT task
    (``TEXT_TASKS``) whose word ids the tokenizer reads as other words (a pretrained LLM)."""
    return (task.name in TEXT_TASKS and tokenizer is not None
            and not speaks_task_vocab(tokenizer, task))


def speaks_task_vocab(tokenizer: Any, task: Task) -> bool:
    """Whether ``tokenizer`` is the task's own word vocabulary (a model trained on the task,
    such as the shipped toys), so the task's token ids are its input as they are."""
    return tokenizer is not None and task.vocabulary_problem(tokenizer) is None


def text_prompts(task: Task, tokenizer: Any, template: str = DEFAULT_TEMPLATE
                 ) -> tuple[Tensor, Tensor, Any, list[int]]:
    """``(clean_tokens, corrupt_tokens, metric, kept)`` for a pretrained LLM: the examples that
    ``render_text`` can render under ``tokenizer`` (clean and corrupt texts of equal token count;
    the others are dropped), right-padded, and the mean log-prob of each prompt's answer tokens
    (``metrics.token_logprob_metric``; a multi-token ICD code has no single-token near-miss rival,
    so no margin). ``kept``: indices of the examples used. ``ValueError`` if none renders."""
    from circuitkit.metrics import token_logprob_metric

    problem = text_problem(task, tokenizer, template)
    if problem:
        raise ValueError(f"task {task.name!r} cannot be rendered as text for this model: "
                         f"{problem}.")
    kept = []
    for i in range(len(task)):
        try:
            render_text(task.subset([i]), tokenizer, template=template)
        except ValueError:
            continue
        kept.append(i)
    if not kept:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(f"none of the {len(task)} {task.name} examples renders as clean and "
                         f"corrupt texts of equal token count under tokenizer {name!r}; use "
                         "more examples (-n), or a .jsonl task with your own token ids.")
    tt = render_text(task.subset(kept), tokenizer, template=template)
    metric = token_logprob_metric(
        tt.answer_pos, [tt.clean_tokens[i, pos].tolist() for i, pos in enumerate(tt.answer_pos)],
        name="answer_logprob")
    return tt.clean_tokens, tt.corrupt_tokens, metric, kept
