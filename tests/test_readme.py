"""The README's two commands are the project's set-up; .ci/run must run exactly the test one."""

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
