"""Score heads of a pretrained LLM: a CoT task rendered as text (``circuitkit.tasks.text``),
with Phase-1 and Phase-2 positions mapped onto the rendered tokens (why and how, with SmolLM2's
example: docs/scores.md, Pretrained LLMs).

A label is scored at its first distinguishing token ``d``: the first token where its code's
tokenization departs from the rival's. Per source example (kept when both phases render as
equal-length clean/corrupt prompts):

* Phase 1: ``t1 = meta["p1_target"]`` against ``m = meta["p1_label"]`` (its corrupting label,
  another anchor): ``anchor_pos = [start(t1) + d1]``, anchor token ``t1``'s there, corrupt anchor
  ``m``'s (``meta["corrupt_anchors"]``).
* Phase 2: ``t2 = meta["p2_target"]`` against its near-miss siblings: ``answer_pos = [start(t2) +
  d2]``, ``d2`` the first departure of any sibling; near-miss tokens those of the siblings
  departing at ``d2``; ``shortlist_pos`` offset ``d2`` in the candidate-line spelling of each.

Labels and anchors of the returned task are these tokens (``label_anchor`` all zeros: no
hierarchy among tokens); ``meta`` keeps the source index and the codes; dropped examples are
counted, by reason, in ``task.config["dropped"]``.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch

from circuitkit.tasks.base import Example, Task
from circuitkit.tasks.text import DEFAULT_TEMPLATE, render_text, text_problem

TEXT_OVERSAMPLE = 25  # source examples drawn per wanted text example (~5% render for SmolLM2)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def text_task(task: Task, tokenizer: Any, n_examples: int | None = None,
              template: str = DEFAULT_TEMPLATE, add_bos: bool = True) -> Task:
    """``task`` rendered for ``tokenizer`` with positions mapped (module docstring): a Task of at
    most ``n_examples`` examples (the first renderable ones, in order). ``ValueError`` when the
    task lacks per-phase corruption records or no example can be mapped."""
    need = {"p1_target", "p1_label", "p2_target", "corrupt_tokens_p1", "corrupt_tokens_p2"}
    if not task.examples or not need <= set(task.examples[0].meta):
        raise ValueError(f"text_task needs examples with meta {sorted(need)} (built-in icd10 and "
                         f"synthetic tasks have them); task {task.name!r} lacks "
                         f"{sorted(need - set(task.examples[0].meta if task.examples else {}))}.")
    for phase in (1, 2):  # the phases rendered below
        problem = text_problem(task.with_phase(phase), tokenizer, template)
        if problem:
            raise ValueError(f"task {task.name!r} cannot be rendered as text for this model: "
                             f"{problem}.")
    names = task.label_names
    bos = getattr(tokenizer, "bos_token_id", None) if add_bos else None
    pre = [bos] if bos is not None else []

    def enc(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False))

    @functools.cache
    def code(label: int) -> list[int]:
        return enc(" " + names[label])

    tok2label = {int(t): i for i, t in enumerate(task.label_token_ids.tolist())}
    la = task.label_anchor
    dropped: Counter[str] = Counter()
    rows = []
    for i, e in enumerate(task.examples):
        if n_examples is not None and len(rows) >= n_examples:
            break
        sub = task.subset([i])
        try:
            r1 = render_text(sub, tokenizer, phase=1, template=template, add_bos=add_bos)
            r2 = render_text(sub, tokenizer, phase=2, template=template, add_bos=add_bos)
        except ValueError:
            dropped["clean and corrupt prompts tokenize to different lengths"] += 1
            continue
        ids = r2.clean_tokens[0].tolist()
        starts = dict(zip(e.targets, r2.label_pos[0], strict=True))
        if any(ids[s:s + len(code(t))] != code(t) for t, s in starts.items()):
            dropped["a code's tokens in the answer differ from its standalone tokens"] += 1
            continue
        t1, m1 = int(e.meta["p1_target"]), int(e.meta["p1_label"])
        d1 = _lcp(code(t1), code(m1))
        if d1 >= min(len(code(t1)), len(code(m1))):
            dropped["target and corrupting label codes do not diverge"] += 1
            continue
        t2 = int(e.meta["p2_target"])
        sibs = [m for m in e.near_misses if int(la[m]) == int(la[t2])]
        div = {m: _lcp(code(t2), code(m)) for m in sibs}
        div = {m: d for m, d in div.items() if d < min(len(code(t2)), len(code(m)))}
        if not div:
            dropped["target has no near-miss whose code diverges from it"] += 1
            continue
        d2 = min(div.values())
        rivals = [m for m, d in div.items() if d == d2]
        cand_start = _candidate_starts(e, r2.clean_text[0], ids, names, tok2label, pre, enc,
                                       code, [t2, *rivals])
        if cand_start is None:
            dropped["candidate codes not found as tokens in the prompt"] += 1
            continue
        rows.append(dict(
            i=i, ids=ids, c1=r1.corrupt_tokens[0].tolist(), c2=r2.corrupt_tokens[0].tolist(),
            anchor_pos=starts[t1] + d1, anchor_tok=code(t1)[d1], bad_anchor_tok=code(m1)[d1],
            answer_pos=starts[t2] + d2, target_tok=code(t2)[d2],
            rival_toks=sorted({code(m)[d2] for m in rivals}),
            shortlist_pos=[cand_start[m] + d2 for m in [t2, *rivals]],
            codes=dict(p1_target=names[t1], p1_label=names[m1], p2_target=names[t2],
                       near_misses=[names[m] for m in rivals]), text=r2.clean_text[0]))
    if not rows:
        raise ValueError(f"text_task: none of {len(task)} examples of {task.name!r} could be "
                         f"mapped under this tokenizer: {dict(dropped)}. Text rendering is for a "
                         "pretrained LLM's subword tokenizer that spells codes character by "
                         "character (SmolLM2, Llama 3); a toy model's word-level tokenizer "
                         "cannot render them (use the task as built: --text no).")
    anchor_toks = sorted({r["anchor_tok"] for r in rows} | {r["bad_anchor_tok"] for r in rows})
    label_toks = sorted({r["target_tok"] for r in rows} | {t for r in rows
                                                             for t in r["rival_toks"]})
    a_id = {t: j for j, t in enumerate(anchor_toks)}
    l_id = {t: j for j, t in enumerate(label_toks)}
    examples = []
    for r in rows:
        examples.append(Example(
            tokens=torch.tensor(r["ids"]), corrupt_tokens=torch.tensor(r["c2"]), evidence_pos=[],
            anchor_pos=[r["anchor_pos"]], shortlist_pos=r["shortlist_pos"],
            answer_pos=[r["answer_pos"]], targets=[l_id[r["target_tok"]]],
            near_misses=[l_id[t] for t in r["rival_toks"]], anchors=[a_id[r["anchor_tok"]]],
            meta=dict(corrupt_tokens_p1=r["c1"], corrupt_tokens_p2=r["c2"],
                      corrupt_anchors=[a_id[r["bad_anchor_tok"]]], source_index=r["i"],
                      codes=r["codes"], text=r["text"])))
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else 1 + max(
        max(r["ids"] + r["c1"] + r["c2"]) for r in rows)
    vocab = (tokenizer.convert_ids_to_tokens(list(range(size)))
             if hasattr(tokenizer, "convert_ids_to_tokens") else [str(j) for j in range(size)])

    def show(t: int) -> str:
        return tokenizer.decode([t]) if hasattr(tokenizer, "decode") else str(t)

    pad = getattr(tokenizer, "pad_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    return Task(
        name=f"{task.name}-text", examples=examples,
        label_names=[show(t) for t in label_toks], anchor_names=[show(t) for t in anchor_toks],
        label_token_ids=torch.tensor(label_toks), anchor_token_ids=torch.tensor(anchor_toks),
        label_anchor=torch.zeros(len(label_toks), dtype=torch.long), vocab=list(vocab), phase=2,
        pad_id=int(pad) if pad is not None else 0, bos_id=int(bos) if bos is not None else 1,
        eos_id=int(eos) if eos is not None else 2,
        config=dict(name=f"{task.name}-text", source=task.config, source_name=task.name,
                    source_fingerprint=task.fingerprint(),
                    tokenizer=str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
                    template=template, n_source=len(task), dropped=dict(dropped)),
    ).with_phase(2)


def _candidate_starts(e: Any, text: str, ids: list[int], names: list[str],
                      tok2label: dict[int, int], pre: list[int], enc: Any, code: Any,
                      wanted: list[int]) -> dict[int, int] | None:
    """Token position where each ``wanted`` label's code starts in the candidate line."""
    shortlist = [tok2label[int(t)] for t in e.tokens[e.shortlist_pos].tolist()
                 if int(t) in tok2label] or sorted(set(e.targets) | set(e.near_misses))
    line = ", ".join(names[j] for j in shortlist)
    off = text.find(line)
    if off < 0 or any(w not in shortlist for w in wanted):
        return None
    out = {}
    for w in wanted:
        k = shortlist.index(w)
        char = off + len(", ".join(names[j] for j in shortlist[:k])) + (2 if k else 0)
        head = pre + enc(text[:char - 1])  # everything before the space that opens the code
        pos = len(head)
        if ids[:pos] != head or ids[pos:pos + len(code(w))] != code(w):
            return None
        out[w] = pos
    return out


