"""The notebooks spell the public API as the README does (issue 36 item 13): ``task.metric``,
not the older ``task.prompt_metric()``. (Executing them: ``pytest --nbmake notebooks/``.)"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_notebooks_use_task_metric_as_the_readme_does():
    readme = (ROOT / "README.md").read_text()
    assert "task.metric" in readme and "prompt_metric" not in readme
    books = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert books
    uses = 0
    for book in books:
        code = "\n".join("".join(c["source"]) for c in json.loads(book.read_text())["cells"]
                         if c["cell_type"] == "code")
        assert "prompt_metric" not in code, book.name
        uses += code.count(".metric")
    assert uses >= 3  # the quick start's two sweeps and characterize's
