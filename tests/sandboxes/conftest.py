"""The hostile suites share one real pool per test module (namespaces, cgroups, seccomp)."""

from __future__ import annotations

import os

import pytest

from agentenv.sandboxes.local import LocalSandbox

from ..waiting import wait_for
from .hostile import LIMITS, SECRET, alive


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def sandbox():
    os.environ[SECRET] = "hunter2"
    spawned: set[int] = set()
    async with LocalSandbox(limits=LIMITS, default_timeout=2.0, kill_grace=0.3, prewarm=2) as sb:
        sb.spawned = spawned  # type: ignore[attr-defined]
        yield sb
    os.environ.pop(SECRET, None)
    # After the suite: every worker this sandbox ever started is gone.
    wait_for(lambda: not any(alive(p) for p in spawned),
             "every process of the suite's sandbox exited")


@pytest.fixture
def cgroups():
    """A pool's cgroups (``_Cgroups``); at the end every directory it made is removed, its parents
    too."""
    from agentenv.sandboxes.local import CGROUP_V1
    from agentenv.sandboxes.local.cgroups import _Cgroups

    cg = _Cgroups(CGROUP_V1)
    if cg.missing:
        pytest.skip(f"no writable cgroup hierarchy for {cg.missing} on this host")
    yield cg
    cg.drain()  # the ends still on its teardown thread
    wait_for(cg.remove_all, "every released directory removed")
    cg.remove_roots()
    assert not [p for base in cg.bases.values() for p in base.glob(f"{cg.name}*")], "a directory was left"
