"""Attention views with circuitsvis: chosen heads' patterns over one example's tokens, with the
note/evidence, anchor, shortlist and answer spans marked.

Offline: circuitsvis's own ``RenderedHTML`` shows its CDN version (``unpkg.com``) whenever a probe
of ``google.com`` succeeds, and ``str()`` of it is always the CDN version; only its "local" source
inlines the bundle (``circuitsvis/dist/cdn/iife.js``, ~1.3 MB, shipped in the wheel), and that one
wraps it in a ``<script type="module">``, so the bundle's ``var CircuitsVis`` stays module-local and
every view carries its own copy. Here the bundle is read from the installed package
(``circuitsvis_js()``) and loaded as a classic script, which defines the global ``CircuitsVis``
once; each view then calls ``CircuitsVis.render(id, CircuitsVis.AttentionHeads, props)``.
``AttentionView.html`` (and Jupyter's ``_repr_html_``) is self-contained: bundle + view; a report
loads the bundle once and embeds ``view.fragment()`` per view. Nothing is fetched from a network.
"""

from __future__ import annotations

import functools
import html
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# span -> (marker prefixed to the token in the circuitsvis view, colour, legend text)
SPANS: dict[str, tuple[str, str, str]] = {
    "note": ("", "#e8e8e8", "note"),
    "evidence": ("✱", "#ffbb78", "evidence (note words that identify a target)"),
    "anchor": ("▲", "#aec7e8", "anchors (Phase 1)"),
    "shortlist": ("◆", "#c5b0d5", "shortlist (Phase 2)"),
    "answer": ("★", "#ff9896", "answer labels"),
}


@functools.lru_cache(maxsize=1)
def circuitsvis_js() -> str:
    """The circuitsvis browser bundle (``dist/cdn/iife.js`` of the installed package), safe to
    inline in a ``<script>``: ``</script`` (once, in a string literal) is written ``<\\/script``,
    which is the same string in JavaScript."""
    import circuitsvis

    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    if not path.exists():
        raise FileNotFoundError(f"circuitsvis bundle not found at {path}: reinstall circuitsvis "
                                f"(pip install --force-reinstall circuitsvis).")
    return path.read_text(encoding="utf-8").replace("</script", "<\\/script")


def circuitsvis_script() -> str:
    """``<script>`` defining the global ``CircuitsVis`` (load once per page, before any view)."""
    return f"<script>{circuitsvis_js()}</script>"


def _json_for_script(obj: Any) -> str:
    """JSON safe inside an inline ``<script>`` (no ``</``, no HTML comment openers)."""
    return json.dumps(obj).replace("</", "<\\/").replace("<!--", "<\\!--")


@dataclass
class AttentionView:
    """Attention patterns of ``heads`` over one example.

    ``patterns``: ``[n_heads, seq, seq]`` (query, key), rows sum to 1; ``words``: the tokens;
    ``spans``: span name -> positions (``SPANS`` keys). Jupyter renders it (``_repr_html_``);
    ``html`` is a self-contained snippet; ``fragment()`` needs ``circuitsvis_script()`` on the page.
    """

    patterns: np.ndarray
    words: list[str]
    heads: list[tuple[int, int]]
    spans: dict[str, list[int]] = field(default_factory=dict)
    title: str = ""

    def span_of(self, pos: int) -> str | None:
        for name in ("answer", "shortlist", "anchor", "evidence", "note"):  # most specific first
            if pos in self.spans.get(name, ()):
                return name
        return None

    @property
    def labels(self) -> list[str]:
        """Token labels with the span marker prefixed (what circuitsvis shows)."""
        return [(SPANS[s][0] if s else "") + w
                for p, w in enumerate(self.words) for s in [self.span_of(p)]]

    @property
    def head_names(self) -> list[str]:
        from circuitkit import hooks

        return [hooks.head_name(layer, head) for layer, head in self.heads]

    def props(self) -> dict[str, Any]:
        """Props of circuitsvis's ``AttentionHeads`` (as ``circuitsvis.attention.attention_heads``
        passes them)."""
        return {"attention": np.round(self.patterns, 4).tolist(), "tokens": self.labels,
                "attentionHeadNames": self.head_names, "maskUpperTri": True}

    def legend_html(self) -> str:
        chips = "".join(
            f'<span style="background:{color};padding:1px 6px;margin-right:6px;'
            f'border-radius:3px">{html.escape(marker + " " + text)}</span>'
            for marker, color, text in SPANS.values())
        words = "".join(
            f'<span title="pos {p}" style="background:{SPANS[s][1] if s else "transparent"};'
            f'padding:1px 3px;margin:1px;border-radius:3px;display:inline-block">'
            f'{html.escape(w)}</span>'
            for p, w in enumerate(self.words) for s in [self.span_of(p)])
        return (f'<div style="font:13px sans-serif;margin:4px 0">{chips}</div>'
                f'<div style="font:13px monospace;margin:4px 0 8px 0;line-height:1.7">'
                f'{words}</div>')

    def fragment(self) -> str:
        """This view as HTML that renders with the ``CircuitsVis`` global already loaded."""
        element = "circuitkit-attn-" + uuid.uuid4().hex[:12]
        title = f"<h4 style='font-family:sans-serif;margin:6px 0'>{html.escape(self.title)}</h4>" \
            if self.title else ""
        return (f'<div class="circuitkit-attention">{title}{self.legend_html()}'
                f'<div id="{element}" style="margin:8px 0"></div>'
                f'<script>CircuitsVis.render("{element}", CircuitsVis.AttentionHeads, '
                f'{_json_for_script(self.props())});</script></div>')

    @property
    def html(self) -> str:
        """Self-contained HTML (the circuitsvis bundle inlined, ~1.3 MB): works offline."""
        return circuitsvis_script() + self.fragment()

    def _repr_html_(self) -> str:
        # the bundle in every view: Colab renders each output in its own frame, so a bundle
        # sent once per kernel would leave the other views blank there
        return self.html

    def __repr__(self) -> str:  # the text fallback: not the whole patterns array
        return (f"AttentionView({self.title!r}, heads={self.head_names}, "
                f"{len(self.words)} tokens)")

    def to_circuitsvis(self):
        """The same view as circuitsvis's own object (``attention_heads``; note: it loads from
        the unpkg CDN when online, see the module docstring)."""
        from circuitsvis.attention import attention_heads

        p = self.props()
        return attention_heads(p["attention"], p["tokens"], attention_head_names=p[
            "attentionHeadNames"], mask_upper_tri=True)


