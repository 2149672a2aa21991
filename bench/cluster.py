"""Rollouts on Ray vs in one process, on a sandbox-CPU-bound trace workload, side by side.

    python bench/cluster.py [--programs 48 --group-size 2 --tool-median 0.2 --tool-cpu 1.0]

The same trace workload (``trace`` env, ``tool_cpu`` share of every tool call's latency spent
computing in the program's sandbox) three ways: one process (a reactor, the embedded engine,
a sandbox pool), then a local Ray cluster with 1 and with 2 rollout workers (each its own
engine, reactor and pool). Prints wall time, programs/s and CPU seconds per program for each,
the 2-vs-1 worker scaling, and Ray's overhead per program (1 worker vs in-process), last
``cluster_scaling: <1-worker wall / 2-worker wall>``. On one machine the workers share its
cores, so the scaling says what the layout costs or gains there, not what more nodes add.

Then (or alone, with ``--projection-only``) the simulator's projection for a GPU cluster: the
real program scheduler (``agentenv.simulator``) against ``--engines`` model engines (a 7B
model on one H100 each, ``H100_7B``: assumptions, not a measurement), each fed by
``--workers-per-engine`` rollout workers whose ``--worker-cpus`` start sandboxes. Groups are
placed as the driver places them when all start at once (round robin over equal loads); the
simulator does not model refilling a worker that finishes early, so the slowest engine's wall
time is an upper bound. Prints 1 engine x 1 worker, E x 1 and E x W side by side, with the
aggregate tok/s, the scaling over one engine and the engines' imbalance (slowest / mean wall).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.cluster import RayRollouts  # noqa: E402
from agentenv.engines import open_engine  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402
from agentenv.simulator import H100_7B, simulate  # noqa: E402
from agentenv.workload import WorkloadSpec, workload  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def cpu_seconds() -> float:
    """CPU time of this process, of Ray's processes (its workers are not our children) and of
    everything under either (sandboxes), with their reaped children's."""
    procs = list(psutil.process_iter(["cmdline"]))
    roots = {os.getpid()} | {p.pid for p in procs if any("ray" in c for c in (p.info["cmdline"] or [])[:2])}
    total = 0.0
    for p in procs:
        try:
            if p.pid in roots or any(a.pid in roots for a in p.parents()):
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def check(trajs: list, env) -> None:
    """Every program ran its whole trace (a broken run must not look fast)."""
    bad = [
        t
        for t in trajs
        if t.finish_reason != "stop" or len(t.tool_calls) != env.trace_of(t.task_id, t.sample_index).turns - 1
    ]
    if bad:
        raise SystemExit(f"{len(bad)} of {len(trajs)} programs did not follow their trace; first: "
                         f"{bad[0].finish_reason} {bad[0].error}")


