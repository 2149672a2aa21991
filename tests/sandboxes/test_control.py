"""The host's channel to a fork server (``control.py``), against a real SOCK_SEQPACKET socket
whose far end this test serves: pipelined requests answered in order, file descriptors passed
alongside, answers of callers that gave up dropped, and every way the server can be gone."""

from __future__ import annotations

import json
import os
import socket
import time

import anyio
import pytest

from agentenv.sandboxes.local.control import _Control, _ServerGone

from ..waiting import DEADLINE_S, until

pytestmark = pytest.mark.anyio


def channel(timeout: float = DEADLINE_S) -> tuple[_Control, socket.socket]:
    """A channel and the far end of its socket (the "server", blocking)."""
    host, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return _Control(host, timeout=timeout), server


def take(server: socket.socket) -> dict:
    """The next request the far end receives (its descriptors closed)."""
    msg, fds, _, _ = socket.recv_fds(server, 1 << 16, 4)
    for fd in fds:
        os.close(fd)
    return json.loads(msg)


def answer_with_pipe(server: socket.socket, n: int) -> int:
    """Answer ``{"n": n}`` with the write end of a new pipe; returns its read end."""
    r, w = os.pipe()
    socket.send_fds(server, [json.dumps({"n": n}).encode()], [w])
    os.close(w)
    return r


async def test_pipelined_requests_get_their_own_answers_in_order_with_their_descriptors():
    ctl, server = channel()
    got: dict[int, tuple[dict, list[int]]] = {}

    async def ask(n: int) -> None:
        got[n] = await ctl.request({"n": n})

    try:
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                for n in range(3):
                    tg.start_soon(ask, n)
                    await until(lambda: ctl.pending == n + 1, f"request {n} sent")
                # All three are on the wire before the first answer: sent at once, not in turn.
                sent = [await anyio.to_thread.run_sync(take, server) for _ in range(3)]
                assert sent == [{"n": 0}, {"n": 1}, {"n": 2}]
                ends = [await anyio.to_thread.run_sync(answer_with_pipe, server, n) for n in range(3)]
        for n in range(3):
            msg, fds = got[n]
            assert msg == {"n": n} and len(fds) == 1
            assert not os.get_inheritable(fds[0])  # no child the host starts may inherit it
            os.write(fds[0], str(n).encode())  # the descriptor is the pipe sent with this answer
            os.close(fds[0])
            assert os.read(ends[n], 8) == str(n).encode()
            os.close(ends[n])
        assert ctl.pending == 0
    finally:
        ctl.close()
        server.close()


async def test_the_answer_to_a_request_whose_caller_gave_up_is_dropped_with_its_descriptors():
    ctl, server = channel()
    try:
        with anyio.fail_after(DEADLINE_S):
            with anyio.move_on_after(0.2) as scope:  # the caller stops waiting
                await ctl.request({"n": 0})
            assert scope.cancelled_caught and ctl.pending == 0
            later: list[tuple[dict, list[int]]] = []
            async with anyio.create_task_group() as tg:

                async def ask() -> None:
                    later.append(await ctl.request({"n": 1}))

                tg.start_soon(ask)
                assert [await anyio.to_thread.run_sync(take, server) for _ in range(2)] == [{"n": 0}, {"n": 1}]
                dropped = await anyio.to_thread.run_sync(answer_with_pipe, server, 0)
                kept = await anyio.to_thread.run_sync(answer_with_pipe, server, 1)
        (msg, fds), = later
        assert msg == {"n": 1} and len(fds) == 1  # its own answer, not the abandoned one
        # The abandoned answer's descriptor was closed on arrival: its pipe's only writer is
        # gone, so its read end is at EOF. The kept one's is still open.
        for end in (dropped, kept):
            os.set_blocking(end, False)
        assert os.read(dropped, 1) == b""
        with pytest.raises(BlockingIOError):
            os.read(kept, 1)
        for fd in (dropped, kept, *fds):
            os.close(fd)
    finally:
        ctl.close()
        server.close()


async def test_a_server_that_closes_its_end_fails_every_waiting_request():
    ctl, server = channel()
    errors: list[str] = []

    async def ask() -> None:
        with pytest.raises(_ServerGone) as exc:
            await ctl.request({"op": "spawn"})
        errors.append(str(exc.value))

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(ask)
            await until(lambda: ctl.pending == 2 and len(ctl._answers) == 2, "both sent")
            server.close()  # the fork server died
    # Unread requests left on its end: the host's read fails (ECONNRESET) or sees the end.
    assert len(errors) == 2 and all(e.startswith("the sandbox fork server is gone") for e in errors), errors
    with pytest.raises(_ServerGone):  # and a request after it learns it too
        with anyio.fail_after(DEADLINE_S):
            await ctl.request({"op": "spawn"})
    ctl.close()


async def test_closing_a_channel_ends_the_requests_waiting_on_it():
    """The pool closes a fork server's channel when it replaces the server (its base server
    died): a start waiting there for an answer, inside the start's shielded scope, must end
    at once (and be retried on the new server), not wait for an answer that never comes."""
    host, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ctl = _Control(host)
    errors: list[BaseException] = []

    async def ask() -> None:
        try:
            await ctl.request({"op": "spawn"})
        except _ServerGone as exc:
            errors.append(exc)

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            for _ in range(3):  # one reading the socket, two waiting for their turn to read
                tg.start_soon(ask)
            await until(lambda: ctl.pending >= 3 and len(ctl._answers) >= 3, "all three sent, none answered")
            await anyio.sleep(0.05)
            ctl.close()
    assert len(errors) == 3
    server.close()


async def test_a_fork_server_that_does_not_answer_fails_the_request_in_bounded_time():
    # A real SOCK_SEQPACKET channel whose far end takes requests and never answers.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ctl = _Control(mine, timeout=0.5)
    failed: list[tuple[float, str]] = []

    async def ask() -> None:
        start = time.perf_counter()
        with pytest.raises(_ServerGone) as exc:
            await ctl.request({"op": "spawn"})
        failed.append((time.perf_counter() - start, str(exc.value)))

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(3):  # pipelined: every waiter learns it
                    tg.start_soon(ask)
        assert len(failed) == 3 and max(t for t, _ in failed) < 3, failed
        # the first to reach its deadline closes the channel; the others learn it at once
        assert any("did not answer within 0.5s" in why for _, why in failed), failed
        assert ctl.sock.fileno() == -1  # the stuck channel is closed
    finally:
        theirs.close()
