"""Bounded memory: a long rollout's RSS does not grow with the programs it has finished.

    python bench/memory.py [--programs 10000 --concurrency 64]

Runs ``agentenv rollout`` (the CLI, as users run it: bundled model, embedded engine, local
sandbox pool, event log on) for ``--programs`` retool-math programs with tiny settings
(8 new tokens, 2 turns), and samples the CLI process's RSS every 0.5 s together with how
many trajectories its ``--out`` holds. Prints RSS when 10 %, 25 %, 50 %, 75 % and 100 % of the
programs are written and, last, ``rss_growth_mb_per_1k_programs``: the slope from the 25 %
point (start-up and warm-up behind) to the end. Every program's trajectory is streamed to
``--out`` as it finishes; what remains in memory per program is bounded by what is in flight.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

import _report  # bench/_report.py: the figures as JSON


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=10_000)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    tasks = a.programs // a.group_size
    total = tasks * a.group_size
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "run.jsonl"
        cmd = [sys.executable, "-m", "agentenv.cli", "rollout", "--tasks", str(tasks), "--group-size",
               str(a.group_size), "--max-new-tokens", "8", "--max-turns", "2", "--concurrency", str(a.concurrency),
               "--no-progress", "--out", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ps = psutil.Process(proc.pid)
        samples: list[tuple[float, int, float]] = []  # (seconds, trajectories written, RSS MiB)
        lines, pos = 0, 0
        while proc.poll() is None:
            time.sleep(0.5)
            try:
                rss = ps.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                break
            if rss == 0:  # exited, not yet reaped
                break
            if out.exists():
                with open(out, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                lines += chunk.count(b"\n")
                pos += len(chunk)
            samples.append((time.perf_counter() - t0, lines, rss))
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"rollout failed ({proc.returncode}): {err[-2000:]}")
        lines = sum(1 for _ in open(out, "rb"))
    assert lines == total, f"{lines} of {total} trajectories written"

    def at(frac: float) -> tuple[float, int, float]:
        return next(s for s in samples if s[1] >= frac * total) if any(s[1] >= frac * total for s in samples) \
            else samples[-1]

    print(f"{total} programs in {samples[-1][0]:.0f} s; peak RSS {max(s[2] for s in samples):.0f} MiB")
    for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
        t, n, rss = at(frac)
        print(f"  {n:6d} written ({100 * frac:3.0f} %)  t={t:6.1f} s  RSS {rss:7.1f} MiB")
    (_, n0, r0), (_, n1, r1) = at(0.25), at(1.0)
    print(f"rss_growth_mb_per_1k_programs: {1000 * (r1 - r0) / max(1, n1 - n0):.2f}")
    _report.write("memory", {"programs": total, "wall_s": samples[-1][0], "peak_rss_mib": max(s[2] for s in samples),
                             "rss_mib_at": {f"{100 * f:.0f}%": at(f)[2] for f in (0.1, 0.25, 0.5, 0.75, 1.0)},
                             "rss_growth_mb_per_1k_programs": 1000 * (r1 - r0) / max(1, n1 - n0)},
                  headline="rss_growth_mb_per_1k_programs", args=a)


if __name__ == "__main__":
    main()
