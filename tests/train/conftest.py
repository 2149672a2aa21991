"""Fixtures shared by the trainer tests: a real rollout's scored groups, and an environment
whose groups always have reward variance."""

from __future__ import annotations

import anyio
import pytest

from agentenv.config import RolloutConfig
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.reactor import Reactor
from agentenv.registry import make
from agentenv.sandboxes import default_sandbox


class AlternatingReward(RetoolMathEnv):
    """Every group has reward variance (odd samples score 1), so every step has a gradient."""

    async def reward(self, task, trajectory):
        return float(trajectory.sample_index % 2)


@pytest.fixture(scope="module")
def groups(model_dir):
    """Two scored GRPO groups of 3 from a real rollout (version 0)."""
    async def collect():
        env = make("retool-math")
        eng = EmbeddedEngine(model_dir, seed=1)
        try:
            async with default_sandbox("local") as sb, Reactor(eng, env, sb, RolloutConfig(max_new_tokens=96)) as r:
                return await r.collect(env.tasks(2, seed=5), group_size=3)
        finally:
            await eng.aclose()

    return anyio.run(collect)
