"""``agentenv plot RUN``: a training run's curves as a PNG.

Six panels: reward (batch mean, moving mean, and held-out pass@1 from ``eval.jsonl`` when the
run evaluated), loss, clip fraction (and the KL to the reference when it was penalised),
throughput with generator/trainer idle fractions, and off-policyness (staleness and
KL(behaviour || trainer)). Every legend sits below its panel, never over a curve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .metrics import read_metrics


def _moving(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1): i + 1] if v == v]  # NaN: a batch with no reward
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


@dataclass
class _Curves:
    """A run's rows, read once, for the panels."""

    rows: list[dict[str, Any]]
    evals: list[dict[str, Any]]  # eval.jsonl's rows; empty when the run did not evaluate
    window: int  # steps in the reward's moving mean

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.rows]

    def series(self, key: str) -> list[float]:
        """One value per step; NaN where a row lacks ``key``."""
        return [float(r.get(key, float("nan"))) for r in self.rows]


def _below(ax: Any, *more: Any) -> None:
    """The legend of ``ax`` (and of its twins ``more``) under the panel, clear of the curves."""
    handles, labels = ax.get_legend_handles_labels()
    for extra in more:
        h, lab = extra.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def _reward(ax: Any, c: _Curves) -> None:
    reward = c.series("reward_mean")
    ax.plot(c.steps, reward, ".", alpha=0.35, label="batch mean")
    ax.plot(c.steps, _moving(reward, c.window), "-", label=f"moving mean ({c.window} steps)")
    if c.evals:
        ax.plot([e["step"] for e in c.evals], [e["pass@1"] for e in c.evals], "s-", color="tab:red",
                label=f"held-out pass@1 ({c.evals[0]['tasks']} tasks)")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    _below(ax)


def _loss(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("loss"), label="loss")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel="step", title="loss")
    _below(ax)


def _clipping(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("clip_frac"), label="clipped token fraction")
    ax.plot(c.steps, c.series("is_truncated_frac"), "--", label="IS-truncated token fraction")
    if any("kl_ref" in r for r in c.rows):
        ax.plot(c.steps, c.series("kl_ref"), ":", label="KL(policy || reference)")
    ax.set(xlabel="step", title="clipping")
    _below(ax)


def _throughput(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("gen_tokens_per_s"), label="generated tok/s")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2 = ax.twinx()
    ax2.plot(c.steps, c.series("gen_idle_frac"), "g--", alpha=0.6, label="generator idle")
    ax2.plot(c.steps, c.series("trainer_idle_frac"), "r--", alpha=0.6, label="trainer idle")
    ax2.set(ylabel="idle fraction", ylim=(0, 1))
    _below(ax, ax2)


def _off_policy(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("staleness_mean"), label="mean token staleness")
    ax.plot(c.steps, c.series("kl_behaviour"), label="KL(behaviour || trainer)")
    ax.set(xlabel="step", title="off-policyness")
    _below(ax)


def _signal(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("zero_variance_groups"), label="groups with no reward variance")
    ax.plot(c.steps, c.series("groups"), ":", label="groups per step")
    ax.set(xlabel="step", title="learning signal")
    ax.set_ylim(bottom=0)
    _below(ax)


#: The panels, left to right, top row first.
PANELS = (_reward, _loss, _clipping, _throughput, _off_policy, _signal)


def plot(run: str | Path, out: str | Path | None = None, window: int = 5) -> Path:
    """Draw the curves of ``run`` (a run directory or its ``metrics.jsonl``) into ``out``
    (default: ``curves.png`` beside the metrics); returns the PNG's path. ``window``: steps in
    the reward's moving mean. ConfigError when there are no metrics or no complete step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run)
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl at {path}")
    rows = read_metrics(path)
    if not rows:
        raise ConfigError(f"{path} holds no complete step")
    evals = read_metrics(path.parent / "eval.jsonl") if (path.parent / "eval.jsonl").is_file() else []
    out = Path(out) if out else path.parent / "curves.png"
    curves = _Curves(rows, evals, window)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for draw, ax in zip(PANELS, axes.flatten()):
        draw(ax, curves)
    fig.suptitle(f"{path.parent.name}: {len(rows)} steps, {rows[-1]['time_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
