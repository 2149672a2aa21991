"""One program's turn loop (``agentenv.program``) driven directly, without a reactor: the
bundled model on the real embedded engine, real sandbox sessions, hooks that record what the
program asked for."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest

from agentenv import RolloutConfig
from agentenv.env import TurnPlan
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.formats import get_format
from agentenv.journal import Journal, load_state, read
from agentenv.program import (ProgramContext, apply_reward, observation_ids, render_prompt, run_program,
                              score_program, stop_token_ids)
from agentenv.sandboxes.local import LocalSandbox
from agentenv.trajectory import Trajectory

pytestmark = pytest.mark.anyio
FINISHES = {"stop", "length", "max_turns", "context_overflow"}


class Hooks:
    """A scheduler that lets every turn go at once and records what the program reported."""

    def __init__(self, sandbox: LocalSandbox) -> None:
        self.sandbox, self._session = sandbox, None
        self.before: list[tuple[int, int]] = []
        self.after: list[int] = []

    async def before_turn(self, tokens: int, max_tokens: int) -> int:
        self.before.append((tokens, max_tokens))
        return 0

    def after_turn(self, tokens: int, prefilled: int = 0) -> None:
        self.after.append(tokens)

    async def session(self):
        if self._session is None:
            self._session = await self.sandbox.session()
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.aclose()


def context(engine, env, config: RolloutConfig, journal=None) -> ProgramContext:
    fmt = get_format(env.tool_format)
    return ProgramContext(engine, env, None, config.for_env(env), fmt, {t.name: t for t in env.tools()}, {},
                          stop_token_ids(engine.tokenizer, fmt), journal)


async def run(engine, sandbox, env, task, config, **kw) -> tuple[Trajectory, Hooks]:
    hooks = Hooks(sandbox)
    try:
        with anyio.fail_after(300):
            traj = await run_program(context(engine, env, config, kw.pop("journal", None)), task, "g", 0, hooks, **kw)
    finally:
        await hooks.aclose()
    return traj, hooks


def test_prompt_stop_tokens_and_observations_use_the_tokenizer_as_the_template_renders(tokenizer):
    msgs = [{"role": "system", "content": "Use Python."}, {"role": "user", "content": "17 * 23?"}]
    ids = render_prompt(tokenizer, msgs)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    retool, hermes = get_format("retool"), get_format("hermes")
    end_code = tokenizer.convert_tokens_to_ids("</code>")
    assert stop_token_ids(tokenizer, retool) == (tokenizer.eos_token_id, end_code)
    assert stop_token_ids(tokenizer, hermes) == (
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("</tool_call>"),
    )
    obs = observation_ids(retool, tokenizer, ["391"], ended_with_eos=False)
    assert tokenizer.decode(obs) == retool.observation(["391"], tokenizer, False) and "391" in tokenizer.decode(obs)


async def test_each_turn_extends_the_sequence_and_the_hooks_see_every_turn(engine):
    env = RetoolMathEnv(extra_digits=0)
    config = RolloutConfig(max_turns=4, max_new_tokens=256)
    async with LocalSandbox() as sb:
        traj, hooks = await run(engine, sb, env, env.tasks(1, seed=2)[0], config)
    traj.validate()
    assert traj.finish_reason in FINISHES, (traj.finish_reason, traj.error)
    assert traj.turns and len(hooks.before) == len(hooks.after) == len(traj.turns)
    for (tokens, max_tokens), after, turn in zip(hooks.before, hooks.after, traj.turns):
        # Each turn's request is the whole sequence so far; the scheduler hears its length
        # before and after, and the turn samples no more than it was told.
        assert tokens == turn.prompt_tokens and after == tokens + turn.new_tokens
        assert 0 < turn.new_tokens <= max_tokens <= config.max_tokens_per_turn
    assert traj.num_sampled_tokens <= config.max_new_tokens
    assert traj.text == engine.tokenizer.decode(traj.completion_ids, skip_special_tokens=False)
    assert all(c.status in ("ok", "error", "timeout", "malformed") for c in traj.tool_calls)


class FailsOnSecondTurn(RetoolMathEnv):
    """The first turn is cut at 8 tokens with no stop token, so a second turn follows; planning
    it raises."""

    def plan_turn(self, task, trajectory, turn):
        if turn == 0:
            return TurnPlan(max_tokens=8, stop=False)
        raise RuntimeError("the environment broke")


async def test_an_environment_failure_ends_the_program_as_data(engine):
    env = FailsOnSecondTurn(extra_digits=0)
    async with LocalSandbox() as sb:
        traj, _ = await run(engine, sb, env, env.tasks(1, seed=0)[0], RolloutConfig(max_turns=3))
    assert traj.finish_reason == "error:RuntimeError" and traj.error == "RuntimeError: the environment broke"
    assert len(traj.turns) == 1 and traj.turns[0].new_tokens == 8 and traj.duration_s > 0
    traj.validate()  # the turn it did take is kept, aligned


async def test_a_prompt_past_the_context_window_is_a_context_overflow(engine):
    env = RetoolMathEnv(extra_digits=0)
    task = env.tasks(1, seed=0)[0]
    long = type(task)(task.id, "9 " * engine.max_model_len, task.answer, task.data)
    async with LocalSandbox() as sb:
        traj, hooks = await run(engine, sb, env, long, RolloutConfig(max_turns=2))
    assert traj.finish_reason == "context_overflow" and not traj.turns and not hooks.before


async def test_a_program_resumed_from_its_logged_turns_continues_from_the_same_tokens(engine, tmp_path: Path):
    """Run a program with an event log, replay the log, and resume from the last turn it holds:
    the resumed program keeps those tokens verbatim and runs its logged code again first."""
    env = RetoolMathEnv(extra_digits=0)
    config = RolloutConfig(max_turns=4, max_new_tokens=256)
    async with LocalSandbox() as sb:
        for seed in range(8):  # a task whose program takes at least two turns (most do)
            log = Journal.create(tmp_path / f"{seed}.log", {"seed": seed})
            task = env.tasks(1, seed=seed)[0]
            first, _ = await run(engine, sb, env, task, config, journal=log, program_id=f"p{seed}")
            log.close()
            partial = load_state(read(log.path)[0]).partial.get((task.id, 0))
            if partial is not None and partial.turns and any(c.status == "ok" for c in partial.tool_calls):
                break
        else:
            pytest.fail("no program logged a completed turn with a tool call that ran")
        assert partial.id == first.id and partial.prompt_ids == first.prompt_ids
        assert first.segments[:len(partial.segments)] == partial.segments  # logged as it was sampled
        resumed, hooks = await run(engine, sb, env, task, config, resume=partial)
    assert resumed.id == first.id and resumed.segments[:len(partial.segments)] == partial.segments
    assert resumed.tool_calls[:len(partial.tool_calls)] == partial.tool_calls
    meta = resumed.metadata["resumed"]
    assert meta["from_turn"] == len(partial.turns)
    assert (
        meta["replayed_calls"] == sum(c.status == "ok" for c in partial.tool_calls) and meta["replay_mismatches"] == 0
    )
    assert len(hooks.before) == len(resumed.turns) - len(partial.turns)  # only the new turns were asked for
    resumed.validate()


def test_a_reward_is_a_number_or_named_components():
    t = Trajectory("k", "e", "t", "g", 0, [1, 2])
    apply_reward(t, 1)
    assert t.reward == 1.0 and t.reward_components == {}
    apply_reward(t, {"correct": 1.0, "format": 0.25})
    assert t.reward == 1.25 and t.reward_components == {"correct": 1.0, "format": 0.25}
    apply_reward(t, {"reward": 0.5, "format": 0.25})  # a component named "reward" is the reward
    assert t.reward == 0.5 and t.reward_components == {"format": 0.25}
    with pytest.raises(ValueError, match="not a finite number"):
        apply_reward(t, math.nan)


class Rewards(RetoolMathEnv):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    async def reward(self, task, trajectory):
        if self.how == "raise":
            raise KeyError("no answer")
        if self.how == "hang":
            await anyio.Event().wait()
        return {"correct": 1.0}


async def test_a_reward_that_fails_or_hangs_is_recorded_and_the_trajectory_kept():
    task = RetoolMathEnv().tasks(1)[0]
    for how, error in (("raise", "reward: KeyError: 'no answer'"), ("hang", "reward: TimeoutError: ")):
        t = Trajectory("k", "e", task.id, "g", 0, [1, 2], finish_reason="stop")
        t.add_model([3], [-0.1], 0)
        await score_program(Rewards(how), task, t, timeout=0.05)
        assert (t.finish_reason, t.reward, t.error) == ("error:reward", None, error)
        assert t.metadata["program_finish_reason"] == "stop"
    t = Trajectory("k", "e", task.id, "g", 0, [1, 2], finish_reason="stop")
    t.add_model([3], [-0.1], 0)
    t.segments[0].logprobs.append(-0.2)  # arrays an engine got wrong: kept, flagged
    await score_program(Rewards("ok"), task, t, timeout=5)
    assert t.reward == 1.0 and t.finish_reason == "error:trajectory"
