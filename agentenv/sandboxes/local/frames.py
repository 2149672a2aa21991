"""The host's reader of a session's answer frames (``protocol.py`` has the framing).

The session's code can write to the session socket, so every byte that arrives is untrusted
data. ``read_frame`` never raises for what it reads: it returns the answer as a dict of
exactly the expected keys and types, ``"eof"`` when the session is gone, or a sentence saying
how the frame was wrong (the caller kills the session and reports the call as an error).
"""

from __future__ import annotations

import json

import anyio
from anyio.abc import SocketStream

from .protocol import HEADER, VIOLATION

VIOLATION_CAP = 4096  # bytes of a violation frame's payload
STATUSES = ("ok", "error", "timeout")
TEXT_FIELDS = ("stdout", "stderr", "value", "error")
MALFORMED = "the session sent a malformed result"


async def _read_exact(stream: SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        buf += await stream.receive(n - len(buf))
    return bytes(buf)


async def read_frame(stream: SocketStream, seq: int, cap: int) -> dict | str:
    """The answer to call ``seq`` (payload at most ``cap`` bytes)."""
    try:
        n, got = HEADER.unpack(await _read_exact(stream, HEADER.size))
        if got == VIOLATION and n <= VIOLATION_CAP:
            return decode_violation(await _read_exact(stream, n))
        if got != seq:
            return f"the session answered call {got} during call {seq}"
        if n > cap:
            return f"the session sent a {n}-byte result (at most {cap})"
        payload = await _read_exact(stream, n)
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        return "eof"
    return decode_answer(payload)


def _parse(payload: bytes) -> object:
    """JSON, or None for anything that is not: bad bytes or encodings, and nesting deep
    enough to exhaust the parser's recursion (``RecursionError``, not a ``ValueError``)."""
    try:
        return json.loads(payload)
    except Exception:  # noqa: BLE001 - whatever the parser makes of hostile bytes is "malformed"
        return None


def decode_answer(payload: bytes) -> dict | str:
    """A checked answer: a dict with a known status, text fields that are strings or None,
    and a bool ``truncated``; otherwise the reason it is malformed."""
    resp = _parse(payload)
    if not isinstance(resp, dict):
        return MALFORMED
    status = resp.get("status")
    if not isinstance(status, str) or status not in STATUSES:
        return MALFORMED
    out: dict = {"status": status}
    for key in TEXT_FIELDS:
        value = resp.get(key)
        if value is not None and not isinstance(value, str):
            return MALFORMED
        out[key] = value
    truncated = resp.get("truncated", False)
    if not isinstance(truncated, (bool, type(None))):
        return MALFORMED
    out["truncated"] = bool(truncated)
    return out


def decode_violation(payload: bytes) -> str:
    """Why the session says it is unusable (e.g. it could not confine itself)."""
    why = _parse(payload)
    if isinstance(why, dict) and isinstance(why.get("violation"), str):
        return why["violation"][:300]
    return "the session sent a malformed violation frame"