def load_for(model: Any, task_name: str, n_examples: int, seed: int, split: str,
             text: bool | None, **task_kwargs: Any) -> tuple[Any, bool]:
    """The task for ``model``: ``task_name`` as built (``ck.load_task(..., **task_kwargs)``), or
    rendered as text (``text_task``) when ``text`` is True, or None and the model's vocabulary
    cannot hold the task's tokens. Returns ``(task, rendered)``."""
    import circuitkit as ck
    from circuitkit.tasks import TOKENIZER_TASKS

    if task_name in TOKENIZER_TASKS and "tokenizer" not in task_kwargs:  # text for this model
        task_kwargs = dict(task_kwargs, tokenizer=getattr(model, "tokenizer", None))
    file = str(task_name).endswith(".jsonl")  # a file: its first n_examples rows, at most all
    # a file keeps the phase its header names (a task with answer steps only may store no
    # Phase-1 corruption, and the reverse); the steps ask for each phase with with_phase
    task = ck.load_task(task_name, n_examples=None if file else n_examples, seed=seed,
                        split=split, phase=None if file else 2, **task_kwargs)
    if file and n_examples < len(task):
        task = task.subset(range(n_examples))
    vocab_error = None
    if text is None:
        try:
            task.check_model(model)
            text = False
        except ValueError as e:
            text, vocab_error = True, e
    if not text:
        return task, False
    try:
        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise ValueError("text=True needs a model with a tokenizer (model.tokenizer).")
        many = None if file else n_examples * TEXT_OVERSAMPLE  # a file: all its rows
        source = ck.load_task(task_name, n_examples=many, seed=seed, split=split,
                              phase=None if file else 2, **task_kwargs)
        return text_task(source, tok, n_examples=n_examples), True
    except ValueError as e:
        if vocab_error is None:  # text=True asked for: its own error
            raise
        # chosen automatically: the vocabulary is the cause, rendering only the failed fallback
        raise ValueError(f"{vocab_error} (Rendering the task as text for this model's "
                         f"tokenizer failed too: {e})") from None
