"""Pages beside results: ``write_page`` (a plotly figure as a page that loads the folder's one
``plotly.min.js``) and ``plotly_bundle`` (that one copy, written atomically). ``report.html`` is
the one page that inlines plotly.js (``experiments/report.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOTLY_BUNDLE = "plotly.min.js"


def plotly_bundle(folder: Path) -> Path:
    """``folder/plotly.min.js`` for pages written with ``include_plotlyjs=PLOTLY_BUNDLE``,
    written atomically unless a complete copy is there (plotly's own
    ``include_plotlyjs="directory"`` writes it in place and keeps whatever it finds, so a write
    cut short by a full disk left every later page blank). Returns its path."""
    from plotly.offline import get_plotlyjs

    from circuitkit import files

    js, dest = get_plotlyjs(), folder / PLOTLY_BUNDLE
    try:
        if dest.stat().st_size == len(js.encode()) and dest.read_text(encoding="utf-8") == js:
            return dest
    except (OSError, UnicodeDecodeError):
        pass
    return files.atomic_write(dest, lambda p: p.write_text(js, encoding="utf-8"))


# What a page shows in place of its figure when plotly.min.js is not beside it (a page copied
# out of its folder): a plain sentence, not a blank page or a console error.
_NO_BUNDLE = (
    "<script>if(!window.Plotly){window.Plotly={newPlot:function(id){"
    "var d=document.getElementById(id);if(d){d.style.height='auto';d.innerHTML="
    "'<p style=\"font-family:sans-serif;color:#b00020;padding:12px\">This figure is drawn by "
    "plotly.min.js, which is not in this page\\'s folder: copy the results folder\\'s "
    "plotly.min.js beside the page, or open the folder\\'s report.html (self-contained).</p>';}"
    "return Promise.resolve();}};}</script>")


def write_page(fig: Any, path: str | Path) -> Path:
    """Write plotly figure ``fig`` as the page ``path`` (atomically) that loads plotly.js
    from ``plotly.min.js`` in the same folder, written there once (``plotly_bundle``): the one
    rule for every page beside results, so a folder holds one copy of plotly.js however many
    pages it has (docs/durability.md). A page copied out of its folder says so in place of its
    figure."""
    from circuitkit import files

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plotly_bundle(path.parent)
    tag = f'<script charset="utf-8" src="{PLOTLY_BUNDLE}"></script>'
    page = fig.to_html(include_plotlyjs=PLOTLY_BUNDLE, full_html=True)
    page = page.replace(tag, tag + _NO_BUNDLE, 1)
    return files.atomic_write(path, lambda p: p.write_text(page, encoding="utf-8"))

