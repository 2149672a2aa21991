"""Local sandbox pool vs. a fresh python3 process per call, side by side in one run.

    python bench/sandbox.py [--calls 3200 --repeats 5 --starts 32 --baseline-calls 96]

For concurrency 1 and 32: trivial code (``1 + 1``) through the pool (each concurrent client
holds its own isolated session) and through a fresh ``python3 -c`` process per call (what a
naive sandbox does, with no isolation at all). Prints call latency p50/p99 and calls/s for
both, then how many isolated sessions start per second when 64 are asked for at once (right
after the previous 64 closed, and again once their teardown is done), then as the last line
``sandbox_speedup: <baseline time per call / pool time per call>`` at concurrency 32.

The pool's figures are medians over repeated measures, because one short measure on a small
machine swings with whatever else it does in that moment: each concurrency runs ``--repeats``
phases of ``--calls`` calls on the same sessions (calls/s is the median phase's, latencies are
pooled), and a session start is the median of ``--starts`` starts one after another (the first
start of the run, with nothing warm yet, is reported beside it). The bursts of starts come
after the calls, so no call phase shares the machine with the teardown of 64 sessions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)

CODE = "1 + 1"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def pool_run(sessions: list, calls: int) -> tuple[float, list[float]]:
    """One phase: ``calls`` calls spread over ``sessions``, each session's calls one after
    another; its wall time and latencies."""
    lat: list[float] = []
    per = calls // len(sessions)

    async def client(s) -> None:
        for _ in range(per):
            t = time.perf_counter()
            r = await s.run(CODE)
            lat.append(time.perf_counter() - t)
            assert r.value == "2", r

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for s in sessions:
            tg.start_soon(client, s)
    return time.perf_counter() - t0, lat


async def start_rate(sb: LocalSandbox, n: int, rounds: int = 3, settle: float = 0.0) -> float:
    """Median sessions started per second when ``n`` are asked for at once (each checked).
    ``settle``: seconds to wait after closing a round's sessions, so the kernel's teardown of
    them (their exit, their namespaces: about 1.5 ms of CPU each) is not in the next round;
    with 0 it is, as in a pool that starts sessions while others end."""
    rates = []
    for _ in range(rounds):
        await anyio.sleep(settle)
        sessions: list = []

        async def one() -> None:
            sessions.append(await sb.session())

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
        rates.append(n / (time.perf_counter() - t))
        assert (await sessions[-1].run(CODE)).value == "2"
        async with anyio.create_task_group() as tg:
            for s in sessions:
                tg.start_soon(s.aclose)
    return statistics.median(rates)


async def pool_phases(sb: LocalSandbox, concurrency: int, calls: int, repeats: int) -> tuple[float, list[float]]:
    """``repeats`` phases on the same ``concurrency`` sessions, after a warm-up on them: the
    median phase's wall time, and all latencies. The sessions live through all phases, as a
    rollout's do through its calls, so no phase pays for starting or ending sessions."""
    sessions = [await sb.session() for _ in range(concurrency)]
    try:
        await pool_run(sessions, 2 * concurrency)
        walls, lat = [], []
        for _ in range(repeats):
            wall, got = await pool_run(sessions, calls)
            walls.append(wall)
            lat += got
    finally:
        for s in sessions:
            await s.aclose()
    return statistics.median(walls) * repeats, lat


async def start_times(sb: LocalSandbox, n: int) -> list[float]:
    """Seconds each of ``n`` sessions took to start, one after another (each closed before the
    next is asked for)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        s = await sb.session()
        out.append(time.perf_counter() - t)
        await s.aclose()
    return out


async def baseline_run(concurrency: int, calls: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    per = max(1, calls // concurrency)

    async def client() -> None:
        for _ in range(per):
            t = time.perf_counter()
            r = await anyio.run_process([sys.executable, "-c", f"print({CODE})"])
            lat.append(time.perf_counter() - t)
            assert r.stdout.strip() == b"2"

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(client)
    return time.perf_counter() - t0, lat


def line(name: str, wall: float, lat: list[float]) -> str:
    return (f"{name:28s} calls {len(lat):5d}  p50 {1000 * statistics.median(lat):7.2f} ms  "
            f"p99 {1000 * pct(lat, 0.99):7.2f} ms  {len(lat) / wall:8.1f} calls/s")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3200, help="calls per phase")
    ap.add_argument("--repeats", type=int, default=5, help="phases per concurrency")
    ap.add_argument("--starts", type=int, default=32, help="sequential session starts")
    ap.add_argument("--baseline-calls", type=int, default=96)
    a = ap.parse_args()
    results = {}
    async with LocalSandbox(prewarm=0, max_workers=80) as sb:
        t = time.perf_counter()
        s = await sb.session()
        spawn = time.perf_counter() - t
        await s.aclose()
        start = statistics.median(await start_times(sb, a.starts))
        print(f"isolated session start (fork + namespaces + limits): {1000 * start:.2f} ms "
              f"(median of {a.starts}; the run's first: {1000 * spawn:.2f} ms)")
        for c in (1, 32):
            results[("pool", c)] = await pool_phases(sb, c, a.calls, a.repeats)
        starts = await start_rate(sb, 64)  # after the calls: the bursts' teardown is in no call phase
        settled = await start_rate(sb, 64, settle=1.0)
    for c in (1, 32):
        results[("baseline", c)] = await baseline_run(c, a.baseline_calls)
    for c in (1, 32):
        print(line(f"pool, concurrency {c}", *results[("pool", c)]))
        print(line(f"fresh python3, concurrency {c}", *results[("baseline", c)]))
    per_call = {k: wall / len(lat) for k, (wall, lat) in results.items()}
    print(f"isolated session starts, 64 at once: {starts:.0f}/s (right after the previous 64 closed), "
          f"{settled:.0f}/s (1 s later: their teardown done)")
    print(f"speedup at concurrency 1: {per_call[('baseline', 1)] / per_call[('pool', 1)]:.1f}")
    print(f"sandbox_speedup: {per_call[('baseline', 32)] / per_call[('pool', 32)]:.1f}")
    calls = {f"{kind}_c{c}": {"p50_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * pct(lat, 0.99),
                             "calls_per_s": len(lat) / wall} for (kind, c), (wall, lat) in results.items()}
    _report.write("sandbox", {"session_start_ms": 1000 * start, "first_session_start_ms": 1000 * spawn,
                              "starts_per_s_after_close": starts,
                              "starts_per_s_settled": settled, "calls": calls,
                              "speedup_c1": per_call[("baseline", 1)] / per_call[("pool", 1)],
                              "sandbox_speedup": per_call[("baseline", 32)] / per_call[("pool", 32)]},
                  headline="sandbox_speedup", args=a)


if __name__ == "__main__":
    anyio.run(main)
