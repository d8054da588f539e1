"""The README's test command prints pytest's summary line ("N passed in ..."), and CI runs the
same command: pyproject's addopts must not add a second -q (-qq hides the summary)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_pytest_args() -> list[str]:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if "python -m pytest" in line and not line.lstrip().startswith("#")]
    assert lines, "README names no `python -m pytest` command"
    cmd = shlex.split(lines[0].split("&&")[-1])
    return cmd[cmd.index("pytest") + 1:]


def test_readme_command_prints_the_summary_line(tmp_path):
    args = [a for a in _readme_pytest_args() if a != "tests"]
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    # the project's pytest configuration, on a one-test folder
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                           "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^1 passed in [\d.]+s", done.stdout, re.M), done.stdout


def test_ci_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(x for x in ci.splitlines() if "-m pytest" in x and not x.startswith("#"))
    ci_args = shlex.split(line)[shlex.split(line).index("pytest") + 1:]
    extra = [a for a in ci_args if a not in _readme_pytest_args()]
    assert extra in ([], ["-p", "no:cacheprovider"]), line
    assert [a for a in _readme_pytest_args() if a not in ci_args] == []


def test_addopts_does_not_quiet_the_summary():
    text = (ROOT / "pyproject.toml").read_text()
    addopts = re.search(r"^addopts\s*=\s*(.+)$", text, re.M)
    flags = shlex.split(addopts[1].strip("\"'[]")) if addopts else []
    quiet = sum(f.count("q") for f in flags if re.fullmatch(r"-q+", f)) + flags.count("--quiet")
    assert quiet + _readme_pytest_args().count("-q") <= 1
