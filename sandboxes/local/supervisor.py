"""The session supervisor: the only process that holds the host's end of a session.

A session is two processes. The worker runs the untrusted code; the supervisor relays one
request to it and exactly one response back, and runs no user code, so code in the worker
cannot write to the host's channel. The supervisor checks every response against the call it
answers (sequence number, size cap ``protocol.frame_cap``); a response nobody asked for, with
the wrong number or too big means the worker's code forged or broke the framing: the
supervisor tells the host (a ``VIOLATION`` frame) and exits, which kills the worker and its
whole pid namespace. The host checks all of it again.
"""

from __future__ import annotations

import json
import select
import socket

from protocol import HEADER, MAX_REQUEST, VIOLATION


class _Reader:
    """Frames from one socket, read in large chunks (one recv per small frame)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            try:
                chunk = self.sock.recv(max(65536, n - len(self.buf)))
            except InterruptedError:
                continue
            except OSError:
                return False
            if not chunk:
                return False
            self.buf += chunk
        return True

    def header(self) -> tuple[int, int] | None:
        return HEADER.unpack_from(self.buf) if self._fill(HEADER.size) else None

    def take(self, n: int) -> bytes | None:
        """The whole frame (header included) whose payload is ``n`` bytes."""
        if not self._fill(HEADER.size + n):
            return None
        frame = bytes(self.buf[:HEADER.size + n])
        del self.buf[:HEADER.size + n]
        return frame


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except InterruptedError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _violation(host: socket.socket, why: str) -> None:
    payload = json.dumps({"violation": why}).encode()
    try:
        host.sendall(HEADER.pack(len(payload), VIOLATION) + payload)
    except OSError:
        pass


def refuse(host: socket.socket, why: str) -> None:
    """The worker failed to start confined: answer the host's first call with ``why``."""
    if _recv_exact(host, HEADER.size) is not None:
        _violation(host, why)


def relay(host: socket.socket, worker: socket.socket, cap: int) -> None:
    """Relay calls until the host hangs up, the worker dies or the worker breaks the framing.
    Idle, it watches both sides (a frame from the worker then is a violation); during a call
    it waits on the worker alone (the host sends nothing until it has its answer, and kills
    the session if it gives up)."""
    from_host, from_worker = _Reader(host), _Reader(worker)
    while True:
        if not from_host.buf:
            ready, _, _ = select.select([host, worker], [], [])
            if worker in ready:
                head = from_worker.header()
                if head is None:
                    return  # the worker died: the host sees EOF (a crash)
                return _violation(host, "the session sent a result when no call was running")
        head = from_host.header()
        if head is None:
            return  # the host closed the session
        n, pending = head
        request = from_host.take(n) if n <= MAX_REQUEST else None
        if request is None:
            return
        try:
            worker.sendall(request)
        except OSError:
            return
        head = from_worker.header()
        if head is None:
            return
        n, seq = head
        if seq != pending:
            return _violation(host, f"the session answered call {seq} during call {pending}")
        if n > cap:
            return _violation(host, f"the session sent a {n}-byte result (at most {cap})")
        answer = from_worker.take(n)
        if answer is None:
            return
        try:
            host.sendall(answer)
        except OSError:
            return
        if from_worker.buf:  # more than one answer arrived for this call
            return _violation(host, "the session sent a result when no call was running")
