"""The one run path (``agentenv.rollout_run``): the writer that both sources feed, the summary
they share, and the same small rollout run here and on a local Ray cluster, whose summaries
agree field by field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv import journal
from agentenv.config import ClusterOptions, OutputOptions, RolloutConfig, RolloutRunConfig, RunOptions
from agentenv.reactor import Group
from agentenv.registry import make
from agentenv.rollout_run import RolloutJob, execute, resuming_line
from agentenv.sources import WORKER_SIDE
from agentenv.summary import summary_rows
from agentenv.trajectory import Trajectory
from agentenv.writer import RunWriter


def traj(task: str, sample: int, *, reason: str = "stop", reward: float | None = 1.0) -> Trajectory:
    t = Trajectory(f"{task}-{sample}", "e", task, f"{task}#g", sample, [1, 2], reward=reward, finish_reason=reason)
    t.add_model([3, 4], [-0.1, -0.2], 0)
    return t


def records(log: Path) -> list[tuple[str, str]]:
    """(event, key) of every record after the header."""
    objs, _ = journal.read(log)
    return [(o["e"], o.get("k", "")) for o in objs[1:]]


def lines(out: Path) -> list[tuple[str, int]]:
    return [(d["task_id"], d["sample_index"]) for d in map(json.loads, out.read_text().splitlines())]


def test_the_writer_writes_each_program_once_as_it_finishes(tmp_path):
    out, log = tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"
    j = journal.Journal.create(log, {})
    with RunWriter(out, j, by_group=False) as w:
        assert w.take(traj("a", 0)) == 1
        assert lines(out) == [("a", 0)]  # at once, not when its group completes
        assert w.take(Group(None, [traj("a", 0), traj("a", 1)])) == 1  # a group whose first program came before
        assert w.take(traj("b", 0, reason="error:engine")) == 1  # finished, but not a result
        assert w.take(traj("b", 1, reason="error:reward", reward=None)) == 1
    j.close()
    assert lines(out) == [("a", 0), ("a", 1), ("b", 1)] and w.written == 3
    assert [t.task_id for t in w.held_back] == ["b"] and len(w.reward_errors) == 1
    assert records(log) == [("done", "a-0"), ("done", "a-1"), ("done", "b-1")]


def test_with_a_group_reward_a_group_is_written_whole_or_held(tmp_path):
    out, log = tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"
    j = journal.Journal.create(log, {})
    with RunWriter(out, j, by_group=True) as w:
        for t in (traj("a", 0), traj("a", 1)):
            w.take(t)
        assert lines(out) == []  # not before the group is scored
        w.take(Group(None, [traj("a", 0), traj("a", 1)]))
        w.take(Group(None, [traj("b", 0), traj("b", 1, reason="error:engine")]))
    j.close()
    assert lines(out) == [("a", 0), ("a", 1)]
    assert [t.sample_index for t in w.waiting] == [0] and [t.sample_index for t in w.held_back] == [1]
    assert records(log) == [("done", "a-0"), ("done", "a-1"), ("held", "b-0")]


def test_a_resumed_run_neither_rewrites_nor_recounts_what_was_finished(tmp_path):
    out, log = tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"
    out.write_text(json.dumps(traj("a", 0).to_dict()) + "\n")
    j = journal.Journal.create(log, {})
    with RunWriter(out, j, by_group=True, in_out={("a", 0)}, already={("a", 1)}, append=True) as w:
        fresh = w.take(Group(None, [traj("a", 0), traj("a", 1), traj("a", 2)]))  # a Ray group comes back whole
    j.close()
    assert fresh == 1  # only a/2 ran in this run
    assert lines(out) == [("a", 0), ("a", 1), ("a", 2)]  # the held sample is written with its group


def test_the_resuming_line_counts_in_words():
    assert resuming_line(1, 0, 0) == "resuming: 1 trajectory done, 0 in flight continue from their last logged turn"
    assert resuming_line(2, 1, 3) == ("resuming: 2 trajectories done, 1 in flight continue from their last logged "
                                      "turn, 3 finished wait for their groups")


def test_the_summary_leaves_out_what_its_source_did_not_measure():
    full = {"programs": 2, "turns": 3, "tool_calls": 1, "tool_errors": 0, "programs_with_ok_tool_call": 1,
            "tokens_generated": 9, "tokens_per_s": 3.0, "prefix_cache_hit_pct": 50.0, "resume_reuse_pct": 0.0,
            "mean_requests_in_flight": 1.5, "engine_idle_pct": 2.0, "engine_under_half_pct": None, "pauses": 0,
            "restores": 0, "session_waits": 0, "session_wait_s": 0.0, "session_starts": 0, "session_start_p50_ms": None,
            "session_start_p90_ms": None, "mean_reward": 0.5, "reward_components": {"correct": 0.5},
            "finish_reasons": {"stop": 2}, "wall_s": 1.0}
    here = dict(summary_rows(full, prepared=2, startup_s=3.0, startup="model, sandbox"))
    driver = dict(summary_rows({k: v for k, v in full.items() if k not in WORKER_SIDE}, startup_s=3.0,
                               startup="cluster, workers", extra=[("workers (pids)", "1, 2")]))
    assert here["engine occupancy (mean requests in flight)"] == 1.5 and here["pauses / restores (KV pressure)"]
    assert here["sandbox sessions prepared ahead (model loading)"] == 2
    assert (
        "engine occupancy (mean requests in flight)" not in driver and "pauses / restores (KV pressure)" not in driver
    )
    assert driver["workers (pids)"] == "1, 2" and driver["  mean correct"] == 0.5
    assert set(here) - set(driver) == {
        "engine occupancy (mean requests in flight)",
        "engine idle (no request in flight)",
        "pauses / restores (KV pressure)",
        "sandbox sessions prepared ahead (model loading)",
    }


# The figures a run's stats give that depend on timing or on which programs shared an engine's
# prefix cache (one engine here, one per worker on Ray), and those a Ray driver does not see
# (its workers' engines and sandboxes measure them): not compared.
TIMING = {"tokens_per_s", "wall_s"}
CACHE = {"cached_tokens", "prefix_cache_hit_pct", "resume_reuse_pct", "reprefilled_tokens"}


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_same_rollout_here_and_on_ray_reports_the_same_summary(ray_cluster, tmp_path, model_dir):
    """4 tasks x 2, greedy (temperature 0: the same tokens whatever the batching), through the
    one run path: in this process, then on 2 Ray rollout workers."""
    base = RolloutRunConfig(run=RunOptions(tasks=4, group_size=2, seed=11),
                            rollout=RolloutConfig(temperature=0.0, max_new_tokens=96, concurrency=4))
    base = replace(base, engine=replace(base.engine, model=model_dir))
    results = {}
    for where in ("none", "ray"):
        out = tmp_path / f"{where}.jsonl"
        opts = replace(base, output=OutputOptions(out=out, progress=False),
                       cluster=ClusterOptions(cluster=where, workers=2))
        job = RolloutJob.open(opts, make("retool-math"))
        results[where] = (await execute(job), out)
    (here, here_out), (ray, ray_out) = results["none"], results["ray"]
    assert here.code == ray.code == 0 and here.written == ray.written == 8
    compared = set(here.summary) - TIMING - CACHE - set(WORKER_SIDE)
    assert set(ray.summary) == compared | TIMING | CACHE  # the driver gives every figure it can measure
    assert {"programs", "turns", "tool_calls", "tokens_generated", "mean_reward", "finish_reasons"} <= compared
    for key in sorted(compared):
        assert ray.summary[key] == here.summary[key], key
    # The same trajectories, token for token.
    def by_key(out: Path) -> dict:
        return {(d["task_id"], d["sample_index"]): (d["input_ids"], d["reward"])
                for d in map(json.loads, out.read_text().splitlines())}

    assert by_key(ray_out) == by_key(here_out)


@pytest.mark.anyio
async def test_an_overwrite_that_fails_to_start_leaves_the_old_run_as_it_was(tmp_path, model_dir):
    """--overwrite touches nothing of the run it replaces until its own has started: after an
    engine that fails to start, the old output and log are there byte for byte (a later
    --resume with the new settings is refused by the old header); after a start, both are the
    new run's."""
    from agentenv.errors import AgentEnvError

    out = tmp_path / "r.jsonl"
    old = RolloutRunConfig(run=RunOptions(tasks=2, group_size=1, seed=3),
                           rollout=RolloutConfig(temperature=1.0, max_new_tokens=8),
                           output=OutputOptions(out=out, progress=False))
    old = replace(old, engine=replace(old.engine, model=model_dir))
    assert (await execute(RolloutJob.open(old, make("retool-math")))).written == 2
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["r.jsonl", "r.jsonl.log"]

    new = replace(old, rollout=replace(old.rollout, temperature=0.5), output=replace(old.output, overwrite=True))
    bad = replace(new, engine=replace(new.engine, engine_kwargs={"bogus": 1}))
    with pytest.raises(AgentEnvError, match="bad --engine-arg"):
        await execute(RolloutJob.open(bad, make("retool-math")))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    resumed = replace(new, output=replace(new.output, overwrite=False, resume=True))
    with pytest.raises(AgentEnvError, match="^cannot resume with different settings: temperature was 1.0, now 0.5$"):
        RolloutJob.open(resumed, make("retool-math"))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    result = await execute(RolloutJob.open(replace(new, run=replace(new.run, tasks=1)), make("retool-math")))
    assert result.code == 0 and result.written == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r.jsonl.log"]
    assert len(lines(out)) == 1  # the new run's one line, none of the old run's two
    objs, _ = journal.read(Path(f"{out}.log"))
    assert objs[0]["settings"]["temperature"] == 0.5
    assert [e for e, _ in records(Path(f"{out}.log"))].count("done") == 1
