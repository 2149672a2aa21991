"""What durability costs: the event log's overhead on rollout throughput, side by side.

    python bench/journal.py [--tasks 24 --group-size 4 --rounds 3]

The same retool-math rollouts (bundled model, embedded engine, local sandbox pool) run with
and without the event log (``agentenv.journal.Journal``, batched fsync), alternating, in one
process; prints tok/s of each round and, as the last line, ``log_overhead_pct``: the median
throughput without the log over the median with it, minus one, in percent. Also prints the
log's size per trajectory and the time to read and replay it (what ``--resume`` does first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, journal, make  # noqa: E402
from agentenv.engines.embedded import EmbeddedEngine  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


async def one(engine, sandbox, env, tasks, group: int, log: Path | None) -> tuple[float, int]:
    j = journal.Journal.create(log, {"bench": True}) if log is not None else None
    reactor = Reactor(engine, env, sandbox, RolloutConfig(concurrency=16, max_turns=env.max_turns), journal=j)
    t0 = time.perf_counter()
    n = 0
    async with reactor.rollouts(tasks, group) as results:
        async for item in results:
            if j is not None and hasattr(item, "segments"):
                j.done(item)
            n += hasattr(item, "segments")
    wall = time.perf_counter() - t0
    if j is not None:
        j.close()
    return reactor.stats.outcomes.sampled_tokens / wall, n


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    env = make("retool-math")
    tasks = env.tasks(a.tasks, seed=0)
    rates: dict[str, list[float]] = {"without log": [], "with log": []}
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "run.jsonl.log"
        async with EmbeddedEngine(default_model(), seed=0) as engine, LocalSandbox() as sandbox:
            await one(engine, sandbox, env, tasks[:4], 2, None)  # warm up
            for r in range(a.rounds):
                for name in (("without log", "with log") if r % 2 == 0 else ("with log", "without log")):
                    rate, n = await one(engine, sandbox, env, tasks, a.group_size, log if name == "with log" else None)
                    rates[name].append(rate)
                    print(f"round {r} {name:12s} {rate:8.1f} tok/s  ({n} trajectories)", flush=True)
            size = log.stat().st_size
            t0 = time.perf_counter()
            records, _ = journal.read(log)
            journal.load_state(records)
            replay_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for rec in records:
                journal.encode(rec)
            encode_s = time.perf_counter() - t0
    n = a.tasks * a.group_size
    print(f"log: {size / n / 1024:.1f} KiB per trajectory, {len(records)} records; encoding them all "
          f"{1000 * encode_s:.1f} ms of event-loop time per run; read + replay {1000 * replay_s:.1f} ms")
    without, with_ = statistics.median(rates["without log"]), statistics.median(rates["with log"])
    print(f"log_overhead_pct: {100 * (without / with_ - 1):.1f}")
    _report.write("journal", {"tok_s": rates, "median_tok_s_without_log": without, "median_tok_s_with_log": with_,
                              "log_kib_per_trajectory": size / n / 1024, "records": len(records),
                              "encode_ms": 1000 * encode_s, "read_replay_ms": 1000 * replay_s,
                              "log_overhead_pct": 100 * (without / with_ - 1)},
                  headline="log_overhead_pct", args=a)


if __name__ == "__main__":
    anyio.run(main)
