"""``agentenv plot RUN``: a training run's curves as a PNG.

Six panels: reward (batch mean, moving mean, and held-out pass@1 from ``eval.jsonl`` when the
run evaluated), loss, clip fraction (and the KL to the reference when it was penalised),
throughput with generator/trainer idle fractions, off-policyness (staleness in weight
versions and KL(behaviour || trainer), each on its own labelled axis) and the learning signal.
Every legend sits below its panel, never over a curve; steps are whole numbers on every axis.

The title's time is the run's ``summary.json`` wall time (what ``agentenv train`` reports);
a run without one (still going, or killed) shows the last row's time. :func:`figure` builds
the figure, :func:`plot` saves it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def moving(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it, NaN (a batch with no scored
    reward) left out; NaN where the window holds no number."""
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
    ax.plot(c.steps, moving(reward, c.window), "-", label=f"moving mean ({c.window} steps)")
    if c.evals:
        ax.plot([e["step"] for e in c.evals], [e["pass@1"] for e in c.evals], "s-", color="tab:red",
                label=f"held-out pass@1 ({c.evals[0]['tasks']} tasks)")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    _below(ax)


def _loss(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("loss"), label="loss")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel="step", ylabel="loss", title="loss")
    _below(ax)


def _clipping(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("clip_frac"), label="clipped token fraction")
    ax.plot(c.steps, c.series("is_truncated_frac"), "--", label="IS-truncated token fraction")
    ax.set(xlabel="step", ylabel="fraction of tokens", title="clipping")
    if not any("kl_ref" in r for r in c.rows):
        _below(ax)
        return
    ref = ax.twinx()
    ref.plot(c.steps, c.series("kl_ref"), ":", color="tab:red", label="KL(policy || reference)")
    ref.set_ylabel("KL(policy || reference), nats/token", color="tab:red")
    _below(ax, ref)


