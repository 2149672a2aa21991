"""``agentenv plot RUN``: reward and throughput curves of a training run, as a PNG."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .metrics import read_metrics


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
    out = Path(out) if out else path.parent / "curves.png"
    steps = [r["step"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    smooth = [sum(reward[max(0, i - window + 1): i + 1]) / len(reward[max(0, i - window + 1): i + 1])
              for i in range(len(reward))]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(steps, reward, ".", alpha=0.35, label="batch mean")
    ax.plot(steps, smooth, "-", label=f"moving mean ({window} steps)")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, [r["gen_tokens_per_s"] for r in rows], label="generated tok/s")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["gen_idle_frac"] for r in rows], "g--", alpha=0.6, label="generator idle")
    ax2.plot(steps, [r["trainer_idle_frac"] for r in rows], "r--", alpha=0.6, label="trainer idle")
    ax2.set(ylabel="idle fraction", ylim=(0, 1))
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    ax = axes[2]
    ax.plot(steps, [r["staleness_mean"] for r in rows], label="mean token staleness")
    ax.plot(steps, [r["kl_behaviour"] for r in rows], label="KL(behaviour || trainer)")
    ax.set(xlabel="step", title="off-policyness")
    ax.legend()
    fig.suptitle(f"{path.parent.name}: {len(rows)} steps, {rows[-1]['time_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
