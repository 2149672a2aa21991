"""Trace workloads (``agentenv.workload``): traces are pure functions of the spec and the
program's key, bounded as documented, and a trace program runs its trace exactly on the real
embedded engine, with and without a real sandbox session per tool call."""

from __future__ import annotations

import math
import statistics

import anyio
import pytest

from agentenv import Reactor, RolloutConfig
from agentenv.sandboxes.local import LocalSandbox
from agentenv.workload import TraceEnv, TraceFormat, WorkloadSpec, program_trace, workload

SMALL = {"tool_median": 0.01, "tool_cap": 0.05, "mean_turns": 3.0, "turn_tokens": 10, "tool_tokens": 5,
         "prompt_tokens": 24}


def test_a_trace_is_a_pure_function_of_the_spec_and_the_programs_key():
    spec = WorkloadSpec(mean_turns=8, max_turns=12, max_turn_tokens=100, max_total_tokens=900)
    assert program_trace(spec, "0/1/2") == program_trace(WorkloadSpec(**{f: getattr(spec, f) for f in spec.__slots__}),
                                                         "0/1/2")
    assert program_trace(spec, "0/1/2") != program_trace(spec, "0/1/3")
    w = workload(spec, tasks=5, group_size=3, seed=4)
    assert [len(g) for g in w] == [3] * 5
    assert w[2][1] == program_trace(spec, "4/2/1")  # task-major, keyed seed/task/sample
    for trace in (p for g in workload(spec, 40, 4) for p in g):
        assert 1 <= trace.turns <= spec.max_turns
        assert len(trace.tool_tokens) == len(trace.tool_latency) == trace.turns - 1
        assert all(8 <= n <= spec.max_turn_tokens for n in trace.turn_tokens)
        assert all(4 <= n <= 256 for n in trace.tool_tokens)
        assert all(0 < s <= spec.tool_cap for s in trace.tool_latency)
        # The context bounds a program: only a single turn may exceed it.
        assert trace.total_tokens <= spec.max_total_tokens or trace.turns == 1
        assert trace.total_tokens == trace.prompt_tokens + sum(trace.turn_tokens) + sum(trace.tool_tokens)


def test_the_lognormal_profile_is_heavy_tailed_and_swe_is_not():
    spread = {}
    for profile in ("lognormal", "swe"):
        spec = WorkloadSpec(profile=profile, tool_median=1.0, tool_cap=1000.0)
        lat = [s for g in workload(spec, 100, 2) for p in g for s in p.tool_latency]
        spread[profile] = statistics.pstdev(math.log(s) for s in lat)
        assert 0.7 < statistics.median(lat) < 1.4, profile
    assert spread["lognormal"] > 0.8 and spread["swe"] < 0.25, spread


def test_a_bad_spec_is_refused():
    with pytest.raises(ValueError, match="profile must be one of"):
        WorkloadSpec(profile="uniform")
    with pytest.raises(ValueError, match="tool_cpu must be between 0 and 1"):
        WorkloadSpec(tool_cpu=1.5)
    with pytest.raises(TypeError):
        TraceEnv(turns=3)  # not a WorkloadSpec field


def test_every_instance_plays_the_same_trace_from_the_task_id_alone():
    env = TraceEnv(**SMALL)
    task = env.tasks(3, seed=7)[2]
    assert task.id == "trace/7/2" and task.data == {"seed": 7, "index": 2}
    other = TraceEnv(**SMALL)  # made no tasks: a rollout worker elsewhere
    trace = other.trace_of(task.id, 1)
    assert trace == env.trace_of(task.id, 1) == program_trace(env.spec, "7/2/1")
    plans = [env.plan_turn(task, type("T", (), {"sample_index": 1})(), i) for i in range(trace.turns)]
    assert [p.max_tokens for p in plans] == list(trace.turn_tokens)
    assert not any(p.stop for p in plans) and [p.last for p in plans] == [False] * (trace.turns - 1) + [True]
    assert TraceFormat().parse("anything at all", ["trace"])[0].name == "trace"
    with pytest.raises(ValueError, match="not a trace task id"):
        other.trace_of("retool/1", 0)


@pytest.mark.anyio
@pytest.mark.parametrize("sandbox", [False, True])
async def test_a_trace_program_samples_and_receives_exactly_its_trace(engine, sandbox):
    env = TraceEnv(sandbox=sandbox, **SMALL)
    config = RolloutConfig(concurrency=2, max_turns=64, max_new_tokens=10_000, max_tokens_per_turn=4096)
    tasks = env.tasks(1, seed=3)
    with anyio.fail_after(300):
        if sandbox:
            async with LocalSandbox() as sb:
                groups = await Reactor(engine, env, sb, config).collect(tasks, 2)
        else:  # no sandbox at all: a trace tool without one never asks for a session
            groups = await Reactor(engine, env, None, config).collect(tasks, 2)
    for t in groups[0].trajectories:
        t.validate()
        trace = env.trace_of(t.task_id, t.sample_index)
        assert [len(s.token_ids) for s in t.segments if s.kind == "model"] == list(trace.turn_tokens)
        spliced = [engine.tokenizer.decode(s.token_ids) for s in t.segments if s.kind == "env"]
        assert spliced == [env.filler * n for n in trace.tool_tokens]
        assert t.finish_reason == "stop" and [c.status for c in t.tool_calls] == ["ok"] * (trace.turns - 1)


def test_the_trace_envs_turn_cap_is_its_specs_max_turns():
    """``agentenv envs`` shows one max_turns for trace: the spec's, which caps a trace's turns
    and is the cap the run uses; --env-arg max_turns=N moves both."""
    from agentenv.registry import describe, make

    assert describe("trace")["max_turns"] == WorkloadSpec().max_turns == 30
    assert make("trace", sandbox=False, max_turns=12).max_turns == 12
