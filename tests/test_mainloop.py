"""A SIGTERM to the CLI cancels the running work's main task (``mainloop.interrupt``): the
code it interrupts runs on to its next ``await``, and the work unwinds through its clean-up,
whether or not SIGINT was ignored when the process started."""

from __future__ import annotations

import asyncio
import signal

import anyio
import pytest

from agentenv import mainloop
from agentenv.cli import _sigterm_as_ctrl_c


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
            await anyio.sleep(60)
            seen.append("slept")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0)  # a clean-up that awaits still runs
                seen.append("cleaned up")

    with _sigterm_as_ctrl_c(), pytest.raises(asyncio.CancelledError):
        mainloop.run(work)
    assert seen == ["the line after the signal", "cleaned up"]


def test_a_second_sigterm_stops_harder_and_none_outside_a_run_is_cancelled(sigint):
    async def stubborn() -> None:
        signal.raise_signal(signal.SIGTERM)
        try:
            await anyio.sleep(60)
        except asyncio.CancelledError:  # a stop that hangs: the second signal ends it
            signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(60)

    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(stubborn)
    assert not mainloop.interrupt()  # no work runs now: nothing to cancel
