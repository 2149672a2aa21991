"""A run's start-up (``agentenv.runtime.open_runtime``) on the bundled tiny model on the real
embedded engine and a real local sandbox: the sandbox's sessions are started before the engine
opens, the reactor runs groups, and what the runtime opened closes with it, while what the
caller passed in stays open."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentenv import make
from agentenv.config import RolloutConfig, SandboxOptions
from agentenv.engines.spec import EngineSpec
from agentenv.errors import EnvCheckError
from agentenv.inflight import InFlight
from agentenv.runtime import open_runtime
from agentenv.sandboxes.local import LocalSandbox

from .conftest import child_pids

pytestmark = pytest.mark.anyio
CONFIG = RolloutConfig(max_turns=2, max_new_tokens=48, max_tokens_per_turn=32, concurrency=4)


def rewarded(groups, tasks, group_size: int) -> bool:
    return (sorted(g.task.id for g in groups) == sorted(t.id for t in tasks)
            and all(len(g.trajectories) == group_size and all(t.reward is not None for t in g.trajectories)
                    for g in groups))


async def test_a_runtime_it_opens_runs_groups_and_closes_its_sandbox_and_engine(model_dir: str):
    env = make("retool-math")
    tasks = env.tasks(2, seed=0)
    before = child_pids()
    programs = InFlight()
    async with open_runtime(env, EngineSpec.sampling_as(CONFIG, "embedded", model_dir), SandboxOptions(sandbox_pids=32),
                            CONFIG, programs=4, journal=programs) as rt:
        assert rt.prepared == 4  # the run's size, under the concurrency: sessions started ahead
        assert rt.config.tool_timeout == env.tool_timeout  # the env's limit, filled in for the reactor
        assert child_pids() - before  # the sandbox's fork server and sessions
        groups = await rt.reactor.collect(tasks, 2)
        engine = rt.engine
    await env.aclose()
    assert rewarded(groups, tasks, 2)
    snapshot = programs.snapshot({t.id for t in tasks})  # the journal given was the reactor's
    assert sorted(snapshot) == sorted(t.id for t in tasks) and all(len(s.finished) == 2 for s in snapshot.values())
    assert engine._closed  # opened from its spec, so closed with the runtime
    assert child_pids() - before == set()  # the sandbox closed: no session or server left


async def test_the_sessions_start_before_the_engine_and_a_callers_sandbox_stays_open(model_dir: str):
    env = make("retool-math")
    spec = EngineSpec.sampling_as(CONFIG, "embedded", model_dir)
    seen: dict[str, int] = {}
    opened = []

    async def start():  # a starter, as engine actors are given: records what the sandbox holds then
        seen["ready"] = len(sandbox.ready_pids)
        opened.append(await spec.open())
        return opened[0]

    async with LocalSandbox(prewarm=0) as sandbox:  # only the runtime's sessions are started ahead
        async with open_runtime(env, start, sandbox, CONFIG, programs=3, wait=True) as rt:
            assert rt.sandbox is sandbox and rt.engine is opened[0]
            groups = await rt.reactor.collect(env.tasks(1, seed=1), 2)
        assert seen["ready"] == rt.prepared == 3  # started (and, with wait, ready) before the engine opened
        assert opened[0]._closed  # what the starter opened is the runtime's to close
        session = await sandbox.session(env.sandbox_setup())  # the caller's sandbox: still open
        try:
            assert (await session.run("print(6 * 7)")).stdout.strip() == "42"
        finally:
            await session.aclose()
    await env.aclose()
    assert rewarded(groups, env.tasks(1, seed=1), 2)


async def test_a_callers_engine_stays_open_and_a_broken_env_fails_before_the_reactor(engine, model_dir: str):
    env = make("retool-math")
    async with open_runtime(env, engine, "local", CONFIG) as rt:
        assert rt.engine is engine
        first = await rt.reactor.collect(env.tasks(1, seed=2), 2)
    assert not engine._closed  # the caller's engine: left open for the caller's next run
    assert rewarded(first, env.tasks(1, seed=2), 2)
    env.tool_timeout = -1.0  # check_env refuses it, after the sandbox and the engine opened
    before = child_pids()
    with pytest.raises(EnvCheckError, match="tool_timeout"):
        async with open_runtime(env, EngineSpec.sampling_as(CONFIG, "embedded", model_dir), "local",
                                replace(CONFIG, tool_timeout=5.0), programs=2):
            raise AssertionError("a runtime was yielded for an env check_env refuses")
    assert child_pids() - before == set()  # the sandbox it opened was closed on the way out
    await env.aclose()
