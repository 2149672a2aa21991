"""A one-call agent to train through the gateway: the reward is for a final answer in
``\\boxed{}`` that is right (1.0), or at least boxed (0.2).

    agentenv train --env examples/agents/short_answers.py:BoxedAnswer --model agentenv/models/tiny-hermes --steps 10

Its training defaults (``train_defaults``) are the settings under which it learns on the bundled
model; flags on the command line override them.
"""

from __future__ import annotations

from agentenv import AgentEnvironment
from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv
from agentenv.rewards import extract_boxed


class BoxedAnswer(AgentEnvironment):
    id = "boxed-answer"
    max_turns = 1
    train_defaults = {"lr": 2e-4, "aggregation": "sequence", "temperature": 1.3, "groups_per_step": 4,
                      "group_size": 8, "max_new_tokens": 96, "steps": 10, "eval_every": 0}

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
