"""Every file in scripts/ is a tool someone will run again: it says in a module docstring (or a
header comment) what it does and how to run it, and answers --help on a CPU machine. Python
scripts do nothing at import, so that --help needs neither a GPU nor the library's private names.

The scripts are found by listing the folder: a new one is tested without a line here."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PYTHON = sorted(p.name for p in SCRIPTS.glob("*.py"))
SHELL = sorted(p.name for p in SCRIPTS.glob("*.sh"))
# What a script may hold at its top level: imports, definitions, constants and the main guard.
TOP_LEVEL = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def _run(*command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_every_script_is_python_or_shell():
    files = {p.name for p in SCRIPTS.iterdir() if p.name != "__pycache__"}
    assert files == set(PYTHON) | set(SHELL)


@pytest.mark.parametrize("name", PYTHON)
def test_python_script_says_what_it_does_and_runs_nothing_at_import(name):
    tree = ast.parse((SCRIPTS / name).read_text())
    doc = ast.get_docstring(tree)
    assert doc and f"scripts/{name}" in doc, "a module docstring that says what it does and how to run it"
    for node in tree.body[1:]:
        main_guard = isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        assert isinstance(node, TOP_LEVEL) or main_guard, f"line {node.lineno} runs at import"


@pytest.mark.parametrize("name", PYTHON)
def test_python_script_help(name):
    result = _run(sys.executable, str(SCRIPTS / name), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {name}"), result.stdout


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_parses_and_helps(name):
    path = str(SCRIPTS / name)
    syntax = _run("bash", "-n", path)
    assert syntax.returncode == 0, syntax.stderr
    result = _run("bash", path, "--help")
    assert result.returncode == 0, result.stderr
    assert f"Usage (on the device machine, repo root): bash scripts/{name}" in result.stdout, result.stdout
