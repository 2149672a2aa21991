"""The fork-server pool on its own: a real base server, real templates and real workers, with
the pool's own cgroups and uids; no session pool above it."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local.control import _ServerGone
from agentenv.sandboxes.local.servers import _ForkServers

from ..waiting import until
from .pools import fork_servers, gone

pytestmark = pytest.mark.anyio


async def kill_base(servers: _ForkServers) -> int:
    pid = servers.pid
    os.kill(pid, signal.SIGKILL)
    await until(lambda: gone(pid), "the base server died")
    return pid


async def test_a_worker_runs_as_its_own_uid_in_its_own_cgroups_and_end_takes_them_back():
    async with fork_servers() as servers:
        a, b = await servers.spawn(None), await servers.spawn(None)
        assert servers.starts == 2 and a.uid != b.uid and not set(a.cgroups) & set(b.cgroups)
        for w in (a, b):  # the worker confines itself once forked: waited for
            await until(lambda: psutil.Process(w.pid).uids().real == w.uid, "the worker runs as its own uid")
            await until(lambda: all(str(w.pid) in open(os.path.join(d, "cgroup.procs")).read().split()
                                    for d in w.cgroups), "the worker is in each of its cgroups")
        servers.end(a)
        await until(lambda: gone(a.pid), "the ended worker exited")
        assert a.pidfd == -1 and not gone(b.pid)  # the other worker is untouched
        # Its cgroups and uid are handed back for reuse (each once nothing of it is left).
        assert a.uid in [u for u, _ in servers._uids.free]
        await until(lambda: a.cgroups in list(servers._cgroups.free), "its cgroups back for reuse")
        servers.end(b)


async def test_freeze_stops_a_worker_and_thaw_lets_it_run():
    async with fork_servers() as servers:
        w = await servers.spawn(None)
        if not w.freezes:
            pytest.skip("no cgroup v2 freezer on this host")
        assert servers.freeze(w) and w.frozen
        frozen = next(e for d in w.cgroups if os.path.exists(e := os.path.join(d, "cgroup.events")))
        await until(lambda: "frozen 1" in open(frozen).read(), "the worker's cgroup frozen")
        assert servers.thaw(w) and not w.frozen
        await until(lambda: "frozen 0" in open(frozen).read(), "the worker's cgroup thawed")
        servers.end(w)


async def test_workers_of_one_setup_fork_at_most_spawn_servers_templates_that_ran_it():
    async with fork_servers(spawn_servers=2) as servers:
        base = psutil.Process(servers.pid)
        plain = len(base.children())
        workers = [await servers.spawn("PREPARED = 1") for _ in range(6)]
        assert 1 <= len(base.children()) - plain <= 2
        # Every worker is a fork of a template, not of the base server.
        assert all(psutil.Process(w.pid).ppid() != servers.pid for w in workers)
        with pytest.raises(SandboxError, match="environment setup code failed: .*NameError"):
            await servers.spawn("undefined_name")
        assert servers.starts == 6 and servers.restarts == 0 and not servers.lost
        for w in workers:
            servers.end(w)


async def test_a_dead_base_server_is_replaced_its_workers_are_reported_lost_and_starts_go_on():
    async with fork_servers() as servers:
        old = await servers.spawn("X = 1")
        dead = await kill_base(servers)
        await until(lambda: gone(old.pid), "its worker died with it")  # by design: killed with its parent
        new = await servers.spawn("X = 1")
        assert servers.restarts == 1 and servers.lost == [None]  # told once, after the dead one was dropped
        assert servers.pid not in (None, dead) and not gone(new.pid)
        assert psutil.Process(new.pid).ppid() != dead
        servers.end(old)
        servers.end(new)


async def test_without_replace_dead_a_dead_server_is_an_error_not_a_new_server():
    # The owner's isolation check runs before replacement is allowed: a crash there must
    # surface, never be retried on a server the check did not see.
    async with fork_servers(replace_dead=False) as servers:
        dead = await kill_base(servers)
        with pytest.raises(_ServerGone):
            await servers.spawn(None)
        assert servers.restarts == 0 and not servers.lost and servers.pid == dead


async def test_stop_refuses_new_servers_and_aclose_kills_the_base_server():
    async with fork_servers() as servers:
        servers.stop()
        await kill_base(servers)
        with pytest.raises(_ServerGone):  # stopped: not replaced
            await servers.spawn(None)
        assert servers.restarts == 0
    async with fork_servers() as servers:
        base = servers.pid
        worker = await servers.spawn("Y = 2")
        await servers.aclose()
        await servers.aclose()  # idempotent
        await until(lambda: gone(base) and gone(worker.pid), "the base server and its worker died")
        with pytest.raises(SandboxError, match="closed"):
            await servers.start()
        servers.end(worker)
