"""The rows a training run writes, built from a real rollout's groups: the keys ``agentenv
plot``, the trackers and users read, in their order, and the rates between rows."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from agentenv.evaluation import report
from agentenv.train import collate
from agentenv.train.rows import EvalRow, Interval, IntervalMeter, StepRow, Sync

STEP_KEYS = ["step", "version", "time_s", "reward_mean", "reward_std", "groups", "trajectories", "reward_failures",
             "zero_variance_groups", "trained_tokens", "loss", "grad_norm", "staleness", "staleness_mean",
             "dropped_groups", "gen_tokens_per_s", "gen_idle_frac", "trainer_idle_frac", "train_s", "sync_s",
             "sync_bytes", "full_sync_bytes", "step_s", "task_ids", "groups_in_flight_at_sync"]


def test_the_meter_measures_each_interval_from_running_totals():
    meter = IntervalMeter(t0=100.0)
    first = meter.tick(tokens=50, gen_busy=1.5, wait=0.5, now=102.0)
    assert first == Interval(time_s=2.0, step_s=2.0, gen_tokens_per_s=25.0, gen_idle_frac=0.25, trainer_idle_frac=0.25)
    second = meter.tick(tokens=60, gen_busy=2.5, wait=0.5, now=103.0)  # busy the whole second, no wait
    assert second == Interval(time_s=3.0, step_s=1.0, gen_tokens_per_s=10.0, gen_idle_frac=0.0, trainer_idle_frac=0.0)
    # Fractions stay within [0, 1] (a busy clock read a moment late can run past the interval).
    third = meter.tick(tokens=60, gen_busy=4.0, wait=2.5, now=104.0)
    assert (third.gen_idle_frac, third.trainer_idle_frac) == (0.0, 1.0)
    same = meter.tick(tokens=60, gen_busy=4.0, wait=2.5, now=104.0)  # no time passed: no division by zero
    assert same.step_s == 0.0 and same.gen_tokens_per_s == 0.0


def test_a_step_row_lists_its_keys_in_order_with_the_policys_statistics_in_place(groups):
    batch = collate(groups)
    row = StepRow.of(3, groups, batch, {"loss": 0.123456789, "grad_norm": 1.5},
                     staleness=Counter({0: 10, 1: 5}), dropped=2,
                     interval=Interval(time_s=9.5, step_s=2.25, gen_tokens_per_s=40.0, gen_idle_frac=0.1,
                                       trainer_idle_frac=0.2),
                     sync=Sync(train_s=1.234567, sync_s=0.0123456, sync_bytes=100, full_sync_bytes=1000,
                               groups_in_flight=1))
    d = row.to_dict()
    assert list(d) == STEP_KEYS
    rewards = [t.reward for g in groups for t in g.trajectories if t.reward is not None]
    mean = sum(rewards) / len(rewards)
    assert d["reward_mean"] == pytest.approx(mean)
    assert d["reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)
    assert (d["step"], d["version"], d["groups"], d["trajectories"]) == (3, 3, 2, 6)
    assert d["trained_tokens"] == batch.trained_tokens > 0
    assert d["zero_variance_groups"] == sum(len({r for r in g.rewards if r is not None}) <= 1 for g in groups)
    assert (d["loss"], d["grad_norm"]) == (0.123457, 1.5)  # rounded to 6 places
    assert d["staleness"] == {"0": 10, "1": 5} and d["staleness_mean"] == round(5 / 15, 4)
    assert (d["train_s"], d["sync_s"], d["time_s"], d["step_s"]) == (1.2346, 0.0123, 9.5, 2.25)
    assert d["task_ids"] == [g.task.id for g in groups] and d["groups_in_flight_at_sync"] == 1


def test_a_batch_without_a_scored_reward_has_no_mean(groups):
    from agentenv.reactor import Group
    from agentenv.trajectory import Trajectory

    failed = [Group(g.task, [Trajectory.from_dict({**t.to_dict(), "reward": None, "error": "reward timed out",
                                                   "finish_reason": "error:reward"}) for t in g.trajectories])
              for g in groups]
    batch = collate(failed)
    d = StepRow.of(1, failed, batch, {}, staleness=Counter(), dropped=0,
                   interval=IntervalMeter(0.0).tick(tokens=0, gen_busy=0.0, wait=0.0, now=1.0),
                   sync=Sync(train_s=0.0, sync_s=0.0, sync_bytes=0, full_sync_bytes=0, groups_in_flight=0)).to_dict()
    assert math.isnan(d["reward_mean"]) and math.isnan(d["reward_std"])
    assert d["reward_failures"] == 6 and d["zero_variance_groups"] == 2
    assert d["staleness"] == {} and d["staleness_mean"] == 0.0


def test_an_eval_row_is_the_reports_figures(groups):
    trajectories = [t for g in groups for t in g.trajectories]
    rep = report(trajectories)
    d = EvalRow.of(4, 3, 1.23456, trajectories).to_dict()
    assert list(d) == ["step", "version", "versions", "eval_s", "tasks", "samples", "pass@1", "pass@2", "pass@3",
                       "mean_reward", *(f"mean_{k}" for k in rep["components"]), "finish_reasons"]
    assert (d["step"], d["version"], d["versions"], d["eval_s"]) == (4, 3, [0, 0], 1.23)  # sampled at version 0
    assert (d["tasks"], d["samples"], d["mean_reward"]) == (2, 6, rep["mean_reward"])
    assert [d[f"pass@{k}"] for k in (1, 2, 3)] == [rep["pass@k"][str(k)] for k in (1, 2, 3)]
    assert d["finish_reasons"] == rep["finish_reasons"] and sum(d["finish_reasons"].values()) == 6
