"""``pytest --nbmake`` (the README's test command) executes these notebooks: tiny
(``CIRCUITKIT_NOTEBOOK_SMALL=1``), one thread, and importing this checkout's ``circuitkit``
(the kernel starts in notebooks/, where an installed copy would otherwise win)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"CIRCUITKIT_NOTEBOOK_SMALL": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
_saved: dict[str, str | None] = {}


def pytest_runtest_setup(item) -> None:  # the kernel inherits the environment at its start
    for key, value in ENV.items():
        _saved[key] = os.environ.get(key)
        os.environ[key] = value


def pytest_runtest_teardown(item) -> None:
    for key, value in _saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
