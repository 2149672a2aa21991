"""Per-token text: the string each token id of a trajectory contributes, for the viewer.

A trajectory keeps token ids, not text (``text`` is the whole completion). To show which tokens
were sampled and which were inserted, the viewer needs each token's own piece of text, such
that the pieces joined are the decoded sequence. :class:`TokenText` loads a run's tokenizer
(``tokenizer.json`` through the ``tokenizers`` library; no transformers import) and, for a
byte-level BPE vocabulary (GPT-2, Qwen, Llama 3 and the bundled model), maps each token to its
bytes and decodes the bytes of the sequence incrementally: a character split over several
tokens belongs to the token that completes it. Other vocabularies decode token by token.
"""

from __future__ import annotations

import codecs
import functools
import threading
from pathlib import Path
from typing import Any, Sequence

from ..models import default_model


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def tokenizer_dir(model: str | Path | None) -> tuple[Path, bool]:
    """Where to read the tokenizer of a run made with ``model``: that directory when it holds
    a ``tokenizer.json``, else the bundled model's; and whether it is the run's own."""
    if model:
        path = Path(model)
        if (path / "tokenizer.json").is_file():
            return path, True
    return default_model(), False


class TokenText:
    """The text pieces of token ids under one tokenizer (``model_dir/tokenizer.json``),
    loaded on first use. Thread-safe: the viewer's server answers requests in threads."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._tok: Any = None
        self._bytes: dict[int, bytes | str] = {}  # a token's bytes, or an added token's text
        self._byte_level = False

    def _load(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
            self._byte_level = type(tok.decoder).__name__ == "ByteLevel"
            self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
            self._tok = tok
        return self._tok

    def _token_bytes(self, tid: int) -> bytes | str:
        got = self._bytes.get(tid)
        if got is None:
            if tid in self._added:
                got = self._added[tid]
            else:
                piece = self._tok.id_to_token(tid)
                table = _byte_of_char()
                got = bytes(table[c] for c in piece) if piece is not None and all(c in table for c in piece) \
                    else (piece or "")
            self._bytes[tid] = got
        return got

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per id; joined, they are the decoded sequence (special tokens shown)."""
        with self._lock:
            tok = self._load()
            if not self._byte_level:
                return [tok.decode([i], skip_special_tokens=False) for i in ids]
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            out = []
            for tid in ids:
                raw = self._token_bytes(int(tid))
                if isinstance(raw, str):  # an added token: its text, after what was pending
                    out.append(decoder.decode(b"", final=True) + raw)
                    decoder.reset()
                else:
                    out.append(decoder.decode(raw))
            if out:
                out[-1] += decoder.decode(b"", final=True)
            return out


__all__ = ["TokenText", "tokenizer_dir"]