async def main_async(a: argparse.Namespace) -> None:
    import ray

    spec = {"profile": "lognormal", "mean_turns": a.mean_turns, "turn_tokens": a.turn_tokens, "tool_tokens": 8,
            "tool_median": a.tool_median, "tool_cap": 4 * a.tool_median, "tool_cpu": a.tool_cpu,
            "prompt_tokens": 32}
    env = make("trace", **spec)
    tasks = env.tasks(a.programs // a.group_size, seed=a.seed)
    config = RolloutConfig(concurrency=a.concurrency, max_new_tokens=4096, max_turns=env.max_turns,
                           tool_timeout=env.tool_timeout)
    results = {}
    # In one process.
    engine = await open_engine("embedded", str(default_model()), seed=a.seed)
    async with engine, LocalSandbox() as sb, Reactor(engine, env, sb, config) as reactor:
        await reactor.collect(env.tasks(2, seed=a.seed + 1), a.group_size)  # warm-up
        c0, t0 = cpu_seconds(), time.perf_counter()
        groups = await reactor.collect(tasks, a.group_size)
        results["in-process"] = (time.perf_counter() - t0, cpu_seconds() - c0, sum(len(g.trajectories) for g in groups))
        check([t for g in groups for t in g.trajectories], env)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        for workers in (1, 2):
            async with RayRollouts("trace", workers=workers, env_args=spec, config=config, seed=a.seed,
                                   worker_options={"num_cpus": os.cpu_count() / workers},
                                   snapshot_interval=a.snapshot_interval or None) as cluster:
                async with cluster.rollouts(env.tasks(2, seed=a.seed + 1), a.group_size) as warm_up:
                    async for _ in warm_up:
                        pass
                c0, t0, trajs = cpu_seconds(), time.perf_counter(), []
                async with cluster.rollouts(tasks, a.group_size) as received:
                    async for group in received:
                        trajs += group.trajectories
                results[f"ray, {workers} worker{'s' if workers > 1 else ''}"] = (
                    time.perf_counter() - t0, cpu_seconds() - c0, len(trajs))
                check(trajs, env)
    finally:
        ray.shutdown()
    for name, (wall, cpu, n) in results.items():
        print(f"{name:16s} {n} programs in {wall:6.1f}s: {n / wall:6.2f} programs/s, "
              f"{1000 * cpu / n:6.0f} ms CPU per program")
    w_local, w1, w2 = (results[k][0] for k in ("in-process", "ray, 1 worker", "ray, 2 workers"))
    n = results["in-process"][2]
    print(f"Ray overhead per program (1 worker vs in-process): {1000 * (w1 - w_local) / n:+.1f} ms wall")
    print(f"cluster_scaling: {w1 / w2:.2f}")
    _report.write("cluster", {"runs": {k: {"wall_s": w, "cpu_s": c, "programs": n} for k, (w, c, n) in results.items()},
                              "ray_overhead_ms_per_program": 1000 * (w1 - w_local) / n, "cluster_scaling": w1 / w2},
                  headline="cluster_scaling", args=a)


def projection(a: argparse.Namespace) -> None:
    spec = WorkloadSpec(profile="lognormal", tool_median=2.0, mean_turns=8.0, turn_tokens=256, max_turn_tokens=1024,
                        tool_tokens=128, prompt_tokens=512, max_total_tokens=16_384, tool_cap=40.0)
    groups = workload(spec, a.sim_programs // a.sim_group_size, a.sim_group_size, a.seed)
    print(f"projection: {len(groups) * a.sim_group_size} programs in groups of {a.sim_group_size} (lognormal tools, "
          f"median 2 s, ~8 turns of 256 tokens), {a.sim_concurrency} requests per engine, sandbox start "
          f"{1000 * a.session_start_s:.0f} ms of CPU")
    base, rows = None, {}
    for engines, workers in ((1, 1), (a.engines, 1), (a.engines, a.workers_per_engine)):
        walls, tokens, t0 = [], 0, time.perf_counter()
        for e in range(engines):
            traces = [t for g in groups[e::engines] for t in g]
            r = simulate(traces, H100_7B, "program", concurrency=a.sim_concurrency, group_size=a.sim_group_size,
                         session_start_s=a.session_start_s, session_workers=workers * a.worker_cpus)
            walls.append(r.wall_s)
            tokens += r.tokens
        wall = max(walls)
        rate = tokens / wall
        base = base or rate
        print(f"{engines} engine{'s' if engines > 1 else ' '} x {workers} worker{'s' if workers > 1 else ' '} per "
              f"engine ({workers * a.worker_cpus:3d} sandbox CPUs each): wall {wall:7.1f}s  {rate:8.0f} tok/s  "
              f"scaling {rate / base:5.2f}x  imbalance {wall / (sum(walls) / len(walls)):.2f}  "
              f"(simulated in {time.perf_counter() - t0:.1f}s)", flush=True)
        rows[f"{engines}x{workers}"] = {
            "engines": engines,
            "workers_per_engine": workers,
            "wall_s": wall,
            "tok_s": rate,
            "scaling": rate / base,
            "imbalance": wall / (sum(walls) / len(walls)),
        }
    _report.write("cluster-projection", {"rows": rows, "projected_scaling": rows[f"{a.engines}x1"]["scaling"]},
                  headline="projected_scaling", args=a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=48)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--mean-turns", type=float, default=4.0)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--tool-median", type=float, default=0.2)
    p.add_argument("--tool-cpu", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-interval", type=float, default=1.0,
                   help="seconds between the driver's snapshots of in-flight work (0: none)")
    p.add_argument("--projection-only", action="store_true", help="only the simulator's projection")
    p.add_argument("--no-projection", action="store_true", help="only the measured runs")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--workers-per-engine", type=int, default=4)
    p.add_argument("--worker-cpus", type=int, default=4, help="sandbox CPUs per rollout worker")
    p.add_argument("--session-start-s", "--env-start-s", type=float, default=0.010,
                   help="CPU seconds per sandbox session start")
    p.add_argument("--sim-programs", type=int, default=16_384)
    p.add_argument("--sim-group-size", type=int, default=8)
    p.add_argument("--sim-concurrency", type=int, default=256)
    a = p.parse_args()
    if not a.projection_only:
        anyio.run(main_async, a)
    if not a.no_projection:
        projection(a)


if __name__ == "__main__":
    main()
