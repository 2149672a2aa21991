"""The tool-call format a model speaks natively, read from its directory or its tokenizer.

    native_format("agentenv/models/tiny-hermes")   # NativeFormat("hermes", "training.json")
    native_format(tokenizer)                        # the same, from a loaded tokenizer

What decides, first match wins:

1. ``agentenv.json`` in the model directory: ``{"tool_format": "hermes"}`` (the way to declare
   it for a model of your own; any id of :data:`agentenv.formats.FORMATS`);
2. ``training.json``'s ``"format"`` (what the bundled models' training scripts write);
3. the chat template's tool syntax: ``<tool_call>`` is Hermes (Qwen2.5/Qwen3, Hermes models);
   ``<|python_tag|>`` or a ``"parameters"`` JSON call is Llama 3.1's JSON (``llama3-json``);
4. a known family, from ``config.json`` or the directory's name: Qwen is Hermes, Llama 3.x is
   ``llama3-json``.

Nothing found: ``NativeFormat(None, ...)``; the run then uses ``retool`` (see
:func:`agentenv.formats.choose_format`). Reading touches only small text files, never weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The file a model directory may carry to declare its format (and nothing else, for now).
METADATA = "agentenv.json"
_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen3_next")
_NAMES = ((re.compile(r"qwen|hermes", re.I), "hermes"),
          (re.compile(r"llama[-_ ]?3(\.[1-9])?|meta-llama-3", re.I), "llama3-json"))


@dataclass(frozen=True, slots=True)
class NativeFormat:
    """A model's tool-call format (None: unknown) and what said so, in words."""

    name: str | None
    source: str

    def __str__(self) -> str:
        return f"{self.name or 'unknown'} ({self.source})"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def template_format(template: Any) -> str | None:
    """The format a chat template's tool syntax shows (a string, or the list of named
    templates some tokenizer configs hold), else None."""
    if isinstance(template, list):
        template = " ".join(t.get("template", "") for t in template if isinstance(t, dict))
    if not isinstance(template, str):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3-json"
    return None


def family_format(config: dict[str, Any], name: str = "") -> tuple[str | None, str]:
    """The format of a known family, from a ``config.json`` and a name; and what said so."""
    kind = str(config.get("model_type", "")).lower()
    if kind in _QWEN_TYPES:
        return "hermes", f"the {kind} family"
    if kind == "llama" and int(config.get("vocab_size") or 0) >= 128000:  # Llama 3's 128k vocabulary
        return "llama3-json", "the Llama 3 family"
    for pattern, fmt in _NAMES:
        if name and pattern.search(name):
            return fmt, f"the name {name!r}"
    return None, ""


def _dir_format(path: Path) -> NativeFormat:
    declared = _read_json(path / METADATA).get("tool_format")
    if isinstance(declared, str) and declared:
        return NativeFormat(declared, METADATA)
    trained = _read_json(path / "training.json").get("format")
    if isinstance(trained, str) and trained:
        return NativeFormat(trained, "training.json")
    jinja = path / "chat_template.jinja"
    template = jinja.read_text("utf-8") if jinja.is_file() else _read_json(path / "tokenizer_config.json").get(
        "chat_template")
    if fmt := template_format(template):
        return NativeFormat(fmt, "its chat template's tool syntax")
    fmt, why = family_format(_read_json(path / "config.json"), path.resolve().name)
    return NativeFormat(fmt, why or "no tool syntax in its files")


def default_model_for(tool_format: Any = None) -> Path:
    """The bundled model a run uses without ``--model``: the one whose own tool format is
    ``tool_format`` (an environment's pinned format: a format's id or the format itself) when
    one is, else the default model."""
    from . import BUNDLED, default_model

    tool_format = getattr(tool_format, "name", tool_format)
    if tool_format is not None:
        for path in BUNDLED.values():
            if native_format(path).name == tool_format:
                return path
    return default_model()


def native_format(model: str | Path | Any) -> NativeFormat:
    """``model``'s native format: a model directory (or a bundled model's name), or a loaded
    tokenizer (its directory when ``name_or_path`` is one, else its chat template and name)."""
    if isinstance(model, (str, Path)):
        from . import model_dir

        path = model_dir(model)
        if not path.is_dir():
            fmt, why = family_format({}, str(model))
            return NativeFormat(fmt, why or f"{model} is not a directory")
        return _dir_format(path)
    name = str(getattr(model, "name_or_path", "") or "")
    if name and Path(name).is_dir():
        return _dir_format(Path(name))
    if fmt := template_format(getattr(model, "chat_template", None)):
        return NativeFormat(fmt, "its chat template's tool syntax")
    fmt, why = family_format({}, name)
    return NativeFormat(fmt, why or "no tool syntax in its chat template")
