"""What the reactor itself costs: memory per idle program, and scheduler time per event.

    python bench/overhead.py [--programs 10000]

Memory: ``--programs`` trace programs are admitted at once (``max_programs`` = all, one
decode slot, an engine with no KV limit for the scheduler), so every program has its
coroutine, trajectory, prompt ids and scheduler record and waits for a decode slot; the
resident-set growth over the idle baseline, divided by the number of parked programs, is the
memory per idle program. The run is then cancelled (nothing is left behind).

Scheduler: the pure scheduler alone, driven through a 10,000-program simulation
(``agentenv.simulator``): microseconds of scheduling per scheduler call.

Client CPU per generated token on a real engine is printed by ``bench/scheduling.py``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.engines.embedded import EmbeddedEngine  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.simulator import EngineModel, simulate  # noqa: E402
from agentenv.workload import WorkloadSpec, workload  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def idle_programs(n: int) -> tuple[float, int]:
    env = make("trace", sandbox=False)
    engine = EmbeddedEngine(default_model())
    engine.kv_capacity_tokens = None  # the scheduler's limit is max_programs here
    async with engine:
        tasks = env.tasks(n // 4, seed=0)
        cfg = RolloutConfig(concurrency=1, max_programs=n, max_turns=64, max_new_tokens=100_000,
                            max_tokens_per_turn=4096)
        reactor = Reactor(engine, env, None, cfg)
        gc.collect()
        before = rss_mb()
        parked = 0
        async with anyio.create_task_group() as tg:
            async def run() -> None:
                await reactor.collect(tasks, 4)

            tg.start_soon(run)
            for _ in range(600):  # until every program is admitted and parked
                await anyio.sleep(0.1)
                if reactor.scheduler.admitted >= len(tasks) * 4 - 1:
                    break
            await anyio.sleep(0.5)
            parked = reactor.scheduler.admitted - reactor.scheduler.in_flight
            gc.collect()
            after = rss_mb()
            tg.cancel_scope.cancel()
    return (after - before), parked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=10_000)
    args = p.parse_args()

    grew, parked = anyio.run(idle_programs, args.programs)
    print(f"idle programs: {parked} parked, RSS +{grew:.1f} MB = {1024 * grew / max(parked, 1):.1f} KB per idle "
          f"program ({args.programs} would take {grew * args.programs / max(parked, 1):.0f} MB)")

    traces = [t for g in workload(WorkloadSpec(), 2500, 4) for t in g]
    model = EngineModel(kv_capacity=262_144, block_size=16)
    t0 = time.perf_counter()
    r = simulate(traces, model, "program", concurrency=256, group_size=4)
    took = time.perf_counter() - t0
    print(f"simulated 10,000 programs in {took:.1f}s ({r.events} engine macro-steps)")
    print(f"idle_program_kb: {1024 * grew / max(parked, 1):.1f}")
    _report.write("overhead", {"parked_programs": parked, "rss_growth_mb": grew, "simulated_programs": len(traces),
                               "simulation_s": took, "idle_program_kb": 1024 * grew / max(parked, 1)},
                  headline="idle_program_kb", args=args)


if __name__ == "__main__":
    main()
