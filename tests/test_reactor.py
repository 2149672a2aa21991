"""The reactor end to end: real embedded engine, real sandbox processes, the bundled model."""

from __future__ import annotations

import gc

import anyio
import pytest

from agentenv import Environment, Group, Reactor, RolloutConfig, Task, Trajectory, make
from agentenv import reactor as reactor_module
from agentenv.engines.instant import InstantEngine
from agentenv.reactor import prepare_sessions
from agentenv.formats import MalformedCall, ReToolFormat
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.sandboxes.local import LocalSandbox

from .conftest import child_pids
from .waiting import until

pytestmark = pytest.mark.anyio


async def run(engine, env, n_tasks=4, group_size=2, seed=0, **cfg) -> list[Group]:
    config = RolloutConfig(**{"max_turns": 4, "max_new_tokens": 256, "concurrency": 8, **cfg})
    async with LocalSandbox() as sb:
        return await Reactor(engine, env, sb, config).collect(env.tasks(n_tasks, seed=seed), group_size)


def flat(groups: list[Group]) -> list[Trajectory]:
    return [t for g in groups for t in g.trajectories]


async def test_tokens_masks_logprobs_and_transcript(engine):
    env = make("retool-math")
    groups = await run(engine, env, n_tasks=6, group_size=2)
    assert len(groups) == 6 and all(len(g.trajectories) == 2 for g in groups)
    trajs = flat(groups)
    tok = engine.tokenizer
    with_tool = [t for t in trajs if any(c.status == "ok" for c in t.tool_calls)]
    assert with_tool, f"precondition: a tool call of the model ran {[[c.status for c in t.tool_calls] for t in trajs]}"
    for t in trajs:
        t.validate()
        for seg in t.segments:
            if seg.kind == "model":
                assert all(lp <= 0 for lp in seg.logprobs)
                assert set(seg.weight_versions) == {engine.weight_version}
        mask, ids = t.loss_mask, t.input_ids
        sampled = [i for s in t.segments if s.kind == "model" for i in s.token_ids]
        assert [x for x, m in zip(ids, mask) if m == 1] == sampled
        # Decoding input_ids reproduces the whole transcript: chat prompt + completion.
        prompt_text = tok.apply_chat_template(env.prompt(next(g.task for g in groups if g.task.id == t.task_id)),
                                              tokenize=False, add_generation_prompt=True)
        assert tok.decode(ids) == prompt_text + t.text
        assert t.reward in (0.0, 1.0)
    for t in with_tool:
        env_segs = [s for s in t.segments if s.kind == "env"]
        # Each tool output (or, for a malformed call, its error text) is spliced with mask 0,
        # exactly as the format renders it: one env segment per call (retool: one call a turn).
        assert len(env_segs) == len(t.tool_calls) or t.finish_reason == "context_overflow"
        for seg, call in zip(env_segs, t.tool_calls):
            assert tok.decode(seg.token_ids) == ReToolFormat().observation([call.output], tok, False)
        # A resumed turn is served from the prefix cache.
        assert len(t.turns) >= 2 and t.turns[1].cached_tokens > 0


class AlwaysMalformed(ReToolFormat):
    def parse(self, text, tool_names):
        calls = super().parse(text, tool_names)
        return [MalformedCall("test: every call is malformed") for _ in calls]


class MalformedEnv(RetoolMathEnv):
    tool_format = AlwaysMalformed()


async def test_malformed_tool_call_becomes_an_observation_and_the_program_continues(engine):
    groups = await run(engine, MalformedEnv(extra_digits=0), n_tasks=4, group_size=2, max_turns=3)
    trajs = flat(groups)
    bad = [t for t in trajs if t.tool_calls]
    assert bad, "precondition: the model made a tool call"
    for t in bad:
        assert all(c.status == "malformed" for c in t.tool_calls)
        assert "Error: malformed tool call: test: every call is malformed" in t.text
        assert not t.finish_reason.startswith("error")
    assert any(len(t.turns) > 1 for t in bad), "after a malformed call the model gets another turn"


class SlowToolEnv(RetoolMathEnv):
    def sandbox_setup(self):
        return "import builtins, time\nbuiltins.print = lambda *a, **k: time.sleep(60)"


async def test_tool_timeout_is_recorded_and_the_program_continues(engine):
    with anyio.fail_after(300):
        groups = await run(engine, SlowToolEnv(extra_digits=0), n_tasks=3, group_size=2, tool_timeout=0.5, max_turns=2)
    calls = [c for t in flat(groups) for c in t.tool_calls]
    timed_out = [c for c in calls if c.status == "timeout"]
    assert timed_out, f"precondition: the model called print() (it times out here), got {[c.status for c in calls]}"
    assert all(c.duration_s < 30 for c in timed_out)  # each would take 60 s unless cut off


class BrokenReward(RetoolMathEnv):
    async def reward(self, task, trajectory):
        if trajectory.sample_index == 0:
            raise RuntimeError("grader crashed")
        return 1.0


