"""Evaluation: pass@k and reward components over k samples per task.

``agentenv eval`` rolls out ``k`` samples of every task and hands the trajectories (the JSONL
lines it wrote) to :func:`report`; the library can do the same with any trajectories:

    rep = report(trajectories, threshold=1.0)
    rep["pass@k"]["1"], rep["components"]["correct"]

A sample *passes* when its reward is at least ``threshold`` (a failed reward, None, does not
pass). pass@k is the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)`` for
a task with ``n`` samples of which ``c`` pass, averaged over tasks; it is reported for k = 1,
2, 4, ... up to the smallest number of samples any task has.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import ConfigError
from .stats import component_rows
from .trajectory import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from
    ``n`` (``c`` of them correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ks(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks + ([n] if ks[-1] != n else [])


def _fields(t: Trajectory | Mapping[str, Any]) -> tuple[str, Any, dict, str, str | None, int]:
    if isinstance(t, Trajectory):
        return t.task_id, t.reward, t.reward_components, t.finish_reason, t.error, len(t.tool_calls)
    return (t["task_id"], t.get("reward"), t.get("reward_components") or {}, t.get("finish_reason", ""),
            t.get("error"), len(t.get("tool_calls") or []))


def report(trajectories: Iterable[Trajectory | Mapping[str, Any]], threshold: float = 1.0,
           ks: Iterable[int] | None = None) -> dict[str, Any]:
    """pass@k, mean reward and per-component means, overall and per task."""
    by_task: dict[str, list[tuple]] = defaultdict(list)
    for t in trajectories:
        f = _fields(t)
        by_task[f[0]].append(f)
    if not by_task:
        raise ConfigError("nothing to evaluate: no trajectories")
    n_min = min(len(v) for v in by_task.values())
    ks = sorted(set(ks)) if ks is not None else _ks(n_min)
    if ks and (ks[0] < 1 or ks[-1] > n_min):
        raise ConfigError(f"k must be between 1 and the samples per task ({n_min}), got {ks}")
    comp_sum: Counter = Counter()
    comp_n: Counter = Counter()
    finish: Counter = Counter()
    rewards: list[float] = []
    errors: list[str] = []
    per_task = []
    for task_id, rows in sorted(by_task.items()):
        task_rewards = [r for _, r, *_ in rows]
        passed = sum(r is not None and r >= threshold for r in task_rewards)
        scored = [r for r in task_rewards if r is not None]
        rewards += scored
        for _, _, comps, fin, err, _ in rows:
            finish[fin] += 1
            if err and fin == "error:reward":
                errors.append(err)
            for name, value in comps.items():
                comp_sum[name] += value
                comp_n[name] += 1
        per_task.append({
            "task_id": task_id, "samples": len(rows), "passed": passed,
            "mean_reward": round(sum(scored) / len(scored), 4) if scored else None,
            **{f"pass@{k}": round(pass_at_k(len(rows), passed, k), 4) for k in ks},
        })
    samples = sum(len(v) for v in by_task.values())
    return {
        "tasks": len(by_task),
        "samples": samples,
        "samples_per_task": n_min if all(len(v) == n_min for v in by_task.values()) else None,
        "threshold": threshold,
        "pass@k": {str(k): round(sum(t[f"pass@{k}"] for t in per_task) / len(per_task), 4) for k in ks},
        "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "components": {name: round(comp_sum[name] / comp_n[name], 4) for name in sorted(comp_sum)},
        "tool_calls_per_sample": round(sum(f[5] for v in by_task.values() for f in v) / samples, 3),
        "finish_reasons": dict(sorted(finish.items())),
        "reward_failures": len(errors),
        "first_reward_error": errors[0] if errors else None,
        "per_task": per_task,
    }


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The trajectory lines of an ``agentenv rollout``/``eval`` output file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ConfigError(f"{path}:{n}: not a trajectory line") from None
    return out


def table(rep: Mapping[str, Any], title: str = "evaluation", weights: Mapping[str, float] | None = None) -> Any:
    """A rich Table of a report: the overall figures, then one row per component, marked with
    its weight in the reward where that is known and not 1 (``weights``, as the run summary)."""
    from rich.table import Table


    t = Table(title=f"{title}: {rep['tasks']} tasks x {rep['samples_per_task'] or 'varying'} samples",
              show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in rep["pass@k"].items():
        t.add_row(f"pass@{k}", f"{v:.3f}")
    t.add_row("mean reward", "-" if rep["mean_reward"] is None else f"{rep['mean_reward']:.3f}")
    for label, v in component_rows(rep["components"], dict(weights or {})):
        t.add_row(label, f"{v:.3f}")
    t.add_row("tool calls per sample", str(rep["tool_calls_per_sample"]))
    t.add_row("finish reasons", ", ".join(f"{k}={v}" for k, v in rep["finish_reasons"].items()))
    if rep["reward_failures"]:
        t.add_row("reward failures", f"{rep['reward_failures']} (first: {rep['first_reward_error']})")
    return t
