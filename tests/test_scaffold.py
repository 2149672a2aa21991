"""``agentenv init NAME``: the project it writes imports, builds and passes its own tests as
written (``check_env`` and a 2 x 2 rollout on the bundled model, the embedded engine and the
local sandbox); a name the package cannot have, or a folder in the way, is one error line
with exit status 2 and nothing written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import agentenv.scaffold as scaffold
from agentenv.cli import main

ROOT = Path(__file__).resolve().parents[1]
FILES = {".gitignore", "README.md", "pyproject.toml", "demo/__init__.py", "demo/env.py", "tests/test_env.py"}


def python(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """The venv's interpreter in ``cwd``, with nothing of this test session's settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTENV_ENV_MODULES", "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def written(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_init_writes_a_project_whose_package_imports_from_its_folder(tmp_path):
    # In a fresh interpreter: the command runs without loading torch.
    code = ("import sys; from agentenv.cli import main; rc = main(['init', 'demo', '--dir', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules)")
    r = python("-c", code, str(tmp_path / "envs"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "0 False"
    project = tmp_path / "envs" / "demo"
    assert f"created {project}/" in r.stdout and f"cd {project}" in r.stdout
    assert written(project) == FILES
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "demo" and meta["project"]["dependencies"] == ["agentenv"]
    assert meta["project"]["entry-points"]["agentenv.envs"] == {"demo": "demo.env:DemoEnv"}
    assert meta["tool"]["pytest"]["ini_options"]["pythonpath"] == ["."]
    for rel in FILES:
        if rel.endswith(".py"):
            compile((project / rel).read_text(), rel, "exec")
    # From its folder, uninstalled: the package imports, registers its id, and passes check_env.
    code = ("import json, demo; from agentenv import check_env, make; check_env(demo.DemoEnv); "
            "env = make('demo'); print(json.dumps([type(env).__name__, [t.id for t in env.tasks(10, seed=3)], "
            "[t.id for t in env.tasks(10, seed=3)], sorted({t.answer for t in env.tasks(8)} - {None})]))")
    r = python("-c", code, cwd=project)
    assert r.returncode == 0, r.stderr
    name, ids, again, answers = json.loads(r.stdout)
    assert name == "DemoEnv" and ids == again and len(set(ids)) == 10
    assert sorted(i for i in ids if "@" not in i) == [f"demo/{k}" for k in range(8)]  # every problem, once
    assert all(i.endswith("@1") for i in ids[8:])  # then a second pass
    assert len(answers) == 8


def test_init_says_how_to_install_what_its_tests_need(capsys, tmp_path):
    """``python -m pytest`` needs pytest: the next steps install the project with its ``test``
    extra, which holds it, and that command resolves (pip's dry run, no index needed here)."""
    rc, out, _ = cli(capsys, "init", "demo", "--dir", str(tmp_path))
    project = tmp_path / "demo"
    steps = out.split("next:\n", 1)[1].splitlines()
    install = [ln.split("#")[0].strip() for ln in steps if "pip install" in ln]
    assert rc == 0 and install == [scaffold.INSTALL] == ["pip install -e '.[test]'"], out
    assert steps.index(next(ln for ln in steps if "pip install" in ln)) < \
        steps.index(next(ln for ln in steps if "python -m pytest" in ln))  # installed before the tests run
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("pytest") for r in extras["test"])
    assert scaffold.INSTALL in (project / "README.md").read_text()
    r = python("-m", "pip", "install", "--dry-run", "--no-build-isolation", "-e", ".[test]", cwd=project, timeout=300)
    assert r.returncode == 0 and "Would install demo-0.1.0" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^Requirement already satisfied: pytest>=8", r.stdout, re.M), r.stdout[-3000:]


def test_the_starter_check_skips_itself_once_the_tasks_are_the_users(capsys, tmp_path):
    """The generated test compares the module's PROBLEMS and SYSTEM_PROMPT with the digest init
    wrote: equal as written, different once customised as the docs say."""
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path))[0] == 0
    project = tmp_path / "demo"
    code = "import sys; sys.path.insert(0, 'tests'); import test_env; print(test_env.starter_unchanged())"
    r = python("-c", code, cwd=project)
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr[-2000:]
    customise(project)
    r = python("-c", code, cwd=project)
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr[-2000:]


