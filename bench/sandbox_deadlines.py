"""How long a call takes to come back ``timeout`` from a session that stops taking calls.

    python bench/sandbox_deadlines.py [--timeout 1.0 --kill-grace 0.3]

For each kind of stalled worker (``tests/sandboxes/stalls.py``: its reader replaced by one
that sleeps, a thread holding the GIL in one C call, a reader that takes a byte a second, a
signal handler that never returns) and each request size from 1 KB to 16 MB: a fresh
session is stalled, then sent the request with the given timeout. Prints a table of the
seconds until the call came back (every cell must be a ``timeout`` with ``state_lost``;
anything else is printed instead of the figure), then ``worst: <s>`` against the bound
(timeout + kill grace). A cell that never came back would hang the script: the call is also
bounded here, at 60 s, and reported ``HUNG``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.sandboxes.local import LocalSandbox  # noqa: E402
from tests.sandboxes.stalls import ALARM_LOOP, SIZES, STALLS, alarm_pending, request  # noqa: E402


async def one(sb: LocalSandbox, stall: str, size: int, timeout: float) -> str | float:
    """Seconds until a stalled session's call came back, or what went wrong."""
    s = await sb.session()
    try:
        armed = await s.run(stall, timeout=10)
        if armed.value != "'armed'":
            return f"not armed: {armed.status}"
        if stall == ALARM_LOOP:
            with anyio.fail_after(10):
                while not alarm_pending(s.pid):
                    await anyio.sleep(0.01)
        start = time.perf_counter()
        with anyio.move_on_after(60):
            r = await s.run(request(size), timeout=timeout)
            took = time.perf_counter() - start
            if r.status != "timeout" or not r.state_lost:
                return f"{r.status}{' lost' if r.state_lost else ''}"
            after = await s.run("6 * 7", timeout=10)
            return took if after.value == "42" else f"then {after.status}"
        return "HUNG"
    finally:
        await s.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--kill-grace", type=float, default=0.3)
    args = ap.parse_args()
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}, cpus: {os.cpu_count()}")
    worst = 0.0
    async with LocalSandbox(kill_grace=args.kill_grace, prewarm=0, max_workers=2) as sb:
        print(f"{'request':>8} | " + " | ".join(f"{k:>16}" for k in STALLS))
        for label, size in SIZES.items():
            cells = []
            for stall in STALLS.values():
                got = await one(sb, stall, size, args.timeout)
                worst = max(worst, got) if isinstance(got, float) else float("inf")
                cells.append(f"{got:>15.2f}s" if isinstance(got, float) else f"{got:>16}")
            print(f"{label:>8} | " + " | ".join(cells), flush=True)
    print(f"worst: {worst:.2f}s (bound: timeout {args.timeout:g}s + kill grace {args.kill_grace:g}s)")
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    anyio.run(main)
