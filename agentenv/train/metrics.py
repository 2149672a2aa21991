"""Training metrics: a JSONL log (one object per step), a busy clock for idle fractions, and
the one-line step summary printed to stdout."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any


class BusyClock:
    """Accumulates the time during which at least one unit of work is in progress."""

    def __init__(self) -> None:
        self.active = 0
        self._since = 0.0
        self._busy = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._busy += time.perf_counter() - self._since

    @property
    def busy_s(self) -> float:
        return self._busy + (time.perf_counter() - self._since if self.active else 0.0)


class MetricsLog:
    """``metrics.jsonl`` under the run directory. On resume, lines past the checkpoint's step
    are dropped (they belong to work the checkpoint does not contain)."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut short by a kill: everything after it is gone too
        path.write_text("".join(k + "\n" for k in kept))
        self._f = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def staleness_summary(hist: Counter) -> tuple[dict[str, int], float]:
    total = sum(hist.values())
    mean = sum(k * v for k, v in hist.items()) / total if total else 0.0
    return {str(k): hist[k] for k in sorted(hist)}, mean


def step_line(row: dict[str, Any], steps: int) -> str:
    stale = " ".join(f"{k}:{v}" for k, v in row["staleness"].items())
    return (f"step {row['step']:>4}/{steps} v{row['version']:<4} reward {row['reward_mean']:.3f}"
            f"±{row['reward_std']:.3f}  loss {row['loss']:+.5f}  kl_mu {row['kl_behaviour']:.2e}"
            f"  is {row['is_weight_mean']:.3f}  stale[{stale}]  {row['gen_tokens_per_s']:.0f} tok/s"
            f"  idle gen {row['gen_idle_frac']:.2f} train {row['trainer_idle_frac']:.2f}"
            f"  sync {row['sync_s'] * 1000:.0f} ms")


def eval_line(row: dict[str, Any]) -> str:
    passes = "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("pass@"))
    mean = row["mean_reward"]
    return (f"eval after step {row['step']} (v{row['version']}): {row['tasks']} held-out tasks x "
            f"{row['samples'] // max(row['tasks'], 1)}  {passes}  mean reward "
            f"{'-' if mean is None else f'{mean:.3f}'}  ({row['eval_s']:.0f} s)")
