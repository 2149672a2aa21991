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
    """Relay calls until the host hangs up, the worker dies or the worker breaks the framing."""
    pending: int | None = None  # the call the worker owes an answer to
    while True:
        ready, _, _ = select.select([host, worker], [], [])
        if worker in ready:
            head = _recv_exact(worker, HEADER.size)
            if head is None:
                return  # the worker died: the host sees EOF (a crash)
            n, seq = HEADER.unpack(head)
            if pending is None:
                return _violation(host, "the session sent a result when no call was running")
            if seq != pending:
                return _violation(host, f"the session answered call {seq} during call {pending}")
            if n > cap:
                return _violation(host, f"the session sent a {n}-byte result (at most {cap})")
            body = _recv_exact(worker, n)
            if body is None:
                return
            try:
                host.sendall(head + body)
            except OSError:
                return
            pending = None
            continue
        head = _recv_exact(host, HEADER.size)
        if head is None:
            return  # the host closed the session
        n, seq = HEADER.unpack(head)
        body = _recv_exact(host, n) if n <= MAX_REQUEST and pending is None else None
        if body is None:
            return
        pending = seq
        try:
            worker.sendall(head + body)
        except OSError:
            return
