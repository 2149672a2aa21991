"""A plain ``openai`` SDK tool loop, trained as it is: the gateway turns its calls into
token-exact rollouts.

    agentenv rollout --env examples/agents/openai_tool_loop.py:ToolLoopMath --model tiny-hermes \
        --tasks 8 --group-size 2 --out tool_loop.jsonl

The agent asks the model (the bundled ``tiny-hermes``, through the gateway) with a ``python``
tool, runs each call's code in the run's sandbox pool, sends the output back as a ``tool``
message, and stops when the model answers without a call.
"""

from __future__ import annotations

import json

from agentenv import AgentEnvironment
from agentenv.agent import sandbox_session
from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv

PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


class ToolLoopMath(AgentEnvironment):
    id = "tool-loop-math"
    max_turns = 4
    uses_sandbox = True

    def __init__(self, extra_digits: int = 1) -> None:
        super().__init__()
        self.math = RetoolMathEnv(extra_digits=extra_digits, format="hermes")

    def tasks(self, n, seed=0):
        return self.math.tasks(n, seed)

    async def agent(self, task, client, model):
        messages = [{"role": "system", "content": HERMES_PROMPT}, {"role": "user", "content": task.question}]
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=[PYTHON])
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                code = json.loads(call.function.arguments).get("code", "")
                result = await (await sandbox_session()).run(code, timeout=5.0)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.render()})
        return messages[-1].get("content") if isinstance(messages[-1], dict) else messages[-1].content

    async def reward(self, task, trajectory):
        return await self.math.reward(task, trajectory)
