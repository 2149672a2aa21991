"""How the package is installed and what the clone ignores: a folder named ``agentenv`` beside
a script (a clone of this repository, say) cannot shadow the installed package, a wheel holds
the package only, and git ignores what the commands write by default."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import agentenv

PACKAGE = Path(agentenv.__file__).parent
ROOT = PACKAGE.parent


def test_a_folder_named_agentenv_in_the_working_directory_does_not_shadow_the_package(tmp_path):
    """The layout of a user with an env file next to their clone: ``python`` run from the clone's
    parent finds the clone's root, a folder named agentenv without ``__init__.py``. Python's
    path search takes it as a namespace package unless a regular package comes up on
    ``sys.path``, which the editable install's .pth line (or a plain install) provides."""
    (tmp_path / "agentenv").mkdir()
    (tmp_path / "myenv.py").write_text("from agentenv import Environment\nimport agentenv\nprint(agentenv.__file__)\n")
    r = subprocess.run([sys.executable, "myenv.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stderr[-2000:]}\n(an editable install older than pyproject.toml's " \
                              "package-dir: run pip install -e . again)"
    assert Path(r.stdout.strip()) == PACKAGE / "__init__.py"


def _skeleton(to: Path) -> None:
    """This project's pyproject.toml and README, and its packages as empty ``__init__.py``
    files: all that setuptools reads to pick an editable install's layout and the wheel's packages."""
    shutil.copy(ROOT / "pyproject.toml", to / "pyproject.toml")
    shutil.copy(ROOT / "README.md", to / "README.md")
    for init in PACKAGE.rglob("__init__.py"):
        target = to / init.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("")


def _build(project: Path, hook: str) -> Path:
    out = project / "dist"
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


def test_the_editable_install_puts_the_project_root_on_sys_path(tmp_path):
    """setuptools picks the .pth strategy for this pyproject.toml, not its import hook (which
    runs after the path search, so a namespace folder earlier on sys.path would win)."""
    _skeleton(tmp_path)
    with zipfile.ZipFile(_build(tmp_path, "build_editable")) as wheel:
        names = wheel.namelist()
        pth = [n for n in names if n.endswith(".pth")]
        assert not [n for n in names if "finder" in n], names
        assert len(pth) == 1 and Path(wheel.read(pth[0]).decode().strip()) == tmp_path


def test_the_wheel_holds_the_package_only(tmp_path):
    _skeleton(tmp_path)
    with zipfile.ZipFile(_build(tmp_path, "build_wheel")) as wheel:
        tops = {n.split("/")[0] for n in wheel.namelist()}
    assert tops == {"agentenv", "agentenv-0.1.0.dist-info"}, tops


def test_git_ignores_what_the_commands_write_by_default():
    """A run in the clone with the default paths leaves nothing for ``git status`` to list:
    rollout's output and log, eval's output, log and report (train's ``runs/`` too)."""
    from agentenv.config import EvalRunConfig, OutputOptions
    from agentenv.train.config import TrainConfig

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = OutputOptions().out
    eval_out = EvalRunConfig.DEFAULTS["output.out"]
    eval_report = EvalRunConfig(output=OutputOptions(out=eval_out)).report_path
    paths = [out, Path(f"{out}.log"), eval_out, Path(f"{eval_out}.log"), eval_report,
             Path(TrainConfig().output.out_dir) / "metrics.jsonl"]
    r = subprocess.run(["git", "check-ignore", *map(str, paths)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert sorted(r.stdout.split()) == sorted(map(str, paths)), r.stdout + r.stderr
