"""Cancelling a start at each early point, in a fresh process whose only children are what the
start makes: how many times something was left behind, running or unreaped, once the
cancellation had finished. (A fresh process: the test run's own children, a shared engine's,
would blur the count.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .waiting import DEADLINE_S

_SCRIPT = """
import sys, anyio, psutil
{imports}

async def start():
    {start}

async def main():
    me, left = psutil.Process(), 0
    for steps in {steps!r}:
        before = {{p.pid for p in me.children(recursive=True)}}
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            for _ in range(steps):
                await anyio.sleep(0)
            tg.cancel_scope.cancel()
        behind = [p for p in me.children(recursive=True) if p.pid not in before]
        left += bool(behind)
        for p in behind:
            try:
                p.kill()
            except psutil.Error:
                pass
    print(left)

anyio.run(main)
"""


def left_behind(imports: str, start: str, steps: Sequence[int]) -> int:
    """Cancel ``start`` (one statement, awaited in a task; ``imports`` before it) after each
    number of event-loop steps in ``steps``; how many of those starts left a process behind."""
    code = _SCRIPT.format(imports=imports, start=start, steps=list(steps))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=4 * DEADLINE_S,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())
