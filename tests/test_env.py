"""The ``Environment`` base class (``agentenv.env``): its defaults, and each optional hook
taking effect in a real rollout (the bundled model on the embedded engine, real sandbox
sessions): ``sandbox_setup``, ``on_turn``, ``plan_turn`` and ``group_reward``."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from agentenv import Reactor, RolloutConfig
from agentenv.env import Environment, Task, TurnAction, TurnPlan
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.sandboxes.local import LocalSandbox
from agentenv.tools import PythonTool, ToolOutput


class Minimal(Environment):
    def tasks(self, n, seed=0):
        return [Task(f"m/{seed}/{i}", f"q{i}") for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0


class WithSystem(Minimal):
    system_prompt = "Use Python."


def test_the_defaults_a_subclass_gets():
    env = Minimal(level=3)
    task = env.tasks(1)[0]
    assert env.options == {"level": 3}
    assert env.prompt(task) == [{"role": "user", "content": "q0"}]
    assert WithSystem().prompt(task) == [
        {"role": "system", "content": "Use Python."},
        {"role": "user", "content": "q0"},
    ]
    tools = env.tools()
    assert len(tools) == 1 and isinstance(tools[0], PythonTool) and tools[0].name == "python"
    assert env.sandbox_setup() is None and env.plan_turn(task, None, 0) is None
    assert (env.tool_format, env.max_turns, env.tool_timeout) == (None, 4, 5.0)  # None: the model's own format
    assert TurnPlan() == TurnPlan(max_tokens=None, stop=True, last=False)
    assert TurnAction() == TurnAction(stop=False, inject=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        task.question = "changed"  # type: ignore[misc]
    with pytest.raises(NotImplementedError):
        Environment().tasks(1)


async def rollout(engine, env, tasks=2, group=2, **cfg):
    config = RolloutConfig(**{"max_turns": 3, "max_new_tokens": 192, "concurrency": 4, **cfg})
    async with LocalSandbox() as sb:
        with anyio.fail_after(300):
            groups = await Reactor(engine, env, sb, config).collect(env.tasks(tasks, seed=1), group)
    return [t for g in groups for t in g.trajectories]


class SetupSeen(PythonTool):
    """Runs its own code, whatever the model wrote: what the setup left in the session."""

    async def __call__(self, ctx, **arguments):
        res = await ctx.session.run("SECRET + 1", timeout=ctx.timeout)
        return ToolOutput(res.render(), "ok" if res.status == "ok" else "error", res.error)


class CheckedOnce(RetoolMathEnv):
    """The setup defines a name in every session; after the first tool call a note is
    injected and the program ends."""

    def sandbox_setup(self):
        return "SECRET = 41"

    def tools(self):
        return [SetupSeen()]

    async def on_turn(self, task, trajectory, turn_text):
        return TurnAction(stop=True, inject="Checked.")


@pytest.mark.anyio
async def test_setup_code_runs_in_each_session_and_on_turn_injects_and_stops(engine):
    trajs = await rollout(engine, CheckedOnce(extra_digits=0))
    called = [t for t in trajs if t.tool_calls]
    assert any(c.status == "ok" for t in called for c in t.tool_calls), "precondition: a tool call of the model ran"
    tok = engine.tokenizer
    for t in called:
        t.validate()
        assert len(t.tool_calls) == 1 and t.finish_reason == "stop" and len(t.turns) == 1
        assert t.tool_calls[0].output == "42" or t.tool_calls[0].status == "malformed"
        # The tool's observation, then the injected text: both environment tokens (mask 0).
        assert [s.kind for s in t.segments] == ["model", "env", "env"]
        assert tok.decode(t.segments[-1].token_ids) == "Checked." and t.text.endswith("Checked.")


class Budgeted(RetoolMathEnv):
    """Turn 0 samples exactly 6 tokens whatever the model writes, and is the last."""

    def plan_turn(self, task, trajectory, turn):
        return TurnPlan(max_tokens=6, stop=False, last=True)


class Ranked(RetoolMathEnv):
    """Each group's samples are rewarded by their rank in the group."""

    async def reward(self, task, trajectory):
        return {"correct": 1.0, "format": 0.5}

    async def group_reward(self, task, trajectories):
        assert all(t.reward == 1.5 for t in trajectories), "group_reward sees the per-sample rewards"
        return [float(t.sample_index) for t in trajectories]


@pytest.mark.anyio
async def test_plan_turn_limits_a_turn_and_group_reward_replaces_the_sample_rewards(engine):
    for t in await rollout(engine, Budgeted(extra_digits=0), tasks=1):
        assert [len(s.token_ids) for s in t.segments] == [6] and t.finish_reason == "stop" and not t.tool_calls
    trajs = await rollout(engine, Ranked(extra_digits=0), tasks=2, group=3, max_turns=1, max_new_tokens=16)
    assert len(trajs) == 6
    for t in trajs:
        assert t.reward == float(t.sample_index)
        assert t.metadata["sample_reward"] == {"reward": 1.5, "components": {"correct": 1.0, "format": 0.5}}
