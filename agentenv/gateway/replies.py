"""A model's reply as OpenAI's assistant message: its text split into visible content and
``tool_calls`` by the tool-call format of the model's chat template (``agentenv.formats``:
Hermes ``<tool_call>`` blocks for Qwen-style templates, Llama 3's JSON turn).

A reply whose calls do not parse (bad JSON, an unclosed tag, a tool the request did not
offer, arguments holding NaN or Infinity) is returned as plain content, its reason kept as
data (:attr:`Reply.malformed`): the agent sees what the model wrote, the trajectory records
the malformed call, and nothing raises. Pure: no I/O.
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
    #: Why each malformed call was not returned as a call (its text is in ``content``).
    malformed: list[str] = field(default_factory=list)

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


def parse_reply(fmt: ToolFormat, text: str, tool_names: list[str], tool_choice: Any = None, *,
                call_id: str = "call") -> Reply:
    """``text`` (one turn, decoded without its end-of-turn token) as an assistant reply. With
    no tools offered, or ``tool_choice="none"``, the whole text is content. Call ids are
    ``<call_id>_<j>``: the same on a replay, so a re-run agent sends the same requests."""
    if not tool_names or tool_choice == "none":
        return Reply(text)
    parsed = fmt.parse(text, tool_names)
    if not parsed:
        return Reply(text)
    bad = [p.reason if isinstance(p, MalformedCall) else f"the arguments of {p.name!r} hold NaN, Infinity or a number "
           "past a double's range, which JSON cannot carry"
           for p in parsed if isinstance(p, MalformedCall) or not _standard_json(p.arguments)]
    if bad:
        return Reply(text, [], bad)
    calls = [{"id": f"{call_id}_{j}", "name": p.name, "arguments": p.arguments}
             for j, p in enumerate(x for x in parsed if isinstance(x, ToolRequest))]
    return Reply(_visible(fmt, text) or None, calls)
