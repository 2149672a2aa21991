"""Fixtures shared by the trainer tests: a real rollout's scored groups, and an environment
whose groups always have reward variance."""

from __future__ import annotations

import copy

import anyio
import pytest

from agentenv.config import RolloutConfig
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.reactor import Reactor
from agentenv.sandboxes import default_sandbox


class AlternatingReward(RetoolMathEnv):
    """Every group has reward variance (odd samples score 1), so every step has a gradient."""

    async def reward(self, task, trajectory):
        return float(trajectory.sample_index % 2)


@pytest.fixture(scope="session")
def rollout_groups(model_dir):
    """Two scored GRPO groups of 3 from a real rollout (version 0), with reward variance in
    each. What the embedded engine samples depends on which requests share a step, and so on
    the machine's load: a real reward could come out equal across a group (zero advantages,
    zero gradient). The rewards here depend on the sample index alone, so every group has
    advantages whatever was sampled; the tokens, masks and logprobs are the rollout's own.
    One rollout serves the session; each module takes its own copy (``groups``)."""
    async def collect():
        env = AlternatingReward()
        eng = EmbeddedEngine(model_dir, seed=1)
        try:
            async with default_sandbox("local") as sb, Reactor(eng, env, sb, RolloutConfig(max_new_tokens=96)) as r:
                return await r.collect(env.tasks(2, seed=5), group_size=3)
        finally:
            await eng.aclose()

    out = anyio.run(collect)
    assert [len(g.trajectories) for g in out] == [3, 3], "precondition: two complete groups of 3"
    assert all(len(set(g.rewards)) > 1 for g in out), (
        f"precondition: reward variance in each group {[g.rewards for g in out]}"
    )
    sampled = sum(sum(t.loss_mask) for g in out for t in g.trajectories)
    assert sampled > 50, f"precondition: the rollout sampled tokens to train on ({sampled})"
    return out


@pytest.fixture(scope="module")
def groups(rollout_groups):
    """The session's rollout groups, a deep copy for this module: what a module's tests do to
    their groups never reaches another module's."""
    return copy.deepcopy(rollout_groups)
