"""Async vs. sync GRPO training, and the async run against its ideal overlap, on one workload.

    python bench/trainer.py [--steps 10 --groups-per-step 4 --group-size 4 --max-staleness 2]

Three runs train or generate the bundled tiny model on retool-math with the same seeded task
stream and the same settings:

* ``sync`` (colocated baseline, a fresh engine of its own): generate a batch, score it,
  train, sync, repeat. Its steps time the trainer *alone*: nothing generates while it trains;
* ``async`` (one engine E): generation never stops; a program starts when the staleness
  gate admits it, groups enter the buffer as their rewards land, the trainer steps and syncs
  meanwhile;
* ``generation alone`` (the same engine E, after): the async run's generator with the same
  admission rule (``max_staleness``: at most ``max_staleness + 1`` batches started and not yet
  taken), each batch taken the moment it is complete and the gate's version moved on at once
  (no training, no weight update), no group dropped as stale: the batches' availability times.

The learning rate is small by default (``--lr 1e-6``): the overlap's accounting compares runs
that must generate alike, and a policy that learns changes its turn lengths (at ``1e-4`` the
async run's turns grew from 23 to 29 tokens in 10 steps). Each run's token count is printed.

The workload (the *straggler workload*) stands in for a real agentic task: every tool call
runs for real in the local sandbox *plus* a heavy-tailed extra latency (log-normal; a remote
sandbox, a slow test suite), and every reward waits on a verifier latency (an LLM judge, a
remote grader) before it is computed. Latencies are keyed by (task, sample, turn), so every
run waits the same.

**Ideal overlap** (``bench/_overlap.py``): with ``gen[i]`` the time from batch ``i - 1``'s
availability to batch ``i``'s in the generation-alone run and ``train[i]`` the sync run's
optimiser step plus weight sync of step ``i`` (the last one's with the run's end: the final
checkpoint), a perfect overlap takes ``gen[1] + sum(max(gen[i], train[i-1]) for i in 2..n) +
train[n]``; ``ideal_overlap`` is that over the async run's wall (1.0: a perfect overlap; above
1: async beat it, e.g. by generating faster than the generation-alone run did). The tighter
flow-shop bound (``pipeline_wall``) is printed beside it.

**Generation against pure decode**: an instrument on engine E counts its requests in flight,
so each of the two runs on E gives its tok/s over the time the engine had work and the mean
requests in flight then; right after the async run, on E, a closed loop of that many requests
at that run's mean prompt and turn lengths (no tools, no training) measures pure decode. The
ratio shows how fast the engine decodes during the async run, training and syncs beside it,
against alone at the same load; generation alone's busy rate is the same ratio without
training (its turns also carry tool results to prefill, which pure decode has not).

Prints each mode's wall time, idle fractions, throughput and staleness, the overlap and
decode figures, then ``async_speedup: <sync_wall / async_wall>`` and, last,
``ideal_overlap: <ideal_wall / async_wall>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

# The async mode stands for the trainer and the engine on devices of their own (disaggregated),
# which is what the ideal overlap assumes (generation and training do not slow each other). On
# a CPU machine each gets one core's worth of threads: torch's thread pools of two (the
# engine's and the trainer's step, in threads of this process) on two cores would measure
# their contention for the same cores, not the overlap. Set OMP_NUM_THREADS to change it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a waiting thread sleeps, not spins on a shared core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import inflight  # noqa: E402
from agentenv.envs.retool_math import RetoolMathEnv  # noqa: E402
from agentenv.runtime import open_runtime  # noqa: E402
from agentenv.tools import PythonTool, ToolContext, ToolOutput  # noqa: E402
from agentenv.train import TrainConfig, Trainer  # noqa: E402
from agentenv.train.generation import Generation, TaskStream  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)
from _overlap import ideal_wall, intervals, pipeline_wall  # noqa: E402  (bench/_overlap.py)
from scheduling import pure_decode  # noqa: E402  (bench/scheduling.py)


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


class DecodeMeter:
    """Counts an engine's requests in flight (its ``generate`` wrapped on the instance): the
    time it had at least one, the request-seconds in flight, the tokens sampled, and each
    request's prompt and sampled lengths. ``mark()`` and ``since(mark)`` read one run's share."""

    def __init__(self, engine) -> None:
        self._generate, engine.generate = engine.generate, self._wrapped
        self.in_flight, self.busy_s, self.area, self.tokens = 0, 0.0, 0.0, 0
        self.prompts: list[int] = []
        self.turns: list[int] = []
        self._t = time.perf_counter()

    def _advance(self) -> None:
        now = time.perf_counter()
        if self.in_flight:
            self.busy_s += now - self._t
            self.area += self.in_flight * (now - self._t)
        self._t = now

    async def _wrapped(self, prompt_ids, params, request_id, **kw):
        self._advance()
        self.in_flight += 1
        try:
            out = await self._generate(prompt_ids, params, request_id, **kw)
        finally:
            self._advance()
            self.in_flight -= 1
        self.tokens += len(out.token_ids)
        self.prompts.append(len(prompt_ids))
        self.turns.append(len(out.token_ids))
        return out

    def mark(self) -> tuple:
        self._advance()
        return self.busy_s, self.area, self.tokens, len(self.prompts)

    def since(self, mark: tuple, wall: float) -> dict:
        """The engine's figures since ``mark`` over a run of ``wall`` seconds."""
        self._advance()
        busy, area, tokens = self.busy_s - mark[0], self.area - mark[1], self.tokens - mark[2]
        prompts, turns = self.prompts[mark[3]:], self.turns[mark[3]:]
        return {"busy_frac": busy / wall, "tokens": tokens, "busy_tok_s": tokens / max(busy, 1e-9),
                "in_flight_busy": area / max(busy, 1e-9), "requests": len(prompts),
                "prompt": round(statistics.mean(prompts)) if prompts else 1,
                "turn": max(1, round(statistics.mean(turns))) if turns else 1}


