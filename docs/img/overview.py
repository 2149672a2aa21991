"""Draw docs/img/overview.png, the picture at the top of the README and the site's home page.

    python docs/img/overview.py

One program's loop (engine, reactor, sandbox session) above the trajectory it builds: the
prompt, the model's sampled turns (loss mask 1, each token with its logprob and weight
version) and the tool outputs spliced in between (loss mask 0).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

MODEL, ENV, PROMPT = "#4C72B0", "#DD8452", "#B0B0B0"


def box(ax, x: float, y: float, w: float, h: float, title: str, body: str, color: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc="white", ec=color, lw=2))
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=12, weight="bold", color=color)
    ax.text(x + w / 2, y + h - 0.62, body, ha="center", va="top", fontsize=9, color="#333333", linespacing=1.4)


def arrow(ax, a: tuple[float, float], b: tuple[float, float], text: str, color: str, rad: float = 0.0,
          dy: float = 0.12) -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=16, lw=1.8, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))
    ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + dy, text, ha="center", va="bottom", fontsize=9, color=color)


def main() -> None:
    fig, ax = plt.subplots(figsize=(11, 4.6))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 4.6)
    ax.axis("off")

    box(
        ax,
        0.2,
        2.2,
        2.7,
        2.1,
        "engine",
        "embedded | vLLM | OpenAI server\nsamples a turn from the\nprefix cache: token ids,\nlogprobs, weight version",
        MODEL,
    )
    box(
        ax,
        4.15,
        2.2,
        2.7,
        2.1,
        "reactor",
        "schedules programs, not\nrequests; parses the tool\ncall; splices its output\nas tokens (never re-encoded)",
        "#555555",
    )
    box(
        ax,
        8.1,
        2.2,
        2.7,
        2.1,
        "sandbox session",
        "a stateful Python per\nprogram, isolated;\nruns the call,\nnever raises",
        ENV,
    )
    arrow(ax, (2.95, 3.55), (4.1, 3.55), "a turn: ids,\nlogprobs", MODEL)
    arrow(ax, (6.9, 3.55), (8.05, 3.55), "tool call", ENV)
    arrow(ax, (8.05, 2.75), (6.9, 2.75), "output", ENV, dy=-0.38)
    arrow(ax, (4.1, 2.75), (2.95, 2.75), "next turn:\nall so far", "#555555", dy=-0.52)

    # The trajectory: segments in order, their loss mask underneath.
    segs = [("prompt", 1.6, PROMPT, 0), ("model turn 1", 2.0, MODEL, 1), ("tool output", 1.4, ENV, 0),
            ("model turn 2", 2.0, MODEL, 1), ("tool output", 1.0, ENV, 0), ("answer", 1.4, MODEL, 1)]
    x, y = 0.3, 0.75
    ax.text(0.3, 1.62, "the trajectory (one JSONL line, or a trainer's batch row):", fontsize=10, color="#333333")
    for name, w, color, mask in segs:
        ax.add_patch(FancyBboxPatch((x, y), w - 0.06, 0.55, boxstyle="square,pad=0", fc=color, ec="white"))
        ax.text(x + w / 2 - 0.03, y + 0.27, name, ha="center", va="center", fontsize=9, color="white", weight="bold")
        ax.text(x + w / 2 - 0.03, y - 0.22, f"mask {mask}", ha="center", va="center", fontsize=8, color="#333333")
        x += w
    ax.text(0.3, 0.12, "every sampled token: its logprob and the weight version that sampled it; tool tokens: "
            "logprob 0, version -1", fontsize=8.5, color="#555555")
    fig.tight_layout(pad=0.3)
    fig.savefig(Path(__file__).with_name("overview.png"), dpi=110)


if __name__ == "__main__":
    main()
