"""A fork-server pool on its own, for the tests of the local sandbox's two halves."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import psutil

from agentenv.sandboxes.local import CGROUP_V1, Limits
from agentenv.sandboxes.local.cgroups import _Cgroups
from agentenv.sandboxes.local.servers import _ForkServers
from agentenv.sandboxes.local.uids import _Uids

from ..waiting import until


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie, not reaped yet, has)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@asynccontextmanager
async def fork_servers(*, replace_dead: bool = True, spawn_servers: int = 2):
    """A started fork-server pool, torn down as ``LocalSandbox.aclose`` does. Its ``lost``
    lists, for each call of ``on_lost``, the base server's pid then (None: already dropped)."""
    lost: list[int | None] = []
    limits = Limits()
    cgroups, uids = _Cgroups(CGROUP_V1), _Uids(limits.uid, limits.uids)

    async def on_lost() -> None:
        lost.append(servers.pid)

    servers = _ForkServers(limits=limits, isolate=True, allow_unisolated=False, max_output=2000,
                           setup_timeout=60.0, spawn_servers=spawn_servers, cgroups=cgroups, uids=uids,
                           cgroup_root=CGROUP_V1, on_lost=on_lost)
    servers.lost = lost  # type: ignore[attr-defined]
    try:
        await servers.start()
        servers.replace_dead = replace_dead
        yield servers
    finally:
        await servers.aclose()
        await anyio.to_thread.run_sync(cgroups.drain)
        await until(cgroups.remove_all, "the workers left their cgroups")
        cgroups.remove_roots()
        uids.close()