def throughput(rows: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """The steps whose generation rate was measured, that rate, and the run's mean rate up to
    each of them. A row counts the tokens of the programs that finished in its interval, so an
    interval in which the generator was busy but no program finished (programs longer than a
    step: the tokens land in a later row) measured no rate, and is left out; an interval in
    which the generator was idle throughout did generate nothing, and stays at 0."""
    steps, rate, mean = [], [], []
    tokens = seconds = 0.0
    for r in rows:
        tokens += r["gen_tokens_per_s"] * r["step_s"]
        seconds += r["step_s"]
        if r["gen_tokens_per_s"] == 0 and r["gen_idle_frac"] < 1:
            continue
        steps.append(r["step"])
        rate.append(r["gen_tokens_per_s"])
        mean.append(tokens / seconds if seconds else 0.0)
    return steps, rate, mean


def _throughput(ax: Any, c: _Curves) -> None:
    steps, rate, mean = throughput(c.rows)
    ax.plot(steps, rate, ".-", color="tab:blue", label="generated tok/s (programs finished in the step)")
    ax.plot(steps, mean, "-", color="tab:purple", label="generated tok/s (run mean)")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    # The viewer's training page draws these in the same colours (its SERIES_COLORS).
    ax2.plot(c.steps, c.series("gen_idle_frac"), "--", color="tab:green", alpha=0.6, label="generator idle")
    ax2.plot(c.steps, c.series("trainer_idle_frac"), "--", color="tab:red", alpha=0.6, label="trainer idle")
    ax2.set(ylabel="idle fraction", ylim=(0, 1))
    _below(ax, ax2)


def _off_policy(ax: Any, c: _Curves) -> None:
    ax.plot(c.steps, c.series("staleness_mean"), ".-", color="tab:blue", label="mean token staleness")
    ax.set(xlabel="step", title="off-policyness")
    ax.set_ylabel("staleness (weight versions behind)", color="tab:blue")
    ax.set_ylim(bottom=0)
    kl = ax.twinx()
    kl.plot(c.steps, c.series("kl_behaviour"), ".--", color="tab:orange", label="KL(behaviour || trainer)")
    kl.set_ylabel("KL(behaviour || trainer), nats/token", color="tab:orange")
    _below(ax, kl)


def _signal(ax: Any, c: _Curves) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.plot(c.steps, c.series("zero_variance_groups"), label="groups with no reward variance")
    ax.plot(c.steps, c.series("groups"), ":", label="groups per step")
    ax.set(xlabel="step", ylabel="groups", title="learning signal")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _below(ax)


#: The panels, left to right, top row first.
PANELS = (_reward, _loss, _clipping, _throughput, _off_policy, _signal)


def run_time(path: Path, rows: list[dict[str, Any]]) -> str:
    """The run's time for the title: ``summary.json``'s wall time (the figure ``agentenv
    train`` reports) when it belongs to these rows, else the last row's time."""
    summary = path.parent / "summary.json"
    try:
        s = json.loads(summary.read_text()) if summary.is_file() else None
    except (OSError, json.JSONDecodeError):
        s = None
    if s is None or s.get("steps") != rows[-1]["step"] or "wall_s" not in s:  # running, killed, or resumed since
        return f"{rows[-1]['time_s']:.1f} s to step {rows[-1]['step']} (no summary.json for it)"
    since = f" (the attempt resumed at step {s['start_step']})" if s.get("start_step") else ""
    return f"{s['wall_s']:.1f} s{since}"


#: What every row of a training run's metrics.jsonl holds that the figure reads.
REQUIRED = ("step", "time_s", "step_s", "gen_tokens_per_s", "gen_idle_frac")


def _metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path``, checked to be a training run's metrics: ConfigError in one line
    that says what ``path`` lacks (another JSONL, a text file, a run with no complete step)."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{path} is not a training run's metrics.jsonl ({why}); give an agentenv train "
                           "--out-dir or its metrics.jsonl")

    try:
        rows = read_metrics(path)
    except UnicodeDecodeError:
        raise refuse("not text") from None
    if not rows:
        if path.stat().st_size:
            raise refuse("line 1 is not JSON")
        raise ConfigError(f"{path} holds no complete step")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise refuse(f"line {i} is not a JSON object")
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise refuse(f"line {i} has no {', '.join(repr(k) for k in missing)}")
    return rows


def figure(run: str | Path, window: int = 5) -> Figure:
    """The curves of ``run`` (a run directory or its ``metrics.jsonl``) as a matplotlib
    Figure (not drawn on any screen). ``window``: steps in the reward's moving mean.
    ConfigError when there are no metrics, no complete step, or rows that are not a training
    run's metrics (:data:`REQUIRED`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run = Path(run)
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl at {path}")
    rows = _metrics_rows(path)
    evals = read_metrics(path.parent / "eval.jsonl") if (path.parent / "eval.jsonl").is_file() else []
    evals.sort(key=lambda e: e["step"])  # a log written before evaluations were reported in step order
    curves = _Curves(rows, evals, window)
    fig = Figure(figsize=(16, 8.5))
    for draw, ax in zip(PANELS, fig.subplots(2, 3).flatten()):
        draw(ax, curves)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    fig.suptitle(f"{path.parent.name}: {len(rows)} steps, {run_time(path, rows)}")
    fig.tight_layout()
    return fig


def plot(run: str | Path, out: str | Path | None = None, window: int = 5) -> Path:
    """Draw the curves of ``run`` (a run directory or its ``metrics.jsonl``) into ``out``
    (default: ``curves.png`` beside the metrics); returns the PNG's path. ``window``: steps in
    the reward's moving mean. ConfigError when there are no metrics or no complete step."""
    fig = figure(run, window)
    run = Path(run)
    out = Path(out) if out else (run if run.is_dir() else run.parent) / "curves.png"
    fig.savefig(out, dpi=100)
    return out
