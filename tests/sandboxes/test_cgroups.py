"""Per-session cgroups (``cgroups.py``) on this host's real hierarchies (cgroup v1 ``pids``,
``memory``, ``cpu`` and the v2 hierarchy beside them): directories made with the session's
limits, killed, frozen, read, reused only once empty, removed, and a dead pool's reaped.
The processes put in them are this test's own children, so each is reaped here (this
machine's pid 1 reaps no orphan: an orphan's zombie would keep its cgroup busy for good)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import anyio
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local import LocalSandbox
from agentenv.sandboxes.local.cgroups import _alive, _Cgroups
from agentenv.sandboxes.local.limits import Limits

from ..waiting import DEADLINE_S, until
from .hostile import LIMITS

pytestmark = pytest.mark.anyio
SPIN = ["sh", "-c", "while :; do :; done"]


async def member(dirs: list[str], argv: list[str] | None = None, *, new_session: bool = False):
    """A process of this test's, moved into every directory of ``dirs``."""
    proc = await anyio.open_process(argv or ["sleep", "300"], start_new_session=new_session)
    for d in dirs:
        Path(d, "cgroup.procs").write_text(str(proc.pid))
    return proc


def by_hierarchy(cg: _Cgroups, dirs: list[str]) -> dict[str, Path]:
    return {ctl: next(Path(d) for d in dirs if Path(d).parent in (base, base / cg.name)) for ctl, base in
            cg.bases.items()}


async def test_a_sessions_directories_carry_its_limits_one_per_hierarchy(cgroups):
    capped = await cgroups.acquire(Limits(pids=7, memory_mb=64, cpus=0.5))
    plain = await cgroups.acquire(Limits())
    try:
        dirs = by_hierarchy(cgroups, capped)
        assert set(dirs) == {"pids", "memory", "cpu", "freeze"} and len(capped) == 4
        # Under the pool's own parent, except cpu: each session beside the host's processes.
        assert dirs["cpu"] == cgroups.bases["cpu"] / f"{cgroups.name}.s1"
        assert dirs["pids"] == cgroups.bases["pids"] / cgroups.name / "s1"
        assert (dirs["pids"] / "pids.max").read_text().strip() == "7"
        assert int((dirs["memory"] / "memory.limit_in_bytes").read_text()) == 64 << 20
        period = int((dirs["cpu"] / "cpu.cfs_period_us").read_text())
        assert int((dirs["cpu"] / "cpu.cfs_quota_us").read_text()) == int(0.5 * period)
        other = by_hierarchy(cgroups, plain)
        assert other["cpu"].name.endswith(".s2") and not set(plain) & set(capped)
        assert int((other["cpu"] / "cpu.cfs_quota_us").read_text()) == -1  # no cap: an equal share only
        assert (other["pids"] / "pids.max").read_text().strip() == str(Limits().pids)
    finally:
        cgroups.release(capped)
        cgroups.release(plain)


async def test_released_directories_are_reused_oldest_first(cgroups):
    a, b = await cgroups.acquire(LIMITS), await cgroups.acquire(LIMITS)
    cgroups.release(b)
    cgroups.release(a)
    again = [await cgroups.acquire(LIMITS), await cgroups.acquire(LIMITS)]
    assert again == [b, a] and cgroups.n == 2  # nothing new made
    for dirs in again:
        cgroups.release(dirs)


async def test_kill_ends_every_process_in_the_session_at_once(cgroups):
    dirs = await cgroups.acquire(LIMITS)
    try:
        procs = [await member(dirs), await member(dirs, new_session=True)]  # another session, another group
        assert cgroups._busy(dirs) is True
        assert cgroups.kill(dirs)
        with anyio.fail_after(DEADLINE_S):
            assert [await p.wait() for p in procs] == [-9, -9]
        assert cgroups._busy(dirs) is False  # reaped: nothing left, not even a zombie
    finally:
        cgroups.release(dirs)
    assert not cgroups.kill([str(d) for d in dirs if "/unified/" not in d])  # v1 only: no cgroup.kill


