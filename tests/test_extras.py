"""pyproject's extras declare what their features need (issue 36 item 7).

A fresh venv with ``.[notebook]`` could not execute a notebook ("NoSuchKernel: No such kernel
named python3"): ipykernel came only with the dev extra (through nbmake). A fresh-venv install
takes minutes here, so the check is on the declaration: the notebook extra names the kernel and
the executor, and the distributions it names pull, through their own installed metadata, what a
kernel needs to start (jupyter_client, pyzmq), without the dev extra.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what executing notebooks/ needs: the "python3" kernel, the executor nbconvert and nbmake use,
# the notebook reader, widget bars (tqdm.auto), HTML export
NOTEBOOK_NEEDS = {"ipykernel", "nbclient", "nbformat", "ipywidgets", "nbconvert"}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]


def name_of(req: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_the_notebook_extra_declares_the_kernel_and_the_executor():
    notebook = {name_of(r) for r in extras()["notebook"]}
    assert not NOTEBOOK_NEEDS - notebook, f"notebook extra lacks {NOTEBOOK_NEEDS - notebook}"
    dev = extras()["dev"]  # the dev extra includes it rather than a second list
    assert "circuitkit-tl[notebook]" in dev
    assert not {name_of(r) for r in dev} & NOTEBOOK_NEEDS


def closure(reqs: list[str]) -> set[str]:
    """Distributions that installing ``reqs`` pulls, read from the installed metadata
    (requirements behind an extra marker are not followed)."""
    seen: set[str] = set()
    todo = [name_of(r) for r in reqs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [name_of(r) for r in requires if "extra ==" not in r.replace("extra==",
                                                                             "extra ==")]
    return seen


def test_what_the_notebook_extra_pulls_starts_a_python3_kernel():
    for dist in NOTEBOOK_NEEDS:
        pytest.importorskip(dist.replace("-", "_"))
    pulled = closure(extras()["notebook"])
    assert {"jupyter-client", "pyzmq", "ipython", "nbclient"} <= pulled
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")  # NoSuchKernel without ipykernel
    assert "ipykernel_launcher" in " ".join(spec.argv)
