"""Lazy re-exports (PEP 562), so importing a package never imports torch.

``__getattr__, __dir__ = lazy_exports(globals(), {"name": "module:attribute", ...})`` in a
package ``__init__``: the first access imports the module and caches the attribute.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = target.partition(":")
        value = importlib.import_module(module)
        if attr:
            value = getattr(value, attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
