"""Strings from files, escaped for the medium they go to (issue 49): a terminal and a
spreadsheet (CSV). HTML pages escape with ``html.escape`` where they build their markup.

A task's name, its labels and a position group's name come from the user's files (a JSONL
header, a result's JSON); printed raw, ``ESC]0;...BEL`` retitles the terminal and other escape
sequences move the cursor or recolour it, and a CSV cell starting ``=`` (``=HYPERLINK(...)``)
is a formula in a spreadsheet. Imports nothing heavy.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls but tab and newline, DEL, and the C1 controls (``\x9b`` is a one-byte CSI)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: Any) -> str:
    """``text`` with every control character (ESC, BEL, CR, C1 ...; not tab or newline) shown
    as its escape (``\\x1b``), so nothing read from a file can drive the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


# a cell a spreadsheet reads as a formula (OWASP's list: = + - @, tab, carriage return)
_FORMULA = ("=", "+", "@", "\t", "\r")


def csv_safe(value: Any) -> Any:
    """A string cell that a spreadsheet would run as a formula, prefixed with ``'`` (shown as
    text); numbers, a lone "-" (a "no mechanism" mark), negative numbers written as text and
    other strings unchanged."""
    if not isinstance(value, str):
        return value
    if value.startswith(_FORMULA) or (value.startswith("-") and len(value) > 1
                                      and not _number(value)):
        return "'" + value
    return value


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def csv_frame(frame: Any) -> Any:
    """A copy of the pandas ``frame`` whose text cells are ``csv_safe`` (what a ``.csv`` the
    library writes holds: group, label and node names come from the user's files)."""
    from pandas.api.types import is_object_dtype, is_string_dtype

    out = frame.copy()
    for col in out.columns:
        if is_object_dtype(out[col]) or is_string_dtype(out[col]):
            out[col] = out[col].map(csv_safe)
    return out