def make_env(a: argparse.Namespace) -> AgenticMath:
    return AgenticMath(SlowPython(a.tool_median, a.tool_sigma, a.tool_cap), a.reward_median, a.reward_sigma)


def config(mode: str, a: argparse.Namespace, out: Path) -> TrainConfig:
    return TrainConfig(mode=mode, steps=a.steps, groups_per_step=a.groups_per_step, group_size=a.group_size,
                       max_staleness=a.max_staleness, concurrency=a.concurrency, lr=a.lr, seed=a.seed,
                       max_new_tokens=a.max_new_tokens, out_dir=str(out / mode), checkpoint_every=10**6)


async def train(mode: str, a: argparse.Namespace, out: Path, engine=None) -> dict:
    """One training run; its summary, per-step train and sync times, and its tail (the time
    after the last step's row: the final checkpoint, the groups in flight cancelled)."""
    t0 = time.perf_counter()
    trainer = Trainer(config(mode, a, out), env=make_env(a), engine=engine, print_steps=False)
    summary = await trainer.run()
    rows = trainer.rows
    tokens = sum(r["gen_tokens_per_s"] * r["step_s"] for r in rows)
    return {**summary, "wall_s": round(time.perf_counter() - t0, 2), "train_wall_s": summary["wall_s"],
            "tokens_per_s": round(tokens / summary["wall_s"], 1), "tokens": round(tokens),
            "reward_mean": round(sum(r["reward_mean"] for r in rows) / len(rows), 3),
            "train_s_per_step": round(sum(r["train_s"] for r in rows) / len(rows), 3),
            "train_s": [r["train_s"] for r in rows], "sync_s": [r["sync_s"] for r in rows],
            "tail_s": round(summary["wall_s"] - rows[-1]["time_s"], 3)}


async def generate_alone(engine, a: argparse.Namespace) -> dict:
    """The async run's generator without training: each batch is taken as soon as it is
    complete and generation's version moves on at once (no weight update). Returns each
    batch's availability time (seconds from the start) and the run's wall and tokens."""
    cfg, env = config("async", a, Path(".")), make_env(a)
    rollout, batch, staleness = cfg.rollout.for_env(env), cfg.batch, cfg.staleness.limit
    programs = inflight.InFlight()
    async with open_runtime(env, engine, cfg.sandbox, rollout, journal=programs, wait=True,
                            programs=batch.trajectories * (staleness + 1)) as runtime:
        reactor = runtime.reactor
        v0 = engine.weight_version
        gen = Generation(reactor, TaskStream(env, batch.groups_per_step, batch.seed), programs,
                         group_size=batch.group_size, batch=batch.groups_per_step, max_staleness=staleness, version=v0)
        # The gate admits as in the async run (its version moves on as each batch is taken);
        # the engine's weights and version stay as they are (no weight update: none would
        # change them), and nothing is dropped as stale: the tokens keep version v0.
        gen.buffer.max_staleness = 10**9
        ready: list[float] = []
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.run, tg)
            for step in range(1, cfg.optimiser.steps + 1):
                await gen.next_batch()
                ready.append(time.perf_counter() - t0)
                await gen.publish(v0 + step)
            tg.cancel_scope.cancel()
    return {"ready_s": ready, "wall_s": ready[-1], "tokens": reactor.stats.outcomes.sampled_tokens,
            "dropped_groups": gen.buffer.dropped}


