"""Kill a training subprocess at its first durable checkpoint (SIGKILL: no cleanup runs), for the
kill-then-resume tests of ``training`` and ``distill``."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest


def kill_at_first_checkpoint(proc: subprocess.Popen, state: Path, timeout: float,
                             poll: float = 0.02) -> None:
    """Wait until ``state`` exists, then SIGKILL ``proc``; skip the test when the run finished
    first (a machine too fast to catch it)."""
    deadline = time.time() + timeout
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(poll)
    if proc.poll() is not None:
        pytest.skip("training finished before it could be killed (machine too fast)")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
