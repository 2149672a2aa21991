"""The command form: an agent that is a program of its own (here ``math_agent.py``, a script
that knows nothing of agentenv), run once per sample with ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` pointing at the gateway and the task as JSON on its stdin; its stdout is
the answer.

    agentenv rollout --env examples/agents/subprocess_agent.py:CommandMath --model agentenv/models/tiny-hermes \
        --tasks 8 --group-size 2 --max-new-tokens 512 --out command.jsonl

The script runs its own ``python`` tool (arithmetic only): a sandbox session is for agents
that run in the rollout's process (``agent()``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from agentenv import AgentEnvironment
from agentenv.envs.retool_math import RetoolMathEnv


class CommandMath(AgentEnvironment):
    id = "command-math"
    max_turns = 4
    agent_command = [sys.executable, str(Path(__file__).with_name("math_agent.py"))]

    def __init__(self, extra_digits: int = 1) -> None:
        super().__init__()
        self.math = RetoolMathEnv(extra_digits=extra_digits, format="hermes")

    def tasks(self, n, seed=0):
        return self.math.tasks(n, seed)

    async def reward(self, task, trajectory):
        return await self.math.reward(task, trajectory)
