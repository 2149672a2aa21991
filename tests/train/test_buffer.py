import pytest

from agentenv.env import Task
from agentenv.reactor import Group
from agentenv.train.buffer import RolloutBuffer, StalenessGate
from agentenv.trajectory import Trajectory


def group(task_id: str, versions: list[int], reward: float | None = 1.0, g: int = 2) -> Group:
    trajs = []
    for i in range(g):
        t = Trajectory(f"{task_id}-{i}", "env", task_id, task_id, i, [1, 2])
        for v in versions:
            t.add_model([5, 6], [-0.1, -0.2], v)
        t.finish_reason, t.reward = "stop", reward
        trajs.append(t)
    return Group(Task(task_id, "q"), trajs)


def test_only_complete_scored_groups_enter_and_capacity_is_bounded():
    buf = RolloutBuffer(capacity=2, max_staleness=1)
    with pytest.raises(ValueError):
        buf.put(group("a", [0], reward=None))
    failed = group("a", [0], reward=None)
    failed.trajectories[0].error = "reward: ValueError: boom"  # scored, and it failed: data
    failed.trajectories[1].reward = 1.0
    buf.put(failed)
    buf.put(group("b", [0]))
    with pytest.raises(OverflowError):
        buf.put(group("c", [0]))


def test_stale_groups_are_dropped_and_staleness_is_recorded():
    buf = RolloutBuffer(capacity=10, max_staleness=1)
    buf.put(group("old", [0]))
    buf.put(group("mixed", [1, 2]))  # a partial rollout that continued across an update
    buf.put(group("new", [2]))
    assert buf.take(3, version=2) is None  # "old" is 2 versions behind: dropped
    assert buf.dropped == 1
    batch = buf.take(2, version=2)
    assert [g.task.id for g in batch] == ["mixed", "new"]
    assert buf.staleness == {1: 4, 0: 8}  # per consumed token: 2 groups x 2 samples x 2 tokens


def test_admission_bounds_work_in_flight_and_staleness():
    """Properties of the gate: in-flight + queued groups never exceed (max_staleness + 1)
    batches beyond what was consumed, and when programs finish in the order they started,
    no consumed group is more than max_staleness versions old. (Out-of-order stragglers are
    what the buffer's version-based dropping is for.)"""
    import random

    rng = random.Random(0)
    for max_staleness in (0, 1, 3):
        batch = 4
        gate, version, consumed_total = StalenessGate(batch=batch, max_staleness=max_staleness), 0, 0
        running: list[int] = []
        done: list[int] = []
        for _ in range(3000):
            if rng.random() < 0.6 and gate.start(version):
                running.append(version)
            assert gate.started - consumed_total <= (max_staleness + 1) * batch
            if running and rng.random() < 0.5:
                done.append(running.pop(0))  # finish in start order
            if len(done) >= batch and rng.random() < 0.3:
                consumed, done = done[:batch], done[batch:]
                assert all(version - v <= max_staleness for v in consumed)
                consumed_total += batch
                version += 1
        assert version > 50  # the loop really trained


def test_oldest_groups_are_consumed_first_so_stragglers_are_not_wasted():
    buf = RolloutBuffer(capacity=10, max_staleness=2)
    buf.put(group("new", [2]))
    buf.put(group("straggler", [0]))  # admitted at version 0, finished last
    buf.put(group("mid", [1]))
    assert [g.task.id for g in buf.take(2, version=2)] == ["straggler", "mid"]
    assert buf.dropped == 0 and len(buf) == 1