@pytest.mark.parametrize("name, says", [
    ("3d-env", "is not a Python identifier"),
    ("my-env", "is not a Python identifier"),
    ("class", "is a Python keyword"),
    ("json", "a module Python already imports (the standard library)"),
    ("agentenv", "a module Python already imports"),
    ("tests", "the project's test folder"),
])
def test_a_name_the_package_cannot_have_is_refused_with_exit_2_and_nothing_written(capsys, tmp_path, name, says):
    rc, out, err = cli(capsys, "init", name, "--dir", str(tmp_path))
    assert (rc, out) == (2, "")
    assert err.startswith(f"agentenv: error: NAME {name!r} ") and says in err and "e.g. '" in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_module_loaded_without_a_spec_is_refused_in_one_line(tmp_path):
    """Under the console script, ``__main__`` is loaded with no import spec (``find_spec``
    raises ValueError for it): refused as a module Python has, not a traceback."""
    script = Path(sys.executable).with_name("agentenv")
    r = subprocess.run([str(script), "init", "__main__", "--dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert list(tmp_path.iterdir()) == []
    assert r.stderr == ("agentenv: error: NAME '__main__' is a module Python already imports (loaded in this "
                        "process): the package would shadow it or be shadowed by it; choose another name, e.g. "
                        "'__main___env'\n")


def test_the_suggested_name_is_one_init_takes(capsys, tmp_path):
    rc, _, err = cli(capsys, "init", "3d-env", "--dir", str(tmp_path))
    suggested = err.split("e.g. '")[1].split("'")[0]
    assert rc == 2 and suggested == "env_3d_env"
    assert cli(capsys, "init", suggested, "--dir", str(tmp_path))[0] == 0
    assert (tmp_path / suggested / suggested / "env.py").is_file()
    assert "class Env3dEnv(Environment)" in (tmp_path / suggested / suggested / "env.py").read_text()


def test_an_existing_folder_with_files_needs_force_which_keeps_the_others(capsys, tmp_path):
    project = tmp_path / "demo"
    project.mkdir()
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path))[0] == 0  # an empty folder is no obstacle
    (project / "notes.txt").write_text("mine")
    (project / "demo" / "env.py").write_text("edited")
    rc, out, err = cli(capsys, "init", "demo", "--dir", str(tmp_path))
    assert (rc, out) == (2, "")
    assert err == f"agentenv: error: {project} exists and is not empty: pass --force to write the package's files " \
                  "into it (files of the same names are replaced), or choose another NAME or --dir\n"
    assert (project / "demo" / "env.py").read_text() == "edited"
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path), "--force")[0] == 0
    assert (project / "notes.txt").read_text() == "mine"
    assert (project / "demo" / "env.py").read_text() == scaffold.files("demo")[Path("demo/env.py")]
    assert written(project) == FILES | {"notes.txt"}


def test_a_dir_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    rc, out, err = cli(capsys, "init", "demo", "--dir", str(tmp_path / "f"))
    assert (rc, out, err) == (2, "", f"agentenv: error: --dir {tmp_path / 'f'} is not a folder: give a folder to "
                                     "create demo/ in\n")


def test_the_package_data_carries_every_template():
    """A non-editable install carries what pyproject's package-data globs match: every template."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = Path(scaffold.__file__).parent
    carried = {p for pattern in globs["agentenv.scaffold"] for p in package.glob(pattern)}
    templates = set(scaffold.TEMPLATES.rglob("*.tmpl"))
    assert len(templates) == len(FILES) and templates | set(scaffold.AGENT_TEMPLATES.values()) == carried


def test_init_agent_writes_an_agent_environment_and_says_which_model_runs_it(capsys, tmp_path):
    rc, out, _ = cli(capsys, "init", "demo", "--agent", "--dir", str(tmp_path))
    assert rc == 0 and "agentenv rollout --env demo --model tiny-hermes" in out, out
    project = tmp_path / "demo"
    assert "class DemoEnv(AgentEnvironment)" in (project / "demo" / "env.py").read_text()
    assert 'dependencies = ["agentenv[agents]"]' in (project / "pyproject.toml").read_text()
    assert "--env demo --model tiny-hermes" in (project / "README.md").read_text()
    assert set(scaffold.files("demo", agent=True)) == set(scaffold.files("demo"))  # the same files, other texts


@pytest.mark.slow
def test_the_generated_agent_project_passes_its_own_tests(capsys, tmp_path):
    """``agentenv init demo --agent && cd demo && python -m pytest``: the agent's calls go through
    the gateway on the bundled tiny-hermes model, and it calls the tool and scores."""
    assert cli(capsys, "init", "demo", "--agent", "--dir", str(tmp_path))[0] == 0
    r = python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path / "demo", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "3 passed" in r.stdout


@pytest.mark.slow
def test_the_generated_project_passes_its_own_tests(capsys, tmp_path):
    """``agentenv init demo && cd demo && python -m pytest``, as a user runs it."""
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path))[0] == 0
    r = python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path / "demo", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "3 passed" in r.stdout


def customise(project: Path) -> None:
    """What env.py's docstring and docs/cli.md tell a user to change first: the tasks and the
    prompt (here: questions the bundled model was never trained on)."""
    env = project / "demo" / "env.py"
    text = env.read_text()
    start, end = text.index("PROBLEMS: list"), text.index("#: The bundled model's own prompt")
    text = text[:start] + ('PROBLEMS: list[tuple[str, int]] = [\n    ("How many legs have 3 spiders?", 24),\n'
                           '    ("How many days have 2 weeks?", 14),\n]\n\n') + text[end:]
    text = text.replace('"Solve the problem with Python.', '"Answer with Python.')
    env.write_text(text)


@pytest.mark.slow
def test_the_generated_project_passes_its_own_tests_with_the_users_tasks(capsys, tmp_path):
    """Changed as the docs say (other tasks and prompt), the tests still pass: the contract
    ones hold, and the check that the bundled model solves the starter problems skips itself."""
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path))[0] == 0
    customise(tmp_path / "demo")
    r = python("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", cwd=tmp_path / "demo", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 passed, 1 skipped" in r.stdout and "PROBLEMS or SYSTEM_PROMPT changed" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_the_generated_project_builds_a_wheel_that_publishes_the_environment(capsys, tmp_path):
    assert cli(capsys, "init", "demo", "--dir", str(tmp_path))[0] == 0
    r = python("-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(tmp_path / "demo"),
               "-w", str(tmp_path / "wheels"), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "wheels").glob("demo-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"demo/__init__.py", "demo/env.py"} <= names
        assert "[agentenv.envs]\ndemo = demo.env:DemoEnv" in z.read("demo-0.1.0.dist-info/entry_points.txt").decode()
