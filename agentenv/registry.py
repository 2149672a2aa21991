"""Environment registry: ``make("retool-math")``, entry points, ``module:Class`` paths and
``path/to/file.py:Class``.

Lookup order for ``make(spec)``:
1. ids registered in this process with :func:`register` (a user's module that registers its
   environments is loaded with :func:`load_module`: ``--env-module`` on the CLI, or the
   ``AGENTENV_ENV_MODULES`` variable, a list separated by ``os.pathsep``);
2. ids published by installed packages under the ``agentenv.envs`` entry-point group
   (agentenv's own ``retool-math`` is published this way in pyproject.toml);
3. ``"package.module:ClassName"`` import paths (a module in the current directory included,
   as with ``python -m``) and ``"path/to/file.py:ClassName"``; ``"path/to/file.py"`` alone
   names the one Environment subclass the file defines.

Every class is checked once with :func:`agentenv.checker.check_env` before its first use.
Constructor arguments given as text (``--env-arg KEY=VALUE``) are checked against the
constructor's signature and converted by its annotations (:func:`env_kwargs`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import typing
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .env import Environment
from .errors import ConfigError, EnvCheckError, EnvNotFoundError

EntryPoint = type[Environment] | Callable[..., Environment] | str
_REGISTRY: dict[str, EntryPoint] = {}
_CHECKED: set[type] = set()
_LOADED: set[str] = set()
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


_FROM_FILE: dict[str, str] = {}  # module name -> the file load_module imported it from


def load_module(spec: str) -> ModuleType:
    """Import a user's module: a dotted name (importable, or found in the current directory)
    or the path of a ``.py`` file (its directory joins ``sys.path``, as for a script)."""
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise EnvNotFoundError(f"no such file: {spec}")
        for mod in list(sys.modules.values()):
            if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == path:
                return mod  # imported already (a module's classes must stay one and the same)
        name = path.stem if path.stem.isidentifier() else "agentenv_user_" + str(abs(hash(path)))
        if name in sys.modules:
            name = f"{name}_{abs(hash(path))}"
        _FROM_FILE[name] = str(path)  # class_spec names the file: its name may find another elsewhere
        importer = importlib.util.spec_from_file_location(name, path)
        assert importer is not None and importer.loader is not None
        module = importlib.util.module_from_spec(importer)
        sys.modules[name] = module  # dataclasses, pickling and later imports find it
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        try:
            importer.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[name]
            raise EnvNotFoundError(f"cannot import {spec}: {_failure(exc)}") from None
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != spec.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise EnvNotFoundError(f"cannot import {spec!r}: {exc}") from exc
        sys.path.append(cwd)  # a module beside the user, as `python -m` would find it
        try:
            return importlib.import_module(spec)
        except ModuleNotFoundError as exc2:
            if exc2.name != spec.split(".")[0]:  # found beside the user; what it imports is missing
                raise EnvNotFoundError(f"cannot import {spec!r}: {_failure(exc2)}") from None
            sys.path.remove(cwd)
            raise EnvNotFoundError(f"cannot import {spec!r}: {exc2} (looked in the installed packages "
                                   f"and in {cwd})") from None
        except Exception as exc2:  # noqa: BLE001 - the module beside the user failed while importing
            raise EnvNotFoundError(f"cannot import {spec!r}: {_failure(exc2)}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise EnvNotFoundError(f"cannot import {spec!r}: {_failure(exc)}") from None


def _failure(exc: BaseException) -> str:
    """One line for an exception a user's module raised while importing: a syntax error names
    its file and line in full (``SyntaxError: invalid syntax (/x/env.py, line 2)``)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


