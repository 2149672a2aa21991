"""Waiting on conditions, not on the clock.

A test that needs something to have happened (a program mid-turn, a worker gone, a request
at the server) waits for that condition, checked often, under a deadline generous enough for
a machine several times slower or busier than a developer's. The deadline only bounds a hang:
a test never relies on it passing for its scenario to occur.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any, Awaitable, Callable, TypeVar

import anyio

# Generous: CI machines of one kind differ up to 4x in speed, and may be busy.
DEADLINE_S = 180.0

T = TypeVar("T")


def wait_for(condition: Callable[[], object], what: str, *, timeout: float = DEADLINE_S,
             interval: float = 0.02, unless: Callable[[], object] | None = None) -> object:
    """Block until ``condition()`` is truthy and return its value. ``unless()`` truthy first
    (say, the process under test exited) returns None at once. AssertionError naming ``what``
    once ``timeout`` has passed."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if unless is not None and unless():
            return None
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def ended(proc: subprocess.Popen, what: str, *, timeout: float = DEADLINE_S) -> tuple[Any, Any]:
    """``proc.communicate()`` for a process that must end by itself (stopped by a signal, or
    its work done). Past ``timeout`` it is killed and an AssertionError naming ``what`` carries
    the end of its stderr: a command still stopping a while after SIGTERM writes there which
    threads and tasks it waits on (``AGENTENV_STOPPING_REPORT_S``), and that is what a hang's
    report needs."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        tail = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
        raise AssertionError(f"not within {timeout:.0f} s: {what}; its stderr ends:\n{tail[-12000:]}") from None


async def until(condition: Callable[[], object], what: str, *, timeout: float = DEADLINE_S,
                interval: float = 0.01) -> object:
    """The async form of :func:`wait_for`: other tasks run while it waits."""
    with anyio.move_on_after(timeout) as scope:
        while not (value := condition()):
            await anyio.sleep(interval)
        return value
    assert not scope.cancelled_caught, f"not within {timeout:.0f} s: {what}"


async def until_ok(call: Callable[[], Awaitable[T]], errors: type[BaseException] | tuple, what: str, *,
                   timeout: float = DEADLINE_S, interval: float = 0.1) -> T:
    """Await ``call()`` until it returns instead of raising one of ``errors`` (a restarting
    actor, a server coming up) and return what it returned."""
    with anyio.move_on_after(timeout):
        while True:
            try:
                return await call()
            except errors:
                await anyio.sleep(interval)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")
