"""Options declared once: a config dataclass's field carries its command-line flag, help text,
default and check, and the rest is derived from the fields.

    @dataclass(frozen=True)
    class Sampling:
        temperature: float = option(1.0, "sampling temperature", check=NON_NEGATIVE)
        top_p: float = option(1.0, "nucleus sampling mass (default {default}: off)", check=UNIT)

        def __post_init__(self) -> None:
            validate(self)

* :func:`add_options` adds a flag per field to an ``argparse`` parser (``--top-p``; the type,
  choices and ``(default X)`` come from the annotation and the default; a check runs as the
  flag is parsed, so ``--top-p 2`` is refused as ``argument --top-p: must be > 0 and <= 1,
  got 2``). A field whose type is a dataclass contributes that dataclass's flags: configs
  compose by concern.
* :func:`build` turns the parsed values into the config objects at once.
* :func:`validate` runs each field's check and choices on a config built in Python
  (``top_p must be > 0 and <= 1, got 2.0``).
* :func:`resume_settings` collects the fields marked ``resume``: what a resumed run must
  share with the run it continues.
* :func:`same_as` declares a field of another config as the same option (the trainer's
  ``group_size`` is the rollout's, with another help).
* :func:`concern` declares a field that holds a whole config, one concern of a larger one; it
  may take only some of the concern's options and re-declare some for its holder, those of a
  concern held inside it too (the trainer holds the rollout's ``RolloutConfig`` and, of its
  ``sampling``, only ``temperature``, checked to be > 0).
* :func:`flat_concern` lets a config that holds a concern take and read that concern's options
  by their own names (``RolloutConfig(temperature=0.7).temperature``, held in its ``sampling``).
* Each option belongs to a concern, its help group: the option's ``group``, else its config's
  ``GROUP`` class attribute. :func:`add_options` given ``groups`` (name -> title, in the order
  ``--help`` shows them) puts each flag under its group's heading.

Annotations decide the flag's form: ``bool`` is a switch (``--flag`` sets True; a field that
defaults to True is turned off by its ``flag``, e.g. ``--no-progress``), ``X | None`` takes an
``X``, ``Literal[...]`` gives the choices, ``list[X]`` and ``dict[str, X]`` repeat the flag
(a dict's items are ``KEY=VALUE``, turned into the dict by the option's ``convert``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class Check:
    """A condition a value meets, and the words that say so when it does not."""

    test: Callable[[Any], bool]
    says: str  # e.g. "must be > 0": follows the option's name in an error

    def __call__(self, value: Any) -> bool:
        return value is None or bool(self.test(value))


POSITIVE = Check(lambda v: v > 0, "must be > 0")
NON_NEGATIVE = Check(lambda v: v >= 0, "must be >= 0")
UNIT = Check(lambda v: 0 < v <= 1, "must be > 0 and <= 1")


def at_least(bound: float) -> Check:
    return Check(lambda v: v >= bound, f"must be >= {bound}")


@dataclass(frozen=True, slots=True)
class Option:
    """What a field says about itself as an option (``field(metadata={"option": ...})``)."""

    help: str
    #: The flag (default ``--`` + the field's name with ``-`` for ``_``); without a leading
    #: ``-``, a positional argument.
    flag: str | None = None
    check: Check | None = None
    #: The allowed values, where the annotation is not a ``Literal`` that lists them.
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    #: For a repeated flag: ``convert(items, earlier)`` turns the strings given into the
    #: field's value; ``earlier`` holds the values of the fields declared before it in the
    #: same config (an environment's arguments are typed against the environment named).
    convert: Callable[[list[str], dict[str, Any]], Any] | None = None
    #: A resumed run must have the same value: True, or the name it has in the run's settings.
    resume: bool | str = False
    #: The concern ``--help`` lists it under (default: its config's ``GROUP``).
    group: str | None = None
    #: Former flags still taken (deprecated), not shown in ``--help``.
    former: tuple[str, ...] = ()


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | Any = MISSING,
           **spec: Any) -> Any:
    """A dataclass field declared as an option (see :class:`Option` for ``spec``). ``help`` may
    hold ``{default}``; without it and without the word "default", ``(default X)`` is added where X
    says something. Write ``{default}`` rather than a value: the command line's default may be
    another one (an environment's training defaults)."""
    return field(default=default, default_factory=factory, metadata={"option": Option(help, **spec)})


def same_as(cls: type, name: str, **changes: Any) -> Any:
    """The field ``name`` of the config ``cls`` declared again as the same option, with
    ``changes`` to its default (``default=``) or its :class:`Option` settings."""
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    default = changes.pop("default", f.default)
    spec = replace(f.metadata["option"], **changes)
    if spec.group is None:
        spec = replace(spec, group=getattr(cls, "GROUP", None))
    return field(default=default, default_factory=f.default_factory, metadata={"option": spec})


@dataclass(frozen=True, slots=True)
class Concern:
    """What a field holding a config says about it (``field(metadata={"concern": ...})``)."""

    #: The names of the options its holder takes, in the order it lists them (None: all); the
    #: rest keep their defaults and have no flag.
    only: tuple[str, ...] | None = None
    #: name -> :class:`Option` settings re-declared for this holder (a stricter check); for a
    #: field that holds a config itself, the :class:`Concern` this holder takes it as.
    changes: Mapping[str, Mapping[str, Any] | Concern] = field(default_factory=dict)


def concern(cls: type, *, only: Sequence[str] | None = None, **changes: Any) -> Any:
    """A field holding the config ``cls`` (default: ``cls()``), one concern of a larger config:
    its options are the holder's, ``only`` those named (see :class:`Concern`), each of
    ``changes`` (name -> :class:`Option` settings) re-declared for the holder. A change to a
    field of ``cls`` that holds a config is a ``concern(...)`` of that config: how the holder
    takes the concern ``cls`` holds (``sampling=concern(SamplingConfig, only=("temperature",))``)."""
    unknown = (set(only or ()) | set(changes)) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"{cls.__name__} has no options {sorted(unknown)}")
    taken: dict[str, Mapping[str, Any] | Concern] = {}
    for name, change in changes.items():
        inner = _shape(_hints(cls)[name]).config
        held = isinstance(change, Field) and "concern" in change.metadata
        if held != (inner is not None) or held and change.default_factory is not inner:
            want = f"concern({inner.__name__}, ...)" if inner is not None else "Option settings"
            raise ConfigError(f"{cls.__name__}.{name} is re-declared with {want}, got {change!r}")
        taken[name] = concern_of(change) if held else change
    spec = Concern(tuple(only) if only is not None else None, taken)
    return field(default_factory=cls, metadata={"concern": spec})


