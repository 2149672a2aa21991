"""Chat messages as the gateway compares and renders them.

SDKs and agent frameworks send back what the gateway answered in their own shape: key order
changes, ``None`` fields appear (``refusal``, ``audio``, ``function_call``), content comes as
a list of text parts, tool-call arguments are re-serialised, tool-call ids are kept or not.
:func:`normalise` maps every such variant of one message to one plain dict, so that "does this
request extend the previous one?" is a comparison of normalised messages. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: The message fields a chat template reads; everything else an SDK adds is dropped.
_KEPT = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class MessageError(ValueError):
    """A message the gateway cannot take (answered with 400); the text names what is wrong."""


def _text(content: Any, where: str) -> str | list[Any] | None:
    """Content as one string: text parts joined; a part that is not text is kept as a list."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{where}.content must be a string or a list of content parts, got {type(content).__name__}")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise MessageError(f"{where}.content[{i}] must be an object")
        if part.get("type") not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            return content  # an image or audio part: passed to the template as it is
        parts.append(part["text"])
    return "".join(parts)


def _arguments(args: Any) -> Any:
    """Tool-call arguments as a JSON value (a string that parses is parsed; one that does not
    stays a string)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise MessageError(f"{where} must be an object")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    if not isinstance(fn.get("name"), str):
        raise MessageError(f"{where}.function.name must be a string")
    # The id is left out: the gateway minted it, and frameworks keep it or not.
    return {"type": call.get("type") or "function",
            "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}))}}


def normalise(message: Any, index: int = 0) -> dict[str, Any]:
    """One message in the gateway's canonical form (see the module docstring)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise MessageError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = _text(message.get("content"), where)
    if content not in (None, ""):
        out["content"] = content
    elif role != "assistant":
        out["content"] = ""
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise MessageError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value not in (None, ""):
            out[key] = value
    return out


def normalise_all(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list of message objects")
    return [normalise(m, i) for i, m in enumerate(messages)]


def normalise_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` (function definitions), checked; [] for none."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise MessageError("tools must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") not in (None, "function"):
            raise MessageError(f"tools[{i}] has type {tool['type']!r}: the gateway serves function tools only")
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def same(a: Any, b: Any) -> bool:
    """Whether two JSON values are one value as JSON spells it. Python's ``==`` is not that:
    ``True == 1 == 1.0`` and ``-0.0 == 0.0``, yet a chat template renders ``true``, ``1``,
    ``1.0`` and ``-0.0`` apart, so a history compared with ``==`` could be extended with ids
    the model sampled for other text than the request holds. Once ``==`` holds, a string
    equals only a string, so only the numbers and containers are walked."""
    if a != b:
        return False
    pairs = [(a, b)]
    while pairs:
        x, y = pairs.pop()
        kind = type(x)
        if kind is not type(y):
            return False
        if kind is dict:
            pairs.extend((v, y[k]) for k, v in x.items() if type(v) is not str)
        elif kind is list:
            pairs.extend(p for p in zip(x, y) if type(p[0]) is not str)
        elif kind is float and repr(x) != repr(y):
            return False
    return True


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A normalised message as a chat template reads it: content always present (a string),
    tool-call arguments as JSON objects, each call with its ``function``."""
    out = dict(message)
    out.setdefault("content", "")
    if "tool_calls" in out:
        out["tool_calls"] = [{"type": c["type"], "function": dict(c["function"])} for c in out["tool_calls"]]
    return out


def digest(*parts: Any) -> str:
    """A stable hash of JSON values (a request as the journal compares it on a replay)."""
    body = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def assistant_message(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The normalised assistant message of a response: its visible content and parsed calls
    (``{"name", "arguments"}`` each)."""
    out: dict[str, Any] = {"role": "assistant"}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in calls]
    return out
