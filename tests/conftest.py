"""Shared fixtures: tiny random models (seeded) on CPU.

``tiny_llama``: 3 layers, 4 query heads sharing 2 KV heads (GQA), rotary, d_model 64, vocab 64.
``tiny_gpt2``: 2 layers, 4 heads, learned positions, d_model 32, vocab 64.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tinymodels import TINY_GPT2, TINY_LLAMA, make_model  # noqa: E402  (after the env default)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_model(TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_gpt2():
    return make_model(TINY_GPT2)


def pytest_collection_modifyitems(config, items):
    """Tests listed in tests/slow_tests.txt (measured >= 0.8 s in a full run) are marked
    ``slow``: ``-m "not slow"`` is the fast subset. The list is data, not a judgement: regenerate
    it with tests/slow_from_durations.py from a ``--durations=0`` log."""
    from pathlib import Path

    import pytest

    listed = Path(__file__).with_name("slow_tests.txt")
    slow = {line.strip() for line in listed.read_text().splitlines()
            if line.strip() and not line.startswith("#")} if listed.exists() else set()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


# a process that holds a folder's lock until it is killed (``holder``)
HOLD = """
import sys, time
from circuitkit.files import lock_folder
lock = lock_folder(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """``start(folder)``: another process holding ``folder``'s lock (killed at teardown)."""
    procs = []

    def start(folder):
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def teacher_and_scores():
    """(icd-teacher, 32 icd10 test notes, their score table without the bootstrap)."""
    import circuitkit as ck
    from circuitkit.scoring import score_heads

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=32, split="test")
    return model, task, score_heads(model, task, progress=False, n_boot=0)
