"""The vLLM engine core at nice 0 against nice 10 (its default on CPU), side by side on one
engine, alternating (``VLLMEngine.nice``; the workers keep their priority).

    python bench/engine_priority.py [--pairs 2] [--churn-seconds 30] [--tasks 64]

Two workloads, each run ``--pairs`` times per niceness, alternating (0, 10, 0, 10, ...):

* **session churn beside decode**: 32 clients each start an isolated sandbox session, run one
  call in it, wait a heavy-tailed 0.1-15 s, close it and start the next, while the engine
  decodes 32 closed-loop requests. Prints the session start latency p50/p90/p99/max, the
  starts made and the engine's tok/s.
* **retool-math**: ``agentenv rollout --engine vllm --tasks 64 --group-size 4 --concurrency 64``
  (program-aware scheduling, the library API). Prints wall time, generated tok/s, sandbox
  session waits and session start p50/p90.

Last line: ``priority_speedup: <median retool-math tok/s at nice 10 / at nice 0>``.
Lowering the niceness back to 0 needs CAP_SYS_NICE (run as root, as the sandbox pool is).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.engines import open_engine  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

from scheduling import pure_decode  # noqa: E402  (bench/scheduling.py)
import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def churn(engine, seconds: float, clients: int = 32) -> dict:
    starts: list[float] = []
    decoded: list[float] = []

    async def client(sb: LocalSandbox, w: int, deadline: float) -> None:
        rnd = random.Random(w)
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            s = await sb.session()
            starts.append(time.perf_counter() - t)
            try:
                assert (await s.run("1 + 1")).value == "2"
                await anyio.sleep(min(5.0, rnd.lognormvariate(-0.7, 1.0)) * 3)
            finally:
                await s.aclose()

    async def decode() -> None:
        decoded.append(await pure_decode(engine, 130, 45, 32, seconds))

    async with LocalSandbox() as sb:
        await (await sb.session()).aclose()  # the fork server is up
        deadline = time.perf_counter() + seconds
        async with anyio.create_task_group() as tg:
            tg.start_soon(decode)
            for w in range(clients):
                tg.start_soon(client, sb, w, deadline)
    return {"starts": len(starts), "p50": pct(starts, 0.5), "p90": pct(starts, 0.9), "p99": pct(starts, 0.99),
            "max": max(starts), "decode_tok_s": decoded[0]}


async def retool(engine, tasks: int, seed: int) -> dict:
    env = make("retool-math")
    cfg = RolloutConfig(max_turns=env.max_turns, max_new_tokens=384, concurrency=64, scheduling="program",
                        tool_timeout=env.tool_timeout)
    async with LocalSandbox() as sb, Reactor(engine, env, sb, cfg) as reactor:
        t0 = time.perf_counter()
        await reactor.collect(env.tasks(tasks, seed=seed), 4)
        wall = time.perf_counter() - t0
    s = reactor.stats
    d = s.summary()
    return {
        "wall": wall,
        "tok_s": s.outcomes.sampled_tokens / wall,
        "waits": s.sessions.session_waits,
        "wait_s": s.sessions.session_wait_s,
        "p50": d["session_start_p50_ms"],
        "p90": d["session_start_p90_ms"],
    }


async def main_async(args) -> None:
    engine = await open_engine("vllm", str(default_model()), seed=args.seed)
    async with engine:
        await pure_decode(engine, 130, 45, 32, 2.0)  # warm-up
        await retool(engine, 8, args.seed + 99)
        order = [0, 10] * args.pairs
        runs: list[dict] = []
        for nice in order:
            engine.nice = nice
            r = await churn(engine, args.churn_seconds)
            runs.append({"workload": "churn", "nice": nice, **r})
            print(f"churn     nice {nice:2d}: {r['starts']:4d} session starts, start p50 {1e3 * r['p50']:6.0f} ms "
                  f"p90 {1e3 * r['p90']:6.0f} p99 {1e3 * r['p99']:6.0f} max {1e3 * r['max']:6.0f}; "
                  f"engine {r['decode_tok_s']:.0f} tok/s", flush=True)
        rates: dict[int, list[float]] = {0: [], 10: []}
        for i, nice in enumerate(order):
            engine.nice = nice
            r = await retool(engine, args.tasks, args.seed + i // 2)  # each pair: the same tasks
            rates[nice].append(r["tok_s"])
            runs.append({"workload": "retool-math", "nice": nice, **r})
            print(f"retool    nice {nice:2d}: {r['wall']:5.1f}s {r['tok_s']:6.0f} tok/s, session waits {r['waits']} "
                  f"({r['wait_s']:.1f}s), session start p50/p90 {r['p50']}/{r['p90']} ms", flush=True)
        engine.nice = 10
    print(f"priority_speedup: {statistics.median(rates[10]) / statistics.median(rates[0]):.2f}")
    _report.write("engine_priority", {"runs": runs,
                                      "priority_speedup": statistics.median(rates[10]) / statistics.median(rates[0])},
                  headline="priority_speedup", args=args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--churn-seconds", type=float, default=30.0)
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    anyio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
