"""A Chat Completions request, checked: what the gateway takes from the body, or a
:class:`RequestError` (answered with 400 and OpenAI's error object) naming the bad field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .messages import MessageError, digest, normalise_all, normalise_tools

#: Fields accepted and ignored: they change nothing a token-exact rollout records.
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier",
            "response_format", "frequency_penalty", "presence_penalty", "logit_bias", "modalities",
            "reasoning_effort", "prediction", "audio", "web_search_options", "function_call", "functions"}


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


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings", "stop")
    return stops


def parse_chat(body: Any) -> ChatRequest:
    """The checked request of a decoded JSON body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    n = body.get("n")
    if n not in (None, 1):
        raise RequestError(f"n={n!r} is not supported: the gateway samples one choice per request (a GRPO group "
                           "is several programs, each its own agent run); send n=1 or leave it out", "n")
    if not isinstance(body.get("model"), str):
        raise RequestError("model must be a string (the gateway serves one model; see GET /v1/models)", "model")
    try:
        messages, tools = normalise_all(body.get("messages")), normalise_tools(body.get("tools"))
    except MessageError as exc:
        raise RequestError(str(exc), "messages" if "message" in str(exc) else "tools") from None
    top = _int(body, "top_logprobs", 0)
    if top is not None and top > 20:
        raise RequestError("top_logprobs must be at most 20", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    opts = body.get("stream_options")
    return ChatRequest(
        model=body["model"], messages=messages, tools=tools, tool_choice=body.get("tool_choice"),
        stream=bool(body.get("stream")), include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        logprobs=bool(body.get("logprobs")), top_logprobs=top or 0,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
        seed=_int(body, "seed", -(2**63)), stop=_stop(body.get("stop")), max_tokens=max_tokens)
