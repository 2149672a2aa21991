"""The host's channel to one fork server (``forkserver.py``): JSON requests, with file
descriptors alongside (SCM_RIGHTS), on a SOCK_SEQPACKET socket, served on the event loop."""

from __future__ import annotations

import json
import os
import socket
from collections import deque

import anyio

from agentenv.errors import SandboxError

#: How long a request to a fork server may wait for its answer (a start takes milliseconds;
#: queued behind others on a loaded host, well under a second).
CONTROL_TIMEOUT = 30.0


class _ServerGone(SandboxError):
    """A fork server died (killed, crashed): the pool starts a new one."""


class _Answer:
    __slots__ = ("msg", "fds", "done", "abandoned")

    def __init__(self) -> None:
        self.msg, self.fds, self.done, self.abandoned = b"", [], False, False


class _Control:
    """A request/response channel to one fork server, served on the event loop.

    Requests are pipelined: each is sent at once, and the server answers them in order, so
    it never idles while the host gets round to sending the next one. (The channel used a
    worker thread per request, one request at a time: a busy event loop, e.g. one handling
    an engine's outputs, left the server waiting between starts, and each hand-off of the
    GIL cost milliseconds.) Whoever holds ``_reading`` reads one answer and hands it to the
    oldest request; a request whose caller was cancelled has its answer read and dropped
    (its file descriptors closed) all the same."""

    def __init__(self, sock: socket.socket, timeout: float = CONTROL_TIMEOUT) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.timeout = timeout  # how long a request may wait for its answer, queueing included
        self.pending = 0  # requests not answered yet
        self._answers: deque[_Answer] = deque()  # sent, in order
        # Free locks are taken without a pass through the event loop (a request waits on the
        # server soon enough); taken ones queue their waiters in order, as before.
        self._sending = anyio.Lock(fast_acquire=True)
        self._reading = anyio.Lock(fast_acquire=True)

    async def request(self, req: dict, fds: list[int] = (), timeout: float | None = None  # type: ignore[assignment]
                      ) -> tuple[dict, list[int]]:
        """The server's answer to ``req``. A server that takes longer than ``timeout``
        (default :attr:`timeout`) to take the request or answer it is stuck: the channel is
        closed, so this request and every other waiting on it end with ``_ServerGone``, and
        the pool replaces the server as it would a dead one."""
        data = json.dumps(req).encode()
        mine = _Answer()
        limit = self.timeout if timeout is None else timeout
        self.pending += 1
        try:
            with anyio.move_on_after(limit) as deadline:
                async with self._sending:
                    while True:
                        try:
                            socket.send_fds(self.sock, [data], list(fds))
                            break
                        except BlockingIOError:
                            await anyio.wait_writable(self.sock)
                    self._answers.append(mine)
                while not mine.done:
                    async with self._reading:
                        if not mine.done:
                            await self._read_one()
        except (OSError, anyio.ClosedResourceError) as exc:
            raise _ServerGone(f"the sandbox fork server is gone: {exc!r}") from exc
        except BaseException:
            self._abandon(mine)
            raise
        finally:
            self.pending -= 1
        if deadline.cancelled_caught and not mine.done:
            self._abandon(mine)
            self.close()
            raise _ServerGone(f"the sandbox fork server did not answer within {limit:g}s; its channel was closed")
        if not mine.msg:
            raise _ServerGone("the sandbox fork server is gone")
        return json.loads(mine.msg), mine.fds

    @staticmethod
    def _abandon(mine: _Answer) -> None:
        """Its caller stopped waiting: the answer, when it comes, is read and dropped."""
        mine.abandoned = True
        for fd in mine.fds:
            os.close(fd)
        mine.fds = []

    async def _read_one(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
                break
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
        for fd in fds:  # received without MSG_CMSG_CLOEXEC: no child of the host may inherit them
            os.set_inheritable(fd, False)
        if not msg:  # the server is gone: every request still waiting learns it
            for a in self._answers:
                a.done = True
            self._answers.clear()
            return
        answer = self._answers.popleft()
        if answer.abandoned:
            for fd in fds:
                os.close(fd)
        answer.msg, answer.fds, answer.done = msg, fds, True

    def close(self) -> None:
        """Close the channel. Every request still waiting on it ends with ``_ServerGone`` (a
        start waits inside a shielded scope: a waiter left on a closed socket would never
        wake, and the start would hang for good)."""
        for a in self._answers:
            a.done = True  # no message: the server is gone
        self._answers.clear()
        if self.sock.fileno() >= 0:
            anyio.notify_closing(self.sock)  # the task reading it raises ClosedResourceError
        try:
            self.sock.close()
        except OSError:
            pass