def class_spec(env: Any) -> str:
    """A ``make`` spec of ``env``'s own class that another process (a Ray worker) can import
    given this process's ``sys.path``: ``path/to/file.py:Class`` for a module imported from a
    file (two files may share a name), else ``module:Class``. Not the env's id: a subclass
    that keeps its parent's id is made as itself."""
    cls = type(env)
    file = _FROM_FILE.get(cls.__module__)
    if cls.__module__ == "__main__":  # a class in the user's script: its file, imported under its
        file = getattr(sys.modules["__main__"], "__file__", None)  # own name (``__main__`` code skipped)
    return f"{Path(file).resolve() if file else cls.__module__}:{cls.__qualname__}"


def portable_spec(env: Any) -> dict[str, Any]:
    """:func:`class_spec` for a process that may run on another machine (a Ray worker on
    another node): ``{"env": spec, "source": text}``, with the text of the class's module
    when that module is one file of the user's own (a file, a module beside the user, a
    script), not an installed package. :func:`make_portable` makes the class from it where
    that file is not on disk. A module the env's module imports in turn is not carried: it
    must be installed on every node (or shipped with Ray's ``runtime_env``)."""
    spec = class_spec(env)
    module = sys.modules.get(type(env).__module__)
    file = getattr(module, "__file__", None)
    source = None
    if file and file.endswith(".py") and "." not in type(env).__module__:
        path = Path(file).resolve()
        installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        if not any(path.is_relative_to(p) for p in installed):
            try:
                source = path.read_text()
            except OSError:  # gone since it was imported: a worker without it says so
                source = None
    return {"env": spec, "source": source}


def make_portable(spec: dict[str, Any], **kwargs: Any) -> Environment:
    """:func:`make` from a :func:`portable_spec`: the module's file on disk where it is there
    (the same machine), else its text, written to a private directory and imported."""
    env, source = spec["env"], spec.get("source")
    if source is not None:
        target, _, name = env.rpartition(":")
        if target.endswith(".py"):
            missing, stem = not Path(target).is_file(), Path(target).stem
        else:
            missing, stem = importlib.util.find_spec(target) is None, target
        if missing:
            return _make_from_text(source, stem, name, **kwargs)
    return make(env, **kwargs)


def _make_from_text(source: str, stem: str, name: str, **kwargs: Any) -> Environment:
    """Import ``source`` as module ``stem`` from a private directory, make its class ``name``,
    and remove the directory: the module lives on in ``sys.modules`` and its lines in
    ``linecache`` (tracebacks and ``inspect.getsource`` still show them), so nothing is left
    on disk, however many workers start and stop."""
    import linecache
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="agentenv-env-"))
    file = folder / f"{stem}.py"
    try:
        file.write_text(source)
        return make(f"{file}:{name}", **kwargs)
    finally:
        resolved = str(file.resolve())
        linecache.cache[resolved] = (len(source), None, source.splitlines(keepends=True), resolved)
        if str(folder.resolve()) in sys.path:
            sys.path.remove(str(folder.resolve()))
        shutil.rmtree(folder, ignore_errors=True)


def load_env_modules(specs: list[str] = ()) -> None:  # type: ignore[assignment]
    """Import the modules in ``specs`` and in ``AGENTENV_ENV_MODULES`` (once each), so the
    environments they ``register()`` can be made by id."""
    extra = [m for m in os.environ.get("AGENTENV_ENV_MODULES", "").split(os.pathsep) if m.strip()]
    for spec in [*extra, *specs]:
        if spec not in _LOADED:
            load_module(spec.strip())
            _LOADED.add(spec)


def _import(path: str) -> Any:
    module, _, attr = path.rpartition(":")
    obj: Any = load_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(obj).items() if isinstance(v, type) and not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f" Did you mean {path.rpartition(':')[0]}:{attr[:-len(part)]}{close[0]}?" if close else ""
            raise EnvNotFoundError(f"cannot import environment {path!r}: {getattr(obj, '__name__', obj)!r} has "
                                   f"no attribute {part!r}.{hint}")
        obj = getattr(obj, part)
    return obj


