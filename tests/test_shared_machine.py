"""Issue 44 item 6: on a shared machine the default thread count does not collapse (one torch
thread on two cores or fewer, the load average's free cores above; ``CIRCUITKIT_THREADS``
overrides), and ``ck.evaluate`` shows progress by default where someone watches (a terminal,
a notebook). Each fails on the code before the issue."""

from __future__ import annotations

import io
import sys

import pytest

import circuitkit as ck
from circuitkit import _progress, evaluation, models


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("CIRCUITKIT_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_one_thread_on_two_cores_and_free_cores_above(no_env, monkeypatch):
    monkeypatch.setattr(models, "usable_cores", lambda: 2)
    monkeypatch.setattr(models.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert models.default_threads()[0] == 1  # even quiet: 2 cores are shared or soon will be
    monkeypatch.setattr(models, "usable_cores", lambda: 16)
    assert models.default_threads()[0] == 16
    monkeypatch.setattr(models.os, "getloadavg", lambda: (6.2, 0.0, 0.0))
    assert models.default_threads()[0] == 10  # 6 cores busy with other jobs
    monkeypatch.setattr(models.os, "getloadavg", lambda: (40.0, 0.0, 0.0))
    assert models.default_threads()[0] == 1


def test_the_thread_count_can_be_chosen(no_env, monkeypatch):
    monkeypatch.setattr(models, "usable_cores", lambda: 2)
    monkeypatch.setenv("CIRCUITKIT_THREADS", "2")
    assert models.default_threads() == (2, "CIRCUITKIT_THREADS")
    monkeypatch.setenv("CIRCUITKIT_THREADS", "two")
    with pytest.raises(ValueError, match="CIRCUITKIT_THREADS='two': expected a positive"):
        models.default_threads()
    monkeypatch.delenv("CIRCUITKIT_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert models.default_threads() == (3, "OMP_NUM_THREADS")


def test_load_model_sets_the_default(no_env, monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(models, "usable_cores", lambda: 2)
    models._THREADS_SET.clear()
    try:
        torch.set_num_threads(2)
        ck.load_model("induction-2l")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        models._THREADS_SET.clear()


def test_a_terminal_or_a_notebook_is_interactive(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Tty())
    assert _progress.interactive()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert not _progress.interactive()
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert _progress.interactive()


def test_evaluate_shows_progress_by_default_where_someone_watches(monkeypatch):
    seen = []

    class Bar(_progress.tqdm):
        def __init__(self, *a, **k):
            seen.append(k.get("disable"))
            super().__init__(*a, **{**k, "disable": True})
    monkeypatch.setattr(evaluation, "tqdm", Bar)
    model, task = ck.load_model("icd-teacher"), ck.load_task("icd10", n_examples=2)
    monkeypatch.setattr(evaluation, "interactive", lambda: True)
    ck.evaluate(model, task)
    monkeypatch.setattr(evaluation, "interactive", lambda: False)
    ck.evaluate(model, task)
    ck.evaluate(model, task, progress=True)
    assert seen == [False, True, False]
