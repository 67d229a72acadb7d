"""The import graph read from the source: no cycles (function-level imports count), and lower
layers never import higher ones (tasks never import patching, patching never imports viz, models
never imports tasks, metrics imports no other circuitkit module but files/hooks)."""

from __future__ import annotations

import ast
from pathlib import Path

import circuitkit

ROOT = Path(circuitkit.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    p = ROOT.parent / Path(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    """circuitkit modules imported anywhere in ``path`` (module level or inside functions)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # "from circuitkit.x import y": y may itself be a module
            names = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base
                     for a in node.names]
        else:
            continue
        out |= {n for n in names if n == "circuitkit" or n.startswith("circuitkit.")}
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in ROOT.rglob("*.py")}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_the_source():
    g = graph()
    assert len(g) > 20
    assert "circuitkit.metrics" in g["circuitkit.tasks.base"]  # a module-level import
    assert "circuitkit.tasks.jsonl" in g["circuitkit.tasks.base"]
    # function-level imports count: the checker must see this one inside a function
    assert "circuitkit.models" in g["circuitkit.patching.checkpoint"]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, f"import cycles: {found}"


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


RULES = [  # (importer prefix, forbidden prefix)
    ("circuitkit.tasks", "circuitkit.patching"),
    ("circuitkit.tasks", "circuitkit.scoring"),
    ("circuitkit.patching", "circuitkit.viz"),
    ("circuitkit.patching", "circuitkit.scoring"),
    ("circuitkit.patching", "circuitkit.cli"),
    ("circuitkit.models", "circuitkit.tasks"),
    ("circuitkit.metrics", "circuitkit.tasks"),
    ("circuitkit.metrics", "circuitkit.patching"),
    ("circuitkit.hooks", "circuitkit."),
]


# The one sanctioned exception: ``PatchResult.heatmap()`` and ``EdgeResult.heatmap()`` (public view
# methods, DESIGN) import their figure functions from viz when called; viz.heatmaps imports
# nothing of patching, so no cycle.
ALLOWED = {("circuitkit.patching.results.patch_result", "circuitkit.viz.heatmaps"),
           ("circuitkit.patching.results.edge_result", "circuitkit.viz.heatmaps")}


def test_lower_layers_never_import_higher_ones():
    bad = [(mod, imp) for mod, imps in graph().items() for imp in imps
           for low, high in RULES
           if mod.startswith(low) and imp.startswith(high) and (mod, imp) not in ALLOWED]
    assert not bad, bad


# The experiments wing sits above the core: the core (every circuitkit module but the package's
# own facade, experiments/ and cli/) never imports it, not even through a lazy export's string.
ABOVE_CORE = ("circuitkit.experiments", "circuitkit.cli")


def core_modules() -> list[str]:
    return [m for m in graph() if m != "circuitkit" and not m.startswith(ABOVE_CORE)]


def lazy_targets(module: str) -> set[str]:
    """The modules a package's lazy ``_EXPORTS`` strings name ("module:attr" or "module")."""
    path = ROOT.parent / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("circuitkit."):
            out.add(node.value.partition(":")[0])
    return out


def test_the_core_never_imports_the_experiments():
    g = graph()
    bad = [(m, i) for m in core_modules() for i in g[m] | lazy_targets(m)
           if i.startswith("circuitkit.experiments")]
    assert not bad, bad


def test_the_experiments_rule_can_fail():
    # a planted core module naming experiments in an export string is caught
    assert any(t.startswith("circuitkit.experiments") for t in lazy_targets("circuitkit"))
    assert "circuitkit.patching.api" in core_modules()
    assert not any(m.startswith("circuitkit.experiments") for m in core_modules())