async def test_directories_are_removed_only_once_their_last_process_is_gone(cgroups):
    dirs = await cgroups.acquire(LIMITS)
    proc = await member(dirs)
    cgroups.release(dirs)
    assert not cgroups.remove_all()  # a process is still in them: kept, tried again later
    assert all(os.path.isdir(d) for d in dirs)
    proc.kill()
    await proc.wait()
    assert cgroups.remove_all() and not any(os.path.exists(d) for d in dirs)


async def test_a_frozen_session_runs_nothing_still_dies_to_sigkill_and_is_thawed_on_release(cgroups):
    dirs = await cgroups.acquire(LIMITS)
    events = by_hierarchy(cgroups, dirs)["freeze"] / "cgroup.events"
    proc = await member(dirs)
    try:
        assert cgroups.freeze(dirs)
        await until(lambda: "frozen 1" in events.read_text(), "the session frozen")
        assert cgroups.thaw(dirs)
        await until(lambda: "frozen 0" in events.read_text(), "the session thawed")
        assert cgroups.freeze(dirs)
        await until(lambda: "frozen 1" in events.read_text(), "the session frozen again")
        proc.kill()  # v2's freezer lets SIGKILL through: a frozen session dies with its parent
        with anyio.fail_after(DEADLINE_S):
            assert await proc.wait() == -9
    finally:
        cgroups.release(dirs)  # reused by the next session, which must not start frozen
    assert "frozen 0" in events.read_text()
    assert not cgroups.freeze([]) and not cgroups.thaw([])  # no freezer: said so


async def test_end_kills_and_takes_a_frozen_sessions_directories_back_off_the_event_loop(cgroups, monkeypatch):
    dirs = await cgroups.acquire(LIMITS)
    events = by_hierarchy(cgroups, dirs)["freeze"] / "cgroup.events"
    procs = [await member(dirs), await member(dirs, new_session=True)]
    assert cgroups.freeze(dirs)
    await until(lambda: "frozen 1" in events.read_text(), "the session frozen")
    where: list[str] = []
    kill = cgroups.kill
    monkeypatch.setattr(cgroups, "kill", lambda d: where.append(threading.current_thread().name) or kill(d))
    cgroups.end(dirs)
    with anyio.fail_after(DEADLINE_S):
        assert [await p.wait() for p in procs] == [-9, -9]  # frozen, and killed all the same
    await until(lambda: dirs in cgroups.free, "the directories taken back")
    assert "frozen 0" in events.read_text()  # thawed before reuse: the next session starts running
    assert len(where) == 1 and where[0] != threading.current_thread().name  # the cgroup writes: not here
    assert await cgroups.acquire(LIMITS) == dirs
    cgroups.drain()  # the pool is closing: an end from now on runs where it is called
    cgroups.end(dirs)
    assert where[1:] == [threading.current_thread().name] and dirs in cgroups.free
    cgroups.end([])  # a session without cgroups: nothing to do
    assert len(where) == 2


async def test_cpu_reads_the_sessions_own_cpu_seconds(cgroups):
    dirs = await cgroups.acquire(LIMITS)
    proc = await member(dirs, SPIN)
    try:
        start = cgroups.cpu(dirs)
        assert start is not None and start[0] >= 0 and start[1] >= 0
        await until(lambda: cgroups.cpu(dirs)[0] >= start[0] + 0.05, "the spinner's CPU time counted")
        assert cgroups.cpu([d for d in dirs if "/unified/" not in d]) is None  # v1 only: unknown
    finally:
        proc.kill()
        await proc.wait()
        cgroups.release(dirs)


