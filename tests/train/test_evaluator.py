"""Held-out evaluations on real parts: the bundled model on the embedded engine, real sandbox
processes, retool-math's held-out tasks."""

from __future__ import annotations

import dataclasses
import json

import anyio
import pytest

from agentenv.config import RolloutConfig
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.sandboxes import default_sandbox
from agentenv.train import TrainConfig
from agentenv.train.evaluator import EVAL_SEED, Evaluator
from agentenv.train.status import RunLog


def unopened(start_step: int, **settings) -> Evaluator:
    """An evaluator whose schedule is all that is used: no engine, env, sandbox or log."""
    return Evaluator(TrainConfig(steps=6, **settings), None, None, None, RolloutConfig(),
                     None, start_step=start_step)  # type: ignore[arg-type]


def test_when_evaluations_are_due():
    every2 = unopened(0, eval_every=2)
    assert every2.baseline_due(0) and not every2.baseline_due(2)
    # The final evaluation, after step 6, the step loop awaits itself.
    assert [s for s in range(1, 7) if every2.due(s)] == [2, 4]
    off = unopened(0)
    assert not off.enabled and not off.baseline_due(0) and not any(off.due(s) for s in range(1, 7))


@pytest.mark.anyio
async def test_a_resumed_run_does_not_wait_for_a_baseline():
    ev = unopened(2, eval_every=2)
    with anyio.fail_after(5):  # already set: returns at once
        await ev.wait_for_baseline()


class Seen(RetoolMathEnv):
    """Records each scored program's task, and whether ``released`` was set by then."""

    def __init__(self, released: anyio.Event) -> None:
        super().__init__()
        self.released, self.scored = released, []

    async def reward(self, task, trajectory):
        self.scored.append((task.id, self.released.is_set()))
        return await super().reward(task, trajectory)


@pytest.mark.anyio
async def test_the_baseline_evaluates_held_out_tasks_before_the_first_sync(engine, tmp_path):
    cfg = TrainConfig(steps=2, out_dir=str(tmp_path), eval_every=1, eval_tasks=2, eval_k=2, seed=3,
                      report_to=["none"])
    released = anyio.Event()
    env = Seen(released)
    log = RunLog(tmp_path, cfg, resume_step=None, rows=[], evals=[], print_steps=False)
    try:
        async with default_sandbox("local") as sandbox:
            ev = Evaluator(cfg, engine, env, sandbox, RolloutConfig(max_new_tokens=48), log, start_step=0)

            async def first_sync() -> None:
                await ev.wait_for_baseline()
                released.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(first_sync)
                await anyio.wait_all_tasks_blocked()
                assert not released.is_set()
                row = await ev.evaluate(0)
                await released.wait()
    finally:
        log.close()
    held_out = {t.id for t in env.tasks(2, seed=EVAL_SEED - 3)}
    assert sorted(env.scored) == sorted((tid, False) for tid in held_out for _ in range(2))  # none after the sync
    assert (row["step"], row["version"], row["versions"]) == (0, 0, [0, 0])
    assert row["tasks"] == 2 and row["samples"] == 4 and 0 <= row["pass@1"] <= row["pass@2"] <= 1
    assert log.evals == [row] == [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]


class HeldFirst(RetoolMathEnv):
    """Each evaluation's tasks get their own ids (``@0``, ``@1``, ...); the first evaluation's
    rewards wait for ``go``; ``later_done`` is set once four of the others' programs are scored."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.held, self.later_done = anyio.Event(), anyio.Event(), anyio.Event()
        self.evaluations = self.later_scored = 0

    def tasks(self, n, seed=0):
        k, self.evaluations = self.evaluations, self.evaluations + 1
        return [dataclasses.replace(t, id=f"{t.id}@{k}") for t in super().tasks(n, seed)]

    async def reward(self, task, trajectory):
        if task.id.endswith("@0"):
            self.held.set()
            await self.go.wait()
        reward = await super().reward(task, trajectory)
        if not task.id.endswith("@0"):
            self.later_scored += 1
            if self.later_scored == 4:
                self.later_done.set()
        return reward


@pytest.mark.anyio
async def test_an_evaluation_that_finishes_first_is_reported_after_the_one_started_before_it(engine, tmp_path):
    cfg = TrainConfig(steps=4, out_dir=str(tmp_path), eval_every=1, eval_tasks=2, eval_k=2, report_to=["none"])
    env = HeldFirst()
    log = RunLog(tmp_path, cfg, resume_step=None, rows=[], evals=[], print_steps=False)
    try:
        async with default_sandbox("local") as sandbox:
            ev = Evaluator(cfg, engine, env, sandbox, RolloutConfig(max_new_tokens=48), log, start_step=1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ev.evaluate, 1)
                await env.held.wait()
                tg.start_soon(ev.evaluate, 2)
                await env.later_done.wait()  # the second evaluation's four programs are scored
                await anyio.wait_all_tasks_blocked()
                assert log.evals == [], "the second evaluation is done, but waits for the first to be reported"
                env.go.set()
    finally:
        log.close()
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log.evals] == [r["step"] for r in rows] == [1, 2]