async def test_reward_exception_is_recorded_not_raised(engine):
    trajs = flat(await run(engine, BrokenReward(), n_tasks=2, group_size=2))
    broken = [t for t in trajs if t.sample_index == 0]
    fine = [t for t in trajs if t.sample_index == 1]
    assert all(t.finish_reason == "error:reward" and t.reward is None for t in broken)
    assert all("grader crashed" in t.error for t in broken)
    assert all(t.metadata["program_finish_reason"] for t in broken)
    assert all(t.reward == 1.0 for t in fine)


class GroupRanked(RetoolMathEnv):
    async def group_reward(self, task, trajectories):
        return [{"rank": float(i), "bonus": 10.0} for i, _ in enumerate(trajectories)]


class GroupBroken(RetoolMathEnv):
    async def group_reward(self, task, trajectories):
        raise RuntimeError("group grader crashed")


async def test_group_reward_hook_and_the_run_stats_count_the_group_rewards(engine):
    config = RolloutConfig(max_turns=4, max_new_tokens=256, concurrency=8)
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, GroupRanked(), sb, config)
        groups = await reactor.collect(GroupRanked().tasks(2), 3)
    for g in groups:
        assert g.rewards == [10.0, 11.0, 12.0]
    s = reactor.stats.summary()  # the group's rewards replaced the per-sample ones, once each
    assert s["mean_reward"] == 11.0 and s["reward_components"] == {"rank": 1.0, "bonus": 10.0}
    assert sum(s["finish_reasons"].values()) == 6 and reactor._counted == set()
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, GroupBroken(), sb, config)
        groups = await reactor.collect(GroupBroken().tasks(2), 2)
    assert all(t.finish_reason == "error:reward" and "group grader crashed" in t.error for t in flat(groups))
    s = reactor.stats.summary()
    assert s["mean_reward"] is None and s["finish_reasons"] == {"error:reward": 4}


async def test_max_turns_ends_the_program(engine):
    trajs = flat(await run(engine, make("retool-math"), n_tasks=4, group_size=2, max_turns=1))
    assert all(len(t.turns) == 1 for t in trajs)
    assert all(t.finish_reason in ("max_turns", "stop", "length") for t in trajs)
    callers = [t for t in trajs if "</code>" in t.text]
    assert callers, "precondition: a program's one turn ended on a tool call"
    assert all(t.finish_reason == "max_turns" and not t.tool_calls for t in callers)


async def test_context_overflow(model_dir):
    from agentenv.engines.embedded import EmbeddedEngine

    env = make("retool-math")
    eng = EmbeddedEngine(model_dir, max_model_len=96)
    try:
        trajs = flat(await run(eng, env, n_tasks=3, group_size=2, max_new_tokens=400))
    finally:
        await eng.aclose()
    assert all(t.num_tokens <= 96 for t in trajs)
    # A 66-token prompt and 400 tokens to sample: every program seen ran into the window.
    assert any(t.finish_reason == "context_overflow" for t in trajs), [t.finish_reason for t in trajs]


async def test_engine_failure_is_data(model_dir):
    from agentenv.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_dir)
    await eng.aclose()
    trajs = flat(await run(eng, make("retool-math"), n_tasks=2, group_size=2))
    assert len(trajs) == 4
    assert all(t.finish_reason == "error:engine" and "closed" in t.error for t in trajs)


async def test_cancelling_a_run_leaves_no_process_or_request_behind(engine):
    env = make("retool-math")
    before = child_pids()
    seen = 0
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, RolloutConfig(concurrency=16, max_new_tokens=512))
        async def consume() -> None:
            nonlocal seen
            async with reactor.rollouts(env.tasks(64, seed=3), group_size=4) as results:
                async for _ in results:
                    seen += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await until(
                lambda: reactor.stats.outcomes.started >= 4 and reactor.stats.outcomes.sampled_tokens,
                "programs mid-run",
            )
            tg.cancel_scope.cancel()
        assert seen < 256
    assert child_pids() - before == set()
    bp = engine._mgr.batch_processor
    # Cancellations are applied by the engine loop's next step.
    await until(lambda: not bp.scheduler.active_requests and not bp.scheduler.waiting_requests,
                "the engine dropped the cancelled requests")


async def test_sessions_prepared_before_the_run_are_the_ones_its_programs_take(engine):
    class NoTools(RetoolMathEnv):
        def tools(self):
            return []

    env = make("retool-math")
    config = RolloutConfig(concurrency=4, max_new_tokens=256)
    async with LocalSandbox(prewarm=0) as sb:
        assert await prepare_sessions(NoTools(), sb, config, 6, wait=True) == 0  # no Python tool
        # FIFO admits `concurrency` programs at once; the program policy 8x that (capped by
        # the pool), so the run's size bounds it here.
        assert await prepare_sessions(env, sb, RolloutConfig(concurrency=4, scheduling="fifo"), 6,
                                      wait=True) == 4
        assert await prepare_sessions(env, sb, config, 2, wait=True) == 2
        base, prepared = sb.starts, set(sb.worker_pids)
        assert len(prepared) == 6
        async with Reactor(engine, env, sb, config) as reactor:
            groups = await reactor.collect(env.tasks(3, seed=1), 2)
        assert any(t.tool_calls for t in flat(groups)), "precondition: a program called a tool (took a session)"
        # Every program took a prepared session: none started during the run (but to replace
        # a worker a call killed).
        replaced = sum("[session restarted" in c.output for t in flat(groups) for c in t.tool_calls)
        assert sb.starts - base <= replaced
        assert reactor.stats.sessions.session_waits == 0


