"""Tool-call formats: how a model asks for a tool and how the answer is spliced back.

A format parses the text of one model turn into tool requests, and renders tool outputs as
the *environment text* appended after the model's own tokens (tokenized on its own and
added with loss mask 0; the model's sampled ids are never re-encoded).

* :class:`ReToolFormat`: ``<code>...</code>``; generation stops at ``</code>``; the result
  returns as ``<interpreter>...</interpreter>``.
* :class:`HermesFormat`: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Qwen/Hermes); the result is a ``tool`` chat message rendered by the tokenizer's own chat
  template, so the glue between turns is exactly what the template would produce. A call
  written inside ``<think>...</think>`` is reasoning, not a call (``calls_in_think=True``
  runs it).
* :class:`Llama3JsonFormat`: Llama 3.1's JSON call (the whole turn is ``{"name": ...,
  "parameters": {...}}``, ended by ``<|eot_id|>``); the result is an ``ipython``/``tool``
  message rendered by the chat template, as for Hermes.

Anything malformed (an unclosed tag, bad JSON, an unknown tool, wrong arguments) becomes a
:class:`MalformedCall`; the reactor turns it into an error observation for the model.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import ConfigError


#: Where tool output ends in the built-in formats (retool's interpreter, Hermes' tool response).
TOOL_OUTPUT_ENDS = ("</interpreter>", "</tool_response>")


def final_text(text: str | None, after: Sequence[str] = TOOL_OUTPUT_ENDS) -> str:
    """The part of a completion after the last tool output: the model's final words."""
    text = text or ""
    cut = max((text.rfind(m) + len(m) for m in after if m in text), default=0)
    return text[cut:]


@dataclass(slots=True)
class ToolRequest:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class MalformedCall:
    reason: str
    raw: str = ""
    name: str = ""  # the tool the call named, where it named one


Parsed = ToolRequest | MalformedCall


class ToolFormat:
    name: str = ""
    #: Strings that end a tool call; the engine stops on their token ids.
    stop_strings: tuple[str, ...] = ()

    def parse(self, text: str, tool_names: Sequence[str]) -> list[Parsed]:
        """Tool calls in one model turn's text (empty: the model made none)."""
        raise NotImplementedError

    def observation(self, outputs: list[str], tokenizer: Any, ended_with_eos: bool) -> str:
        """Environment text to splice after the model's turn, carrying the tool outputs."""
        raise NotImplementedError

    def error_text(self, call: MalformedCall) -> str:
        return f"Error: malformed tool call: {call.reason}"

    def example_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text a model writes to call ``name`` (as this format parses it)."""
        raise NotImplementedError


class ReToolFormat(ToolFormat):
    name = "retool"
    stop_strings = ("</code>",)
    OPEN, CLOSE = "<code>", "</code>"

    def parse(self, text: str, tool_names: Sequence[str]) -> list[Parsed]:
        start = text.rfind(self.OPEN)
        if start < 0:
            if self.CLOSE in text:
                return [MalformedCall("</code> without an opening <code>", text[-200:])]
            return []
        end = text.find(self.CLOSE, start)
        if end < 0:
            return [MalformedCall("unclosed <code> block (no </code>)", text[start:][:200])]
        code = text[start + len(self.OPEN) : end].strip("\n")
        if not code.strip():
            return [MalformedCall("empty <code> block")]
        if "python" not in tool_names:
            return [MalformedCall("this environment has no python tool")]
        return [ToolRequest("python", {"code": code})]

    def observation(self, outputs: list[str], tokenizer: Any, ended_with_eos: bool) -> str:
        return "".join(f"\n<interpreter>\n{o}\n</interpreter>\n" for o in outputs)

    def example_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"{self.OPEN}\n{arguments['code']}\n{self.CLOSE}"


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes).

    Reasoning is not acting: a call written inside ``<think>...</think>`` (or after a
    ``<think>`` never closed, or before a ``</think>`` whose ``<think>`` the chat template's
    generation prompt wrote) is not a call, unless ``calls_in_think=True``. The engine still
    stops at its ``</tool_call>``, so such a turn ends with no call and the program ends.
    """

    name = "hermes"
    stop_strings = ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
    # Where the template writes the assistant's text: letters and digits (a template that
    # escapes or trims a message leaves them whole), drawn once a process.
    _A = f"AGENTENV{secrets.token_hex(8)}ASSISTANTZ"
    THINK, UNTHINK = "<think>", "</think>"

    def __init__(self, calls_in_think: bool = False) -> None:
        self.calls_in_think = calls_in_think

    def outside_think(self, text: str) -> list[str]:
        """The parts of ``text`` outside reasoning blocks, in order."""
        pos, parts = 0, []
        close, open_ = text.find(self.UNTHINK), text.find(self.THINK)
        if close >= 0 and (open_ < 0 or close < open_):  # the block was opened by the prompt
            pos = close + len(self.UNTHINK)
        while True:
            start = text.find(self.THINK, pos)
            if start < 0:
                parts.append(text[pos:])
                return parts
            parts.append(text[pos:start])
            end = text.find(self.UNTHINK, start)
            if end < 0:  # still thinking when the turn ended
                return parts
            pos = end + len(self.UNTHINK)

    def parse(self, text: str, tool_names: Sequence[str]) -> list[Parsed]:
        parts = [text] if self.calls_in_think else self.outside_think(text)
        calls: list[Parsed] = []
        for m in (m for part in parts for m in self._CALL.finditer(part)):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                calls.append(MalformedCall("unclosed <tool_call> (no </tool_call>)", body[:200]))
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(MalformedCall(f"tool call is not valid JSON ({exc.msg})", body[:200]))
                continue
            calls.append(_request(obj, body, tool_names, "arguments"))
        return calls

    def example_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def observation(self, outputs: list[str], tokenizer: Any, ended_with_eos: bool) -> str:
        # The tool messages are rendered with their outputs: whatever the template does to a
        # message's content (escape it, trim it, write it as JSON) is done to them.
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._A}]
        tools = [{"role": "tool", "content": out} for out in outputs]
        try:
            text = tokenizer.apply_chat_template(base + tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"the tokenizer's chat template cannot render tool messages: {exc}") from exc
        at = text.find(self._A)
        if at < 0:
            raise ConfigError("the chat template dropped the assistant content; cannot bridge turns")
        tail = text[at + len(self._A) :]
        eos = getattr(tokenizer, "eos_token", None)
        if ended_with_eos and eos and tail.startswith(eos):
            tail = tail[len(eos) :]
        return tail