def flat_concern(name: str) -> Callable[[type], type]:
    """A class decorator, above ``@dataclass``: the config takes the options of the concern it
    holds as ``name`` by their own names too, each replacing that option of the concern (given
    to its constructor, or to ``dataclasses.replace``), and reads them so (a property each):
    ``RolloutConfig(temperature=0.7).temperature`` is its ``sampling.temperature``."""

    def decorate(cls: type) -> type:
        f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
        held = _shape(_hints(cls)[name]).config
        if held is None:
            raise ConfigError(f"{cls.__name__}.{name} holds no config")
        names = [h.name for h in fields(held) if h.init]
        clash = sorted(set(names) & {g.name for g in fields(cls)})
        if clash:  # the property would hide the holder's own field, and its init would give the value to the concern
            raise ConfigError(f"{cls.__name__} has options {clash} of its own: {name}'s cannot be taken by those names")
        init = cls.__init__  # type: ignore[misc]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            given = {n: kwargs.pop(n) for n in names if n in kwargs}
            if given:  # over the concern given whole, else over its default
                kwargs[name] = replace(kwargs[name] if name in kwargs else _default_of(f), **given)
            init(self, *args, **kwargs)

        # What help() and editors show: the concern's options as keywords of their own.
        hints = _hints(held)
        own = inspect.signature(init)
        __init__.__signature__ = own.replace(parameters=[  # type: ignore[attr-defined]
            *own.parameters.values(),
            *(inspect.Parameter(h.name, inspect.Parameter.KEYWORD_ONLY, default=h.default, annotation=hints[h.name])
              for h in fields(held) if h.init)])
        cls.__init__ = __init__  # type: ignore[misc]
        for n in names:
            setattr(cls, n, property(lambda self, n=n: getattr(getattr(self, name), n), doc=f"``{name}.{n}``"))
        return cls

    return decorate


