"""Responses API items: a request's ``instructions`` and ``input`` as the chat messages the
gateway compares and renders, and a reply as ``output`` items. Pure: no I/O.

A conversation sent as Responses items becomes the messages the same conversation sent to
Chat Completions would be, so both APIs extend, branch, render and replay through one path
(``agentenv.gateway.session``):

    instructions                           {"role": "system", "content": instructions}, first
    input as a string                      {"role": "user", "content": input}
    message item {role, content}           {"role", "content"}: text parts (input_text,
                                           output_text) joined; developer is system
    function_call {call_id, name, args}    a call of the assistant message just before it
                                           (a message of its own after anything else)
    function_call_output {call_id, output} {"role": "tool", "tool_call_id", "content"}

A reply goes out as one ``message`` item (its visible content, as ``output_text``) unless it
is calls alone, then one ``function_call`` item per parsed call. An agent that sends that
output back as input items (the Agents SDK, a plain loop) sends back exactly the assistant
message the gateway recorded, so its next request extends the sequence.
"""

from __future__ import annotations

from typing import Any

from .messages import MessageError
from .replies import Reply

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
#: Items that need state the gateway does not keep, or a model it does not run.
_STATEFUL = {"item_reference": "it points at an item the gateway never stored",
             "reasoning": "the gateway's model writes no reasoning items",
             "compaction": "the gateway does no server-side compaction"}


def _text(content: Any, where: str) -> str:
    """A message's or tool output's content as one string (its text parts joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            raise MessageError(f"{where}[{j}] has type {kind!r}: the gateway serves a text model; send text parts "
                               "(input_text, output_text)")
    return "".join(out)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise MessageError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise MessageError(f"{where}.{key} must be a string (a function_call item is "
                               '{"type": "function_call", "call_id", "name", "arguments"})')
    fn = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": fn}


def _output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise MessageError(f"{where}.call_id must be a string (the call_id of the function_call it answers)")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")}


def _add(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """``item`` appended to ``messages`` as the chat message(s) it stands for."""
    if not isinstance(item, dict):
        raise MessageError(f"{where} must be an object, got {type(item).__name__}")
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_message(item, where))
    elif kind == "function_call":
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            messages.append(last)
        last.setdefault("tool_calls", []).append(_call(item, where))
    elif kind == "function_call_output":
        messages.append(_output(item, where))
    elif kind in _STATEFUL:
        raise MessageError(f"{where} has type {kind!r}, which the gateway cannot take: {_STATEFUL[kind]}; send the "
                           "conversation as message, function_call and function_call_output items")
    else:
        raise MessageError(f"{where} has type {kind!r}; the gateway takes message, function_call and "
                           "function_call_output items (function tools only: no built-in tools' items)")


def input_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """The chat messages of a request's ``instructions`` and ``input`` (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise MessageError("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise MessageError("input must be a string or a non-empty list of items (message, function_call, "
                           "function_call_output)")
    for i, item in enumerate(items):
        _add(messages, item, f"input[{i}]")
    return messages


def function_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` ({"type": "function", "name", "description", "parameters",
    "strict"}) as Chat Completions tools; built-in tools are refused."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise MessageError("tools must be a list of tool objects")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise MessageError(f"tools[{i}] has type {kind!r}: the gateway serves function tools only (no built-in "
                               "tools such as web_search or file_search); run the tool in the agent as a function")
        if not isinstance(tool.get("name"), str):
            hint = " (the Chat Completions form; the Responses API takes it flat)" if "function" in tool else ""
            raise MessageError(f'tools[{i}] must be {{"type": "function", "name": ..., "parameters": ...}}{hint}')
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def output_items(reply: Reply, prefix: str, status: str, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The reply as output items: its content as a message (unless it is calls alone), then its
    calls. Item ids are ``msg_<prefix>`` and ``fc_<prefix>_<j>``; call ids are the reply's."""
    out: list[dict[str, Any]] = []
    if reply.content or not reply.calls:
        text = {"type": "output_text", "text": reply.content or "", "annotations": []}
        if logprobs is not None:
            text["logprobs"] = logprobs
        out.append({"type": "message", "id": f"msg_{prefix}", "status": status, "role": "assistant",
                    "content": [text]})
    for j, call in enumerate(reply.openai_calls()):  # arguments spelled as the chat path spells them
        fn = call["function"]
        out.append({"type": "function_call", "id": f"fc_{prefix}_{j}", "call_id": call["id"], "name": fn["name"],
                    "arguments": fn["arguments"], "status": "completed"})
    return out
