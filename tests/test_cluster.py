"""Rollouts on a real local Ray cluster (one per test session): two rollout workers, each a Ray
actor with its own embedded engine, reactor and sandbox pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.cluster import RayRollouts  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402
from agentenv.trajectory import Trajectory  # noqa: E402

pytestmark = pytest.mark.anyio
CONFIG = RolloutConfig(concurrency=8, max_new_tokens=192)


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


def keys(trajs) -> list[tuple[str, int]]:
    return sorted((t.task_id, t.sample_index) for t in trajs)


async def test_two_workers_produce_what_a_local_run_produces(cluster, engine, tokenizer):
    env = make("retool-math")
    tasks = env.tasks(6, seed=3)
    async with RayRollouts("retool-math", workers=2, config=CONFIG, seed=3) as c:
        remote = [t async for t in c.rollouts(tasks, group_size=2)]
        assert len(set(c.pids)) == 2 and os.getpid() not in c.pids  # two actor processes did the work
    async with LocalSandbox() as sb, Reactor(engine, env, sb, CONFIG) as reactor:
        local = [t for g in await reactor.collect(tasks, 2) for t in g.trajectories]
    assert keys(remote) == keys(local) == sorted((t.id, i) for t in tasks for i in range(2))
    for t in remote:
        again = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))  # aligned arrays, masks, segments
        assert again.input_ids[: len(t.prompt_ids)] == t.prompt_ids
        assert tokenizer.decode(t.completion_ids, skip_special_tokens=False) == t.text
        assert t.finish_reason in ("stop", "length", "max_turns", "context_overflow")
        assert t.reward is not None
    # Groups arrive whole: each task's samples are adjacent in the stream.
    order = [t.task_id for t in remote]
    assert all(order[i] == order[i + 1] for i in range(0, len(order), 2))


async def test_a_worker_killed_mid_run_loses_nothing(cluster):
    env = make("retool-math")
    tasks = env.tasks(8, seed=5)
    got = []
    async with RayRollouts("retool-math", workers=2, config=CONFIG, seed=5, groups_per_worker=2) as c:
        victim = c.workers[0]
        async for t in c.rollouts(tasks, group_size=2):
            got.append(t)
            if len(got) == 2:  # one group done, others in flight on both workers
                ray.kill(victim)
        assert c.replaced == 1 and c.rerun >= 1 and victim not in c.workers
    assert keys(got) == sorted((t.id, i) for t in tasks for i in range(2))  # every one, exactly once
    assert all(t.reward is not None for t in got)


def test_cli_rollout_on_a_ray_cluster_and_its_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # the CLI starts a local cluster for the run, and stops it
    cmd = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", "retool-math", "--tasks", "4", "--group-size",
           "2", "--cluster", "ray", "--workers", "2", "--concurrency", "8", "--out", str(out), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [Trajectory.from_dict(json.loads(x)) for x in out.read_text().splitlines()]
    want = sorted((t.id, i) for t in make("retool-math").tasks(4, seed=0) for i in range(2))
    assert keys(lines) == want
    assert "workers replaced" in r.stderr
    # A crash after three lines (the second group half written) and mid-way through a fourth:
    # the output's first three lines and a torn one, the log's header and three `done` records.
    kept = out.read_text().splitlines(keepends=True)[:3]
    out.write_text("".join(kept) + '{"task_id": "torn')
    log = tmp_path / "r.jsonl.log"
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:4]))
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming: 3 trajectories done; 3 tasks with samples missing run again" in r.stderr
    again = [Trajectory.from_dict(json.loads(x)) for x in out.read_text().splitlines()]
    assert keys(again) == want  # every sample exactly once
    assert [t.to_dict() for t in again[:3]] == [json.loads(x) for x in kept]  # the finished lines kept as they were
