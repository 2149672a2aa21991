"""OpenAI-shaped bodies of the gateway's answers: a chat completion, its stream of chunks
(server-sent events), and the error object. Pure: no I/O."""

from __future__ import annotations

import json
import time
from typing import Any, Iterator

from .replies import Reply


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def logprobs_body(tokenizer: Any, ids: list[int], logprobs: list[float], top: int) -> dict[str, Any]:
    """``choice.logprobs``: each sampled token's text and logprob. The engines return the
    sampled token's logprob only, so ``top_logprobs`` lists that token alone."""
    out = []
    for i, lp in zip(ids, logprobs):
        text = tokenizer.decode([i], skip_special_tokens=False)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top else []
        out.append(entry)
    return {"content": out, "refusal": None}


def _message(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.calls:
        msg["tool_calls"] = reply.openai_calls()
    return msg


def finish_reason(reply: Reply, engine_reason: str) -> str:
    if reply.calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def completion_body(cid: str, model: str, reply: Reply, reason: str, usage: dict[str, int],
                    logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": _message(reply), "logprobs": logprobs,
                         "finish_reason": finish_reason(reply, reason)}],
            "usage": usage, "system_fingerprint": None}


def stream_events(cid: str, model: str, reply: Reply, reason: str, usage: dict[str, int] | None,
                  logprobs: dict[str, Any] | None) -> Iterator[str]:
    """The completion as ``data:`` events: the role, the content, each tool call, the finish
    reason, the usage (when asked), then ``[DONE]``."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None, **extra: Any) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if reply.content:
        yield chunk({"content": reply.content}, lp=logprobs)
    for j, call in enumerate(reply.openai_calls()):
        yield chunk({"tool_calls": [{"index": j, **call}]})
    yield chunk({}, finish_reason(reply, reason))
    if usage is not None:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                "usage": usage}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"
