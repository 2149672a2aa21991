"""The uid allocator (``uids.py``) on this machine's real lock file: a uid is owned by one
pool machine-wide, handed out again only once its last worker is reaped (checked through a
real process's pidfd), and given back to the machine when the pool closes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local.uids import _Uids

from ..waiting import DEADLINE_S, until
from .hostile import private_uids

pytestmark = pytest.mark.anyio


async def running() -> tuple[anyio.abc.Process, int]:
    """A real process standing in for a session's worker, and a pidfd of it."""
    proc = await anyio.open_process(["sleep", "300"])
    return proc, os.pidfd_open(proc.pid)


async def reap(proc: anyio.abc.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


@pytest.mark.parametrize("first, count", [(0, 8), (-1, 8), (1000, 0), (2**32 - 4, 8)])
def test_a_range_that_is_not_all_unprivileged_uids_is_refused(first, count):
    with pytest.raises(SandboxError, match=f"^bad sandbox uid range: {count} uids from {first}$"):
        _Uids(first, count)


async def test_released_uids_are_reused_oldest_first():
    uids = _Uids(private_uids(3), 8)
    try:
        a, b, c = uids.acquire(), uids.acquire(), uids.acquire()
        assert len({a, b, c}) == 3 and all(private_uids(3) <= u < private_uids(3) + 8 for u in (a, b, c))
        uids.release(b, None)  # a worker that never started: free at once
        uids.release(a, None)
        assert [uids.acquire(), uids.acquire()] == [b, a]
        assert uids.acquire() not in (a, b, c)  # none released: a new one from the range
    finally:
        uids.close()


async def test_a_uid_whose_worker_may_have_run_unseen_is_never_reused_by_its_pool():
    base = private_uids(4)
    uids = _Uids(base, 2)
    try:
        lost = uids.acquire()
        uids.release(lost, None, reusable=False)  # a start that failed half-way
        other = uids.acquire()
        assert other != lost
        with pytest.raises(SandboxError, match="every sandbox uid"):
            uids.acquire()  # the lost one stays locked: not this pool's to hand out again
        uids.release(other, None)
    finally:
        uids.close()
    again = _Uids(base, 2)  # closing gave back the released uid, never the lost one
    try:
        assert again.acquire() == other
        with pytest.raises(SandboxError, match="every sandbox uid"):
            again.acquire()
    finally:
        again.close()


async def test_closing_gives_back_reaped_uids_and_keeps_one_whose_worker_still_runs():
    base = private_uids(5)
    uids = _Uids(base, 2)
    proc, pidfd = await running()
    try:
        done, busy = uids.acquire(), uids.acquire()
        uids.release(done, None)
        uids.release(busy, pidfd)  # its worker is still exiting
        uids.close()
        after = _Uids(base, 2)
        try:
            assert after.acquire() == done
            with pytest.raises(SandboxError, match="every sandbox uid"):
                after.acquire()  # locked for this process's life rather than shared
        finally:
            after.close()
    finally:
        await reap(proc)


async def test_acquire_soon_waits_for_a_released_uid_whose_worker_is_exiting():
    uids = _Uids(private_uids(6), 1)
    proc, pidfd = await running()
    try:
        only = uids.acquire()
        uids.release(only, pidfd)
        with pytest.raises(SandboxError, match="every sandbox uid"):
            uids.acquire()  # the range is spent and its one released uid's worker still runs
        got: list[int] = []
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:

                async def soon() -> None:
                    got.append(await uids.acquire_soon(within=DEADLINE_S))

                tg.start_soon(soon)
                await anyio.sleep(0.05)
                assert not got  # still running: not handed out
                await reap(proc)
                await until(lambda: got, "the uid handed out once its worker was reaped")
        assert got == [only]
    finally:
        await reap(proc)
        uids.close()


async def test_acquire_soon_fails_at_once_when_nothing_is_exiting():
    uids = _Uids(private_uids(7), 1)
    try:
        uids.acquire()
        with anyio.fail_after(1.0):  # nothing released that could come back: no wait
            with pytest.raises(SandboxError, match="every sandbox uid"):
                await uids.acquire_soon(within=DEADLINE_S)
    finally:
        uids.close()


async def test_a_uid_is_reused_only_once_its_last_worker_is_reaped():
    uids = _Uids(private_uids(2), 8)
    try:
        first = uids.acquire()
        proc = await anyio.open_process(["sleep", "30"])
        uids.release(first, os.pidfd_open(proc.pid))
        second = uids.acquire()
        assert second != first  # its process still runs: a new uid instead
        proc.kill()
        await proc.wait()  # reaped
        assert uids.acquire() == first
    finally:
        uids.close()


@pytest.mark.slow
async def test_two_pools_and_two_processes_never_share_a_uid():
    base = private_uids(0)
    script = ("import sys\nsys.path.insert(0, '.')\nfrom agentenv.sandboxes.local.uids import _Uids\n"
              f"u = _Uids({base}, 6)\nprint([u.acquire() for _ in range(3)], flush=True)\n"
              "sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        theirs = set(eval(other.stdout.readline()))
        a, b = _Uids(base, 6), _Uids(base, 6)
        try:
            ours = [a.acquire(), b.acquire(), a.acquire()]
            assert len(set(ours)) == 3 and not set(ours) & theirs
            with pytest.raises(SandboxError, match="every sandbox uid"):
                b.acquire()  # 3 + 3 of 6: none left on this machine
        finally:
            for pool, uid in zip((a, b, a), ours):
                pool.release(uid, None)
            a.close()
            b.close()
    finally:
        other.stdin.close()
        other.wait()
    c = _Uids(base, 6)  # the other process exited: its uids are free again
    try:
        assert len({c.acquire() for _ in range(6)}) == 6
    finally:
        c.close()


def test_two_test_processes_are_given_different_uids_for_their_tests(tmp_path):
    # Another run of the suite on the machine uses the same test uids by slot: each test
    # process holds its own block of them, whatever its pid and its TMPDIR (a run beside
    # another has its own).
    ours = private_uids(0)
    script = "from tests.sandboxes.hostile import private_uids\nprint(private_uids(0), flush=True)\ninput()\n"
    others = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=Path(__file__).resolve().parents[2],
                               env={**os.environ, "TMPDIR": str(tmp_path)}) for _ in range(2)]
    try:
        theirs = [int(p.stdout.readline()) for p in others]
        assert len({ours, *theirs}) == 3 and all(abs(u - ours) >= 128 for u in theirs), (ours, theirs)
    finally:
        for p in others:
            p.stdin.close()
            p.wait()