def concern_of(f: Field) -> Concern:
    """The :class:`Concern` a field holding a config was declared with (the whole config, as is)."""
    return f.metadata.get("concern") or Concern()


def _as_held(f: Field, spec: Concern) -> Field:
    """``f`` as its holder declares it: its :class:`Option` with the holder's changes."""
    if f.name not in spec.changes:
        return f
    held = copy.copy(f)
    held.metadata = types.MappingProxyType(
        {**f.metadata, "option": replace(f.metadata["option"], **spec.changes[f.name])})
    return held


def option_of(f: Field) -> Option | None:
    """The :class:`Option` a field was declared with (None: a plain field)."""
    return f.metadata.get("option")


# -- what an annotation means ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Shape:
    kind: Any  # the type of one value given on the command line (int, float, str, Path, bool)
    choices: tuple[Any, ...] | None
    repeat: bool  # list[...] or dict[...]: the flag repeats
    config: type | None  # a nested config dataclass


def _shape(hint: Any) -> _Shape:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return _Shape(type(args[0]), tuple(args), False, None)
    if origin in (list, dict):
        inner = _shape(args[0] if origin is list else str)
        return _Shape(inner.kind, inner.choices, True, None)
    if isinstance(hint, type) and is_dataclass(hint):
        return _Shape(None, None, False, hint)
    return _Shape(hint if hint in (int, float, bool, Path) else str, None, False, None)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _walk(cls: type, prefix: str = "", within: str | None = None, spec: Concern = Concern()
          ) -> Iterator[tuple[str, Field, _Shape, str | None]]:
    """Every option of ``cls`` and of the concerns it holds, as its holder declares it (``spec``):
    (dotted path, field, shape, help group)."""
    hints, own = _hints(cls), getattr(cls, "GROUP", None) or within
    named = {f.name: f for f in fields(cls)}
    for f in named.values() if spec.only is None else (named[n] for n in spec.only):  # ``only`` in its order
        if not f.init:
            continue
        shape = _shape(hints[f.name])
        if shape.config is not None:
            inner = spec.changes.get(f.name)  # how the holder takes this concern, else as declared here
            yield from _walk(shape.config, f"{prefix}{f.name}.", own,
                             inner if isinstance(inner, Concern) else concern_of(f))
        else:
            f = _as_held(f, spec)
            opt = option_of(f)
            yield f"{prefix}{f.name}", f, shape, (opt.group if opt is not None else None) or own


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, Field, _Shape]]:
    """Every option of ``cls`` and of the configs it holds: (dotted path, field, shape); a held
    config's options as :func:`concern` declares them."""
    for path, f, shape, _ in _walk(cls, prefix):
        yield path, f, shape


def groups_of(cls: type, within: str | None = None, prefix: str = "") -> dict[str, str | None]:
    """The help group of every option of ``cls`` (dotted path -> group): the option's own, else
    the nearest config's ``GROUP`` around it, else None."""
    return {path: group for path, _, _, group in _walk(cls, prefix, within)}


def flag_of(f: Field) -> str:
    """The field's flag: its option's ``flag``, or ``--`` + its name with ``-`` for ``_``."""
    opt = option_of(f)
    return opt.flag if opt is not None and opt.flag else "--" + f.name.replace("_", "-")


def _default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]


# -- the parser -------------------------------------------------------------------------------

