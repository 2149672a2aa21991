"""What ``agentenv envs`` prints: each environment's id, a one-line summary, its tool-call
format, its limits, the constructor arguments ``--env-arg`` accepts and the settings
``agentenv train`` takes from it, as plain text; then a note on what the bundled model can do.

Docstrings are written for the API reference (Sphinx roles such as ``:class:`Task``` and
double-backquoted literals); :func:`plain_text` turns that markup into the words a terminal
should show.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

#: ``:class:`~pkg.Name```, ``:func:`title <target>```: the role's text, without its role.
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]*?)\s*(?:<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``")
_INTERPRETED = re.compile(r"(?<![\w`])`([^`\n]+)`(?![\w`])")
_KEEP = "\u00a0"  # a space textwrap does not break at; a space again once the line is wrapped

#: The closing note: the bundled model was trained on one environment, so a new one needs
#: another model or training (docs/models.md has the figures and how they were measured).
BUNDLED_MODEL_NOTE = (
    "Note: the default model, the bundled tiny-retool (~1.7M parameters), was trained only on "
    "retool-math tasks in the retool format; on any other environment expect few or no right "
    "answers. A new environment needs a capable model (--model DIR, a local Hugging Face model, "
    "e.g. a Qwen2.5 or Qwen3 instruct model with --engine vllm) or training (agentenv train). "
    "See docs/models.md."
)


def plain_text(text: str) -> str:
    """``text`` (reST as docstrings write it) as plain words on one line: a role keeps its text
    (``:class:`~a.B``` is ``B``, ``:func:`a.f``` is ``a.f``), a literal loses its backquotes,
    and runs of whitespace, line breaks included, become one space."""
    def role(m: re.Match[str]) -> str:
        name = m.group(2)
        return name.rsplit(".", 1)[-1] if m.group(1) else name

    text = _ROLE.sub(role, text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    return " ".join(text.split())


_PY_ARG = re.compile(r"\b([A-Za-z_]\w*)=(?:\"([^\"]*)\"|'([^']*)'|(True|False|None)\b)")


def cli_spelling(text: str) -> str:
    """Arguments written as Python writes them (``format="hermes"``, ``calls_in_think=True``)
    as ``--env-arg`` takes them (``format=hermes``, ``calls_in_think=true``)."""
    def arg(m: re.Match[str]) -> str:
        name, double, single, word = m.groups()
        if word:
            return f"{name}={json.dumps({'True': True, 'False': False, 'None': None}[word])}"
        return f"{name}={double if double is not None else single}"

    return _PY_ARG.sub(arg, text)


def format_text(tool_format: str | None) -> str:
    """A tool format's id, marked when it is the environment's own rather than one of
    :data:`agentenv.formats.FORMATS` (the ids ``--format`` and ``tool_format = "..."`` accept)."""
    from .formats import FORMATS

    if tool_format is None:
        return "the model's own"
    return tool_format if tool_format in FORMATS else f"{tool_format} (the environment's own format)"


def train_flags(defaults: dict[str, Any]) -> str:
    """``train_defaults`` as the ``agentenv train`` flags that would set them: ``{"lr": 2e-4,
    "env_kwargs": {"extra_digits": 1}}`` is ``--lr 0.0002 --env-arg extra_digits=1``. A switch
    is shown only where it changes its option's default; a name TrainConfig lacks is shown
    as ``name=value``."""
    return " ".join(_flags(defaults))


def _flags(defaults: dict[str, Any]) -> list[str]:
    """:func:`train_flags`' words, one flag with its value each."""
    from dataclasses import MISSING

    from .options import flag_of, walk
    from .train.config import TrainConfig

    known = {f.name: f for _, f, _ in walk(TrainConfig)}
    out: list[str] = []
    for name, value in defaults.items():
        f = known.get(name)
        if f is None:
            out.append(f"{name}={value!r}")
        elif isinstance(value, dict):
            out += [f"{flag_of(f)} {k}={_arg(v)}" for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            out += [f"{flag_of(f)} {_arg(v)}" for v in value]
        elif isinstance(value, bool):
            if value != (f.default if f.default is not MISSING else False):
                out.append(flag_of(f))
        else:
            out.append(f"{flag_of(f)} {_arg(value)}")
    return out


def _arg(value: Any) -> str:
    """A value as a command line gives it: text as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def describe_lines(name: str, where: str, info: dict[str, Any]) -> list[str]:
    """One environment's entry: a heading line, then its indented details (``info`` is
    :func:`agentenv.registry.describe`'s answer)."""
    lines = [f"{name}  ({where})"]
    if info["description"]:
        lines.append(cli_spelling(plain_text(info["description"])))
    lines.append(f"tool format: {format_text(info['tool_format'])}; max_turns {info['max_turns']}; "
                 f"tool_timeout {info['tool_timeout']} s")
    lines.append("--env-arg: " + ", ".join(_whole(a) for a in info["args"].split(", ")))
    if info["train_defaults"]:
        flags = " ".join(_whole(f) for f in _flags(info["train_defaults"]))
        lines.append(f"agentenv train --env {name} uses: {flags}")
    return lines[:1] + ["    " + line for line in lines[1:]]


def listing(width: int | None = None) -> str:
    """The whole of ``agentenv envs``'s output: every environment :func:`agentenv.registry.registered`
    knows (one that cannot load says why), then :data:`BUNDLED_MODEL_NOTE`. ``width`` wraps
    each line to that many columns, keeping its indent (a terminal's width); None leaves every
    line whole, for a pipe or a file."""
    from .errors import AgentEnvError
    from .registry import describe, registered

    blocks = []
    for name, where in registered().items():
        try:
            lines = describe_lines(name, where, describe(name))
        except AgentEnvError as exc:
            lines = [f"{name}  ({where})", f"    cannot load: {exc}"]
        blocks.append(lines)
    blocks.append([BUNDLED_MODEL_NOTE])
    return "\n\n".join("\n".join(_wrap(line, width) for line in lines) for lines in blocks) + "\n"


def _whole(text: str) -> str:
    """``text`` kept on one line when its line is wrapped (an argument with its type and
    default, a flag with its value): its spaces are no-break spaces until :func:`_wrap`."""
    return text.replace(" ", _KEEP)


def _wrap(line: str, width: int | None) -> str:
    """``line`` wrapped to ``width`` under its own indent (None: left whole)."""
    if width is not None and len(line) > width:
        indent = line[:len(line) - len(line.lstrip())]
        line = textwrap.fill(line.strip(), width, initial_indent=indent, subsequent_indent=indent + "  ",
                             break_long_words=False, break_on_hyphens=False)
    return line.replace(_KEEP, " ")


__all__ = ["BUNDLED_MODEL_NOTE", "describe_lines", "format_text", "listing", "plain_text", "train_flags"]
