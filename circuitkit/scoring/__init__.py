"""Head scores (Phase-1 CoarseScore, Phase-2 RefineScore) and their causal validation.

``score_heads(model, task)`` (``heads.py``; components in ``coarse.py`` and ``refine.py``),
``validate_heads(model, task, scores)`` and ``ablate_heads(model, task, scores)``
(``validate.py``), ``text_task(task, tokenizer)``
(``text.py``: a task rendered as text for pretrained LLMs, positions mapped). Formulas with
shapes: docs/scores.md. Names resolve lazily so ``import circuitkit.scoring`` stays free of torch.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "score_heads": "circuitkit.scoring.heads:score_heads",
    "top_heads": "circuitkit.scoring.heads:top_heads",
    "COLUMNS": "circuitkit.scoring.heads:COLUMNS",
    "refine_part_influence": "circuitkit.scoring.heads:refine_part_influence",
    "text_task": "circuitkit.scoring.text:text_task",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
