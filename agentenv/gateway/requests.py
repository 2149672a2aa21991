"""A request, checked: what the gateway takes from a Chat Completions or a Responses body, or
a :class:`RequestError` (answered with 400 and OpenAI's error object) naming the bad field.
Both become a :class:`ChatRequest`: the messages, tools and sampling settings a program
session serves (a Responses request's items are translated by ``agentenv.gateway.items``)."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .items import function_tools, input_messages
from .messages import MessageError, digest, normalise_all, normalise_tools

log = logging.getLogger(__name__)

#: Chat Completions fields the gateway reads.
_CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "logprobs", "top_logprobs",
                "temperature", "top_p", "seed", "stop", "max_tokens", "max_completion_tokens", "n"}
#: Responses fields the gateway reads or refuses by name.
_RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "stream", "include", "top_logprobs",
                     "temperature", "top_p", "max_output_tokens", "metadata", "parallel_tool_calls", "n",
                     "store", "previous_response_id", "conversation", "prompt", "background", "context_management"}
#: Fields accepted that change nothing the gateway does or records.
_INERT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
          "safety_identifier", "stream_options", "truncation"}
#: Fields accepted and not applied: the gateway samples from the policy as it is (a penalty
#: or a bias would make the recorded logprobs another distribution's) and constrains nothing
#: (structured output, one call per turn). A value other than the default is logged once per
#: field, so that an agent relying on one finds out.
_NOT_APPLIED = {"parallel_tool_calls", "response_format", "frequency_penalty", "presence_penalty", "logit_bias",
                "modalities", "reasoning_effort", "reasoning", "prediction", "audio", "web_search_options",
                "max_tool_calls", "verbosity", "text"}
_DEFAULTS = (None, 0, False, {}, [], {"type": "text"}, {"format": {"type": "text"}}, "auto", "disabled")
_warned: set[str] = set()


def _unused(body: dict[str, Any], read: set[str]) -> None:
    """Log, once per field in a process, a field the gateway does not apply that asks for
    something, and a field it does not know (a misspelt ``temprature`` changes nothing)."""
    for key, value in body.items():
        if key in _warned or key in _INERT or (key in read and key != "parallel_tool_calls"):
            continue
        if key in _NOT_APPLIED:
            if (value is not False if key == "parallel_tool_calls" else value in _DEFAULTS):
                continue
            log.warning("the gateway does not apply %s=%r (it samples from the policy as it is and constrains "
                        "nothing); it is accepted and ignored", key, value)
        else:
            log.warning("the gateway ignores the request field %r, which it does not know", key)
        _warned.add(key)


#: The chat API's deprecated function calling: the functions would be dropped, and the model
#: told of no tool at all.
_LEGACY = {"functions": 'send each function as a tool: tools=[{"type": "function", "function": {...}}]',
           "function_call": 'send tool_choice ("auto", "none", "required" or {"type": "function", "function": '
                            '{"name": ...}})'}


class RequestError(ValueError):
    """A request the gateway refuses (400); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def digest(self, role: str) -> str:
        """What a replay compares: the role, messages, tools and sampling settings."""
        return digest(role, self.messages, self.tools, self.tool_choice, self.temperature, self.top_p, self.seed,
                      self.stop, self.max_tokens)


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(f"{key} must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RequestError(f"{key} must be an integer >= {lo}, got {v!r}", key)
    return v


def _flag(body: dict[str, Any], key: str) -> bool:
    """A boolean field: a string such as ``"false"`` is refused, not taken as true."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {v!r}", key)
    return bool(v)


def _choice(choice: Any, names: list[str]) -> Any:
    """The chat form of ``tool_choice``, checked: ``auto``, ``none``, ``required`` or a named
    function the request offers (OpenAI refuses any other; a name not among ``tools`` could
    never be called)."""
    if choice == "required" and not names:
        raise RequestError('tool_choice "required" asks for a tool call, and the request offers no tools',
                           "tool_choice")
    if choice is None or (isinstance(choice, str) and choice in _TOOL_CHOICES):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise RequestError(f'tool_choice {choice!r} is not supported: send "auto", "none", "required" or '
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice names the function {name!r}, which tools does not offer (tools: "
                           f"{', '.join(names) or 'none'})", "tool_choice")
    return choice


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings", "stop")
    return stops


def _common(body: Any) -> None:
    """What both APIs check alike: a JSON object, one choice, a model name."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    n = body.get("n")
    if isinstance(n, bool) or n not in (None, 1):
        raise RequestError(f"n={n!r} is not supported: the gateway samples one choice per request (a GRPO group "
                           "is several programs, each its own agent run); send n=1 or leave it out", "n")
    if not isinstance(body.get("model"), str):
        raise RequestError("model must be a string (the gateway serves one model; see GET /v1/models)", "model")


def _top_p(body: dict[str, Any]) -> float | None:
    """``top_p`` in (0, 1]: 0 keeps no token, and the engines refuse it (vLLM's ValueError would
    fail the program as error:engine); greedy sampling is ``temperature: 0``."""
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be a number in (0.0, 1.0], got 0: it keeps no token to sample (for "
                           "greedy sampling send temperature 0)", "top_p")
    return top_p


def _top_logprobs(body: dict[str, Any]) -> int:
    top = _int(body, "top_logprobs", 0)
    if top is not None and top > 20:
        raise RequestError("top_logprobs must be at most 20", "top_logprobs")
    return top or 0


def parse_chat(body: Any) -> ChatRequest:
    """The checked request of a decoded Chat Completions body."""
    _common(body)
    for key, fix in _LEGACY.items():
        if body.get(key) is not None:
            raise RequestError(f"{key} (the deprecated function calling) is not supported: {fix}", key,
                               "unsupported_parameter")
    _unused(body, _CHAT_FIELDS)
    try:
        messages, tools = normalise_all(body.get("messages")), normalise_tools(body.get("tools"))
    except MessageError as exc:
        raise RequestError(str(exc), "messages" if "message" in str(exc) else "tools") from None
    top, logprobs = _top_logprobs(body), _flag(body, "logprobs")
    if top and not logprobs:
        raise RequestError(f"top_logprobs={top} needs logprobs: true", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    opts = body.get("stream_options")
    usage = opts.get("include_usage") if isinstance(opts, dict) else None
    if (opts is not None and not isinstance(opts, dict)) or (usage is not None and not isinstance(usage, bool)):
        raise RequestError(f"stream_options must be an object with include_usage true or false, got {opts!r}",
                           "stream_options")
    names = [t["function"]["name"] for t in tools]
    return ChatRequest(
        model=body["model"], messages=messages, tools=tools, tool_choice=_choice(body.get("tool_choice"), names),
        stream=_flag(body, "stream"), include_usage=bool(usage),
        logprobs=logprobs, top_logprobs=top,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_top_p(body),
        seed=_int(body, "seed", -(2**63)), stop=_stop(body.get("stop")), max_tokens=max_tokens)


# -- the Responses API -----------------------------------------------------------------------

#: Responses fields that need state the gateway does not keep (it answers each request from
#: the request alone; a program's only state is its token sequences), each with the fix.
_STATEFUL = {
    "previous_response_id": "the gateway keeps no responses; send the whole conversation as input items each call "
                            "(the Agents SDK does unless previous_response_id or auto_previous_response_id is set)",
    "conversation": "the gateway keeps no conversations; send the whole conversation as input items each call",
    "prompt": "the gateway keeps no prompt templates; send the prompt as instructions and input",
    "background": "the gateway answers each request in the call; leave background out",
    "context_management": "the gateway does no server-side compaction; leave context_management out",
}
_LOGPROBS = "message.output_text.logprobs"
_TOOL_CHOICES = ("auto", "none", "required")


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses request: the chat request it is served as, and what its answer echoes."""

    chat: ChatRequest
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    max_output_tokens: int | None
    metadata: Any
    parallel_tool_calls: bool
    text: Any


def _tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` in the chat form (a named function nests under ``function``)."""
    if choice is None or choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice {choice!r} is not supported: send auto, none, required or "
                       '{"type": "function", "name": ...} (function tools only)', "tool_choice")


def _refuse_state(body: dict[str, Any]) -> None:
    for key, fix in _STATEFUL.items():
        if body.get(key) not in (None, False):
            raise RequestError(f"{key} is not supported: {fix}", key, "unsupported_parameter")
    if body.get("store"):
        raise RequestError("store=true is not supported: the gateway stores no responses (nothing can be fetched or "
                           "continued later); send store=false or leave it out", "store", "unsupported_parameter")


def parse_responses(body: Any) -> ResponsesRequest:
    """The checked request of a decoded Responses body (``POST /v1/responses``)."""
    _common(body)
    _refuse_state(body)
    _unused(body, _RESPONSES_FIELDS)
    try:
        messages = normalise_all(input_messages(body.get("instructions"), body.get("input")))
        tools = function_tools(body.get("tools"))
    except MessageError as exc:  # its text starts with the field it names: input[3].content, tools[0], ...
        raise RequestError(str(exc), re.match(r"[\w\[\].]*", str(exc)).group().rstrip(".") or "input") from None
    include = body.get("include") or []
    if not isinstance(include, list):
        raise RequestError("include must be a list of strings", "include")
    top = _top_logprobs(body)
    max_tokens = _int(body, "max_output_tokens", 1)
    choice = _choice(_tool_choice(body.get("tool_choice")), [t["function"]["name"] for t in tools])
    chat = ChatRequest(
        model=body["model"], messages=messages, tools=tools, tool_choice=choice,
        stream=_flag(body, "stream"), include_usage=True, logprobs=_LOGPROBS in include,
        top_logprobs=top, temperature=_number(body, "temperature", 0.0, 2.0), top_p=_top_p(body),
        max_tokens=max_tokens)
    return ResponsesRequest(chat, body.get("instructions"), body.get("tools") or [], body.get("tool_choice") or "auto",
                            max_tokens, body.get("metadata"), body.get("parallel_tool_calls") is not False,
                            body.get("text") or {"format": {"type": "text"}})