def _value_parser(kind: type, check: Check | None) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if check is not None and not check(value):
            raise argparse.ArgumentTypeError(f"{check.says}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _help(opt: Option, default: Any, shape: _Shape) -> str:
    text = opt.help
    shown = default.name if isinstance(default, Path) else default
    if "{default}" in text:
        text = text.replace("{default}", str(shown))
    elif shape.kind is not bool and default not in (None, "", [], {}) and "default" not in text:
        text += f" (default {shown})"
    return text.replace("%", "%%")  # argparse %-formats help


def _metavar(name: str, shape: _Shape) -> str:
    """A short placeholder for a value: N for a count, X for a number, PATH for a path, else
    the field's name (its last word where the name is long)."""
    if shape.kind is int:
        return "N"
    if shape.kind is float:
        return "SEC" if name.endswith(("timeout", "deadline")) else "X"
    if shape.kind is Path:
        return "PATH"
    return (name if len(name) <= 8 else name.rsplit("_", 1)[-1]).upper()


def _sections(parser: argparse.ArgumentParser, cls: type,
              groups: Mapping[str, str] | None) -> dict[str, Any]:
    """Dotted path -> where its flag goes: the argument group of its concern, in the order of
    ``groups`` (none given: the parser itself)."""
    if groups is None:
        return {path: parser for path, _, _ in walk(cls)}
    of = groups_of(cls)
    unknown = sorted({str(g) for g in of.values() if g not in groups})
    if unknown:
        raise ConfigError(f"{cls.__name__}: options in groups {unknown} that have no heading (give each option a "
                          "group, each group a heading)")
    made = {name: parser.add_argument_group(title) for name, title in groups.items() if name in of.values()}
    return {path: made[g] for path, g in of.items()}


def add_options(parser: argparse.ArgumentParser, cls: type, *, defaults: Mapping[str, Any] | None = None,
                changes: Mapping[str, Mapping[str, Any]] | None = None,
                groups: Mapping[str, str] | None = None, first: Sequence[str] = ()) -> None:
    """A flag for every option of ``cls`` (nested configs included). ``defaults`` (dotted path
    -> value) replaces fields' defaults (an environment's training defaults); ``changes``
    (dotted path -> :class:`Option` settings) re-declares an option for one command (``eval``
    calls the group size ``--k``); ``groups`` (group -> heading, in order) lists each flag
    under its concern's heading, every option's group named there; ``first`` (dotted paths) lists
    those options first in their groups (the ones a first run needs)."""
    sections = _sections(parser, cls, groups)
    for path, f, shape in sorted(walk(cls), key=lambda item: item[0] not in first):  # stable: the rest in order
        opt = option_of(f)
        if opt is None:
            raise ConfigError(f"{cls.__name__}.{path} is not declared with option()")
        opt = replace(opt, **(changes or {}).get(path, {}))
        default = (defaults or {}).get(path, _default_of(f))
        flag = opt.flag or flag_of(f)
        parser_ = sections[path]
        kw: dict[str, Any] = {"help": _help(opt, default, shape), "metavar": opt.metavar or _metavar(f.name, shape)}
        if not flag.startswith("-"):  # positional
            kind = _value_parser(shape.kind, opt.check) if shape.kind in (int, float) else shape.kind
            parser_.add_argument(
                path, type=kind, help=kw["help"], metavar=opt.metavar, nargs="+" if shape.repeat else None
            )
            continue
        kw["dest"] = path
        if shape.kind is bool:
            kw.pop("metavar")
            parser_.add_argument(flag, action="store_false" if default else "store_true", default=default, **kw)
            continue
        kw["choices"] = opt.choices or shape.choices
        if kw["choices"] and not opt.metavar:
            kw["metavar"] = None  # argparse shows {a,b,c}
        if shape.repeat:  # None, not a shared list: argparse appends to its default
            parser_.add_argument(flag, action="append", default=None, **kw)
        else:
            kind = _value_parser(shape.kind, opt.check) if shape.kind in (int, float) else shape.kind
            parser_.add_argument(flag, type=kind, default=default, **kw)
            for former in opt.former:
                parser_.add_argument(former, type=kind, default=default, dest=path, help=argparse.SUPPRESS)


def build(cls: type, values: Mapping[str, Any], prefix: str = "", earlier: dict[str, Any] | None = None) -> Any:
    """The config ``cls`` from parsed ``values`` (dotted path -> value, as :func:`add_options`
    names them); a repeated flag not given leaves its field's default. A ``convert`` sees the
    options built before its own, in its config and in the concerns held before it
    (``earlier``, by field name: the trainer's held-out env arguments are typed against its env)."""
    hints = _hints(cls)
    earlier = {} if earlier is None else earlier
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if not f.init:
            continue
        path, shape = prefix + f.name, _shape(hints[f.name])
        if shape.config is not None:
            kwargs[f.name] = build(shape.config, values, path + ".", earlier)
            continue
        if path not in values:
            continue
        value, opt = values[path], option_of(f)
        if shape.repeat and value is None and f.default_factory is not MISSING:
            value = f.default_factory()  # type: ignore[misc]
        if opt is not None and opt.convert is not None and value is not None:
            value = opt.convert(list(value), {**earlier, **kwargs})
        kwargs[f.name] = earlier[f.name] = value
    return cls(**kwargs)


def validate(config: Any) -> None:
    """Each option's check and choices, on a config built in Python, and those its held concerns'
    options are re-declared with (:func:`concern`; each concern checks its own); the first
    failure is a :class:`~agentenv.errors.ConfigError` that names the field and the value."""
    hints = _hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if "concern" in f.metadata:
            _check_held(value, concern_of(f))
        elif option_of(f) is not None and value is not None:
            _check(f, value, hints[f.name])


def _check_held(config: Any, spec: Concern) -> None:
    """The options of ``config`` that its holder re-declares (``spec``), those of the concerns
    it holds in turn included."""
    hints = _hints(type(config))
    for f in fields(config):
        change = spec.changes.get(f.name)
        if isinstance(change, Concern):
            _check_held(getattr(config, f.name), change)
        elif change is not None:
            _check(_as_held(f, spec), getattr(config, f.name), hints[f.name])


def _check(f: Field, value: Any, hint: Any) -> None:
    opt, shape = option_of(f), _shape(hint)
    if opt is None or value is None:
        return
    if opt.check is not None and not shape.repeat and not opt.check(value):
        raise ConfigError(f"{f.name} {opt.check.says}, got {value!r}")
    choices = opt.choices or shape.choices
    if choices and not shape.repeat and value not in choices:
        listed = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]
        raise ConfigError(f"{f.name} must be {listed}, got {value!r}")


def resume_settings(config: Any, **resolved: Any) -> dict[str, Any]:
    """The options marked ``resume`` (nested configs included), by their settings name;
    ``resolved`` gives a value in the form the run used (``model`` as a resolved path)."""
    out: dict[str, Any] = {}
    for path, f, _ in walk(type(config)):
        opt = option_of(f)
        if opt is None or not opt.resume:
            continue
        value = config
        for part in path.split("."):
            value = getattr(value, part)
        name = opt.resume if isinstance(opt.resume, str) else f.name
        out[name] = resolved.get(name, value)
    return out


def resume_keys(cls: type) -> tuple[str, ...]:
    """The names :func:`resume_settings` gives for ``cls``."""
    return tuple(o.resume if isinstance(o.resume, str) else f.name
                 for _, f, _ in walk(cls) if (o := option_of(f)) is not None and o.resume)


__all__ = ["Check", "Concern", "NON_NEGATIVE", "Option", "POSITIVE", "UNIT", "add_options", "at_least", "build",
           "concern", "concern_of", "flag_of", "flat_concern", "groups_of", "option", "option_of", "resume_keys",
           "resume_settings", "same_as", "validate", "walk"]
