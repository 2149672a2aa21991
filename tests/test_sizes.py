"""Room to read: no function in the package over 80 lines and no class over 300 (counted from
its ``def`` or ``class`` line to its last line, docstring included), and no line over the
linter's length (``[tool.ruff]`` in pyproject.toml) anywhere in the repository's Python. An
exception is listed here with its reason, and in docs/architecture.md."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import agentenv

PACKAGE = Path(agentenv.__file__).parent
MAX_FUNCTION, MAX_CLASS = 80, 300
EXCEPTIONS: dict[str, str] = {}  # "path:name" -> why it may be longer


def too_long(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            lines = node.end_lineno - node.lineno + 1
            if lines > limit and f"{where}:{node.name}" not in EXCEPTIONS:
                found.append(f"{where}:{node.lineno} {node.name} is {lines} lines (at most {limit})")
    return found


def test_no_function_or_class_in_the_package_is_too_long():
    found = [f for p in sorted(PACKAGE.rglob("*.py"))
             for f in too_long(p.read_text("utf-8"), str(p.relative_to(PACKAGE.parent)))]
    assert not found, "\n".join(found)


def test_the_size_check_sees_a_long_function_and_a_long_class():
    long_def = "def f():\n" + "    x = 1\n" * 80
    long_class = "class C:\n" + "    x = 1\n" * 300
    assert too_long(long_def, "m.py") == ["m.py:1 f is 81 lines (at most 80)"]
    assert too_long(long_class, "m.py") == ["m.py:1 C is 301 lines (at most 300)"]
    assert too_long("def f():\n" + "    x = 1\n" * 79, "m.py") == []


def test_no_line_is_over_the_linters_length():
    root = PACKAGE.parent
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    out = subprocess.run([ruff, "check", "--output-format", "concise", "--no-cache", "."], cwd=root,
                         capture_output=True, text=True)
    assert out.returncode == 0, f"lines over [tool.ruff] line-length (wrap them):\n{out.stdout}{out.stderr}"
