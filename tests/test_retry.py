"""``retry_async`` (``agentenv.retry``): transient errors are retried with backoff up to the
attempt limit, others raised at once, and an unreachable service is waited for up to
``reconnect_s`` whatever the attempt limit; the unreachable service here is a real loopback
port with no listener until the test opens one."""

from __future__ import annotations

import socket
import time

import anyio
import anyio.abc
import pytest

from agentenv.retry import retry_async

pytestmark = pytest.mark.anyio


class Flaky:
    """Fails with ``errors`` in turn, then returns the number of calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    async def __call__(self, value: str) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return f"{value} after {self.calls} calls"


def transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError)  # ConnectionResetError, or a connection nobody accepts


async def test_transient_errors_are_retried_until_it_succeeds():
    fn = Flaky(ConnectionResetError("reset"), ConnectionResetError("reset"))
    assert await retry_async(fn, "ok", attempts=5, transient=transient) == "ok after 3 calls"


async def test_the_last_error_is_raised_after_the_attempts_and_others_at_once():
    last = ConnectionResetError("third")
    fn = Flaky(ConnectionResetError("first"), ConnectionResetError("second"), last, ConnectionResetError("never"))
    with pytest.raises(ConnectionResetError) as info:
        await retry_async(fn, "x", attempts=3, transient=transient)
    assert info.value is last and fn.calls == 3
    fn = Flaky(ValueError("a bug, not a network failure"))
    with pytest.raises(ValueError):
        await retry_async(fn, "x", attempts=5, transient=transient)
    assert fn.calls == 1


def held_port() -> socket.socket:
    """A loopback port this test holds (bound, not listening: a connection to it is refused),
    so that no other process on the machine, a second test run included, can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


async def test_an_unreachable_service_is_waited_for_beyond_the_attempt_limit():
    calls = []
    with held_port() as sock:
        port = sock.getsockname()[1]
        async with anyio.create_task_group() as tg:
            async def connect() -> str:
                calls.append(time.monotonic())
                if len(calls) == 4:  # the service comes up on its port while the caller is waiting for it
                    sock.listen()
                    listener = await anyio.abc.SocketListener.from_socket(sock)
                    tg.start_soon(listener.serve, lambda stream: stream.send(b"hello"))
                async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                    return (await stream.receive()).decode()

            got = await retry_async(connect, attempts=1, transient=transient, reconnect_s=60,
                                    unreachable=lambda e: isinstance(e, OSError) and "connect" in str(e))
            tg.cancel_scope.cancel()
    assert got == "hello" and len(calls) == 4
    waits = [b - a for a, b in zip(calls, calls[1:])]
    # Exponential backoff between tries: 0.2 s, then 0.4 s, then 0.8 s at least. A loaded
    # machine only adds to each wait, so each is held to its own floor, not to the one before.
    assert all(w >= floor - 0.005 for w, floor in zip(waits, (0.2, 0.4, 0.8))) and len(waits) == 3, waits


async def test_an_unreachable_service_is_given_up_on_after_reconnect_s():
    calls = []
    with held_port() as sock:
        port = sock.getsockname()[1]

        async def connect() -> None:
            calls.append(time.monotonic())
            await anyio.connect_tcp("127.0.0.1", port)

        start = time.monotonic()
        with pytest.raises(OSError):
            await retry_async(connect, attempts=1, transient=transient, reconnect_s=0.5, unreachable=transient)
    # Retried beyond the one attempt, and given up once reconnect_s had passed.
    assert len(calls) >= 2 and calls[-1] - start >= 0.5
