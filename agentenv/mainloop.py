"""The event loop a blocking entry point runs its work in (:func:`run`: ``agentenv rollout``
and ``eval``, ``agentenv.train.train``), and the one way to stop that work from a signal
handler (:func:`interrupt`).

The CLI stops on SIGTERM as on Ctrl-C: the work is cancelled and unwinds, closing its engine
and sandbox and removing a run's files that hold nothing yet. asyncio's runner does that for
Ctrl-C only where it could install its SIGINT handler, which it does not where SIGINT was
ignored when Python started: a job started with ``&`` from a script, and so many CI runners
and supervisors. Raising ``KeyboardInterrupt`` from a handler instead lands at whatever line
runs at that moment: in anyio's start of a worker thread, say, after the thread started and
before anything owned it, so that the thread is never told to stop and the interpreter waits
for it at exit for good. :func:`interrupt` raises nothing inside the loop: it asks the loop to
cancel the work's task, as asyncio's own Ctrl-C handler does (the cancellation is delivered
once, at the task's next ``await``, and its clean-up runs), and :func:`run` raises
``KeyboardInterrupt`` once the loop has closed. A stop asked for while the loop starts or
closes is kept and honoured the same way.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class _Run:
    """One :func:`run` in the main thread: whether a stop was asked for, and while the work
    runs, how to cancel it from the signal handler (on its loop, soon)."""

    def __init__(self) -> None:
        self.stop = False
        self.cancel: Callable[[], None] | None = None


_runs: list[_Run] = []  # the main thread's runs, innermost last


def run(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)``. Run from the main thread, it is what :func:`interrupt`
    stops: the work is cancelled, and this raises ``KeyboardInterrupt`` once the loop closed."""
    import anyio

    if threading.current_thread() is not threading.main_thread():
        return anyio.run(func, *args)
    this = _Run()

    @functools.wraps(func)  # the task keeps the work's name (a hanging stop's report shows it)
    async def main() -> Any:
        task = asyncio.current_task()
        assert task is not None
        this.cancel = functools.partial(task.get_loop().call_soon_threadsafe, task.cancel)
        try:
            if this.stop:  # asked for while the loop started
                return None
            return await func(*args)
        finally:
            this.cancel = None  # from here on a stop is only kept: the loop may be closing

    _runs.append(this)
    try:
        result = anyio.run(main)
    except asyncio.CancelledError:
        if not this.stop:
            raise
    finally:
        _runs.remove(this)
    if this.stop:
        raise KeyboardInterrupt  # here, in plain code after the loop closed, not at a line inside it
    return result


def interrupt() -> bool:
    """Stop the innermost work :func:`run` runs in the main thread; False when none runs.
    Made for a signal handler: it raises nothing, and only asks the loop to cancel the work
    (or, while the loop starts or closes, keeps the request for :func:`run`)."""
    if not _runs:
        return False
    this = _runs[-1]
    this.stop = True
    if this.cancel is not None:
        this.cancel()
    return True


__all__ = ["interrupt", "run"]
