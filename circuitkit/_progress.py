"""circuitkit's progress bar: ``tqdm.auto.tqdm`` whose 100% line is printed once.

tqdm prints the line of the update that reaches the total and then, on ``close()``, the same
line again with the overall rate: in a log (no carriage return) every bar ended with two 100%
lines. Here the update that reaches the total only counts; ``close()`` prints the final line.
Every circuitkit bar is made from this class (``from circuitkit._progress import tqdm``).
"""

from __future__ import annotations

from tqdm.auto import tqdm as _tqdm


class tqdm(_tqdm):  # noqa: N801 - a drop-in for tqdm's own name
    def update(self, n: float | None = 1) -> bool | None:
        if not self.disable and self.total is not None and n and self.n + n >= self.total:
            self.n += n  # the 100% line is close()'s, printed once
            return None
        return super().update(n)