async def decode_side_by_side(engine, load: dict, seconds: float) -> dict:
    """Pure decode on ``engine`` at a run's load: as many requests as it had in flight while
    busy, at its mean prompt and turn lengths; and the run's busy rate against it."""
    concurrency = max(1, round(load["in_flight_busy"]))
    await pure_decode(engine, load["prompt"], load["turn"], concurrency, 1.0)  # its prompts cached
    rate = await pure_decode(engine, load["prompt"], load["turn"], concurrency, seconds)
    return {**load, "pure_decode_concurrency": concurrency, "pure_decode_tok_s": rate,
            "busy_vs_pure_decode": load["busy_tok_s"] / rate}


async def on_one_engine(a: argparse.Namespace, out: Path) -> tuple[dict, dict]:
    """The async run, pure decode at its load, then generation alone, on one engine."""
    from agentenv.engines.spec import EngineSpec
    from agentenv.models import default_model

    cfg = config("async", a, out)
    engine = await EngineSpec.sampling_as(cfg.rollout, cfg.engine.engine, default_model(), seed=a.seed).open()
    try:
        meter = DecodeMeter(engine)
        await pure_decode(engine, 64, 16, 4, 2.0)  # warm-up
        mark = meter.mark()
        result = await train("async", a, out, engine=engine)
        result["decode"] = await decode_side_by_side(engine, meter.since(mark, result["train_wall_s"]),
                                                     a.decode_seconds)
        mark = meter.mark()
        alone = await generate_alone(engine, a)
        alone["decode"] = meter.since(mark, alone["wall_s"])
    finally:
        await engine.aclose()
    return alone, result


def overlap(sync: dict, alone: dict, asynchronous: dict) -> dict:
    """The ideal overlap's figures: per-step stage times, both bounds, and shares of them."""
    gen = intervals(alone["ready_s"])
    train = [t + s for t, s in zip(sync["train_s"], sync["sync_s"])]
    train[-1] += sync["tail_s"]  # the run ends with its final checkpoint
    ideal, pipeline = ideal_wall(gen, train), pipeline_wall(gen, train)
    wall = asynchronous["train_wall_s"]
    # The same arithmetic on the async run's own step and sync times (slowed by generation
    # beside them): how much of the gap is the trainer sharing the machine with the engine.
    shared = [t + s for t, s in zip(asynchronous["train_s"], asynchronous["sync_s"])]
    shared[-1] += asynchronous["tail_s"]
    return {"gen_s": [round(g, 3) for g in gen], "train_s": [round(t, 3) for t in train],
            "generation_alone_s": sum(gen), "training_alone_s": sum(train), "ideal_wall_s": ideal,
            "pipeline_wall_s": pipeline, "async_wall_s": wall, "ideal_overlap": ideal / wall,
            "pipeline_overlap": pipeline / wall, "async_train_s": [round(t, 3) for t in shared],
            "training_in_async_s": sum(shared), "ideal_wall_with_async_training_s": ideal_wall(gen, shared),
            "trainer_wait_in_async_s": asynchronous["trainer_idle_frac"] * wall}


