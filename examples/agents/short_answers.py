"""A one-call agent to train through the gateway: the reward is for a final answer in
``\\boxed{}`` that is right (1.0), or at least boxed (0.2).

    agentenv train --env examples/agents/short_answers.py:BoxedAnswer --model agentenv/models/tiny-hermes \
        --steps 10 --groups-per-step 4 --group-size 8 --max-new-tokens 96 --temperature 1.3
"""

from __future__ import annotations

from agentenv import AgentEnvironment
from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv
from agentenv.rewards import extract_boxed


class BoxedAnswer(AgentEnvironment):
    id = "boxed-answer"
    max_turns = 1

    def __init__(self, extra_digits: int = 0) -> None:
        super().__init__()
        self.math = RetoolMathEnv(extra_digits=extra_digits, format="hermes")

    def tasks(self, n, seed=0):
        return self.math.tasks(n, seed)

    async def agent(self, task, client, model):
        reply = await client.chat.completions.create(model=model, max_tokens=96, messages=[
            {"role": "system", "content": HERMES_PROMPT}, {"role": "user", "content": task.question}])
        return reply.choices[0].message.content

    async def reward(self, task, trajectory):
        boxed = extract_boxed(trajectory.text or "")
        right = boxed is not None and boxed.strip() == str(task.answer)
        return {"boxed": 0.2 * (boxed is not None), "correct": 0.8 * right}
