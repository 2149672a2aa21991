"""Sessions and the per-setup session pool on a real fork-server pool: real workers, real
calls; the pool reaches the workers only through the fork-server pool's interface."""

from __future__ import annotations

import socket

import anyio
import psutil
import pytest
from anyio.abc import SocketAttribute

from agentenv.errors import SandboxError
from agentenv.sandboxes.local.sessions import CallSettings, LocalSession, _SessionPool

from ..waiting import DEADLINE_S, until
from .pools import fork_servers, gone

pytestmark = pytest.mark.anyio


async def test_a_session_on_its_own_starts_runs_and_closes_once():
    closed: list[LocalSession] = []
    async with fork_servers() as servers:
        s = LocalSession(servers, CallSettings(timeout=30.0), "BASE = 40", on_close=closed.append)
        assert s.pid is None and servers.starts == 0
        await s.start()
        await s.start()  # started already: no second worker
        pid = s.pid
        assert servers.starts == 1 and pid is not None
        r = await s.run("BASE + 2")
        assert (r.status, r.value, r.state_lost) == ("ok", "42", False)  # started before: nothing lost
        await s.aclose()
        await s.aclose()
        assert closed == [s] and s.pid is None
        await until(lambda: gone(pid), "the closed session's worker exited")
        with pytest.raises(SandboxError, match="closed"):
            await s.run("1")


async def test_a_call_under_way_is_busy_and_closing_the_session_ends_it():
    async with fork_servers() as servers:
        pool = _SessionPool(servers, CallSettings(timeout=DEADLINE_S), max_workers=4, prewarm=0)
        s = await pool.take(None)
        results = []

        async def call() -> None:
            results.append(await s.run("while True:\n    pass"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await until(lambda: pool.busy_pids == [s.pid], "the call under way")
            pid = s.pid
            await s.aclose()
        assert results[0].status == "crashed" and results[0].state_lost
        assert pool.worker_pids == [] and pool.busy_pids == []
        await until(lambda: gone(pid), "the closed session's worker exited")
        await pool.aclose()


async def test_a_call_that_a_frozen_workers_socket_buffer_cannot_hold_goes_out_in_full_after_the_thaw():
    # A call to a session frozen between calls goes out before its thaw as far as the socket
    # buffer takes it; a frozen worker reads nothing, so the rest must follow the thaw, or the
    # call would wait for its deadline.
    async with fork_servers() as servers:
        s = LocalSession(servers, CallSettings(timeout=30.0), None)
        assert (await s.run("1 + 1")).value == "2"
        w = s._worker  # its channel, shrunk below the next call's size
        assert w is not None
        if not w.freezes:
            pytest.skip("no cgroup v2 freezer here: sessions are not frozen between calls")
        assert w.frozen
        w.stream.extra(SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        r = await s.run("x = " + repr("y" * 50_000) + "\nlen(x)")
        assert (r.status, r.value, r.state_lost) == ("ok", "50000", False)
        assert (await s.run("x[:3]")).value == "'yyy'" and w.frozen
        await s.aclose()


async def test_prepared_sessions_are_handed_out_first_and_only_into_free_capacity():
    async with fork_servers() as servers:
        pool = _SessionPool(servers, CallSettings(), max_workers=3, prewarm=0)
        assert await pool.prepare("P = 1", 5, wait=True) == 3  # the free capacity
        ready = set(pool.ready_pids)
        assert len(ready) == 3 and servers.starts == 3
        a = await pool.take("P = 1")
        assert a.pid in ready and servers.starts == 3 and len(pool.ready_pids) == 2
        # Full: another setup's start takes the slot of a ready session, which is closed.
        b = await pool.take("Q = 2")
        assert b.pid not in ready and len(pool.ready_pids) == 1 and len(pool.worker_pids) == 3
        assert (await b.run("'P' in globals(), Q")).value == "(False, 2)"
        await pool.aclose()
        assert pool.worker_pids == []


async def test_dropped_ready_sessions_are_closed_at_once_and_free_their_slots():
    async with fork_servers() as servers:
        pool = _SessionPool(servers, CallSettings(), max_workers=2, prewarm=0)
        assert await pool.prepare(None, 2, wait=True) == 2
        dropped = pool.ready_pids
        await pool.drop_ready()
        assert pool.ready_pids == [] and pool.worker_pids == []
        await until(lambda: all(gone(p) for p in dropped), "the dropped sessions' workers exited")
        a, b = await pool.take(None), await pool.take(None)  # both slots are free again
        assert not {a.pid, b.pid} & set(dropped)
        await pool.aclose()


async def test_a_session_closed_while_its_worker_starts_gets_no_worker(tmp_path):
    # The setup runs in the template before it isolates itself, so it can wait on a host file.
    started, go = tmp_path / "started", tmp_path / "go"
    setup = (f"import os, time\nopen({str(started)!r}, 'w').close()\n"
             f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)")
    async with fork_servers() as servers:
        pool = _SessionPool(servers, CallSettings(), max_workers=2, prewarm=0)
        errors: list[BaseException] = []

        async def take() -> None:
            try:
                await pool.take(setup)
            except SandboxError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await until(started.exists, "the setup runs")
            await pool.aclose()  # closes the session whose start is under way
            go.touch()
        assert len(errors) == 1 and "closed" in str(errors[0])
        assert servers.starts == 1 and pool.worker_pids == []  # started, and ended at once:
        await until(lambda: not sessions_of(servers.pid), "the late worker exited")


def sessions_of(server: int) -> list[psutil.Process]:
    """The session workers forked (through its templates) from the base server ``server``."""
    found = []
    for p in psutil.Process(server).children(recursive=True):
        try:
            if p.name() == "sbx-session" and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found
