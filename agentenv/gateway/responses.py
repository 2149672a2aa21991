"""OpenAI-shaped bodies of the gateway's answers: a chat completion and its stream of chunks,
a Responses API response and its stream of events (server-sent events both), and the error
object. Pure: no I/O."""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from typing import Any, Callable, Iterator

from .items import output_items
from .replies import Reply
from .requests import ResponsesRequest


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@functools.lru_cache(maxsize=1)
def _unbyte() -> dict[str, int]:
    """A byte-level BPE vocabulary's characters back to the bytes they stand for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoders(node: Any) -> set[str]:
    """The types of a tokenizer.json ``decoder`` and of the decoders a sequence of them holds."""
    if not isinstance(node, dict):
        return set()
    kinds = {node.get("type")}
    for child in node.get("decoders") or ():
        kinds |= _decoders(child)
    if node.get("type") == "Replace" and (node.get("pattern") or {}).get("String") == "\u2581":
        kinds.add("Metaspace")
    return kinds


@functools.lru_cache(maxsize=8)
def _spelling(tokenizer: Any) -> tuple[set[str], frozenset[int]]:
    """How ``tokenizer`` spells bytes in its pieces (its decoders' types), and its added ids,
    which are written as they read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kinds = _decoders(json.loads(backend.to_str()).get("decoder")) if backend is not None else set()
    return kinds, frozenset(tokenizer.get_added_vocab().values())


def token_bytes(tokenizer: Any, ids: list[int]) -> list[bytes]:
    """Each token's own bytes, which join into the text's UTF-8 however a character is split
    among tokens: through the byte-level alphabet (GPT-2, Qwen, Llama 3), or a SentencePiece
    piece (``▁`` a space, ``<0xE6>`` a byte); decoded alone where neither applies."""
    kinds, added = _spelling(tokenizer)
    unbyte = _unbyte()
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if isinstance(piece, str) and "ByteFallback" in kinds and _BYTE_PIECE.fullmatch(piece):
            out.append(bytes([int(piece[3:5], 16)]))
        elif not isinstance(piece, str) or i in added:
            out.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
        elif "ByteLevel" in kinds and all(c in unbyte for c in piece):
            out.append(bytes(unbyte[c] for c in piece))
        elif "Metaspace" in kinds:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
        else:
            out.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out


def logprobs_body(tokenizer: Any, ids: list[int], logprobs: list[float], top: int) -> dict[str, Any]:
    """``choice.logprobs``: each sampled token's text, bytes and logprob; the bytes of all the
    tokens join into the reply's UTF-8 (a character split among tokens is U+FFFD in each one's
    text, as OpenAI's are). The engines return the sampled token's logprob only, so
    ``top_logprobs`` lists that token alone."""
    out = []
    for i, lp, raw in zip(ids, logprobs, token_bytes(tokenizer, ids)):
        entry = {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}
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

    # The logprobs of every sampled token (as ``choice.logprobs`` of a completion) ride on the
    # first chunk that carries the reply: its content, else its first call, else the last.
    lp = [logprobs]
    yield chunk({"role": "assistant", "content": ""})
    if reply.content:
        yield chunk({"content": reply.content}, lp=lp.pop())
    for j, call in enumerate(reply.openai_calls()):
        yield chunk({"tool_calls": [{"index": j, **call}]}, lp=lp.pop() if lp else None)
    yield chunk({}, finish_reason(reply, reason), lp=lp.pop() if lp else None)
    if usage is not None:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                "usage": usage}
        yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


# -- the Responses API -----------------------------------------------------------------------

def response_body(rid: str, model: str, req: ResponsesRequest, reply: Reply, reason: str, usage: dict[str, int],
                  cached: int, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A ``response`` object. A reply cut short (``max_output_tokens``, the program's token
    budget or call limit) is ``incomplete`` with reason ``max_output_tokens``, as OpenAI
    answers one; a reply that parsed into calls is complete (the calls are whole)."""
    cut = finish_reason(reply, reason) == "length"
    status = "incomplete" if cut else "completed"
    now = int(time.time())
    return {
        "id": rid, "object": "response", "created_at": now, "completed_at": None if cut else now, "status": status,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output_items(reply, rid.removeprefix("resp_"), status, logprobs),
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "background": False,
        "temperature": req.chat.temperature, "top_p": req.chat.top_p, "top_logprobs": req.chat.top_logprobs,
        "text": req.text, "tool_choice": req.tool_choice, "tools": req.tools, "truncation": "disabled",
        "metadata": req.metadata or {}, "user": None,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]}}


def response_events(body: dict[str, Any]) -> Iterator[str]:
    """``body`` (a finished response) as the Responses stream: ``response.created`` and
    ``response.in_progress`` (no output yet), each output item added, its content or
    arguments in one delta, done, then ``response.completed`` (or ``response.incomplete``)
    with ``body`` itself. Every event is ``event: <type>`` + ``data: {"type", "sequence_number", ...}``."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    start = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
             "completed_at": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for i, item in enumerate(body["output"]):
        yield from (_message_events if item["type"] == "message" else _call_events)(event, i, item)
    yield event(f"response.{body['status']}", response=body)


def _message_events(event: Callable[..., str], i: int, item: dict[str, Any]) -> Iterator[str]:
    part = item["content"][0]
    at = {"item_id": item["id"], "output_index": i, "content_index": 0}
    yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
    yield event("response.content_part.added", **at, part={**part, "text": "", "logprobs": []})
    lp = part.get("logprobs") or []
    yield event("response.output_text.delta", **at, delta=part["text"], logprobs=lp)
    yield event("response.output_text.done", **at, text=part["text"], logprobs=lp)
    yield event("response.content_part.done", **at, part=part)
    yield event("response.output_item.done", output_index=i, item=item)


def _call_events(event: Callable[..., str], i: int, item: dict[str, Any]) -> Iterator[str]:
    at = {"item_id": item["id"], "output_index": i}
    yield event("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""})
    yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
    yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=i, item=item)
