"""Async reactor vs. a lockstep baseline, on the same engine, sandbox, tasks and tool latencies.

    python bench/reactor.py [--tasks 16 --group-size 4 --concurrency 64]

Lockstep is how TRL-style trainers run multi-turn rollouts: the whole batch advances turn by
turn (generate for every live program, wait for all; run every tool call, wait for all;
repeat), so each turn costs the slowest generation plus the slowest tool call. The reactor
runs one coroutine per program, so a program waiting on its tool never holds up the others.

Tool calls run for real in the local sandbox, plus an extra latency drawn from a heavy-tailed
(log-normal) distribution standing in for slower tools (network calls, big computations).
Both modes draw the *same* latency for the same (task, sample, turn), so they do the same
work. The delay is an ``await anyio.sleep`` inside the tool, exactly where a slow tool would
block.

Prints both wall times, prefix-cache reuse on resumed turns for each mode, and as the last
line ``reactor_speedup: <lockstep_wall / async_wall>``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, Trajectory, make  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402
from agentenv.engines.embedded import EmbeddedEngine  # noqa: E402
from agentenv.formats import ReToolFormat  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.program import ProgramContext, _run_call, stop_token_ids  # noqa: E402
from agentenv.stats import RunStats  # noqa: E402
from agentenv.tools import PythonTool, ToolContext, ToolOutput  # noqa: E402
from agentenv.trajectory import TurnStats  # noqa: E402
from envs.retool_math import RetoolMathEnv  # noqa: E402
from sandboxes.local import LocalSandbox  # noqa: E402


def latency(key: str, median: float, sigma: float, cap: float) -> float:
    """Deterministic heavy-tailed latency for one (task, sample, turn)."""
    rng = random.Random(hashlib.sha256(key.encode()).hexdigest())
    return min(cap, median * math.exp(sigma * rng.gauss(0, 1)))


class SlowPython(PythonTool):
    """The real sandboxed python tool plus a heavy-tailed extra latency."""

    def __init__(self, median: float, sigma: float, cap: float) -> None:
        self.median, self.sigma, self.cap = median, sigma, cap

    async def __call__(self, ctx: ToolContext, **arguments) -> ToolOutput:
        t = ctx.trajectory
        key = f"{t.task_id}/{t.sample_index}/{ctx.turn}" if t is not None else arguments["code"]
        await anyio.sleep(latency(key, self.median, self.sigma, self.cap))
        return await super().__call__(ctx, **arguments)


class BenchEnv(RetoolMathEnv):
    tool: SlowPython

    def tools(self):
        return [self.tool]


async def run_async(engine, env, tasks, group_size, config) -> tuple[float, RunStats]:
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, config)
        t0 = time.perf_counter()
        await reactor.collect(tasks, group_size)
        return time.perf_counter() - t0, reactor.stats


async def run_lockstep(engine, env, tasks, group_size, config) -> tuple[float, RunStats]:
    """Every live program generates, everyone waits; every tool runs, everyone waits."""
    fmt = ReToolFormat()
    tools = {t.name: t for t in env.tools()}
    ctx = ProgramContext(engine, env, None, config, fmt, tools, {}, stop_token_ids(engine.tokenizer, fmt))
    stats = RunStats(block_size=engine.page_size)
    stats.start(len(tasks) * group_size)
    t0 = time.perf_counter()
    async with LocalSandbox() as sb:
        progs = []
        for task in tasks:
            for i in range(group_size):
                t = Trajectory(f"{task.id}-{i}", env.id, task.id, task.id, i, ctx.prompt_ids(task))
                progs.append((task, t, await sb.session()))
        live = list(progs)
        for turn in range(config.max_turns):
            if not live:
                break
            gens: dict[str, object] = {}

            async def gen(t: Trajectory) -> None:
                budget = config.max_new_tokens - t.num_sampled_tokens
                p = SamplingParams(min(config.max_tokens_per_turn, budget), stop_token_ids=ctx.stop_token_ids)
                gens[t.id] = await engine.generate(t.input_ids, p, f"ls-{t.id}-{turn}")

            async with anyio.create_task_group() as tg:  # barrier 1: the slowest generation
                for _, t, _ in live:
                    tg.start_soon(gen, t)
            calls = []
            for task, t, s in live:
                g = gens[t.id]
                t.add_model(g.token_ids, g.logprobs, g.weight_version)
                t.turns.append(TurnStats(g.prompt_tokens, g.cached_tokens, len(g.token_ids), g.finish_reason,
                                         g.latency_s, g.weight_version))
                parsed = fmt.parse(engine.tokenizer.decode(g.token_ids), list(tools))
                if parsed and turn < config.max_turns - 1 and t.num_sampled_tokens < config.max_new_tokens:
                    calls.append((task, t, s, parsed))
                else:
                    t.finish_reason = "stop" if g.finish_reason == "stop" else "length"
            outs: dict[str, list[str]] = {}

            async def tool(t: Trajectory, s, parsed) -> None:
                outs[t.id] = [await _run_call(ctx, c, turn, t, s) for c in parsed]

            async with anyio.create_task_group() as tg:  # barrier 2: the slowest tool call
                for _, t, s, parsed in calls:
                    tg.start_soon(tool, t, s, parsed)
            for _, t, _, _ in calls:
                t.add_env(engine.tokenizer.encode(fmt.observation(outs[t.id], engine.tokenizer, False),
                                                  add_special_tokens=False))
            live = [(task, t, s) for task, t, s, _ in calls]
        for _, t, _ in live:
            t.finish_reason = "max_turns"
        for task, t, s in progs:
            await s.aclose()
            t.text = engine.tokenizer.decode(t.completion_ids)
            stats.add(t)
    stats.stop()
    return time.perf_counter() - t0, stats


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model()))
    ap.add_argument("--engine", default="embedded", choices=["embedded", "vllm"])
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--median-latency", type=float, default=0.3)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    if a.engine == "vllm":
        from agentenv.engines.vllm import VLLMEngine

        engine = await VLLMEngine.create(a.model, seed=a.seed)
    else:
        engine = EmbeddedEngine(a.model, seed=a.seed)
    env = BenchEnv()
    env.tool = SlowPython(a.median_latency, a.sigma, a.cap)
    make("retool-math")  # the registry check runs on the real env class too
    tasks = env.tasks(a.tasks, seed=a.seed)
    config = RolloutConfig(max_turns=a.max_turns, max_new_tokens=256, concurrency=a.concurrency)
    print(f"engine {a.engine}: {len(tasks)} tasks x {a.group_size} samples, concurrency {a.concurrency}, tool latency "
          f"lognormal(median={a.median_latency}s, sigma={a.sigma}) capped at {a.cap}s + real execution")
    try:
        # Warm up (first-request overheads), then measure both modes in the same process.
        await run_async(engine, env, env.tasks(2, seed=99), 2, config)
        t_lock, s_lock = await run_lockstep(engine, env, tasks, a.group_size, config)
        t_async, s_async = await run_async(engine, env, tasks, a.group_size, config)
    finally:
        await engine.aclose()
    for name, t, s in (("lockstep", t_lock, s_lock), ("async", t_async, s_async)):
        print(f"{name:9s} wall {t:7.2f}s  programs {s.finished}  tool calls {s.tool_calls}  "
              f"tokens {s.sampled_tokens}  tok/s {s.sampled_tokens / t:7.1f}  "
              f"resume reuse {100 * s.resume_reuse:5.1f}% ({s.resume_cached}/{s.resume_eligible} tokens)  "
              f"mean reward {s.mean_reward if s.mean_reward is not None else float('nan'):.3f}")
    print(f"prefix_reuse_async: {100 * s_async.resume_reuse:.1f}%")
    print(f"reactor_speedup: {t_lock / t_async:.2f}")


if __name__ == "__main__":
    anyio.run(main)
