"""What one tool call costs through an MCP server, against the sandboxed Python tool.

    python bench/mcp_call.py [--calls 200] [--concurrency 1]

The same arithmetic (``print(31 * 24533 + 63)``) through: the ``python`` tool of
examples/mcp_calc_server.py (a stdio server per pool, through agentenv.mcp_tools, the
client's thread hop included), and the :class:`~agentenv.tools.PythonTool` in a local
sandbox session. Each call is timed as the reactor times it (from the tool's ``__call__`` to
its output); the figures are per call, and the load average is printed beside them (the
machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio

from agentenv.mcp_tools import MCPServer, MCPTools
from agentenv.sandboxes.local import LocalSandbox
from agentenv.tools import PythonTool, ToolContext

SERVER = Path(__file__).resolve().parents[1] / "examples" / "mcp_calc_server.py"
CODE = "print(31 * 24533 + 63)"


async def timed(tool, ctx_of, calls: int, concurrency: int) -> list[float]:
    times: list[float] = []

    async def worker(i: int) -> None:
        ctx = await ctx_of(i)
        for _ in range(calls // concurrency):
            t = time.perf_counter()
            out = await tool(ctx, code=CODE)
            times.append(time.perf_counter() - t)
            assert out.status == "ok" and out.text.strip() == "760586", out

    async with anyio.create_task_group() as tg:
        for i in range(concurrency):
            tg.start_soon(worker, i)
    return times


def stats(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"calls": len(s), "p50_ms": round(statistics.median(s) * 1e3, 3),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 3), "mean_ms": round(statistics.fmean(s) * 1e3, 3)}


async def main(calls: int, concurrency: int) -> dict[str, object]:
    pool = MCPTools(MCPServer(command=[sys.executable, str(SERVER)]))
    mcp_tool = next(t for t in await anyio.to_thread.run_sync(pool.tools) if t.name == "python")
    try:
        await timed(mcp_tool, lambda i: _ctx(None), 10, 1)  # warm
        mcp = stats(await timed(mcp_tool, lambda i: _ctx(None), calls, concurrency))
    finally:
        await pool.aclose()
    async with LocalSandbox() as sb:
        sessions = [await sb.session() for _ in range(concurrency)]
        py = PythonTool()
        await timed(py, lambda i: _ctx(sessions[0]), 10, 1)
        python = stats(await timed(py, lambda i: _ctx(sessions[i]), calls, concurrency))
        for s in sessions:
            await s.aclose()
    return {"concurrency": concurrency, "mcp_stdio": mcp, "python_sandbox": python,
            "overhead_p50_ms": round(mcp["p50_ms"] - python["p50_ms"], 3),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


async def _ctx(session) -> ToolContext:
    return ToolContext(session, 10.0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(anyio.run(main, a.calls, a.concurrency), indent=1))
