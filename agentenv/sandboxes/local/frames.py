"""The host's reader of a session's answer frames (``protocol.py`` has the framing).

The session's code can write to the session socket, so every byte that arrives is untrusted
data. ``FrameReader.read`` never raises for what it reads: it returns the answer as a dict of
exactly the expected keys and types, ``"eof"`` when the session is gone, or a sentence saying
how the frame was wrong (the caller kills the session and reports the call as an error). A
frame numbered for one of the session's earlier calls is dropped, not refused.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Collection

import anyio
import anyio.lowlevel
from anyio.abc import SocketAttribute, SocketStream

from .protocol import HEADER, VIOLATION

VIOLATION_CAP = 4096  # bytes of a violation frame's payload
STATUSES = ("ok", "error", "timeout")
TEXT_FIELDS = ("stdout", "stderr", "value", "error")
MALFORMED = "the session sent a malformed result"


async def send_all(sock: socket.socket, data: bytes) -> None:
    """Write all of ``data`` to the non-blocking ``sock``: what its buffer takes at once, the
    rest as the peer reads. A cancellation point while it waits (the call's deadline ends it).

    Written on the raw socket, as ``FrameReader`` reads: a send of anyio's raw-socket stream
    (``UNIXSocketStream.send``, anyio 4.16) cancelled in the pass of the event loop in which
    its socket turns writable has the selector set the result of the cancelled future, and
    the event loop reports an ``InvalidStateError``. ``anyio.wait_writable`` allows for that."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await anyio.wait_writable(sock)


class FrameReader:
    """Reads one session's frames. What arrived but was not used yet stays buffered here, so a
    read cancelled part-way (the call's deadline) loses nothing: the next read, in the grace
    after the interrupt or at the next call, goes on from the same byte.

    It reads the stream's socket itself: bytes that have arrived are taken at once, and only a
    read that finds none waits (a receive through the stream first yields to the event loop
    every time, a whole pass of the loop per call). Close the channel with :meth:`aclose`,
    which wakes a read waiting on it."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self._sock = stream.extra(SocketAttribute.raw_socket, None)
        self._buf = bytearray()

    async def _receive(self, n: int) -> bytes:
        """Up to ``n`` bytes: those that have arrived, else the first to arrive."""
        sock = self._sock
        if sock is None:
            return await self.stream.receive(n)
        while True:
            try:
                data = sock.recv(n)
            except BlockingIOError:
                await anyio.wait_readable(sock)  # a cancellation point: the call's deadline ends it
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def _peek(self, n: int) -> bytes:
        """The next ``n`` bytes, left in the buffer."""
        while len(self._buf) < n:
            self._buf += await self._receive(max(n - len(self._buf), 1 << 16))
        return bytes(self._buf[:n])

    async def aclose(self) -> None:
        """Close the channel. A read waiting on it ends now, as "eof" (closing the socket alone
        would not wake it)."""
        if self._sock is not None and self._sock.fileno() >= 0:
            anyio.notify_closing(self._sock)
        await self.stream.aclose()

    async def _take(self, n: int) -> bytes:
        """The next ``n`` bytes, consumed only once all of them arrived."""
        out = await self._peek(n)
        del self._buf[:n]
        return out

    async def read(self, seq: int, cap: int, stale: Collection[int] = (), just_sent: bool = False) -> dict | str:
        """The answer to call ``seq`` (payload at most ``cap`` bytes). A frame numbered for one
        of this session's earlier calls (``stale``: an answer the host stopped waiting for, or
        the genuine answer behind one the code forged) is read and dropped: it can never be
        taken for this call's answer, and the session keeps its state. Every other number is
        refused. The caller bounds the whole read with the call's deadline.

        ``just_sent``: the call went out a moment ago, so its answer is not in yet; with nothing
        buffered, wait for the socket first rather than try a read that would find it empty."""
        try:
            if just_sent and not self._buf and self._sock is not None:
                await anyio.wait_readable(self._sock)
            while True:
                n, got = HEADER.unpack(await self._peek(HEADER.size))
                if got == VIOLATION and n <= VIOLATION_CAP:
                    return decode_violation((await self._take(HEADER.size + n))[HEADER.size:])
                if got != seq and got not in stale:
                    return f"the session answered call {got} during call {seq}"
                if n > cap:
                    return f"the session sent a {n}-byte result (at most {cap})"
                frame = await self._take(HEADER.size + n)  # all of it or (cancelled) none
                if got == seq:
                    return decode_answer(frame[HEADER.size:])
                # A stale frame dropped: a cancellation point per frame, so the call's deadline
                # ends a session that sends them without end (bytes that have arrived are taken
                # without yielding).
                await anyio.lowlevel.checkpoint()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return "eof"


async def read_frame(stream: SocketStream, seq: int, cap: int) -> dict | str:
    """The answer to call ``seq`` (payload at most ``cap`` bytes), read off ``stream``."""
    return await FrameReader(stream).read(seq, cap)


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
