"""One meaning per word (issue 32, item 7): each of these is written once, in its one home, and
a second copy does not come back (the source of ``circuitkit/`` is read)."""

from __future__ import annotations

import re
from pathlib import Path

import circuitkit

ROOT = Path(circuitkit.__file__).parent


def sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.rglob("*.py")}


def hits(pattern: str, skip: tuple[str, ...] = ()) -> list[str]:
    rx = re.compile(pattern)
    return [f"{name}:{i}: {line.strip()}" for name, text in sources().items() if name not in skip
            for i, line in enumerate(text.splitlines(), 1) if rx.search(line)]


def test_one_derangement():
    """``engine.derangement`` is the one seeded derangement (``circuit``'s resample and
    ``ablate_heads``' draw the same pairing from one seed)."""
    found = hits(r"def derangement\(")
    assert len(found) == 1 and found[0].startswith("patching/engine.py:"), found
    assert hits(r"argsort\(perm\)|roll\(perm") == []
    from circuitkit.patching import faithfulness

    assert "derangement(n, seed)" in Path(faithfulness.__file__).read_text()


def test_one_attn_result_switch():
    """``shortcuts.attn_result`` (and ``attn_result_off``, made of it) is the one place the
    per-head ``hook_result`` flag is switched for a run; ``models`` sets it once at load."""
    assert hits(r"^[^`]*\.set_use_attn_result\(", skip=("patching/shortcuts.py", "models.py")) == []
    assert len(hits(r"(def|class) attn_result_off\b")) == 1
    from circuitkit.distill import signals
    from circuitkit.patching import shortcuts

    assert signals.attn_result_off is shortcuts.attn_result_off


def test_plan_is_the_cost_module_only():
    """"plan" names the module that prices work (``patching/plan.py``); the chunker is
    ``sweep.chunked``."""
    from circuitkit.patching import sweep

    assert not hasattr(sweep, "plan") and callable(sweep.chunked)
    assert hits(r"def plan\(") == []
