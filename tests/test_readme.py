"""The README's two commands are the project's set-up; .ci/run must run exactly the test one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("```")[0].strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    install_and_run, test = _readme_commands()
    ci_lines = [ln for ln in (ROOT / ".ci/run").read_text().splitlines()
                if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert ci_lines == [test]
    assert "pytest" in test and "ruff check" in test
    for cmd in (install_and_run, test):
        assert "requirements-cpu.txt" in cmd  # the CPU torch wheel, never a CUDA download
    assert (ROOT / "requirements-cpu.txt").read_text().count("torch==2.13.0") == 1


def test_readme_python_quick_start_runs_and_prints_what_it_computes(tmp_path):
    """The Quick start block, run as a script (as a new user pastes it), prints the evaluation,
    the strongest heads and the head scores, and writes the result files."""
    import os
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    code = text.split("## Quick start")[1].split("```python\n")[1].split("```")[0]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for word in ("'focus'", "'exact_match'", "normalized", "ci_low", "coarse_score",
                 "refine_score"):
        assert word in out.stdout, (word, out.stdout[-2000:])
    assert (tmp_path / "runs" / "quickstart" / "denoise.safetensors").exists()


def _prose(text: str) -> str:
    """The README without its fenced blocks."""
    return "".join(part for i, part in enumerate(text.split("```")) if i % 2 == 0)


def test_readme_is_a_front_door():
    """At most 120 lines; the fast subset named beside the full suite; every doc it links
    exists; no measured figure in its prose (times, sizes and speed-ups live in
    docs/speed.md, where their machine and method are stated)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    assert '`python -m pytest -q -m "not slow"`' in text
    assert '"slow:' in (ROOT / "pyproject.toml").read_text()  # the marker it names exists
    docs = set(re.findall(r"docs/[\w.-]+\.md", text))
    assert {"docs/speed.md", "docs/from-transformerlens.md", "docs/usage.md"} <= docs
    assert all((ROOT / d).is_file() for d in docs), [d for d in docs if not (ROOT / d).is_file()]
    figures = re.findall(r"\b\d+(?:\.\d+)?\s?(?:s|ms|min|h|MB|GB|MiB|GiB|x|%)(?![\w-])",
                         _prose(text))
    assert not figures, figures
    for heading in ("## Quick start", "## The three objects", "## Commands", "## Models",
                    "## Tasks"):
        assert heading in text


def test_readme_commands_use_flags_their_commands_take():
    """Each command line in the README names a command that exists and only flags its
    ``--help`` lists (so the page cannot promise a flag, such as ``distill -n``, that is
    not there); ``--help`` imports no torch, so this is quick."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    lines = [ln.split("#")[0] for block in text.split("```bash\n")[1:]
             for ln in block.split("```")[0].splitlines()]
    cmds = [ln.split("circuitkit.cli" if "circuitkit.cli" in ln else "circuitkit ", 1)[1].split()
            for ln in lines if "circuitkit " in ln or "circuitkit.cli" in ln]
    assert {c[0] for c in cmds} >= {"characterize", "patch", "edges", "score", "evaluate",
                                    "report", "info", "distill"}
    helps: dict[str, str] = {}
    for cmd in cmds:
        if cmd[0] not in helps:
            out = subprocess.run([sys.executable, "-m", "circuitkit.cli", cmd[0], "--help"],
                                 capture_output=True, text=True, env=_env(), timeout=120)
            assert out.returncode == 0, (cmd, out.stderr[-500:])
            helps[cmd[0]] = out.stdout
        for flag in (a for a in cmd[1:] if a.startswith("-")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[cmd[0]]), (cmd, flag)
    assert not re.search(r"(?<![\w-])-n(?![\w-])", helps["distill"])  # as the README says


def _env():
    import os

    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_a_bad_estimator_is_refused_before_the_model_loads(tmp_path):
    """``--estimator`` is checked with the other flags: a model that does not exist is never
    reached, and the line names the flag as typed (it used to be refused after the model
    loaded, as ``estimator='foo'``)."""
    import subprocess
    import sys

    for cmd, name in (("patch", "foo"), ("edges", "atp")):
        out = subprocess.run([sys.executable, "-m", "circuitkit.cli", cmd, "--model",
                              str(tmp_path / "no-such-model"), "--estimator", name, "--out",
                              str(tmp_path / cmd)], capture_output=True, text=True, env=_env(),
                             timeout=300)
        assert out.returncode == 2, out.stderr
        assert f"--estimator {name}: not one of" in out.stderr, out.stderr
        assert "no-such-model" not in out.stderr
