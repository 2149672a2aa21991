"""The reactor under each scheduling policy: real embedded engine, real sandbox processes, the
trace workload (lengths fixed by the trace, so every policy must produce the same shapes)."""

from __future__ import annotations

import anyio
import pytest

from agentenv import Reactor, RolloutConfig, make
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.costs import CostModel
from agentenv.sandboxes.local import LocalSandbox

from .conftest import child_pids
from .waiting import until

pytestmark = pytest.mark.anyio

SPEC = {"tool_median": 0.02, "tool_cap": 0.1, "mean_turns": 3.0, "turn_tokens": 12, "tool_tokens": 6,
        "prompt_tokens": 24}


def cfg(policy: str, **kw) -> RolloutConfig:
    return RolloutConfig(**{"scheduling": policy, "concurrency": 4, "max_turns": 64, "max_new_tokens": 10_000,
                            "max_tokens_per_turn": 4096, "tool_timeout": 10.0, **kw})


def check_against_trace(env, trajs, tok) -> None:
    for t in trajs:
        t.validate()
        trace = env.trace_of(t.task_id, t.sample_index)
        model = [s for s in t.segments if s.kind == "model"]
        envs = [s for s in t.segments if s.kind == "env"]
        # Every turn sampled exactly its trace length, verbatim (mask 1, logprob, version).
        assert [len(s.token_ids) for s in model] == list(trace.turn_tokens)
        assert all(len(s.logprobs) == len(s.token_ids) == len(s.weight_versions) for s in model)
        # Every tool output is spliced with mask 0, exactly what the tool returned.
        assert [tok.decode(s.token_ids) for s in envs] == [env.filler * n for n in trace.tool_tokens]
        assert sum(t.loss_mask) == sum(trace.turn_tokens)
        assert t.finish_reason == "stop" and len(t.tool_calls) == trace.turns - 1
        assert all(c.status == "ok" for c in t.tool_calls)
        assert tok.decode(t.input_ids).endswith(t.text)
        # Resumed turns come from the prefix cache (nothing was paused here).
        assert all(turn.cached_tokens > 0 for turn in t.turns[1:])


@pytest.mark.parametrize("policy", ["program", "fifo", "lockstep"])
async def test_every_policy_yields_the_trace_exactly(engine, policy):
    env = make("trace", **SPEC)
    before = child_pids()
    async with LocalSandbox() as sb:
        async with Reactor(engine, env, sb, cfg(policy)) as reactor:
            groups = await reactor.collect(env.tasks(4, seed=1), 3)
        # Every session a program had is closed (only the pool's own prewarmed ones remain).
        prewarmed = set(sb.ready_pids)
        assert set(sb.worker_pids) == prewarmed and len(prewarmed) <= sb.prewarm
    assert child_pids() - before == set()
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12 and len({(t.task_id, t.sample_index) for t in trajs}) == 12
    check_against_trace(env, trajs, engine.tokenizer)
    s = reactor.stats.occupancy
    assert s.in_flight == 0 and 0 < s.mean_in_flight <= (12 if policy == "lockstep" else 4)
    # Idle time is part of the time under half the slots (the last program's tail at least).
    assert s.slots == 4 and s.idle_fraction <= s.under_half_fraction < 1
    assert reactor.stats.summary()["engine_under_half_pct"] == round(100 * s.under_half_fraction, 1)
    assert reactor.scheduler.done and not reactor.scheduler.programs
    # The program policy measures the engine's costs from every turn it serves.
    fit = reactor.cost_fit
    assert fit is None if policy != "program" else len(fit) == sum(len(t.turns) for t in trajs)


async def test_programs_are_decoupled_from_decode_slots(engine):
    """With tools slower than turns, the program policy keeps more programs in flight than it
    has decode slots, and never more requests than slots."""
    env = make("trace", **{**SPEC, "tool_median": 0.3, "tool_cap": 0.6})
    seen = {"admitted": 0, "in_flight": 0}
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, cfg("program", concurrency=2, max_programs=8))
        sched = reactor.scheduler
        original = sched.schedule

        def watch():
            d = original()
            seen["admitted"] = max(seen["admitted"], sched.admitted)
            seen["in_flight"] = max(seen["in_flight"], sched.in_flight)
            return d

        sched.schedule = watch
        groups = await reactor.collect(env.tasks(4, seed=2), 2)
    assert seen["admitted"] == 8 and seen["in_flight"] <= 2
    check_against_trace(env, [t for g in groups for t in g.trajectories], engine.tokenizer)


async def test_sessions_are_prepared_ahead_and_unused_ones_handed_on(engine):
    """A program that never calls a tool never waits for a session; one that does finds it
    ready (prepared while it decoded)."""
    env = make("trace", **{**SPEC, "mean_turns": 1.0})  # mostly single-turn programs
    async with LocalSandbox() as sb:
        async with Reactor(engine, env, sb, cfg("program")) as reactor:
            groups = await reactor.collect(env.tasks(6, seed=3), 2)
    trajs = [t for g in groups for t in g.trajectories]
    check_against_trace(env, trajs, engine.tokenizer)
    assert reactor.stats.sessions.session_waits <= sum(1 for t in trajs if t.tool_calls)


