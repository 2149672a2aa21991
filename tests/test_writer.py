"""``RunWriter`` (``agentenv.writer``): what reaches the JSONL output and the event log, with a
real ``Journal`` on disk, read back as ``--resume`` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentenv.env import Environment, Task
from agentenv.journal import Journal, load_state, read
from agentenv.reactor import Group
from agentenv.trajectory import Trajectory
from agentenv.writer import RunWriter, has_group_reward


def program(task: str, index: int, finish: str = "stop") -> Trajectory:
    t = Trajectory(id=f"{task}-{index}", env="test", task_id=task, group_id=f"{task}#g", sample_index=index,
                   prompt_ids=[1, 2, 3], finish_reason=finish, reward=1.0 if finish == "stop" else 0.0)
    t.add_model([4, 5], [-0.5, -0.25], 0)
    return t


def group(task: str, finishes: list[str]) -> Group:
    return Group(Task(task, "q"), [program(task, i, f) for i, f in enumerate(finishes)])


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"


def written(out: Path) -> list[tuple[str, int]]:
    return [(row["task_id"], row["sample_index"]) for row in map(json.loads, out.read_text().splitlines())]


def logged(log_path: Path):
    records, _ = read(log_path)
    return load_state(records)


def test_each_program_is_written_once_as_it_finishes_and_logged_done(paths):
    out, log_path = paths
    log = Journal.create(log_path, {"env": "test"})
    with RunWriter(out, log, by_group=False) as writer:
        assert writer.take(program("a", 0)) == 1
        assert written(out) == [("a", 0)]  # at once, not at the group's end
        assert writer.take(program("a", 0)) == 0  # the same sample again: nothing new
        assert writer.take(group("a", ["stop", "stop"])) == 1  # sample 1 is new, sample 0 is not
    log.close()
    assert written(out) == [("a", 0), ("a", 1)] and writer.written == 2
    assert logged(log_path).done == {("a", 0), ("a", 1)}


def test_what_the_engine_failed_on_is_held_back_not_written_and_not_done(paths):
    out, log_path = paths
    log = Journal.create(log_path, {"env": "test"})
    with RunWriter(out, log, by_group=False) as writer:
        writer.take(program("a", 0, "error:engine"))
        writer.take(program("a", 1))
    log.close()
    assert written(out) == [("a", 1)]
    assert [t.sample_index for t in writer.held_back] == [0]
    assert logged(log_path).done == {("a", 1)}  # --resume runs sample 0 again


def test_with_a_group_reward_a_group_is_written_whole_or_held_in_the_log(paths):
    out, log_path = paths
    log = Journal.create(log_path, {"env": "test"})
    with RunWriter(out, log, by_group=True) as writer:
        writer.take(program("a", 0))
        assert written(out) == []  # a program alone waits for its group's score
        writer.take(group("a", ["stop", "stop"]))
        writer.take(group("b", ["stop", "error:engine", "stop"]))
    log.close()
    assert written(out) == [("a", 0), ("a", 1)]
    state = logged(log_path)
    assert state.done == {("a", 0), ("a", 1)}
    # b's finished samples wait in the log, so that the group is scored whole on resume.
    assert set(state.held) == {("b", 0), ("b", 2)} and [t.sample_index for t in writer.waiting] == [0, 2]


def test_a_resumed_runs_lines_are_not_written_again_nor_counted_again(paths):
    out, log_path = paths
    out.write_text(json.dumps(program("a", 0).to_dict()) + "\n")
    log = Journal.create(log_path, {"env": "test"})
    with RunWriter(out, log, by_group=False, in_out={("a", 0)}, append=True) as writer:
        assert writer.take(group("a", ["stop", "stop"])) == 1
    log.close()
    assert written(out) == [("a", 0), ("a", 1)]


def test_a_reward_error_is_written_and_kept_for_the_summary(paths):
    out, log_path = paths
    log = Journal.create(log_path, {"env": "test"})
    failed = program("a", 0, "error:reward")
    failed.error = "reward raised ValueError"
    with RunWriter(out, log, by_group=False) as writer:
        writer.take(failed)
    log.close()
    assert written(out) == [("a", 0)] and writer.reward_errors == ["reward raised ValueError"]


def test_has_group_reward_is_the_environments_own_answer():
    class PerSample(Environment):
        pass

    class Grouped(Environment):
        async def group_reward(self, task, trajectories):
            return None

    assert (PerSample().has_group_reward(), Grouped().has_group_reward()) == (False, True)
    assert (has_group_reward(PerSample()), has_group_reward(Grouped())) == (False, True)  # the former name