async def test_trajectories_stream_before_groups_complete(engine):
    env = make("retool-math")
    order = []
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, RolloutConfig(concurrency=4))
        async with reactor.rollouts(env.tasks(3), group_size=2) as results:
            async for item in results:
                order.append(type(item).__name__)
    assert order.count("Trajectory") == 6 and order.count("Group") == 3
    assert order[0] == "Trajectory"


async def test_the_library_takes_the_envs_limits_as_the_cli_does(engine):
    class Short(RetoolMathEnv):
        max_turns, tool_timeout = 2, 1.5

    assert RolloutConfig().max_new_tokens == 384  # the CLI's --max-new-tokens default
    reactor = Reactor(engine, Short(), None, RolloutConfig())
    assert (reactor.config.max_turns, reactor.config.tool_timeout) == (2, 1.5)
    explicit = Reactor(engine, Short(), None, RolloutConfig(max_turns=3, tool_timeout=9.0))
    assert (explicit.config.max_turns, explicit.config.tool_timeout) == (3, 9.0)
    groups = await run(engine, Short(), n_tasks=3, group_size=2, max_turns=None)
    trajs = flat(groups)
    assert trajs and all(len(t.turns) <= 2 for t in trajs)
    # A group id names one group: shared by its samples, new for the same task rolled out again.
    again = await run(engine, Short(), n_tasks=3, group_size=2, max_turns=1)
    for g, g2 in zip(groups, again):
        assert g.task.id == g2.task.id and g.id != g2.id and g.id.startswith(g.task.id + "#")
        assert {t.group_id for t in g.trajectories} == {g.id} and {t.group_id for t in g2.trajectories} == {g2.id}


class _Threshold(Environment):
    """Each reward notes the collector's first threshold, after waiting for ``go`` when given
    one (``waiting`` is set then: the run is held open while another ends)."""

    id = "test-collector"
    max_turns = 1

    def __init__(self, seen: list[int], go: anyio.Event | None = None) -> None:
        super().__init__()
        self.seen, self.go, self.waiting = seen, go, anyio.Event()

    def tasks(self, n, seed=0):
        return [Task(f"t/{i}", "Say x.") for i in range(n)]

    def tools(self):
        return []

    async def reward(self, task, trajectory):
        if self.go is not None:
            self.waiting.set()
            await self.go.wait()
        self.seen.append(gc.get_threshold()[0])
        return 0.0


async def test_the_collector_runs_less_often_while_programs_run_and_as_it_was_after():
    """While any run of a reactor is open the collector's first threshold is GC_THRESHOLD; the
    thresholds are put back when the last open run ends, not the first."""
    before = gc.get_threshold()
    engine = InstantEngine(turn_tokens=4)
    first, second, go = [], [], anyio.Event()
    try:
        gc.set_threshold(700, 10, 10)
        assert reactor_module.GC_THRESHOLD is not None and reactor_module.GC_THRESHOLD > 700
        held = Reactor(engine, _Threshold(second, go), None, RolloutConfig())
        async with anyio.create_task_group() as tg:
            tg.start_soon(held.collect, held.env.tasks(1), 1)
            await held.env.waiting.wait()
            await Reactor(engine, _Threshold(first), None, RolloutConfig()).collect(_Threshold(first).tasks(2), 2)
            assert first == [reactor_module.GC_THRESHOLD] * 4
            assert gc.get_threshold()[0] == reactor_module.GC_THRESHOLD, "the held run is still open"
            go.set()
        assert second == [reactor_module.GC_THRESHOLD]
        assert gc.get_threshold() == (700, 10, 10)

        gc.set_threshold(10 * reactor_module.GC_THRESHOLD, 5, 5)  # a higher one is the process's own: kept
        await Reactor(engine, _Threshold(first), None, RolloutConfig()).collect(_Threshold(first).tasks(1), 1)
        assert first[-1] == 10 * reactor_module.GC_THRESHOLD
        assert gc.get_threshold() == (10 * reactor_module.GC_THRESHOLD, 5, 5)
    finally:
        gc.set_threshold(*before)


async def test_gc_threshold_none_leaves_the_collector_alone(monkeypatch):
    before, seen = gc.get_threshold(), []
    monkeypatch.setattr(reactor_module, "GC_THRESHOLD", None)
    try:
        gc.set_threshold(700, 10, 10)
        env = _Threshold(seen)
        await Reactor(InstantEngine(turn_tokens=4), env, None, RolloutConfig()).collect(env.tasks(1), 1)
        assert seen == [700] and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