def _resolve(spec: str) -> EntryPoint:
    load_env_modules()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    eps = _entry_points()
    if spec in eps:
        return eps[spec].load()
    if ":" in spec:
        return _import(spec)
    if spec.endswith(".py"):
        return _only_class(spec)
    known = sorted(set(_REGISTRY) | set(eps))
    close = difflib.get_close_matches(spec, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise EnvNotFoundError(
        f"no environment {spec!r}.{hint} Registered: {', '.join(known) or '(none)'}. "
        "A 'package.module:ClassName' or 'path/to/file.py:ClassName' path also works; a module "
        "that register()s environments loads with --env-module (or AGENTENV_ENV_MODULES)."
    )


def _only_class(path: str) -> type[Environment]:
    """The one Environment subclass that the file ``path`` defines (not one it imports)."""
    module = load_module(path)
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, Environment) and c.__module__ == module.__name__]
    if len(found) == 1:
        return found[0]
    if not found:
        raise EnvNotFoundError(f"{path} defines no Environment subclass (a class that subclasses "
                               "agentenv.Environment)")
    names = ", ".join(c.__qualname__ for c in found)
    raise EnvNotFoundError(f"{path} defines {len(found)} Environment subclasses ({names}): add :ClassName, "
                           f"e.g. {path}:{found[0].__qualname__}")


def _entry(spec: str) -> Any:
    entry = _resolve(spec)
    return _import(entry) if isinstance(entry, str) else entry


def parameters(entry: Any) -> dict[str, inspect.Parameter] | None:
    """The keyword arguments an environment class (or factory) takes; None if it takes any
    name (its constructor has a ``**kwargs``). ``Environment``'s own ``**kwargs`` (kept as
    ``self.options``) does not count: a class that does not override ``__init__`` takes none."""
    chain = [c for c in entry.__mro__ if "__init__" in vars(c)][:1] if isinstance(entry, type) else [entry]
    out: dict[str, inspect.Parameter] = {}
    for owner in chain:
        if owner is Environment or owner is object:
            return out
        fn = owner.__init__ if isinstance(owner, type) else owner
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: no conversion
            hints = {}
        more = False
        for name, prm in sig.parameters.items():
            if name == "self" or prm.kind in (prm.POSITIONAL_ONLY, prm.VAR_POSITIONAL):
                continue
            if prm.kind == prm.VAR_KEYWORD:
                more = True
                continue
            out[name] = prm.replace(annotation=hints.get(name, prm.annotation))
        return None if more else out
    return out


def _type_name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def _convert(text: str, ann: Any) -> Any:
    """``text`` as a value of type ``ann`` (ValueError if it is not one)."""
    if ann in (inspect.Parameter.empty, Any, object):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Union or type(ann).__name__ == "UnionType":
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _convert(text, a)
            except ValueError:
                continue
        raise ValueError(text)
    if origin is typing.Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(text)
    if ann is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    if ann in (int, float, str):
        return ann(text)
    if origin in (list, dict, tuple) or ann in (list, dict, tuple):
        value = json.loads(text)
        if not isinstance(value, origin or ann):
            raise ValueError(text)
        return tuple(value) if (origin or ann) is tuple else value
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _accepted(params: dict[str, inspect.Parameter]) -> str:
    return ", ".join(
        f"{n}" + ("" if p.annotation is inspect.Parameter.empty else f": {_type_name(p.annotation)}")
        + ("" if p.default is inspect.Parameter.empty else f" = {p.default!r}") for n, p in params.items()
    ) or "(none)"


def env_kwargs(spec: str, items: list[str], option: str = "--env-arg") -> dict[str, Any]:
    """``KEY=VALUE`` strings (from the command line) as the environment's constructor
    arguments: names checked against its signature, values converted by its annotations."""
    params = parameters(_entry(spec))
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"{option} wants KEY=VALUE, got {item!r}")
        if params is None:
            out[key] = _convert(text, inspect.Parameter.empty)
            continue
        if key not in params:
            raise ConfigError(f"{option} {key}: environment {spec!r} has no argument {key!r}; "
                              f"it takes: {_accepted(params)}")
        ann = params[key].annotation
        try:
            out[key] = _convert(text, ann)
        except (ValueError, json.JSONDecodeError):
            raise ConfigError(f"{option} {key}={text!r}: not a valid {_type_name(ann)}") from None
    return out


