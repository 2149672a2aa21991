"""The bundled trainer's step loop: one attempt of a run, from the step after its start to
``cfg.optimiser.steps``.

Each step takes ``groups_per_step`` complete groups from :class:`~.generation.Generation`,
recomputes logprobs on the exact sampled tokens and takes one optimiser step (in a worker
thread, while generation goes on), then pushes the new weights into the engine, which bumps
its version while programs in flight keep going (``partial="drain"``: once none is in
flight). The step's row is reported; every ``checkpoint_every`` steps (and after the last) a
checkpoint is written; held-out evaluations run beside the steps. The generator, the status
bar and the evaluations run in one task group with the steps: a failure in any stops all.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import anyio
import anyio.abc

from ..engines.weight_group import weight_bytes
from ..errors import EngineError, SandboxError
from ..reactor import Group
from .batch import collate
from .checkpoints import Checkpoints, latest_checkpoint
from .colocate import Colocation
from .config import TrainConfig
from .evaluator import Evaluator
from .generation import Generation
from .metrics import staleness_summary
from .distributed import RayPolicy
from .policy import Policy
from .rows import IntervalMeter, StepRow, Sync
from .status import RunLog, StatusBar


def check_batch(groups: list[Group], step: int) -> None:
    """Failures are data, but a batch in which *every* program failed in the engine or the
    sandbox means the run cannot learn anything: raise the first error."""
    trajs = [t for g in groups for t in g.trajectories]
    infra = [t for t in trajs if t.finish_reason in ("error:engine", "error:sandbox")]
    if trajs and len(infra) == len(trajs):
        where = infra[0].finish_reason.split(":")[1]
        err = EngineError if where == "engine" else SandboxError
        raise err(f"every program of step {step} failed in the {where}: {infra[0].error}")


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


class StepLoop:
    """Steps ``start_step + 1 .. steps`` of a run whose parts are open: the policy, the
    engine it syncs, generation, evaluations, the log, checkpoints and the status bar.
    ``run`` returns the run's summary (also written to ``summary.json``)."""

    def __init__(self, cfg: TrainConfig, policy: Policy, engine: Any, generation: Generation, *,
                 evaluator: Evaluator, log: RunLog, checkpoints: Checkpoints, bar: StatusBar) -> None:
        self.cfg, self.policy, self.engine, self.generation = cfg, policy, engine, generation
        self.evaluator, self.log, self.checkpoints, self.bar = evaluator, log, checkpoints, bar
        pad = engine.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.colocation = Colocation.for_config(cfg, engine, policy)  # mode="colocated": the engine sleeps in steps

    async def run(self, start_step: int) -> dict[str, Any]:
        cfg, evaluator = self.cfg, self.evaluator
        meter = IntervalMeter(time.perf_counter())  # the rows' times count from here
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.generation.run, tg)
                if self.bar.enabled:
                    tg.start_soon(self.bar.follow, self.generation)
                if evaluator.baseline_due(start_step):
                    tg.start_soon(evaluator.evaluate, 0)  # the starting model, for comparison
                for step in range(start_step + 1, cfg.optimiser.steps + 1):
                    await self._step(step, tg, meter)
                if evaluator.enabled:
                    # The final weights; evaluations still running are dropped.
                    await evaluator.evaluate(cfg.optimiser.steps)
                tg.cancel_scope.cancel()  # groups started for later steps are not needed
        except BaseExceptionGroup as eg:  # one failure inside the task group: raise it as is
            leaves = _leaves(eg)
            if len(leaves) == 1:
                raise leaves[0] from None
            raise
        return self._summary(start_step, time.perf_counter() - meter.t0)

    async def _step(self, step: int, tg: anyio.abc.TaskGroup, meter: IntervalMeter) -> None:
        gen = self.generation
        stale_before = Counter(gen.buffer.staleness)
        groups = await gen.next_batch()
        check_batch(groups, step)
        batch = collate(groups, pad_id=self.pad_id)
        async with self.colocation.asleep():
            t_train = time.perf_counter()
            stats = await anyio.to_thread.run_sync(self.policy.train_step, batch)
            train_s = time.perf_counter() - t_train
        stats.update(self.colocation.last)  # colocated: the engine's sleep, wake and asleep seconds
        sync = await self._sync(step, train_s=train_s)
        interval = meter.tick(tokens=gen.reactor.stats.outcomes.sampled_tokens, gen_busy=gen.clock.busy_s,
                                    wait=gen.wait_s)
        self.log.step(StepRow.of(step, groups, batch, stats, staleness=gen.buffer.staleness - stale_before,
                                 dropped=gen.buffer.dropped, interval=interval, sync=sync))
        self.bar.advance()
        if step % self.cfg.checkpoints.checkpoint_every == 0 or step == self.cfg.optimiser.steps:
            await anyio.to_thread.run_sync(self.checkpoints.save, self.policy, step, gen.snapshot())
        if self.evaluator.due(step):
            tg.start_soon(self.evaluator.evaluate, step)

    async def _sync(self, step: int, train_s: float) -> Sync:
        """Push the weights of ``step`` into the engine (after a drain, and never before the
        baseline evaluation is done) and let generation go on at the new version."""
        gen = self.generation
        if self.cfg.staleness.partial == "drain":
            await gen.drain()
        await self.evaluator.wait_for_baseline()
        in_flight = gen.generating  # groups that continue across this update
        t_sync = time.perf_counter()
        # A Ray policy's weights stay with rank 0, which sends them over a weight-update group itself.
        tensors = self.policy.sync_weights() if isinstance(self.policy, RayPolicy) else self.policy.sync_tensors()
        await self.engine.load_weights(tensors, version=step)
        sync_s = time.perf_counter() - t_sync
        await gen.publish(step)
        return Sync(train_s=train_s, sync_s=sync_s, sync_bytes=weight_bytes(tensors),
                    full_sync_bytes=self.policy.full_bytes, groups_in_flight=in_flight)

    def _summary(self, start_step: int, wall: float) -> dict[str, Any]:
        cfg, gen, rows, evals = self.cfg, self.generation, self.log.rows, self.log.evals
        summary: dict[str, Any] = {
            "steps": cfg.optimiser.steps, "start_step": start_step, "mode": cfg.staleness.mode,
            "wall_s": round(wall, 2),
            "gen_idle_frac": round(max(0.0, 1 - gen.clock.busy_s / wall), 4),
            "trainer_idle_frac": round(gen.wait_s / wall, 4),
            "staleness": staleness_summary(gen.buffer.staleness)[0], "dropped_groups": gen.buffer.dropped,
            "cancelled_groups": gen.cancelled,  # of dropped_groups: cancelled in flight, stale before complete
            "first_reward": rows[0]["reward_mean"] if rows else None,
            "last_reward": rows[-1]["reward_mean"] if rows else None,
            "checkpoint": str(latest_checkpoint(self.checkpoints.out)),
        }
        if evals:
            first, final = evals[0], evals[-1]
            summary["eval"] = {"first_step": first["step"], "first_pass@1": first["pass@1"],
                               "last_step": final["step"], "last_pass@1": final["pass@1"]}
        (self.checkpoints.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


__all__ = ["StepLoop", "check_batch"]
