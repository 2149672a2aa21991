"""Agent environments the CLI tests load by path (``--env tests/agent_envs.py:Class``)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from agentenv import AgentEnvironment, Task


class ThreeCalls(AgentEnvironment):
    """A deterministic agent of three plain chat calls, each extending the last. After its
    first call it waits for the file ``$AGENTENV_TEST_GO`` (when set), so that a test can kill
    the run while every program is in flight."""

    id = "three-calls"
    max_turns = 3

    def tasks(self, n, seed=0):
        return [Task(f"three/{seed}/{i}", f"Count to {i + 3}.", i + 3) for i in range(n)]

    async def agent(self, task, client, model):
        messages = [{"role": "user", "content": task.question}]
        for k in range(3):
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=12)
            messages += [r.choices[0].message, {"role": "user", "content": f"Go on ({k})."}]
            go = os.environ.get("AGENTENV_TEST_GO")
            while k == 0 and go and not Path(go).exists():
                await anyio.sleep(0.05)
        return r.choices[0].message.content

    async def reward(self, task, trajectory):
        return float(len(trajectory.text or "") % 2)


class TwoRoles(AgentEnvironment):
    """One plain chat call, then one of a critic role in a context of its own: every program
    is two token sequences (the second a branch labelled ``critic``), whatever the model says."""

    id = "two-roles"
    max_turns = 2

    def tasks(self, n, seed=0):
        return [Task(f"roles/{seed}/{i}", f"Name {i + 2} colours.", i + 2) for i in range(n)]

    async def agent(self, task, client, model):
        from agentenv.gateway import role_client

        r = await client.chat.completions.create(model=model, max_tokens=8,
                                                 messages=[{"role": "user", "content": task.question}])
        critic = role_client(client, "critic")
        c = await critic.chat.completions.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": f"Critique: {r.choices[0].message.content}"}])
        return c.choices[0].message.content

    async def reward(self, task, trajectory):
        return 0.0
