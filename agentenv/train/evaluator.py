"""Held-out evaluations during training (``TrainConfig.evaluation.eval_every``).

Every ``eval_every`` steps, before the first step of a fresh run (the baseline) and after the
last, ``eval_tasks`` held-out tasks are sampled ``eval_k`` times each with the weights of the
moment and scored (pass@1 .. pass@k, mean reward and components: one ``eval.jsonl`` row).
Held-out tasks come from their own seed, far from the training stream's, so a generated
environment never trains on them.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from ..config import RolloutConfig
from ..reactor import Reactor
from .config import TrainConfig
from .rows import EvalRow
from .status import RunLog

#: Held-out tasks come from this seed minus the run's seed, far from the training stream's
#: seeds (``seed * 1_000_003 + chunk``).
EVAL_SEED = -7_777_777


class Evaluator:
    """The held-out evaluations of a run that starts after ``start_step``, reported to ``log``.

    The evaluation before the first step is the baseline the others are compared with: the
    step loop waits for it (:meth:`wait_for_baseline`) before its first weight sync, so it sees
    only the starting weights. Each evaluation runs on a reactor of its own, so its programs
    are not the checkpoint's in-flight work; a sync during it shows in the row's ``versions``.
    Evaluations overlap training and each other, and a later one may finish first: each is
    reported only after the one started before it, so ``eval.jsonl``, the trackers and the
    summary's last row follow the steps."""

    def __init__(self, cfg: TrainConfig, engine: Any, env: Any, sandbox: Any, rollout: RolloutConfig, log: RunLog,
                 *, start_step: int) -> None:
        self.cfg, self.engine, self.env, self.sandbox, self.rollout, self.log = cfg, engine, env, sandbox, rollout, log
        self.enabled = bool(cfg.evaluation.eval_every)
        self._baseline = anyio.Event()
        if not self.baseline_due(start_step):
            self._baseline.set()
        self._reported = anyio.Event()  # the evaluation started last has been reported (or ended)
        self._reported.set()

    def baseline_due(self, start_step: int) -> bool:
        """Whether a run starting after ``start_step`` evaluates its starting weights."""
        return self.enabled and start_step == 0

    def due(self, step: int) -> bool:
        """Whether an evaluation follows ``step`` while training goes on (the final one,
        after the last step, the step loop awaits itself)."""
        return self.enabled and step < self.cfg.optimiser.steps and step % self.cfg.evaluation.eval_every == 0

    async def wait_for_baseline(self) -> None:
        await self._baseline.wait()

    async def evaluate(self, step: int) -> dict[str, Any]:
        """Evaluate the weights the engine serves now, after ``step`` (0: the baseline), and
        report the row. If it fails, the caller's task group is cancelled, and with it a sync
        waiting for the baseline."""
        cfg, env = self.cfg, self.env
        before, self._reported = self._reported, anyio.Event()
        mine = self._reported
        try:
            version, t_eval = self.engine.weight_version, time.perf_counter()
            async with Reactor(self.engine, env, self.sandbox, self.rollout) as r:
                ev = cfg.evaluation
                groups = await r.collect(env.tasks(ev.eval_tasks, seed=EVAL_SEED - cfg.batch.seed), ev.eval_k)
            if step == 0:
                self._baseline.set()
            row = EvalRow.of(step, version, time.perf_counter() - t_eval, [t for g in groups for t in g.trajectories])
            await before.wait()
            return self.log.evaluation(row)
        finally:
            mine.set()


__all__ = ["EVAL_SEED", "Evaluator"]
