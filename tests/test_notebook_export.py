"""A notebook's figures survive an HTML export (nbconvert): the notebooks set plotly's renderer to
one that stores HTML with plotly.js beside the plotly JSON, so the exported page draws them
offline. Before, the figures were stored as plotly JSON only and vanished from the export."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_exported_to_html_draws_its_figures(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    from nbconvert.preprocessors import ExecutePreprocessor
    from plotly.offline import get_plotlyjs
    from test_report import browser, console_lines, run_chromium

    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    env = {"CIRCUITKIT_NOTEBOOK_SMALL": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment at its start
    try:
        ExecutePreprocessor(timeout=900, kernel_name="python3").preprocess(
            nb, {"metadata": {"path": str(ROOT / "notebooks")}})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    body, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    page = tmp_path / "quickstart.html"
    page.write_text(body, encoding="utf-8")
    n_figs = body.count('class="plotly-graph-div"')
    assert n_figs >= 2, "no figure in the exported HTML"  # the heatmap and the pair
    assert body.count(get_plotlyjs()[:400]) == 1  # plotly.js once, inline: no network needed
    # no progress-bar or warning text in the notebook's stored outputs
    streams = "".join("".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs if o.output_type == "stream")
    assert "Warning" not in streams and "%|" not in streams, streams[-2000:]
    exe = browser()
    run = run_chromium(exe, tmp_path, page.as_uri(), "--dump-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    errors = [ln for ln in console_lines(run.stderr) if "Plotly" in ln or "Uncaught" in ln]
    assert errors == [], errors
    drawn = len(re.findall(r'class="[^"]*\bjs-plotly-plot\b', run.stdout))
    assert drawn == n_figs, (drawn, n_figs)  # every figure drawn, offline