@pytest.mark.slow
@pytest.mark.parametrize("cost", [None, CostModel(step_base=0.01, step_per_seq=0.001, prefill_per_token=0.0),
                                  "measured"], ids=["held", "costed", "measured"])
async def test_kv_pressure_pauses_and_restores_and_stays_exact(model_dir, cost):
    """A KV cache far smaller than the working set: the scheduler pauses and restores whole
    programs, every program finishes, and the trajectories are still exactly the trace. With
    a cost model (here re-prefill is free: acting programs' KV goes to waiting ones at once)
    the reactor gives the scheduler its clock: the tools' durations are measured on it.
    Measured: the scheduler is given the model fitted from the turns served so far."""
    env = make("trace", **{**SPEC, "mean_turns": 5.0, "turn_tokens": 24, "tool_tokens": 16, "prompt_tokens": 48,
                              "max_total_tokens": 600})
    engine = EmbeddedEngine(model_dir, seed=0, kv_cache_tokens=1024)
    async with engine:
        async with LocalSandbox() as sb, Reactor(engine, env, sb, cfg("program", concurrency=8),
                                                 cost_model=cost) as reactor:
            groups = await reactor.collect(env.tasks(6, seed=4), 3)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 18
    for t in trajs:
        t.validate()
        trace = env.trace_of(t.task_id, t.sample_index)
        assert [len(s.token_ids) for s in t.segments if s.kind == "model"] == list(trace.turn_tokens)
        assert t.finish_reason == "stop"
    assert reactor.stats.sessions.pauses > 0 and reactor.stats.sessions.restores > 0
    assert reactor.scheduler.peak_working_set <= 1024
    tools = reactor.scheduler.tool_times
    assert len(tools) == sum(len(t.tool_calls) for t in trajs) and tools.remaining(0.0) > 0
    if cost == "measured":  # every turn measured; the scheduler holds the latest fit, or none
        fit, turns = reactor.cost_fit, sum(len(t.turns) for t in trajs)
        assert len(fit) == turns, f"one row per turn that sampled ({len(fit)} rows, {turns} turns)"
        assert reactor.scheduler.config.cost is fit.model
        # Whether the rows priced a prefilled token (and so gave a model) depends on the
        # machine's timing: a busy one's noise can hide the price, and then no model is given
        # (tests/test_scheduler.py fits known rows).
        assert fit.model is None if fit.fits == 0 else fit.model.step_base > 0 and fit.model.prefill_per_token > 0


async def test_cancelling_with_programs_queued_and_sessions_prepared_leaves_nothing(engine):
    env = make("trace", **{**SPEC, "tool_median": 0.5, "tool_cap": 1.0, "mean_turns": 6.0})
    before = child_pids()
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, cfg("program", concurrency=2, max_programs=4))
        async with anyio.create_task_group() as tg:
            tg.start_soon(reactor.collect, env.tasks(16, seed=5), 4)
            await until(lambda: reactor.scheduler.queued and reactor.stats.outcomes.started,
                        "programs queued while others run")
            tg.cancel_scope.cancel()
        assert reactor.scheduler.queued == 0 and reactor.scheduler.admitted == 0
        await reactor.__aexit__(None, None, None)
    assert child_pids() - before == set()


def _tree_cpu() -> float:
    """CPU seconds of this process's descendants (the sandbox pool), reaped ones included."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.mark.slow
async def test_cpu_bound_trace_tools_compute_in_the_sandbox(engine):
    with pytest.raises(ValueError, match="tool_cpu"):
        make("trace", tool_cpu=1.5)
    env = make("trace", **{**SPEC, "tool_median": 0.3, "tool_cap": 0.6, "tool_cpu": 1.0})
    tasks = env.tasks(3, seed=0)  # 2.75 s of tool latency in all
    busy = sum(sum(env.trace_of(t.id, i).tool_latency) for t in tasks for i in range(2))
    async with LocalSandbox() as sb:
        async with Reactor(engine, env, sb, cfg("program")) as reactor:
            before = _tree_cpu()
            groups = await reactor.collect(tasks, 2)
            # The tool latency was the sandbox's CPU: it shows in the fork servers' children's
            # times once they have reaped the closed sessions.
            assert busy > 1.5
            await until(lambda: _tree_cpu() - before >= 0.8 * busy,
                        f"the sandbox spent 0.8 x {busy:.2f} s of CPU (it spent {_tree_cpu() - before:.2f} s)")
    check_against_trace(env, [t for g in groups for t in g.trajectories], engine.tokenizer)


def test_a_trace_task_plays_the_same_on_an_env_that_did_not_make_it():
    maker, worker = make("trace", **SPEC), make("trace", **SPEC)  # e.g. the driver and a Ray worker
    task = maker.tasks(3, seed=4)[2]
    assert worker.trace_of(task.id, 1) == maker.trace_of(task.id, 1)
    with pytest.raises(ValueError, match="not a trace task id"):
        worker.trace_of("retool-math/0/1", 0)
