"""Where a rollout run's programs run (``agentenv.sources``): ``LocalGroups`` opens a real
sandbox, the bundled model on the embedded engine and a reactor, and streams every program
and group; ``_regroup`` makes a resumed group whole again from the output and the log; the same
trace run through ``LocalGroups`` and ``RayGroups`` (a real local Ray cluster) summarises alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentenv import make
from agentenv.config import RolloutConfig, SandboxOptions
from agentenv.engines.spec import EngineSpec
from agentenv.env import Task
from agentenv.journal import Journal, LogState
from agentenv.reactor import Group
from agentenv.sources import WORKER_SIDE, LocalGroups, _regroup
from agentenv.trajectory import Trajectory


@pytest.mark.anyio
async def test_local_groups_stream_every_program_and_every_group(tmp_path: Path, model_dir: str):
    env = make("retool-math")
    tasks = env.tasks(2, seed=0)
    config = RolloutConfig(max_turns=2, max_new_tokens=48, max_tokens_per_turn=32, concurrency=4).for_env(env)
    log = Journal.create(tmp_path / "r.jsonl.log", {"env": "retool-math"})
    spec = EngineSpec.sampling_as(config, "embedded", model_dir, seed=0)
    programs, groups = set(), []
    async with LocalGroups(env, spec, SandboxOptions(sandbox_pids=32), config, log, programs=4,
                           out=tmp_path / "r.jsonl", by_group=False) as source:
        assert source.prepared > 0  # sessions started while the model loaded
        async with source.results(tasks, 2, None) as results:
            async for item in results:
                if isinstance(item, Group):
                    groups.append(item)
                else:
                    programs.add((item.task_id, item.sample_index))
        summary = source.summary()
    log.close()
    await env.aclose()
    assert sorted(g.task.id for g in groups) == sorted(t.id for t in tasks)
    assert all(len(g.trajectories) == 2 and all(t.reward is not None for t in g.trajectories) for g in groups)
    every = {(t.id, i) for t in tasks for i in range(2)}
    assert {(t.task_id, t.sample_index) for g in groups for t in g.trajectories} == every
    assert programs <= every
    # This source measures the worker-side figures itself (a Ray driver takes them from its workers).
    assert {"mean_requests_in_flight", "session_starts"} <= set(summary) and set(WORKER_SIDE) & set(summary)


def line(task: str, index: int) -> str:
    t = Trajectory(id=f"{task}-{index}", env="e", task_id=task, group_id=f"{task}#g", sample_index=index,
                   prompt_ids=[1], finish_reason="stop", reward=1.0)
    return json.dumps(t.to_dict())


def test_a_group_cut_short_is_scored_whole_again_from_its_lines_and_held_samples(tmp_path: Path):
    out = tmp_path / "r.jsonl"
    # Task a: sample 0 written, sample 1 held in the log; task b: whole; task c: nothing yet.
    out.write_text("\n".join([line("a", 0), line("b", 0), line("b", 1)]) + "\n")
    held = json.loads(line("a", 1))
    resume = LogState({}, {}, {("a", 0), ("b", 0), ("b", 1)}, held={("a", 1): held})
    _regroup(resume, out, [Task("a", "q"), Task("b", "q"), Task("c", "q")], 2)
    assert {tid: sorted(t.sample_index for t in ts) for tid, ts in resume.finished.items()} == {"a": [0, 1]}
    assert ("a", 1) in resume.done  # not run again: scored with its group


#: Summary fields a local and a Ray run of the same trace may differ in, each for its reason.
TIMED = {
    "wall_s": "the run's wall time",
    "tokens_per_s": "tokens over the wall time",
    # Whether a turn's prompt finds its prefix cached depends on which requests the engine
    # batched together and when, which the run's timing decides (a Ray worker's start differs).
    "cached_tokens": "prefix-cache hits: which requests were batched together",
    "prefix_cache_hit_pct": "prefix-cache hits over prompt tokens",
    # A program's later turns find its earlier tokens cached unless its blocks were evicted
    # meanwhile, which depends on what ran beside it then (seen: 10 tokens prefilled again in
    # one run, 0 in the other, the same programs).
    "resume_reuse_pct": "the cache a program's later turns found: what ran beside it",
    "reprefilled_tokens": "tokens prefilled again after eviction: what ran beside it",
}


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_local_and_a_ray_run_of_a_trace_summarise_alike(tmp_path: Path, model_dir: str, ray_cluster):
    """The same small rollout through ``LocalGroups`` and through ``RayGroups`` (one rollout
    worker: the same runtime, in an actor). A trace fixes every program's turns and lengths,
    so the summaries agree field by field, but for the timed fields above and the figures only
    a worker measures (``WORKER_SIDE``), which a Ray driver leaves out."""
    from agentenv.sources import RayGroups

    spec = {"mean_turns": 2.0, "max_turns": 3, "turn_tokens": 8, "max_turn_tokens": 16, "tool_tokens": 4,
            "tool_median": 0.01, "tool_cap": 0.05, "prompt_tokens": 24}
    env = make("trace", **spec)
    tasks = env.tasks(3, seed=1)
    config = RolloutConfig(concurrency=4, max_new_tokens=256, max_turns=env.max_turns, tool_timeout=env.tool_timeout)
    engine = EngineSpec.sampling_as(config, "embedded", model_dir, seed=1)
    summaries = {}
    for name in ("local", "ray"):
        log = Journal.create(tmp_path / f"{name}.jsonl.log", {"env": "trace"})
        source = (LocalGroups(env, engine, "local", config, log, programs=6, out=tmp_path / f"{name}.jsonl",
                              by_group=True) if name == "local" else
                  RayGroups(env, spec, engine, "local", config, log, out=tmp_path / f"{name}.jsonl", workers=1))
        async with source:
            async with source.results(tasks, 2, None) as results:
                groups = [item async for item in results if isinstance(item, Group)]
            assert sorted(g.task.id for g in groups) == sorted(t.id for t in tasks)
            summaries[name] = source.summary()
        log.close()
    await env.aclose()
    local, ray = ({k: v for k, v in s.items() if k not in TIMED} for s in (summaries["local"], summaries["ray"]))
    assert set(WORKER_SIDE) <= set(local) and not set(WORKER_SIDE) & set(ray)  # measured on the worker only
    local = {k: v for k, v in local.items() if k not in WORKER_SIDE}
    assert local["programs"] == 6 and local["turns"] > 6 and local["tool_calls"] > 0  # several turns, tools run
    assert ray == local
    assert set(ray) == set(summaries["ray"]) - set(TIMED)  # nothing else was left out
