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
    """``head_sets.derangement`` (also ``engine.derangement``) is the one seeded derangement
    (``circuit``'s resample and ``ablate_heads``' draw the same pairing from one seed)."""
    found = hits(r"def derangement\(")
    assert len(found) == 1 and found[0].startswith("patching/exact/head_sets.py:"), found
    from circuitkit.patching import exact as engine
    from circuitkit.patching.exact import head_sets

    assert engine.derangement is head_sets.derangement
    assert hits(r"argsort\(perm\)|roll\(perm") == []
    from circuitkit.patching.units import circuits  # (ck.circuit's runs)

    assert "derangement(n, self.seed)" in Path(circuits.__file__).read_text()


def test_one_attn_result_switch():
    """``shortcuts.attn_result`` (and ``attn_result_off``, made of it) is the one place the
    per-head ``hook_result`` flag is switched for a run; ``models`` sets it once at load."""
    assert hits(r"^[^`]*\.set_use_attn_result\(", skip=("patching/shortcuts.py", "models.py")) == []
    assert len(hits(r"(def|class) attn_result_off\b")) == 1
    from circuitkit.distill import signals
    from circuitkit.patching import shortcuts

    assert signals.attn_result_off is shortcuts.attn_result_off


def test_plan_is_the_cost_module_only():
    """"plan" names what prices work (``patching/cost.py``: ``sweep_plan``, ``plan_patch``); the
    chunker is ``sweep.chunked``."""
    from circuitkit.patching import sweep

    assert not hasattr(sweep, "plan") and callable(sweep.chunked)
    assert hits(r"def plan\(") == []


# a model's shape label ("L2H4D64": layers, heads, width), not a node
SHAPE_LABEL = 'return f"L{p.n_layers}H{p.n_heads}D{p.d_model}"'


def test_one_node_naming():
    """Node names ("L2H0", "embed", "logits") are spelled and parsed in ``hooks`` only
    (``head_name``, ``node_name``, ``parse_head``, ``parse_node``, ``heads_in``); the old names
    other code imports are the same functions."""
    spelled = [h for h in hits(r"""f["'][^"']*L\{[^{}]*\}H\{""", skip=("hooks.py",))
               if not h.endswith(SHAPE_LABEL)]
    assert spelled == []
    assert hits(r"L\(\\d\+\)H", skip=("hooks.py",)) == []
    assert hits(r"def (_?node_name|node_of|_node_name|logits_node)\(", skip=("hooks.py",)) == []
    assert hits(r"^EMBED_NODE = \(", skip=("hooks.py",)) == []
    from circuitkit import hooks
    from circuitkit.patching import results, sweep

    assert results.node_name is hooks.node_name and results.node_of is hooks.parse_node
    assert sweep.EMBED_NODE == hooks.EMBED_NODE and sweep.logits_node is hooks.logits_node


def test_node_names_round_trip():
    import pytest

    from circuitkit import hooks

    for node, name in (((-1, -1), "embed"), ((3, -1), "logits"), ((2, 0), "L2H0"),
                       ((0, 11), "L0H11")):
        assert hooks.node_name(node, 3) == name and hooks.parse_node(name, 3) == node
    assert hooks.parse_head("L2H5") == (2, 5) and hooks.parse_head("embed") is None
    assert hooks.heads_in("top: L0H1 and L12H3.") == [(0, 1), (12, 3)]
    for bad in ("L3H0", "l0h1", "L0H", "embeds", ""):
        with pytest.raises(ValueError, match="is not a node of a 3-layer model"):
            hooks.parse_node(bad, 3)


def test_mean_has_one_meaning():
    """"mean" (ablate_heads, run_head_sets: a head's z over prompts and positions) is not
    ck.circuit's per-position mean, which is "position-mean"."""
    from circuitkit.experiments import validation as validate
    from circuitkit.patching import exact as engine
    from circuitkit.patching import faithfulness, results

    assert "mean" in validate.ABLATIONS and "mean" in engine.HEAD_SET_SOURCES
    assert "mean" not in faithfulness.ABLATIONS and "position-mean" in faithfulness.ABLATIONS
    assert faithfulness.ABLATIONS is results.CIRCUIT_ABLATIONS
    assert "position-mean" not in validate.ABLATIONS