def _request(obj: Any, body: str, tool_names: Sequence[str], key: str) -> Parsed:
    """A decoded JSON call as a request, or what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall('tool call must be an object with a string "name"', body[:200])
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models double-encode arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return MalformedCall(f'"{key}" must be a JSON object', body[:200], obj["name"])
    if obj["name"] not in tool_names:
        return MalformedCall(f"unknown tool {obj['name']!r}; available: {', '.join(tool_names)}", body[:200],
                             obj["name"])
    return ToolRequest(obj["name"], args)


class Llama3JsonFormat(HermesFormat):
    """Llama 3.1 JSON tool calls: a turn that is one JSON object ``{"name": ..., "parameters":
    {...}}`` (``<|python_tag|>`` before it allowed) is a call; the turn ends with the model's
    end of turn (EOS), and the result is rendered by the chat template as a tool message."""

    name = "llama3-json"
    stop_strings = ()
    _END = re.compile(r"(\s*<\|[A-Za-z0-9_]+\|>)+\s*$")  # the end-of-turn token(s): <|eot_id|>, <|eom_id|>, ...

    def parse(self, text: str, tool_names: Sequence[str]) -> list[Parsed]:
        body = self._END.sub("", text.strip())
        body = body.split("</think>")[-1].strip()  # reasoning before the call is not part of it
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []  # prose: the final answer
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            if body.startswith('{"name"'):
                return [MalformedCall(f"tool call is not valid JSON ({exc.msg})", body[:200])]
            return []
        return [_request(obj, body, tool_names, "parameters")]

    def example_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments})


FORMATS: dict[str, type[ToolFormat]] = {"retool": ReToolFormat, "hermes": HermesFormat,
                                        "llama3-json": Llama3JsonFormat}
#: The format of a model whose own cannot be told (:mod:`agentenv.models.native` found nothing).
DEFAULT_FORMAT = "retool"


def get_format(spec: str | ToolFormat | None) -> ToolFormat:
    """The format ``spec`` names (an id of :data:`FORMATS`, or a format itself); None, an
    environment's "the model's own", is :data:`DEFAULT_FORMAT` here: a run replaces it with
    the model's (:func:`agentenv.env.bind_tool_format`) before anything reads it."""
    if spec is None:
        return FORMATS[DEFAULT_FORMAT]()
    if isinstance(spec, ToolFormat):
        return spec
    try:
        return FORMATS[spec]()
    except KeyError:
        raise ConfigError(f"unknown tool-call format {spec!r}; choose from {sorted(FORMATS)}") from None
