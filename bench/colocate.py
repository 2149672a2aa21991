"""Colocated against async and sync training of the bundled model, side by side.

    python bench/colocate.py [--steps 40] [--modes async,sync,colocated] [--sleep-level 1]

Each mode trains the bundled tiny model on retool-math with the environment's training
defaults (the settings that make it learn; ``--steps`` of them), no evaluations, the same seed
and task stream, each in a fresh process of its own (so its peak resident memory is its own).
Per mode it prints the wall time per step (the run's wall over its steps), the batch reward
of the first and last ``--window`` steps, the peak resident memory of the process
(``ru_maxrss``), and for colocated the engine's mean sleep, wake and asleep seconds per step.
Last, one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, resource, sys
from agentenv.train import TrainConfig, train
mode, steps, level, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = TrainConfig.for_env("retool-math", mode=mode, steps=steps, sleep_level=level, eval_every=0, out_dir=out,
                          report_to=["none"], checkpoint_every=10**6)
rows = []
summary = train(cfg, print_steps=False, on_step=rows.append)
keys = ("reward_mean", "step_s", "train_s", "sync_s", "engine_sleep_s", "engine_wake_s", "engine_asleep_s")
print("RESULT " + json.dumps({"summary": summary, "rows": [{k: r.get(k) for k in keys} for r in rows],
                               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_mode(mode: str, steps: int, level: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-c", _CHILD, mode, str(steps), str(level), out],
                              capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def figures(mode: str, res: dict, window: int) -> dict:
    rows, summary = res["rows"], res["summary"]
    out = {"mode": mode, "steps": len(rows), "wall_s": summary["wall_s"],
           "wall_per_step_s": round(summary["wall_s"] / max(1, len(rows)), 3),
           "reward_first": round(_mean([r["reward_mean"] for r in rows[:window]]), 3),
           "reward_last": round(_mean([r["reward_mean"] for r in rows[-window:]]), 3),
           "train_s": round(_mean([r["train_s"] for r in rows]), 3),
           "peak_rss_mb": round(res["peak_rss_mb"], 1)}
    if mode == "colocated":
        for k in ("engine_sleep_s", "engine_wake_s", "engine_asleep_s"):
            out[k] = round(_mean([r[k] for r in rows]), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=10, help="steps averaged for the first and last reward")
    ap.add_argument("--modes", default="async,sync,colocated")
    ap.add_argument("--sleep-level", type=int, default=1, choices=(1, 2))
    args = ap.parse_args()
    results = []
    for mode in args.modes.split(","):
        fig = figures(mode, run_mode(mode, args.steps, args.sleep_level), args.window)
        results.append(fig)
        extra = (f"  sleep {fig['engine_sleep_s']} s, wake {fig['engine_wake_s']} s, asleep {fig['engine_asleep_s']} s"
                 if mode == "colocated" else "")
        print(f"{mode:>9}: {fig['wall_per_step_s']:.2f} s/step ({fig['wall_s']:.1f} s), reward first "
              f"{args.window} {fig['reward_first']:.3f} -> last {args.window} {fig['reward_last']:.3f}, "
              f"train {fig['train_s']:.2f} s/step, peak RSS {fig['peak_rss_mb']:.0f} MB{extra}", flush=True)
    for fig in results:
        print(json.dumps(fig))


if __name__ == "__main__":
    main()
