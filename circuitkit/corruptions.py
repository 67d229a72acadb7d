"""Which corruption each phase's corrupt tokens hold (torch-free: the CLI checks ``--corruption``
at parse time, before any model loads).

"note" edits the note (the evidence): Phase 1 one target's whole evidence becomes another
category's label's, Phase 2 its distinguishing words a shortlisted sibling's. The others keep the
note token-identical and edit only the chain of thought: Phase 1 "anchor" writes another
category's anchor at the corrupted target's anchor step (does the shortlist follow the written
anchor or the note?); Phase 2 "shortlist-swap" exchanges the target and a shortlisted sibling in
the shortlist, "shortlist-sibling" writes a sibling in the target's place (does the answer re-read
the shortlist?). ``tasks.synthetic.corrupt_cot`` builds them; docs/scores.md says which hypothesis
(evidence routing or loop-back) each result supports.
"""

from __future__ import annotations

CORRUPTIONS = {1: ("note", "anchor"), 2: ("note", "shortlist-swap", "shortlist-sibling")}


def parse_corruption(spec: str | None) -> dict[int, str]:
    """``{1: name, 2: name}`` from ``"note"`` (both phases), one phase's name (the other phase
    "note"), or ``"P1NAME,P2NAME"``; one ``ValueError`` line naming the choices otherwise."""
    spec = "note" if spec is None else str(spec)
    out = {1: "note", 2: "note"}
    named: set[int] = set()
    for item in [w.strip() for w in spec.split(",")]:
        phases = [p for p in (1, 2) if item in CORRUPTIONS[p]]
        if not phases or (item != "note" and named & set(phases)):
            raise ValueError(
                f"corruption={spec!r}: expected note (both phases), a Phase-1 corruption "
                f"({', '.join(CORRUPTIONS[1])}), a Phase-2 corruption "
                f"({', '.join(CORRUPTIONS[2])}), or one of each joined by a comma "
                "(e.g. anchor,shortlist-sibling).")
        if item != "note":
            out[phases[0]] = item
            named.add(phases[0])
    return out


def corruption_name(choice: dict[int, str]) -> str:
    """The canonical spelling of ``parse_corruption``'s result ("note", "anchor",
    "anchor,shortlist-sibling")."""
    named = [choice[p] for p in (1, 2) if choice[p] != "note"]
    return ",".join(named) or "note"