def report(results: dict, alone: dict, ov: dict) -> None:
    for mode in ("sync", "async"):
        r = results[mode]
        print(
            f"{mode:>5}: wall {r['train_wall_s']:.1f}s  {r['tokens']} tokens, {r['tokens_per_s']:.0f} tok/s  "
            f"generator idle {r['gen_idle_frac']:.2f}  trainer idle {r['trainer_idle_frac']:.2f}  "
            f"train {r['train_s_per_step']:.2f} s/step  staleness {json.dumps(r['staleness'])}  "
            f"dropped {r['dropped_groups']} (cancelled in flight {r.get('cancelled_groups', 0)})  "
            f"reward {r['reward_mean']:.3f}"
        )
    print(f"generation alone: wall {alone['wall_s']:.1f}s, {alone['tokens']} tokens "
          f"({alone['tokens'] / alone['wall_s']:.0f} tok/s), dropped {alone['dropped_groups']}")
    print(f"per step: generation alone {' '.join(f'{g:.1f}' for g in ov['gen_s'])} s (sum "
          f"{ov['generation_alone_s']:.1f}); train+sync alone {' '.join(f'{t:.1f}' for t in ov['train_s'])} s "
          f"(sum {ov['training_alone_s']:.1f})")
    print(f"ideal wall {ov['ideal_wall_s']:.1f}s (flow-shop bound {ov['pipeline_wall_s']:.1f}s); async wall "
          f"{ov['async_wall_s']:.1f}s: {100 * ov['ideal_overlap']:.0f} % of the ideal "
          f"({100 * ov['pipeline_overlap']:.0f} % of the bound)")
    print(f"in the async run: train+sync {' '.join(f'{t:.1f}' for t in ov['async_train_s'])} s (sum "
          f"{ov['training_in_async_s']:.1f}, alone {ov['training_alone_s']:.1f}); the trainer waited for batches "
          f"{ov['trainer_wait_in_async_s']:.1f}s; the ideal with these training times "
          f"{ov['ideal_wall_with_async_training_s']:.1f}s")
    for name, d in (("generation alone", alone["decode"]), ("async", results["async"]["decode"])):
        print(f"{name}: engine busy {100 * d['busy_frac']:.0f} % of the wall, {d['busy_tok_s']:.0f} tok/s while busy "
              f"at {d['in_flight_busy']:.1f} requests in flight (prompt {d['prompt']}, turn {d['turn']} tokens)")
    d = results["async"]["decode"]
    print(f"pure decode on the same engine right after the async run, {d['pure_decode_concurrency']} requests: "
          f"{d['pure_decode_tok_s']:.0f} tok/s; the async run's busy rate is {d['busy_vs_pure_decode']:.2f} of it "
          f"(generation alone: {alone['decode']['busy_tok_s'] / d['pure_decode_tok_s']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-6,
                    help="small: the runs must generate alike (a policy that learns changes its turn lengths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tool-median", type=float, default=0.5, help="extra tool latency, median seconds")
    ap.add_argument("--tool-sigma", type=float, default=1.0)
    ap.add_argument("--tool-cap", type=float, default=5.0)
    ap.add_argument("--reward-median", type=float, default=1.0, help="verifier latency, median seconds")
    ap.add_argument("--reward-sigma", type=float, default=0.5)
    ap.add_argument("--decode-seconds", type=float, default=6.0, help="each pure-decode measurement's length")
    a = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"workload: retool-math, {a.steps} steps x {a.groups_per_step} groups x {a.group_size}; tool +lognormal("
          f"median {a.tool_median}s, sigma {a.tool_sigma}, cap {a.tool_cap}s); reward +lognormal(median "
          f"{a.reward_median}s, sigma {a.reward_sigma}); async max_staleness {a.max_staleness}; torch threads per pool "
          f"{os.environ['OMP_NUM_THREADS']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        sync = anyio.run(train, "sync", a, Path(tmp))
        alone, asynchronous = anyio.run(on_one_engine, a, Path(tmp))
    results = {"sync": sync, "async": asynchronous}
    ov = overlap(sync, alone, asynchronous)
    report(results, alone, ov)
    speedup = sync["train_wall_s"] / asynchronous["train_wall_s"]
    print(f"async_speedup: {speedup:.2f}")
    print(f"ideal_overlap: {ov['ideal_overlap']:.2f}")
    keep = (
        "train_wall_s",
        "tokens",
        "tokens_per_s",
        "gen_idle_frac",
        "trainer_idle_frac",
        "train_s_per_step",
        "staleness",
        "dropped_groups",
        "cancelled_groups",
        "reward_mean",
        "decode",
    )
    _report.write("trainer", {
        "ideal_overlap": ov["ideal_overlap"], "async_speedup": speedup,
        "torch_threads_per_pool": os.environ["OMP_NUM_THREADS"],
        "gen_vs_pure_decode": asynchronous["decode"]["busy_vs_pure_decode"], "overlap": ov,
        "generation_alone": {k: v for k, v in alone.items() if k != "ready_s"},
        **{mode: {k: r[k] for k in keep if k in r} for mode, r in results.items()},
    }, headline="ideal_overlap", args=a)


if __name__ == "__main__":
    main()
