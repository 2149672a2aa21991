"""The E2B backend: the real e2b-code-interpreter SDK against a local server that speaks its
wire protocol (control plane + code interpreter), and live tests when E2B_API_KEY is set."""

from __future__ import annotations

import os

import anyio
import pytest

pytest.importorskip("e2b_code_interpreter")

from agentenv.sandboxes.e2b import E2BSandbox  # noqa: E402
from agentenv.sandboxes.e2b.fake_server import FakeE2BServer  # noqa: E402

from ..waiting import DEADLINE_S, until  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture
def server():
    with FakeE2BServer() as srv:
        yield srv


def backend(srv: FakeE2BServer, **kw) -> E2BSandbox:
    return E2BSandbox(api_key="e2b_" + "0" * 40, api_url=srv.url, sandbox_url=srv.url, **kw)


async def test_stateful_sessions_over_the_real_sdk(server):
    async with backend(server) as sb:
        s = await sb.session()
        r = await s.run("x = 21\nprint('hi')\nx * 2")
        assert (r.status, r.stdout, r.value) == ("ok", "hi\n", "42")
        assert (await s.run("x")).value == "21"
        err = await s.run("1/0")
        assert err.status == "error" and "ZeroDivisionError" in err.error
        await s.aclose()


async def test_timeout_restarts_the_context_instead_of_reusing_it(server):
    # Only the sleeping call has the short deadline: a busy machine may take longer than it
    # for the quick calls around it.
    async with backend(server, default_timeout=DEADLINE_S) as sb:
        s = await sb.session()
        await s.run("keep = 1")
        r = await s.run("import time\ntime.sleep(3)", timeout=0.5)
        # Cut off: the call would take 3 s otherwise (how soon after 0.5 s depends on the load).
        assert r.status == "timeout" and r.state_lost and r.duration_s < 3, r
        assert server.restarts == 1
        after = await s.run("'fresh' if 'keep' not in globals() else 'stale'")
        assert after.value == "'fresh'"


async def test_rate_limited_creation_is_retried():
    with FakeE2BServer(rate_limited_creates=3) as srv:
        async with backend(srv) as sb:
            s = await sb.session()
            assert (await s.run("1 + 1")).value == "2"
        assert len(srv.created) == 1 and srv.rate_limited_creates == 0


async def test_sessions_share_sandboxes_through_contexts(server):
    async with backend(server, sessions_per_sandbox=3) as sb:
        sessions = [await sb.session() for _ in range(7)]
        assert len(server.created) == 3
        assert len(server.contexts) == 7
        for i, s in enumerate(sessions):
            await s.run(f"me = {i}")
        assert [(await s.run("me")).value for s in sessions] == [str(i) for i in range(7)]


async def test_sandbox_cap_makes_sessions_wait(server):
    async with backend(server, sessions_per_sandbox=1, max_sandboxes=2) as sb:
        a, b = await sb.session(), await sb.session()
        with anyio.move_on_after(0.5) as scope:
            await sb.session()
        assert scope.cancelled_caught and len(server.created) == 2
        await a.aclose()
        c = await sb.session()  # room again: reuses the freed sandbox
        assert (await c.run("3")).value == "3" and len(server.created) == 2
        await b.aclose()


async def test_every_sandbox_is_killed_on_close_and_on_cancellation(server):
    sb = backend(server, sessions_per_sandbox=2, default_timeout=5)

    async def busy() -> None:
        s = await sb.session()
        await s.run("import time\ntime.sleep(2)")

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(busy)
        await until(lambda: len(server.created) == 3, "a sandbox for every two sessions created")
        tg.cancel_scope.cancel()  # their calls in flight
    await sb.aclose()
    await sb.aclose()  # idempotent
    assert len(server.created) == 3
    assert server.alive == []


async def test_setup_code_runs_in_each_session(server):
    async with backend(server) as sb:
        s = await sb.session(setup_code="def helper(n):\n    return n + 1")
        assert (await s.run("helper(41)")).value == "42"


async def test_reactor_on_e2b(server, engine):
    from agentenv import Reactor, RolloutConfig, make

    env = make("retool-math")
    async with backend(server, sessions_per_sandbox=8) as sb:
        reactor = Reactor(engine, env, sb, RolloutConfig(concurrency=8, max_new_tokens=200))
        groups = await reactor.collect(env.tasks(4, seed=2), group_size=2)
    calls = [c for g in groups for t in g.trajectories for c in t.tool_calls]
    ran = [c.status for c in calls]
    assert "ok" in ran, f"precondition: a tool call of the model ran {ran}"
    assert server.alive == [] and len(server.created) == 1


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="live E2B test: set E2B_API_KEY")
async def test_live_e2b():
    async with E2BSandbox(max_sandboxes=1, default_timeout=30) as sb:
        s = await sb.session()
        assert (await s.run("x = 2\nx ** 10")).value == "1024"
        assert (await s.run("x")).value == "2"
        ids = sb.sandbox_ids
        assert len(ids) == 1
    assert sb.sandbox_ids == []
