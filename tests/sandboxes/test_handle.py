"""A started session as the host holds it (``handle.py``), around real processes in real
cgroups: ending it kills every process it has (through pidfds and the cgroup's own kill,
never a bare pid) and hands its cgroups and uid back; freezing and thawing it. The processes
are this test's children, standing in for a session's worker, reaper and what its code
started (reaped by this test's event loop: this machine's pid 1 reaps no orphan)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import anyio
import anyio.abc
import psutil
import pytest

from agentenv.sandboxes.local.handle import _Worker, pidfd_signal
from agentenv.sandboxes.local.uids import _Uids

from ..waiting import DEADLINE_S, until
from .hostile import LIMITS, private_uids

pytestmark = pytest.mark.anyio


@pytest.fixture
def uids():
    u = _Uids(private_uids(8), 8)
    yield u
    u.close()


async def started(dirs: list[str], *, new_session: bool = False) -> tuple[anyio.abc.Process, int]:
    """A process of this test's in ``dirs``, and a pidfd of it."""
    proc = await anyio.open_process(["sleep", "300"], start_new_session=new_session)
    for d in dirs:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(proc.pid))
    return proc, os.pidfd_open(proc.pid)


async def stream() -> anyio.abc.SocketStream:
    mine, theirs = socket.socketpair()
    theirs.close()
    return await anyio.abc.UNIXSocketStream.from_socket(mine)


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


async def test_ending_an_unisolated_session_kills_its_worker_its_reaper_and_all_in_its_cgroups(cgroups, uids):
    dirs = await cgroups.acquire(LIMITS)
    (worker, wfd), (reaper, rfd) = await started(dirs), await started(dirs)
    left, left_fd = await started(dirs, new_session=True)  # what its code started, in a session of its own
    os.close(left_fd)
    w = _Worker(await stream(), worker.pid, wfd, rfd, dirs, None, freezes=False)
    w.end(cgroups, uids)
    with anyio.fail_after(DEADLINE_S):
        assert [await p.wait() for p in (worker, reaper, left)] == [-signal.SIGKILL] * 3
    assert (w.pidfd, w.reaper_fd) == (-1, None) and closed(wfd) and closed(rfd)
    assert not uids.free  # it had no uid
    await until(lambda: list(cgroups.free) == [dirs], "its cgroups back for reuse")  # from the pool's thread
    await w.stream.aclose()


async def test_an_isolated_sessions_uid_comes_back_only_once_its_worker_is_reaped(cgroups, uids):
    dirs = await cgroups.acquire(LIMITS)
    uid = uids.acquire()
    # Popen, not an event-loop process: nothing reaps it until this test does.
    worker = subprocess.Popen(["sleep", "300"])
    for d in dirs:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(worker.pid))
    wfd = os.pidfd_open(worker.pid)
    w = _Worker(await stream(), worker.pid, wfd, None, dirs, uid, freezes=False)
    w.end(cgroups, uids)
    assert w.pidfd == -1 and list(uids.free) == [(uid, wfd)]  # the uid's pool took the pidfd over
    await until(lambda: psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE, "the worker killed")
    other = uids.acquire()
    assert other != uid  # killed but not reaped: something of it may still count against the uid
    assert worker.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    assert uids.acquire() == uid
    uids.release(other, None)
    uids.release(uid, None)
    await w.stream.aclose()


async def test_pidfd_signal_reaches_its_process_until_it_is_reaped():
    proc = await anyio.open_process(["sleep", "300"])
    fd = os.pidfd_open(proc.pid)
    try:
        assert pidfd_signal(fd, 0)
        assert pidfd_signal(fd, signal.SIGKILL)
        with anyio.fail_after(DEADLINE_S):
            await proc.wait()
        assert not pidfd_signal(fd, signal.SIGKILL)  # reaped: its pid may be anyone's now, never hit
    finally:
        os.close(fd)


async def test_freeze_and_thaw_a_session_that_freezes_and_not_one_that_does_not(cgroups, uids):
    dirs = await cgroups.acquire(LIMITS)
    events = next(os.path.join(d, "cgroup.events") for d in dirs if os.path.exists(os.path.join(d, "cgroup.events")))
    worker, wfd = await started(dirs)
    try:
        w = _Worker(await stream(), worker.pid, wfd, None, dirs, None, freezes=True)
        assert w.freeze(cgroups) and w.frozen and w.freeze(cgroups)  # twice: still frozen
        await until(lambda: "frozen 1" in open(events).read(), "the session frozen")
        assert w.thaw(cgroups) and not w.frozen and w.thaw(cgroups)
        await until(lambda: "frozen 0" in open(events).read(), "the session thawed")
        used = w.cpu(cgroups)
        assert used is not None and used[0] >= 0
        steady = _Worker(w.stream, worker.pid, -1, None, dirs, None, freezes=False)
        assert steady.freeze(cgroups) and not steady.frozen  # background processes allowed: never frozen
        assert "frozen 0" in open(events).read()
        assert _Worker(w.stream, worker.pid, -1, None, [], None, freezes=False).cpu(cgroups) is None
        w.end(cgroups, uids)
        with anyio.fail_after(DEADLINE_S):
            assert await worker.wait() == -signal.SIGKILL
        await w.stream.aclose()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
