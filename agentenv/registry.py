"""Environment registry: ``make("retool-math")``, entry points, and ``module:Class`` paths.

Lookup order for ``make(spec)``:
1. ids registered in this process with :func:`register`;
2. ids published by installed packages under the ``agentenv.envs`` entry-point group
   (agentenv's own ``retool-math`` is published this way in pyproject.toml);
3. ``"package.module:ClassName"`` import paths.

Every class is checked once with :func:`agentenv.checker.check_env` before its first use.
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Any, Callable

from .env import Environment
from .errors import ConfigError, EnvNotFoundError

EntryPoint = type[Environment] | Callable[..., Environment] | str
_REGISTRY: dict[str, EntryPoint] = {}
_CHECKED: set[type] = set()
GROUP = "agentenv.envs"


def register(env_id: str, entry: EntryPoint) -> None:
    """Register an environment class (or factory, or ``"module:Class"`` string) under an id."""
    _REGISTRY[env_id] = entry


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def registered() -> dict[str, str]:
    """Every known id -> where it comes from."""
    out = {name: f"entry point {ep.value}" for name, ep in _entry_points().items()}
    for name, entry in _REGISTRY.items():
        out[name] = entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
    return dict(sorted(out.items()))


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise EnvNotFoundError(f"cannot import environment {path!r}: {exc}") from exc
    return obj


def _resolve(spec: str) -> EntryPoint:
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    eps = _entry_points()
    if spec in eps:
        return eps[spec].load()
    if ":" in spec:
        return _import(spec)
    known = sorted(set(_REGISTRY) | set(eps))
    close = difflib.get_close_matches(spec, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise EnvNotFoundError(
        f"no environment {spec!r}.{hint} Registered: {', '.join(known) or '(none)'}. "
        "A 'package.module:ClassName' path also works."
    )


def make(spec: str, **kwargs: Any) -> Environment:
    """Create an environment by id or ``module:Class`` path, checked before first use."""
    from .checker import check_env

    entry = _resolve(spec)
    if isinstance(entry, str):
        entry = _import(entry)
    try:
        env = entry(**kwargs)
    except (TypeError, ValueError) as exc:  # bad constructor arguments (--env-arg)
        raise ConfigError(f"cannot create environment {spec!r} with {kwargs}: {exc}") from exc
    if type(env) not in _CHECKED:
        check_env(env)
        _CHECKED.add(type(env))
    if not env.id:
        env.id = spec  # type: ignore[misc]
    return env
