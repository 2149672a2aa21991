"""The step loop's batch check on a real rollout's groups. (The loop itself runs in every
``test_trainer`` test: ``Trainer`` opens its parts and hands them to ``StepLoop``.)"""

from __future__ import annotations

import pytest

from agentenv.errors import EngineError, SandboxError
from agentenv.reactor import Group
from agentenv.trajectory import Trajectory
from agentenv.train.loop import check_batch


def failed(groups: list[Group], reasons: list[str]) -> list[Group]:
    """The groups with their trajectories' finish reasons replaced, in order."""
    it = iter(reasons)
    return [Group(g.task, [Trajectory.from_dict({**t.to_dict(), "finish_reason": next(it), "error": "boom"})
                           for t in g.trajectories]) for g in groups]


def test_a_batch_that_failed_only_in_the_engine_or_the_sandbox_stops_the_run(groups):
    check_batch(groups, 1)  # a real rollout's batch is fine
    with pytest.raises(EngineError, match="every program of step 3 failed in the engine: boom"):
        check_batch(failed(groups, ["error:engine"] * 6), 3)
    with pytest.raises(SandboxError, match="failed in the sandbox"):
        check_batch(failed(groups, ["error:sandbox"] + ["error:engine"] * 5), 1)


def test_one_program_that_did_not_fail_in_the_infrastructure_keeps_the_run_going(groups):
    check_batch(failed(groups, ["error:engine"] * 5 + ["error:reward"]), 1)  # failures are data
    check_batch([], 1)
