"""circuitkit's progress bar: ``tqdm.auto.tqdm`` whose 100% line is printed once.

tqdm prints the line of the update that reaches the total and then, on ``close()``, the same
line again with the overall rate: in a log (no carriage return) every bar ended with two 100%
lines. Here the update that reaches the total only counts; ``close()`` prints the final line.
Every circuitkit bar is made from this class (``from circuitkit._progress import tqdm``).
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm as _tqdm


def interactive() -> bool:
    """Whether someone watches this process: stderr is a terminal, or it runs in a Jupyter
    kernel (a notebook). A default ``progress=None`` means a bar there and none in a log."""
    if getattr(sys.stderr, "isatty", lambda: False)():
        return True
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return type(shell).__name__ == "ZMQInteractiveShell" or "ipykernel" in sys.modules


class tqdm(_tqdm):  # noqa: N801 - a drop-in for tqdm's own name
    def update(self, n: float | None = 1) -> bool | None:
        if not self.disable and self.total is not None and n and self.n + n >= self.total:
            self.n += n  # the 100% line is close()'s, printed once
            return None
        return super().update(n)