def example_spans(ex: Any, words: Sequence[str]) -> dict[str, list[int]]:
    """Span name -> positions of an ``Example``: ``note`` = positions after ``<bos>`` before the
    CoT (``<think>`` if present, else the first anchor/shortlist/answer position), less the
    evidence; the others are the example's own position lists."""
    cot = [p for p in (*ex.anchor_pos, *ex.shortlist_pos, *ex.answer_pos)]
    end = words.index("<think>") if "<think>" in words else (min(cot) if cot else len(words))
    evidence = sorted(int(p) for p in ex.evidence_pos)
    return {
        "note": [p for p in range(1, end) if p not in evidence],
        "evidence": evidence,
        "anchor": sorted(int(p) for p in ex.anchor_pos),
        "shortlist": sorted(int(p) for p in ex.shortlist_pos),
        "answer": sorted(int(p) for p in ex.answer_pos),
    }


def _check_heads(heads: Any, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    try:
        out = [(int(layer), int(head)) for layer, head in heads]
    except (TypeError, ValueError):
        out = []
    if not out or any(not (0 <= la < n_layers and 0 <= h < n_heads) for la, h in out):
        raise ValueError(f"heads={heads!r}: expected a non-empty list of (layer, head) pairs "
                         f"with layer in 0..{n_layers - 1} and head in 0..{n_heads - 1}.")
    return out


def head_patterns(model: Any, tokens: Any, heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """Attention patterns ``[n_heads, seq, seq]`` of ``heads`` on one sequence ``tokens [seq]``
    (one forward pass caching only the needed layers' pattern hooks)."""
    import torch

    from circuitkit import hooks

    names = {hooks.pattern(layer) for layer, _ in heads}
    device = next(model.parameters()).device
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.as_tensor(tokens)[None].to(device),
                                        names_filter=lambda name: name in names)
    missing = sorted(n for n in names if n not in cache)
    if missing:
        raise ValueError(f"model: no attention pattern recorded at {missing}; attention views "
                         f"need a model whose bridge exposes hook_pattern.")
    return torch.stack([cache[hooks.pattern(la)][0, h] for la, h in heads]).float().cpu().numpy()


def attention(model: Any, task_or_example: Any, heads: Sequence[tuple[int, int]],
              example: int = 0, vocab: Sequence[str] | None = None) -> AttentionView:
    """Attention of ``heads`` (``[(layer, head), ...]``) over one example's clean tokens.

    ``task_or_example``: a ``ck.Task`` (shows ``task.examples[example]``, words from
    ``task.vocab``) or a ``ck.Example`` (words from ``vocab``, else the model's tokenizer).
    Returns an ``AttentionView``: renders in Jupyter; ``.html`` embeds anywhere, offline.
    """
    from circuitkit import hooks

    facts = hooks.facts(model)
    heads = _check_heads(heads, facts.n_layers, facts.n_heads)
    if hasattr(task_or_example, "examples"):
        task = task_or_example
        if not 0 <= example < len(task.examples):
            raise ValueError(f"example={example}: expected an index in 0..{len(task) - 1}.")
        ex, vocab = task.examples[example], task.vocab
        title = f"{task.name}, example {example}"
    elif hasattr(task_or_example, "tokens") and hasattr(task_or_example, "answer_pos"):
        ex, title = task_or_example, "example"
    else:
        raise ValueError(f"task_or_example: expected a ck.Task or a ck.Example; got "
                         f"{type(task_or_example).__name__}.")
    ids = [int(t) for t in ex.tokens]
    if vocab is not None:
        words = [vocab[i] if 0 <= i < len(vocab) else str(i) for i in ids]
    elif getattr(model, "tokenizer", None) is not None:
        words = [str(w) for w in model.tokenizer.convert_ids_to_tokens(ids)]
    else:
        words = [str(i) for i in ids]
    patterns = head_patterns(model, ex.tokens, heads)
    return AttentionView(patterns=patterns, words=words, heads=heads,
                         spans=example_spans(ex, words), title=title)
