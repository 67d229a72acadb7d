"""circuitkit's warnings attributed to the caller's line: ``warn(message)`` names the first frame
outside circuitkit (and outside torch's decorators), so a notebook shows the user's own line
under a warning, not a line of ``experiments/validation.py`` or of ``torch/utils/_contextlib.py``
(a fixed ``stacklevel`` pointed into whichever of them called last)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)  # circuitkit/
_TORCH = ("torch/utils/_contextlib.py", "torch\\utils\\_contextlib.py")


def _inside(filename: str) -> bool:
    return filename.startswith(HERE) or filename.endswith(_TORCH) or filename.startswith(
        "<frozen ")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside circuitkit
    (its file, line and module: the filters and the once-per-location rule apply there)."""
    frame = sys._getframe(1)
    while frame is not None and _inside(str(Path(frame.f_code.co_filename).resolve())
                                        if not frame.f_code.co_filename.startswith("<")
                                        else frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:  # (called from circuitkit itself, e.g. a script inside the package)
        warnings.warn(message, category, stacklevel=2)
        return
    g = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=g.get("__name__", "<string>"),
                           registry=g.setdefault("__warningregistry__", {}), module_globals=g)
