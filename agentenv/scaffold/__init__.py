"""``agentenv init NAME``: a small environment package to start from.

    agentenv init demo && cd demo && pip install -e '.[test]' && python -m pytest

writes ``demo/`` with a ``pyproject.toml`` (package ``demo``, depending on agentenv, the
environment published under the ``agentenv.envs`` entry points), the package (``demo/env.py``:
an :class:`~agentenv.Environment` with a few arithmetic tasks in the bundled model's format, a
``Rubric`` reward and ``register("demo", ...)``), a README and ``tests/test_env.py`` (``check_env``
and a 2 x 2 rollout on the embedded engine with the local sandbox), which pass as written, and
still pass once the tasks and prompt are the user's: the check that the bundled model solves
the starter problems skips itself when they differ from the digest :func:`starter_digest`
wrote into the test (``$starter``).

The files are ``string.Template`` files under ``templates/``, laid out as the project is: a
``PACKAGE`` folder becomes ``NAME``, ``gitignore`` becomes ``.gitignore``, ``.tmpl`` is dropped,
and ``$name`` and ``$env_class`` are filled in.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import keyword
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ..errors import ConfigError
from ..options import option

TEMPLATES = Path(__file__).parent / "templates"
#: ``--agent``: the files an agent environment has in place of the default's (same paths).
AGENT_TEMPLATES = {Path("PACKAGE", "env.py.tmpl"): Path(__file__).parent / "agent" / "env.py.tmpl",
                   Path("tests", "test_env.py.tmpl"): Path(__file__).parent / "agent" / "test_env.py.tmpl"}

#: What the project's tests need installed, as ``init`` tells the user to install it.
INSTALL = "pip install -e '.[test]'"

#: Names the project's own layout takes (``NAME/tests`` is the test folder).
_TAKEN = {"tests"}


@dataclass(frozen=True)
class InitConfig:
    """``agentenv init``'s options."""

    name: str = option(help="the package to create: a Python identifier, also the environment's id", flag="name",
                       metavar="NAME")
    dir: Path = option(Path("."), "the folder to create NAME/ in (default: the current directory)")
    force: bool = option(False, "write into an existing non-empty NAME/ folder (its files of the same names are "
                                "replaced, others kept)")
    agent: bool = option(False, "an AgentEnvironment instead: your agent over the OpenAI API (an openai SDK tool "
                                "loop to start from), its calls through the run's gateway (docs/agents.md)")


def class_name(name: str) -> str:
    """The environment class's name for package ``name``: ``my_math`` -> ``MyMathEnv``."""
    camel = "".join(part[:1].upper() + part[1:] for part in name.split("_"))
    return camel if camel.endswith("Env") else camel + "Env"


def check_name(name: str, target: Path | None = None) -> None:
    """Refuse a ``name`` the package cannot have: not an identifier, a keyword, a name of the
    project's own layout, or a module Python already imports (the standard library, agentenv,
    an installed package), which the package would shadow or be shadowed by. ``target`` is
    the project folder: a package found inside it (an earlier ``init`` installed) is its own."""
    if keyword.iskeyword(name):
        raise ConfigError(f"NAME {name!r} is a Python keyword (the package is imported by its name): choose "
                          f"another, e.g. '{name}_env'")
    if not name.isidentifier():
        fix = re.sub(r"\W", "_", name)
        fix = f"env_{fix}" if fix[:1].isdigit() else fix or "my_env"
        raise ConfigError(f"NAME {name!r} is not a Python identifier (the package is imported by its name): use "
                          f"letters, digits and underscores, not starting with a digit, e.g. {fix!r}")
    if name in _TAKEN:
        raise ConfigError(f"NAME {name!r} is the project's test folder: choose another name, e.g. '{name}_env'")
    where = "the standard library" if name in sys.stdlib_module_names else None
    if where is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:  # ValueError: loaded with no spec (a console script's __main__)
            spec, where = None, "loaded in this process" if name in sys.modules else f"its lookup failed: {exc}"
        origin = getattr(spec, "origin", None)  # None: a namespace package (a bare folder), no module
        if origin and not (target is not None and Path(origin).resolve().is_relative_to(target.resolve())):
            where = origin
    if where:
        raise ConfigError(f"NAME {name!r} is a module Python already imports ({where}): the package would shadow "
                          f"it or be shadowed by it; choose another name, e.g. '{name}_env'")


