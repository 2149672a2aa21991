"""One agent program's token sequences: which request extends which, and the ids it costs.

A request *extends* a branch of its role when its messages start with that branch's history
(the messages of the branch's last request plus the gateway's reply to it, compared
normalised, value for value as JSON: ``agentenv.gateway.messages``; the reply's ``name``, which
a framework may add, aside) and it offers the same tools. The branch's ids are then reused
exactly as sampled and spliced; only the new messages are tokenized, as the chat template
renders them after a reply: the template renders the history with a marker in place of the
last reply, once alone and once with the new messages and the generation prompt; the first
rendering must be a prefix of the second up to the marker (the template does not rewrite the
history), and what follows the marker is the glue (mask 0). A template that opens its last
message otherwise than one that others follow (Qwen3's empty think block) still extends when
the history before the reply renders as it did, the reply's opening is one the generation
prompt holds, and the reply itself is written alike, last and followed, but for that opening:
the reply's ids are the ones sampled after that prompt. The reply's own end of turn is
not repeated when the model sampled it.

Any other request (history truncated, summarised, a swapped system prompt, a sub-agent's fresh
context, other tools) starts a new branch from its messages rendered whole. A branch is one
token sequence: loss mask 1 exactly on the sampled ids. Pure: no I/O besides the tokenizer.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from ..literals import literals
from ..trajectory import Segment
from .messages import MessageError, for_template, same


@dataclass(slots=True)
class Branch:
    """One token sequence of a program, sampled by one role."""

    index: int
    role: str
    prompt_ids: list[int]
    tools: list[dict[str, Any]]
    segments: list[Segment] = field(default_factory=list)
    #: Normalised messages: the last request's and the gateway's reply to it.
    history: list[dict[str, Any]] = field(default_factory=list)
    ended_with_eos: bool = False
    calls: int = 0

    @property
    def ids(self) -> list[int]:
        out = list(self.prompt_ids)
        for s in self.segments:
            out.extend(s.token_ids)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "prompt_ids": list(self.prompt_ids),
            "segments": [s.to_dict() for s in self.segments],
            "calls": self.calls,
        }


@dataclass(slots=True)
class Plan:
    """What one request costs before the engine runs it: the branch it extends (None: a new
    one), the glue ids spliced after that branch's last reply, and the whole input."""

    role: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    extends: Branch | None
    glue: list[int]
    input_ids: list[int]


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
           generation_prompt: bool) -> str:
    """The chat template's text for ``messages`` and ``tools``, the special tokens' text in them
    marked (``agentenv.literals``: :func:`encode` spells it as text, never as control tokens)."""
    lit = literals(tokenizer)
    try:
        return tokenizer.apply_chat_template([lit.protect_message(for_template(m)) for m in messages],
                                             tools=lit.protect_value(tools) or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template that cannot take the messages is the client's 400
        raise MessageError(f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}")


def encode(tokenizer: Any, text: str) -> list[int]:
    """The ids of a :func:`render`'s text (or a part of it)."""
    return literals(tokenizer).encode(text)


def glue_text(tokenizer: Any, history: list[dict[str, Any]], new: list[dict[str, Any]],
              tools: list[dict[str, Any]], ended_with_eos: bool) -> str | None:
    """The template's text between the last reply of ``history`` and the next reply (None when
    the template renders the history differently once ``new`` follows it)."""
    # A marker no message can hold: one of fixed text, sent in a message, would be found
    # there first and the glue cut at the wrong place.
    mark = f"\x00AGENTENV-REPLY-{secrets.token_hex(16)}\x00"
    before = history[:-1]
    marked = before + [{"role": "assistant", "content": mark}]
    try:
        alone = render(tokenizer, marked, tools, generation_prompt=False)
        more = render(tokenizer, marked + new, tools, generation_prompt=True)
    except MessageError:  # e.g. a template that checks each tool result against a call: a new branch
        return None
    cut, at = alone.find(mark), more.find(mark)
    if cut < 0 or at < 0:
        return None
    tail = more[at + len(mark):]
    if not more.startswith(alone[: cut + len(mark)]) and not (
            _opens_alike(tokenizer, before, tools, more[:at])
            and _writes_the_reply_alike(tokenizer, history, new, tools, alone[:cut], more[:at], tail)):
        return None
    eos = getattr(tokenizer, "eos_token", None)
    if ended_with_eos and eos and tail.startswith(eos):
        tail = tail[len(eos):]
    return tail


def _opens_alike(tokenizer: Any, before: list[dict[str, Any]], tools: list[dict[str, Any]], head: str) -> bool:
    """Whether ``head``, a rendering's text up to the last reply's content once messages follow
    it, is the history before that reply as the template wrote it when the reply was asked
    for, then an opening of the reply that the generation prompt holds. A template may open
    its last message otherwise (Qwen3 writes an empty think block only into a last assistant
    message): the reply's ids are the ones sampled after that prompt either way."""
    try:
        written = render(tokenizer, before, tools, generation_prompt=False)
        prompt = render(tokenizer, before, tools, generation_prompt=True)
    except MessageError:
        return False
    return (head.startswith(written) and prompt.startswith(written)
            and prompt[len(written):].startswith(head[len(written):]))


def _writes_the_reply_alike(tokenizer: Any, history: list[dict[str, Any]], new: list[dict[str, Any]],
                            tools: list[dict[str, Any]], opens_last: str, opens_followed: str, tail: str) -> bool:
    """Whether the template writes the reply itself (not a marker) the same once ``new``
    follows it as it does when it is last, but for what it writes into the opening of any last
    message (``opens_last`` against ``opens_followed``: the renderings up to a marker's place).
    So an empty think block the template leaves out of a followed message passes, and the
    reasoning it drops from a turn before the last user message (Qwen3) does not: the branch
    holds the reply as sampled, which the model would then see and the template would not."""
    try:
        last = render(tokenizer, history, tools, generation_prompt=False)
        followed = render(tokenizer, history + new, tools, generation_prompt=True)
    except MessageError:
        return False
    if not (followed.endswith(tail) and followed.startswith(opens_followed) and opens_last.startswith(opens_followed)):
        return False
    reply = followed[len(opens_followed): len(followed) - len(tail)]  # the reply, as written once followed
    return last.startswith(opens_followed + reply) or last.startswith(opens_last + reply)


def continues(sent: list[dict[str, Any]], history: list[dict[str, Any]]) -> bool:
    """Whether a request's first messages ``sent`` are a branch's ``history``, whose last
    message is the gateway's own reply. A framework may name that reply as it keeps it
    (LangGraph's named agents set the assistant message's ``name``); the reply's ids are the
    ones the model sampled whatever it is named, so its ``name`` is not compared."""
    *before, reply = sent
    if reply.get("role") == "assistant" and "name" in reply:
        reply = {k: v for k, v in reply.items() if k != "name"}
    return same(reply, history[-1]) and same(before, history[:-1])


class Branches:
    """A program's branches, by role, and the extend-or-branch decision for each request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.all: list[Branch] = []
        self.extended = self.branched = 0

    def plan(self, role: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Plan:
        tok = self.tokenizer
        for b in reversed(self.all):
            n = len(b.history)
            if (b.role != role or len(messages) <= n or not same(tools, b.tools)
                    or not continues(messages[:n], b.history)):
                continue
            text = glue_text(tok, b.history, messages[n:], tools, b.ended_with_eos)
            if text is None:
                continue
            glue = encode(tok, text)
            return Plan(role, messages, tools, b, glue, b.ids + glue)
        text = render(tok, messages, tools, generation_prompt=True)
        return Plan(role, messages, tools, None, [], encode(tok, text))

    def record(self, plan: Plan, token_ids: list[int], logprobs: list[float], versions: list[int],
               reply: dict[str, Any], ended_with_eos: bool) -> Branch | None:
        """The engine sampled ``token_ids`` for ``plan``: extend its branch or start one. A
        request that would start a branch and has nothing sampled (the program's token budget
        or call limit spent, or the engine's request aborted) starts none: it would be a row
        with no token to train on."""
        b = plan.extends
        if b is None and not token_ids:
            return None
        if b is None:
            b = Branch(len(self.all), plan.role, list(plan.input_ids), plan.tools)
            self.all.append(b)
            self.branched += 1
        else:
            self.extended += 1
            if plan.glue:
                b.segments.append(Segment("env", list(plan.glue)))
        if token_ids:
            b.segments.append(Segment("model", list(token_ids), list(logprobs), list(versions)))
        b.history = plan.messages + [reply]
        b.ended_with_eos = ended_with_eos
        b.calls += 1
        return b
