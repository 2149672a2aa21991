"""Text that someone other than the template wrote, tokenized as text.

A tokenizer turns the text of its control tokens (its special tokens: ``<|im_end|>``,
``<|im_start|>``, ``<|endoftext|>``) into those tokens wherever the text occurs. A tool's output,
a task's prompt, a user's paste or a file an agent read can hold such text. Encoded inside the
chat template's markup, it would end the turn there, or open a forged one, in the context the
model sees and the trainer learns from. Only the template's own markup may be control tokens.

:class:`Literals` keeps such text what it is. :meth:`~Literals.protect` puts a marker where
each special token's text occurs in a string; the caller renders its markup around the marked
strings; :meth:`~Literals.encode` tokenizes that rendering with each marker spelt as its
special token's text in ordinary tokens (which decode to the same text). A rendering without a
marker is encoded as before, to the same ids. Tokens the tokenizer adds but does not mark
special (``<tool_call>``, ``<think>``) are the model's own words, and text holding them is
encoded as the model writes them.

Markers are letters and digits only: a template that escapes, trims or splits a message's
content (``tojson``, ``trim``, the reasoning split at ``</think>``) leaves them whole. The
process draws their stem once, which no message can guess, and a special token's marker is its
place in the tokenizer's special tokens: every :class:`Literals` of one tokenizer reads the
markers of any other (one that :func:`literals` dropped from its cache, or built in a race on
another thread, while a rendering it protected was being encoded). Pure: no I/O besides the
tokenizer.
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

#: The markers' stem: ``<stem><index>Z`` stands for the special token ``index``.
_STEM = f"AGENTENV{secrets.token_hex(8)}L"


class Literals:
    """One tokenizer's special tokens, and the markers that stand for their text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        found = {t.content for t in added.values() if getattr(t, "special", False)}
        found |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
        #: The special tokens' texts, longest first: where one is inside another, the longer is matched.
        self.specials: list[str] = sorted((s for s in found if s), key=lambda s: (-len(s), s))
        self._index = {s: i for i, s in enumerate(self.specials)}
        self._find = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self._mark = _STEM
        self._marks = re.compile(re.escape(self._mark) + r"(\d+)Z")
        self._spelt: dict[int, tuple[int, ...]] = {}
        self._anchor = self._find_anchor()

    def protect(self, text: Any) -> Any:
        """``text`` with each special token's text replaced by its marker; anything that is not
        a string is returned as it is."""
        if self._find is None or not isinstance(text, str):
            return text
        return self._find.sub(lambda m: f"{self._mark}{self._index[m.group()]}Z", text)

    def protect_value(self, value: Any) -> Any:
        """:meth:`protect` over every string inside a JSON value, keys as well as values
        (tool-call arguments, tool schemas: a template writes both as JSON text)."""
        if isinstance(value, str):
            return self.protect(value)
        if isinstance(value, list):
            return [self.protect_value(v) for v in value]
        if isinstance(value, dict):
            return {self.protect(k): self.protect_value(v) for k, v in value.items()}
        return value

    def protect_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A chat message with every string in it protected but its role: its content (a
        string, or text parts), its reasoning, its tool calls (names and arguments) and any
        name or id, since a template may write each into the text the model reads. The role
        is the markup's own choice (the template compares it, the gateway checks it)."""
        return {k: v if k == "role" else self.protect_value(v) for k, v in message.items()}

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, each marker in it as its special token's text in ordinary tokens."""
        tok = self.tokenizer
        if self._mark not in text:
            return tok.encode(text, add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for m in self._marks.finditer(text):
            if m.start() > at:
                ids.extend(self._piece(text[at:m.start()], at == 0))
            ids.extend(self.spelt(int(m.group(1))))
            at = m.end()
        if at < len(text):
            ids.extend(self._piece(text[at:], False))
        return ids

    def _piece(self, text: str, first: bool) -> list[int]:
        """The ids of the text between two markers. A tokenizer that marks a word boundary at
        the start of what it encodes (SentencePiece's ``▁``: Llama 2, Mistral) would put one
        after each marker, a space the rendering does not hold; text after a special token is
        encoded without one, so such a piece is encoded after the anchor (a special token, split
        off before anything else is tokenized) and the anchor's id dropped."""
        if first or self._anchor is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(self._anchor + text, add_special_tokens=False)[1:]

    def _find_anchor(self) -> str | None:
        """The special token a piece is encoded after; None where a piece alone is encoded as
        after a special token (byte-level BPE: Qwen, Llama 3), or no special token is one id."""
        tok = self.tokenizer
        for s in self.specials:
            ids = tok.encode(s + "a", add_special_tokens=False)
            if ids[:1] == [tok.convert_tokens_to_ids(s)]:
                return s if ids[1:] != tok.encode("a", add_special_tokens=False) else None
        return None

    def spelt(self, index: int) -> tuple[int, ...]:
        """The special token ``index``'s text in ordinary tokens: as the tokenizer spells it
        when told not to parse special tokens, else (a tokenizer without that option, or one
        that marks a word boundary at the start of what it encodes) one character at a time."""
        if index not in self._spelt:
            text, tok = self.specials[index], self.tokenizer
            special_id = tok.convert_tokens_to_ids(text)
            try:
                ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
            except TypeError:
                ids = [special_id]
            if special_id in ids or self._anchor is not None:
                ids = [i for ch in text for i in self._piece(ch, False)]
            self._spelt[index] = tuple(ids)
        return self._spelt[index]


@functools.lru_cache(maxsize=8)
def literals(tokenizer: Any) -> Literals:
    """The :class:`Literals` of ``tokenizer`` (one per tokenizer in a process)."""
    return Literals(tokenizer)


__all__ = ["Literals", "literals"]