def unused_pid() -> int:
    """A pid no process has (from the top of the range, which pids reach last)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(top - 1, top - 1000, -1) if not _alive(p) and not os.path.exists(f"/proc/{p}"))


async def test_reap_stale_removes_a_dead_pools_directories_and_no_live_ones(cgroups):
    live = await anyio.open_process(["sleep", "300"])
    made: dict[str, list[Path]] = {"dead": [], "live": []}
    try:
        for who, pid in (("dead", unused_pid()), ("live", live.pid)):
            for ctl, base in cgroups.bases.items():
                d = base / f"agentenv-{pid}-feedface.s1" if ctl == "cpu" else base / f"agentenv-{pid}-feedface" / "s1"
                d.mkdir(parents=True)
                made[who].append(d)
        assert cgroups.reap_stale() >= len(cgroups.bases)  # another dead pool's on this host count too
        assert not [d for d in made["dead"] if d.exists() or d.parent.name.startswith("agentenv-") and
                    d.parent.exists()]
        assert all(d.exists() for d in made["live"])  # its pool runs: not ours to remove
    finally:
        live.kill()
        await live.wait()
        for d in made["live"] + made["dead"]:
            for path in (d, d.parent):
                if path.name.startswith(("agentenv-", "s1")) and path.exists():
                    path.rmdir()


async def test_a_host_without_the_hierarchies_or_a_name_in_use(tmp_path, cgroups):
    none = _Cgroups(tmp_path)
    assert none.bases == {} and none.missing == ["pids", "memory", "cpu", "freeze"]
    assert await none.acquire(LIMITS) == []  # nothing to make: the pool refuses such a host itself
    # A directory of that name already there is someone else's limit: never joined, and what
    # this start made before it is removed.
    taken = cgroups.bases["freeze"] / cgroups.name / "s1"
    taken.mkdir(parents=True)
    try:
        with pytest.raises(SandboxError, match=f"cannot set up cgroup {taken}"):
            cgroups.create(LIMITS, 1)
        made = [base / (f"{cgroups.name}.s1" if ctl == "cpu" else f"{cgroups.name}/s1")
                for ctl, base in cgroups.bases.items() if ctl != "freeze"]
        assert len(made) == 3 and not [d for d in made if d.exists()]
    finally:
        taken.rmdir()


@pytest.mark.slow
async def test_a_closed_sessions_cgroups_are_reused_only_once_empty_and_still_limit():
    # Making and removing cgroups takes the kernel's global cgroup lock, so a pool reuses a
    # closed session's directories: never while a process (or zombie) is left in them.
    cg = _Cgroups()
    if cg.missing:
        pytest.skip("no cgroup v1 hierarchy")
    try:
        first = await cg.acquire(LIMITS)
        child = await anyio.open_process(["sleep", "30"])
        for d in first:
            Path(d, "cgroup.procs").write_text(str(child.pid))
        cg.release(first)
        assert set(await cg.acquire(LIMITS)).isdisjoint(first)  # occupied: new directories instead
        child.kill()
        await child.wait()  # reaped: nothing left in it
        assert await cg.acquire(LIMITS) == first
    finally:
        for dirs in [first] + list(cg.free):
            cg.release(dirs)
        assert cg.remove_all()
        cg.remove_roots()
    # And in a pool, a session on reused directories is held to the same limits.
    async with LocalSandbox(limits=LIMITS, prewarm=0) as sb:
        await (await sb.session()).aclose()
        await until(lambda: sb._cgroups.free, "the closed session's cgroups taken back")  # off the loop
        released, made = [list(d) for d in sb._cgroups.free], sb._cgroups.n
        await until(lambda: not sb._cgroups._busy(released[0]), "the closed session's cgroups emptied")
        b = await sb.session()
        assert b._cgroups in released and sb._cgroups.n == made
        flood = ("import os, time\nkids = []\ntry:\n    while True:\n        pid = os.fork()\n"
                 "        if pid == 0:\n            time.sleep(3)\n            os._exit(0)\n        kids.append(pid)\n"
                 "except OSError:\n    pass\nlen(kids)")
        r = await b.run(flood, timeout=10)
        assert LIMITS.pids - 4 <= int(r.value) < LIMITS.pids, r
        await b.aclose()
