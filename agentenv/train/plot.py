"""``agentenv plot RUN``: a training run's curves as a PNG.

Six panels: reward (batch mean, moving mean, and held-out pass@1 from ``eval.jsonl`` when the
run evaluated), loss, clip fraction (and the KL to the reference when it was penalised),
throughput with generator/trainer idle fractions, and off-policyness (staleness and
KL(behaviour || trainer)). Every legend sits below its panel, never over a curve.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .metrics import read_metrics


def _moving(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1): i + 1] if v == v]  # NaN: a batch with no reward
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def plot(run: str | Path, out: str | Path | None = None, window: int = 5) -> Path:
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
    steps = [r["step"] for r in rows]

    def series(key: str) -> list[float]:
        return [float(r.get(key, float("nan"))) for r in rows]

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    panels = axes.flatten()

    def below(ax, *more) -> None:  # the legend under the panel, clear of the curves
        handles, labels = ax.get_legend_handles_labels()
        for extra in more:
            h, lab = extra.get_legend_handles_labels()
            handles, labels = handles + h, labels + lab
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)

    ax = panels[0]
    reward = series("reward_mean")
    ax.plot(steps, reward, ".", alpha=0.35, label="batch mean")
    ax.plot(steps, _moving(reward, window), "-", label=f"moving mean ({window} steps)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["pass@1"] for e in evals], "s-", color="tab:red",
                label=f"held-out pass@1 ({evals[0]['tasks']} tasks)")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    below(ax)

    ax = panels[1]
    ax.plot(steps, series("loss"), label="loss")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel="step", title="loss")
    below(ax)

    ax = panels[2]
    ax.plot(steps, series("clip_frac"), label="clipped token fraction")
    ax.plot(steps, series("is_truncated_frac"), "--", label="IS-truncated token fraction")
    if any("kl_ref" in r for r in rows):
        ax.plot(steps, series("kl_ref"), ":", label="KL(policy || reference)")
    ax.set(xlabel="step", title="clipping")
    below(ax)

    ax = panels[3]
    ax.plot(steps, series("gen_tokens_per_s"), label="generated tok/s")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2 = ax.twinx()
    ax2.plot(steps, series("gen_idle_frac"), "g--", alpha=0.6, label="generator idle")
    ax2.plot(steps, series("trainer_idle_frac"), "r--", alpha=0.6, label="trainer idle")
    ax2.set(ylabel="idle fraction", ylim=(0, 1))
    below(ax, ax2)

    ax = panels[4]
    ax.plot(steps, series("staleness_mean"), label="mean token staleness")
    ax.plot(steps, series("kl_behaviour"), label="KL(behaviour || trainer)")
    ax.set(xlabel="step", title="off-policyness")
    below(ax)

    ax = panels[5]
    ax.plot(steps, series("zero_variance_groups"), label="groups with no reward variance")
    ax.plot(steps, series("groups"), ":", label="groups per step")
    ax.set(xlabel="step", title="learning signal")
    ax.set_ylim(bottom=0)
    below(ax)

    fig.suptitle(f"{path.parent.name}: {len(rows)} steps, {rows[-1]['time_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
