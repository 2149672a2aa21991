"""Waiting on conditions, not on the clock.

A test that needs something to have happened (a program mid-turn, a worker gone, a request
at the server) waits for that condition, checked often, under a deadline generous enough for
a machine several times slower or busier than a developer's. The deadline only bounds a hang:
a test never relies on it passing for its scenario to occur.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable, TypeVar

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
