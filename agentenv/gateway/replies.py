"""A model's reply as OpenAI's assistant message: its text split into visible content and
``tool_calls`` by the tool-call format of the model's chat template (``agentenv.formats``:
Hermes ``<tool_call>`` blocks for Qwen-style templates, Llama 3's JSON turn).

A reply whose calls do not parse (bad JSON, an unclosed tag, a tool the request did not
offer, arguments holding NaN or Infinity) or do not meet the request's ``tool_choice`` (no
call where it is ``required``, a call of another function than the one it names) is returned
as plain content, its reason kept as data (:attr:`Reply.malformed`): the agent sees what the
model wrote, the trajectory records the malformed call, and nothing raises. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..formats import HermesFormat, MalformedCall, ToolFormat, ToolRequest


@dataclass(slots=True)
class Reply:
    """What the agent is shown of one sampled turn."""

    content: str | None
    #: ``{"id", "name", "arguments"}`` (arguments a JSON object) for each parsed call.
    calls: list[dict[str, Any]] = field(default_factory=list)
    #: Each malformed call, not returned as a call (its text is in ``content``): why, and the
    #: tool it named where it named one.
    malformed: list[MalformedCall] = field(default_factory=list)

    def openai_calls(self) -> list[dict[str, Any]]:
        """The calls as OpenAI's ``tool_calls`` (arguments a JSON string)."""
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in self.calls]


def _visible(fmt: ToolFormat, text: str) -> str:
    """The text before the first call (Hermes), stripped of the whitespace that joins them."""
    if isinstance(fmt, HermesFormat) and fmt.name == "hermes":
        at = text.find("<tool_call>")
        return (text[:at] if at >= 0 else text).rstrip()
    return ""  # a Llama 3 call is the whole turn


def _standard_json(value: Any) -> bool:
    """Whether ``value`` is JSON every client reads (Python's parser also takes NaN and
    Infinity, and reads 1e400 as Infinity; an agent in another language, or one reading
    strictly, would fail on them)."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _unmet_choice(tool_choice: Any, names: list[str]) -> str | None:
    """Why the calls named ``names`` do not meet ``tool_choice`` (None: they do). OpenAI's
    ``required`` asks for at least one call, a named function for calls of that function only;
    nothing here constrains the sampling, so a turn that ignores them is recorded, not hidden."""
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if tool_choice == "required" and not names:
        return 'tool_choice "required" asks for a tool call; the model made none'
    if named is not None and (not names or set(names) != {named}):
        made = ", ".join(repr(n) for n in names) or "none"
        return f"tool_choice asks for calls of {named!r} only; the model called {made}"
    return None


def parse_reply(fmt: ToolFormat, text: str, tool_names: list[str], tool_choice: Any = None, *,
                call_id: str = "call") -> Reply:
    """``text`` (one turn, decoded without its end-of-turn token) as an assistant reply. With
    no tools offered, or ``tool_choice="none"``, the whole text is content. A turn that does not
    meet a ``required`` or named ``tool_choice`` is content, its reason in ``malformed``. Call
    ids are ``<call_id>_<j>``: the same on a replay, so a re-run agent sends the same requests."""
    if not tool_names or tool_choice == "none":
        return Reply(text)
    parsed = fmt.parse(text, tool_names)
    bad = [p if isinstance(p, MalformedCall) else
           MalformedCall(f"the arguments of {p.name!r} hold NaN, Infinity or a number past a double's range, "
                         "which JSON cannot carry", name=p.name)
           for p in parsed if isinstance(p, MalformedCall) or not _standard_json(p.arguments)]
    if bad:
        return Reply(text, [], bad)
    unmet = _unmet_choice(tool_choice, [p.name for p in parsed])
    if unmet is not None:
        return Reply(text, [], [MalformedCall(unmet)])
    if not parsed:
        return Reply(text)
    calls = [{"id": f"{call_id}_{j}", "name": p.name, "arguments": p.arguments}
             for j, p in enumerate(x for x in parsed if isinstance(x, ToolRequest))]
    return Reply(_visible(fmt, text) or None, calls)