def starter_digest(env_source: str) -> str:
    """The digest of the starter ``PROBLEMS`` and ``SYSTEM_PROMPT`` in ``env_source`` (the
    package's ``env.py``), as its tests compute it from the imported module: while the two are
    unchanged, the tests expect the bundled model to solve the problems."""
    values: dict[str, object] = {}
    for node in ast.parse(env_source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in ("PROBLEMS", "SYSTEM_PROMPT") and node.value is not None:
            values[target.id] = ast.literal_eval(node.value)
    return hashlib.sha256(repr((values["PROBLEMS"], values["SYSTEM_PROMPT"])).encode()).hexdigest()[:16]


def files(name: str, agent: bool = False) -> dict[Path, str]:
    """The project's files: path relative to the project folder -> text (``agent``: an
    :class:`~agentenv.AgentEnvironment`'s)."""
    values = {"name": name, "env_class": class_name(name), "agentenv": "agentenv[agents]" if agent else "agentenv",
              "model": " --model tiny-hermes" if agent else ""}
    out = {}
    for template in sorted(TEMPLATES.rglob("*.tmpl"), key=lambda t: ("tests" in t.parts, t)):  # env.py first
        rel = template.relative_to(TEMPLATES)
        source = AGENT_TEMPLATES.get(rel, template) if agent else template
        parts = [name if p == "PACKAGE" else ".gitignore" if p == "gitignore" else p for p in rel.with_suffix("").parts]
        if parts[0] == "tests":
            values["starter"] = starter_digest(out[Path(name, "env.py")])
        out[Path(*parts)] = Template(source.read_text("utf-8")).substitute(values)
    return out


def init(name: str, parent: str | Path = ".", force: bool = False, agent: bool = False) -> Path:
    """Write the package ``name`` into ``parent/name`` and return that folder. Raises
    :class:`~agentenv.errors.ConfigError` (nothing written) for a name the package cannot
    have, or for an existing non-empty folder unless ``force``."""
    parent = Path(parent)
    target = parent / name
    check_name(name, target)
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"--dir {parent} is not a folder: give a folder to create {name}/ in")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} exists and is not a folder: choose another NAME or --dir")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ConfigError(f"{target} exists and is not empty: pass --force to write the package's files into it "
                          "(files of the same names are replaced), or choose another NAME or --dir")
    created = not target.exists()
    try:
        for rel, text in files(name, agent).items():
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError:
        if created:  # a failed init leaves no half-written project behind
            shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def run(opts: InitConfig) -> int:
    """``agentenv init``: write the package, then say what was written and what to run next."""
    try:
        target = init(opts.name, opts.dir, opts.force, opts.agent)
    except OSError as exc:
        raise ConfigError(f"cannot write {exc.filename or opts.dir}: {exc.strerror or exc}") from None
    print(f"agentenv init: created {target}/")
    model = " --model tiny-hermes" if opts.agent else ""
    for rel in sorted(files(opts.name, opts.agent)):
        print(f"  {target / rel}")
    print(f"next:\n  cd {target}\n"
          f"  {INSTALL}   # the package and pytest (its test extra); --env {opts.name} then works anywhere\n"
          "  python -m pytest           # check_env, and a 2 x 2 rollout on the bundled model\n"
          f"  agentenv rollout --env {opts.name}{model} --out rollouts.jsonl\n"
          f"and edit {opts.name}/env.py: its docstring says what to change first.")
    return 0


__all__ = ["INSTALL", "InitConfig", "check_name", "class_name", "files", "init", "run", "starter_digest"]