def describe(spec: str) -> dict[str, Any]:
    """What ``agentenv envs`` shows: the description (the class docstring's first paragraph),
    the tool format, the default limits and the constructor arguments with their defaults."""
    entry = _entry(spec)
    params = parameters(entry)
    doc = inspect.getdoc(entry) or ""
    fmt = getattr(entry, "tool_format", None)
    return {
        "id": spec,
        "description": " ".join(doc.split("\n\n")[0].split()),
        "tool_format": fmt if isinstance(fmt, str) or fmt is None else (getattr(fmt, "name", "") or type(fmt).__name__),
        "max_turns": getattr(entry, "max_turns", None),
        "tool_timeout": getattr(entry, "tool_timeout", None),
        "args": "(any)" if params is None else _accepted(params),
        "train_defaults": dict(getattr(entry, "train_defaults", None) or {}),
    }


def _check_entry(spec: str, entry: Any) -> None:
    """``entry`` can make an environment: an Environment subclass, or a function (a factory)."""
    if isinstance(entry, type):
        if not issubclass(entry, Environment):
            raise EnvCheckError(f"{spec} is the class {entry.__qualname__}, which does not subclass "
                                "agentenv.Environment")
    elif not callable(entry):
        raise EnvCheckError(f"{spec} is {type(entry).__name__} {entry!r:.40}, not an Environment subclass")
    elif inspect.isfunction(entry) and _in_class(entry.__qualname__) and _first_parameter(entry) == "self":
        raise EnvCheckError(f"{spec} is a method ({entry.__qualname__}), not an Environment class or factory: name "
                            f"the class ({spec.rsplit('.', 1)[0]}) or a function that returns an Environment")


def _in_class(qualname: str) -> bool:
    """A function's qualified name is a class's method's (``C.f``; ``f.<locals>.g`` is not)."""
    owner, dot, _ = qualname.rpartition(".")
    return bool(dot) and not owner.endswith("<locals>")


def _first_parameter(fn: Any) -> str | None:
    """The name of ``fn``'s first parameter (``self``: an instance method named through its
    class; a static or class method may be a factory)."""
    try:
        return next(iter(inspect.signature(fn).parameters), None)
    except (TypeError, ValueError):
        return None


def make(spec: str, **kwargs: Any) -> Environment:
    """Create an environment by id or ``module:Class`` path, checked before first use.
    Arguments its constructor does not take are refused, with the ones it does."""
    from .checker import check_env

    entry = _entry(spec)
    _check_entry(spec, entry)
    params = parameters(entry)
    unknown = sorted(set(kwargs) - set(params)) if params is not None else []
    if unknown:
        raise ConfigError(f"environment {spec!r} has no argument {unknown[0]!r}; it takes: {_accepted(params)}")
    missing = [n for n, p in (params or {}).items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ConfigError(f"environment {spec!r} needs " + " and ".join(
            f"--env-arg {n}=... ({_accepted({n: params[n]})})" for n in missing))  # type: ignore[index]
    try:
        env = entry(**kwargs)
    except (TypeError, ValueError) as exc:  # bad constructor arguments (--env-arg)
        raise ConfigError(f"cannot create environment {spec!r} with {kwargs}: {exc}") from exc
    if not isinstance(env, Environment):  # a factory (a class is refused before it is called)
        what = "a function" if inspect.isroutine(entry) else f"a callable {type(entry).__name__}"
        raise EnvCheckError(f"{spec} is {what}, not an Environment subclass: one named as an environment must "
                            f"return an Environment, and this one returned {type(env).__name__}")
    if type(env) not in _CHECKED:
        check_env(env)
        _CHECKED.add(type(env))
    if not env.id:
        env.id = spec  # type: ignore[misc]
    return env
