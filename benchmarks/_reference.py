"""Import another checkout of circuitkit beside this one, for before/after timings in one process.

    ref = import_checkout("/work/main")   # its package, imported as ``circuitkit_ref``
    ref.patch_heads(model, clean, corrupt, metric)  # the same model object, the other code

The checkout's ``circuitkit/`` is copied to a temporary folder as ``circuitkit_ref`` with every
``circuitkit`` module reference renamed (imports and the lazy-export tables' "module:attr"
strings; other strings, such as cache folder names, are left alone), then imported. Both packages
run on the same model objects; each keeps its own per-model caches (probe verdicts, hook points).
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

NAME = "circuitkit_ref"
# a module reference: "circuitkit.x" (imports, "module:attr" strings) or an import statement
_MODULE_REF = re.compile(
    r"\bcircuitkit(?=\.[A-Za-z_{])|(?<=import )circuitkit\b|(?<=from )circuitkit\b")


def import_checkout(path: str | Path, name: str = NAME) -> ModuleType:
    """The package ``circuitkit`` of the checkout at ``path`` (a repository root), as ``name``."""
    src = Path(path) / "circuitkit"
    if not (src / "__init__.py").exists():
        raise ValueError(f"--reference {str(path)!r}: no circuitkit/__init__.py there; give the "
                         "root of a circuitkit checkout (e.g. /work/main).")
    root = Path(tempfile.mkdtemp(prefix="circuitkit-ref-"))
    dst = root / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for py in dst.rglob("*.py"):
        py.write_text(_MODULE_REF.sub(name, py.read_text()))
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
