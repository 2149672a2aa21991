"""The rows a training run writes: :class:`StepRow` (one line of ``metrics.jsonl`` per
optimiser step) and :class:`EvalRow` (one line of ``eval.jsonl`` per held-out evaluation).

Each is a typed record built from what the step loop measured; ``to_dict`` gives the JSON
object (``agentenv plot``, the trackers and ``Trainer.rows`` read its keys). Rates over the
time between two rows come from an :class:`IntervalMeter`. Pure: no I/O, no torch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..reactor import Group
from ..trajectory import Trajectory
from .metrics import staleness_summary

if TYPE_CHECKING:
    from .batch import Batch


def _fraction(x: float) -> float:
    return round(min(1.0, max(0.0, x)), 4)


@dataclass(frozen=True)
class Interval:
    """What happened between the previous row and this one."""

    time_s: float  # since the run (this attempt) started
    step_s: float  # since the previous row
    gen_tokens_per_s: float
    gen_idle_frac: float  # share of the interval with no group generating
    trainer_idle_frac: float  # share of the interval the step loop waited for a batch


class IntervalMeter:
    """Turns running totals (tokens sampled, the generator's busy seconds, the step loop's
    waiting seconds) into the rates of each interval between rows."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._t, self._tokens, self._gen_busy, self._wait = t0, 0, 0.0, 0.0

    def tick(self, *, tokens: int, gen_busy: float, wait: float, now: float | None = None) -> Interval:
        """The interval since the previous tick (or ``t0``), given the totals at ``now``."""
        now = time.perf_counter() if now is None else now
        dt = max(now - self._t, 1e-9)
        interval = Interval(time_s=round(now - self.t0, 3), step_s=round(dt, 3),
                            gen_tokens_per_s=round((tokens - self._tokens) / dt, 1),
                            gen_idle_frac=_fraction(1 - (gen_busy - self._gen_busy) / dt),
                            trainer_idle_frac=_fraction((wait - self._wait) / dt))
        self._t, self._tokens, self._gen_busy, self._wait = now, tokens, gen_busy, wait
        return interval


@dataclass(frozen=True)
class Sync:
    """One step's optimiser step and weight sync, as the step loop timed them."""

    train_s: float
    sync_s: float
    sync_bytes: int  # pushed to the engine (the adapter only, with LoRA)
    full_sync_bytes: int  # every parameter's
    groups_in_flight: int  # groups that went on generating across the sync


@dataclass(frozen=True)
class StepRow:
    """One optimiser step: its batch, the policy's statistics, staleness, rates and timings.
    ``to_dict`` lists the fields in this order, ``train_stats`` spread in its place."""

    step: int
    version: int  # the weight version the step's sync published
    time_s: float
    reward_mean: float  # NaN when no reward in the batch was scored
    reward_std: float
    groups: int
    trajectories: int
    reward_failures: int
    zero_variance_groups: int  # groups whose scored rewards are all equal (no GRPO signal)
    trained_tokens: int
    train_stats: dict[str, float]  # Policy.train_step's (loss, grad_norm, kl_behaviour, ...), 6 places
    staleness: dict[str, int]  # consumed tokens by versions behind, this step
    staleness_mean: float
    dropped_groups: int  # dropped as too stale, over the run
    gen_tokens_per_s: float
    gen_idle_frac: float
    trainer_idle_frac: float
    train_s: float
    sync_s: float
    sync_bytes: int
    full_sync_bytes: int
    step_s: float
    task_ids: list[str]
    groups_in_flight_at_sync: int

    @classmethod
    def of(cls, step: int, groups: Sequence[Group], batch: "Batch", train_stats: dict[str, float], *,
           staleness: Counter, dropped: int, interval: Interval, sync: Sync) -> "StepRow":
        """The row of ``step``, which trained ``batch`` (collated from ``groups``)."""
        rewards = [r for r in batch.rewards if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else float("nan")
        hist, stale_mean = staleness_summary(staleness)
        flat = [g.rewards for g in groups]
        return cls(
            step=step, version=step, time_s=interval.time_s, reward_mean=mean, reward_std=std, groups=len(groups),
            trajectories=batch.size, reward_failures=sum(r is None for r in batch.rewards),
            zero_variance_groups=sum(1 for rs in flat if len({r for r in rs if r is not None}) <= 1),
            trained_tokens=batch.trained_tokens, train_stats={k: round(v, 6) for k, v in train_stats.items()},
            staleness=hist, staleness_mean=round(stale_mean, 4), dropped_groups=dropped,
            gen_tokens_per_s=interval.gen_tokens_per_s, gen_idle_frac=interval.gen_idle_frac,
            trainer_idle_frac=interval.trainer_idle_frac, train_s=round(sync.train_s, 4),
            sync_s=round(sync.sync_s, 4), sync_bytes=sync.sync_bytes, full_sync_bytes=sync.full_sync_bytes,
            step_s=interval.step_s, task_ids=[g.task.id for g in groups],
            groups_in_flight_at_sync=sync.groups_in_flight)

    def to_dict(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` object."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "train_stats":
                out.update(value)
            else:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class EvalRow:
    """One held-out evaluation (see :func:`agentenv.evaluation.report`)."""

    step: int  # the step it followed (0: the starting weights)
    version: int  # the engine's weight version when it started
    versions: list[int] | None  # [oldest, newest] version that sampled its tokens; None: no token
    eval_s: float
    tasks: int
    samples: int
    pass_at: dict[str, float]  # k -> pass@k
    mean_reward: float | None
    components: dict[str, float]  # reward component -> its mean
    finish_reasons: dict[str, int]

    @classmethod
    def of(cls, step: int, version: int, eval_s: float, trajectories: Iterable[Trajectory]) -> "EvalRow":
        from ..evaluation import report

        trajs = list(trajectories)
        rep = report(trajs)
        versions = [v for t in trajs for seg in t.segments if seg.kind == "model" for v in seg.weight_versions]
        return cls(step=step, version=version, versions=[min(versions), max(versions)] if versions else None,
                   eval_s=round(eval_s, 2), tasks=rep["tasks"], samples=rep["samples"], pass_at=dict(rep["pass@k"]),
                   mean_reward=rep["mean_reward"], components=dict(rep["components"]),
                   finish_reasons=rep["finish_reasons"])

    def to_dict(self) -> dict[str, Any]:
        """The ``eval.jsonl`` object: ``pass@K`` and ``mean_<component>`` keys."""
        return {"step": self.step, "version": self.version, "versions": self.versions, "eval_s": self.eval_s,
                "tasks": self.tasks, "samples": self.samples, **{f"pass@{k}": v for k, v in self.pass_at.items()},
                "mean_reward": self.mean_reward, **{f"mean_{k}": v for k, v in self.components.items()},
                "finish_reasons": self.finish_reasons}


__all__ = ["EvalRow", "Interval", "IntervalMeter", "StepRow", "Sync"]
