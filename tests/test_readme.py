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
