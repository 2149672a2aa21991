"""Async vs. sync GRPO training: wall time to the same number of steps on the same workload.

    python bench/trainer.py [--steps 10 --groups-per-step 4 --group-size 4 --max-staleness 2]

Both runs train the bundled tiny model on retool-math with the same seeded task stream, the
same settings and a fresh engine each:

* ``sync`` (colocated baseline): generate a batch, score it, train, sync, repeat;
* ``async``: generation never stops; a program starts when the staleness gate admits it,
  groups enter the buffer as their rewards land, the trainer steps and syncs meanwhile.

The workload stands in for a real agentic task: every tool call runs for real in the local
sandbox *plus* a heavy-tailed extra latency (log-normal; a remote sandbox, a slow test
suite), and every reward waits on a verifier latency (an LLM judge, a remote grader) before
it is computed. Latencies are keyed by (task, sample, turn), so both modes wait the same.

Prints each mode's wall time, generator and trainer idle fractions, throughput and staleness,
and as the last line ``async_speedup: <sync_wall / async_wall>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.envs.retool_math import RetoolMathEnv  # noqa: E402
from agentenv.tools import PythonTool, ToolContext, ToolOutput  # noqa: E402
from agentenv.train import TrainConfig, Trainer  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def latency(key: str, median: float, sigma: float, cap: float) -> float:
    """Deterministic heavy-tailed (log-normal, capped) latency for one key."""
    rng = random.Random(hashlib.sha256(key.encode()).hexdigest())
    return min(cap, median * math.exp(sigma * rng.gauss(0, 1)))


class SlowPython(PythonTool):
    """The real sandboxed python tool plus a heavy-tailed extra latency per (task, sample, turn)."""

    def __init__(self, median: float, sigma: float, cap: float) -> None:
        super().__init__()
        self.median, self.sigma, self.cap = median, sigma, cap

    async def __call__(self, ctx: ToolContext, **arguments) -> ToolOutput:
        t = ctx.trajectory
        key = f"{t.task_id}/{t.sample_index}/{ctx.turn}" if t is not None else arguments["code"]
        await anyio.sleep(latency(key, self.median, self.sigma, self.cap))
        return await super().__call__(ctx, **arguments)


class AgenticMath(RetoolMathEnv):
    """retool-math with slow tools and a slow (delayed) reward."""

    def __init__(self, tool: SlowPython, reward_median: float, reward_sigma: float, **kw) -> None:
        super().__init__(**kw)
        self.tool, self.reward_median, self.reward_sigma = tool, reward_median, reward_sigma

    def tools(self):
        return [self.tool]

    async def reward(self, task, trajectory):
        key = f"reward/{task.id}/{trajectory.sample_index}"
        await anyio.sleep(latency(key, self.reward_median, self.reward_sigma, 4 * self.reward_median))
        return await super().reward(task, trajectory)


def run(mode: str, a: argparse.Namespace, out: Path) -> dict:
    env = AgenticMath(SlowPython(a.tool_median, a.tool_sigma, a.tool_cap), a.reward_median, a.reward_sigma)
    cfg = TrainConfig(mode=mode, steps=a.steps, groups_per_step=a.groups_per_step, group_size=a.group_size,
                      max_staleness=a.max_staleness, concurrency=a.concurrency, lr=a.lr, seed=a.seed,
                      max_new_tokens=a.max_new_tokens, out_dir=str(out / mode), checkpoint_every=10**6)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, env=env, print_steps=False)
    summary = anyio.run(trainer.run)
    rows = trainer.rows
    tokens = sum(r["gen_tokens_per_s"] * r["step_s"] for r in rows)
    return {**summary, "wall_s": round(time.perf_counter() - t0, 2), "train_wall_s": summary["wall_s"],
            "tokens_per_s": round(tokens / summary["wall_s"], 1),
            "reward_mean": round(sum(r["reward_mean"] for r in rows) / len(rows), 3),
            "train_s_per_step": round(sum(r["train_s"] for r in rows) / len(rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tool-median", type=float, default=0.5, help="extra tool latency, median seconds")
    ap.add_argument("--tool-sigma", type=float, default=1.0)
    ap.add_argument("--tool-cap", type=float, default=5.0)
    ap.add_argument("--reward-median", type=float, default=1.0, help="verifier latency, median seconds")
    ap.add_argument("--reward-sigma", type=float, default=0.5)
    a = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"workload: retool-math, {a.steps} steps x {a.groups_per_step} groups x {a.group_size}; tool +lognormal("
          f"median {a.tool_median}s, sigma {a.tool_sigma}, cap {a.tool_cap}s); reward +lognormal(median "
          f"{a.reward_median}s, sigma {a.reward_sigma}); async max_staleness {a.max_staleness}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, a, Path(tmp)) for mode in ("sync", "async")}
    for mode, r in results.items():
        print(f"{mode:>5}: wall {r['train_wall_s']:.1f}s  {r['tokens_per_s']:.0f} tok/s  generator idle "
              f"{r['gen_idle_frac']:.2f}  trainer idle {r['trainer_idle_frac']:.2f}  train {r['train_s_per_step']:.2f}"
              f" s/step  staleness {json.dumps(r['staleness'])}  dropped {r['dropped_groups']}  reward "
              f"{r['reward_mean']:.3f}")
    print(f"async_speedup: {results['sync']['train_wall_s'] / results['async']['train_wall_s']:.2f}")
    _report.write("trainer", {**results, "async_speedup": results["sync"]["train_wall_s"] / results["async"]["train_wall_s"]},
                  headline="async_speedup", args=a)


if __name__ == "__main__":
    main()
