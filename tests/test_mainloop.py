"""A SIGTERM to the CLI stops the running work (``mainloop.interrupt``): the code it lands in
runs on to its next ``await``, the work unwinds through its clean-up, and ``mainloop.run``
raises KeyboardInterrupt once the loop has closed, whether or not SIGINT was ignored when the
process started and whenever the signal comes."""

from __future__ import annotations

import asyncio
import signal
import threading

import anyio
import pytest

from agentenv import mainloop
from agentenv.cli import _sigterm_as_ctrl_c

from .waiting import DEADLINE_S


@pytest.fixture(params=["default", "ignored"])
def sigint(request):
    """SIGINT as Python sets it, or ignored (as it is in a job started with ``&`` from a
    script: asyncio's runner then installs no Ctrl-C handler)."""
    earlier = signal.getsignal(signal.SIGINT)
    if request.param == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield request.param
    signal.signal(signal.SIGINT, earlier)


def test_sigterm_lets_the_code_it_lands_in_run_on_and_the_work_unwind(sigint):
    seen: list[str] = []

    async def work() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, between two lines of plain code
            seen.append("the line after the signal")
            await anyio.sleep(DEADLINE_S)
            seen.append("slept")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0)  # a clean-up that awaits still runs
                seen.append("cleaned up")

    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(work)
    assert seen == ["the line after the signal", "cleaned up"]


def test_a_stop_asked_for_while_the_loop_closes_waits_for_it_to_close(sigint):
    """The signal comes after the work ended, while the loop runs its last callbacks: the stop
    is kept for after the loop, and every worker thread the run started is told to stop."""
    async def work() -> None:
        # Registered before anyio's own callback that stops its worker thread, so it runs first.
        asyncio.current_task().add_done_callback(lambda _: signal.raise_signal(signal.SIGTERM))
        await anyio.to_thread.run_sync(lambda: None)

    before = set(threading.enumerate())
    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(work)
    for thread in set(threading.enumerate()) - before:
        if thread.name == "AnyIO worker thread":
            thread.join(DEADLINE_S)
            assert not thread.is_alive(), "a worker thread of the run was never told to stop"


def test_a_second_sigterm_stops_harder_and_none_outside_a_run_is_stopped(sigint):
    async def stubborn() -> None:
        with anyio.CancelScope(shield=True):  # a stop that hangs: the second signal ends it
            signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(0)
            signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(DEADLINE_S)

    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(stubborn)
    assert not mainloop.interrupt()  # no work runs now: nothing to stop
