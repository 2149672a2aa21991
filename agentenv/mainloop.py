"""The event loop a blocking entry point runs its work in (:func:`run`: ``agentenv rollout``
and ``eval``, ``agentenv.train.train``), and the one way to stop that work from a signal
handler (:func:`interrupt`).

The CLI stops on SIGTERM as on Ctrl-C: the work's main task is cancelled and unwinds, closing
its engine and sandbox and removing a run's files that hold nothing yet. asyncio's runner does
that for Ctrl-C only where it could install its SIGINT handler, which it does not where SIGINT
was ignored when Python started: a job started with ``&`` from a script, and so many CI
runners and supervisors. Raising ``KeyboardInterrupt`` from a handler instead lands at
whatever line runs at that moment: in anyio's start of a worker thread, say, after the
thread started and before anything owned it, so that the thread is never told to stop and the
interpreter waits for it at exit for good. :func:`interrupt` therefore cancels the task
:func:`run` started, as asyncio's own handler does, whatever SIGINT's disposition.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")

_tasks: list[asyncio.Task] = []  # the main thread's running works, innermost last


def run(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)``; run from the main thread, its task is the one
    :func:`interrupt` cancels. A cancelled run raises ``CancelledError`` here."""
    import anyio

    if threading.current_thread() is not threading.main_thread():
        return anyio.run(func, *args)

    @functools.wraps(func)  # the task keeps the work's name (a hanging stop's report shows it)
    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        _tasks.append(task)
        try:
            return await func(*args)
        finally:
            _tasks.remove(task)

    return anyio.run(main)


def interrupt() -> bool:
    """Cancel the innermost work :func:`run` runs in the main thread; False when none runs.
    Made for a signal handler: it only marks the task cancelled and wakes its loop, which
    delivers the cancellation at the task's next ``await``."""
    if not _tasks or _tasks[-1].done():
        return False
    task = _tasks[-1]
    task.cancel()
    task.get_loop().call_soon_threadsafe(lambda: None)  # a loop asleep in select wakes to deliver it
    return True


__all__ = ["interrupt", "run"]
