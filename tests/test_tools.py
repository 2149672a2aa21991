"""Tools on real sandbox processes: a session killed from outside is rebuilt by replay."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from agentenv.tools import PythonTool, ToolContext, replayable
from agentenv.trajectory import ToolCall, Trajectory
from agentenv.sandboxes.local import LocalSandbox

from .sandboxes.test_local import gone
from .waiting import until

pytestmark = pytest.mark.anyio


async def call(tool: PythonTool, session, traj: Trajectory, code: str):
    out = await tool(ToolContext(session, 10.0, traj, len(traj.tool_calls)), code=code)
    traj.tool_calls.append(
        ToolCall(len(traj.tool_calls), tool.name, {"code": code}, out.text, out.status, 0.0, out.error)
    )
    return out


def trajectory() -> Trajectory:
    return Trajectory(id="t", env="e", task_id="task", group_id="g", sample_index=0, prompt_ids=[1])


async def kill_in_its_call(session) -> None:
    """SIGKILL the session's worker once a call is under way in it (the session holds its lock
    for the call's whole round trip)."""
    pid = session.pid
    await until(session._lock.locked, "a call under way")
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
async def test_worker_killed_mid_call_is_a_tool_error_and_the_state_is_rebuilt():
    tool, traj = PythonTool(), trajectory()
    async with LocalSandbox(prewarm=0) as sb:
        s = await sb.session()
        assert (await call(tool, s, traj, "x = 41\nx")).text == "41"
        await call(tool, s, traj, "y = [x]\nraise ValueError('kept: it ran up to here')")
        await call(tool, s, traj, "import time\nwhile True: time.sleep(1)")  # timed out: not replayed
        assert traj.tool_calls[-1].status == "timeout"
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_in_its_call, s)
            out = await call(tool, s, traj, "import time\ntime.sleep(30)")
        assert out.status == "error" and out.error == "crashed"
        assert out.restored == {"replayed_calls": 2, "replay_mismatches": 0, "complete": True}
        assert "[session restarted: 2 earlier calls were run again]" in out.text
        after = await call(tool, s, traj, "x + 1, y")
        assert (after.status, after.text) == ("ok", "(42, [41])")


async def test_without_restore_the_state_is_lost_and_said_so():
    tool, traj = PythonTool(restore=False), trajectory()
    async with LocalSandbox(prewarm=0) as sb:
        s = await sb.session()
        await call(tool, s, traj, "x = 41")
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_in_its_call, s)
            out = await call(tool, s, traj, "import time\ntime.sleep(30)")
        assert out.restored is None and "earlier variables are lost" in out.text
        assert "NameError" in (await call(tool, s, traj, "x")).text


async def test_fork_server_killed_the_pool_starts_a_new_one_and_sessions_are_rebuilt():
    tool, traj = PythonTool(), trajectory()
    async with LocalSandbox(prewarm=2) as sb:
        s = await sb.session("helper = lambda v: v * 2")
        await call(tool, s, traj, "z = helper(21)")
        old, worker = sb.server_pid, s.pid
        os.kill(old, signal.SIGKILL)  # its templates and the sessions it forked die with it
        assert gone(worker), "a session worker outlived its fork server"
        out = await call(tool, s, traj, "z")
        # The worker died with its server: this call is a tool error, the session rebuilt.
        assert out.status == "error" and out.restored is not None and out.restored["complete"], out
        assert (await call(tool, s, traj, "z, helper(1)")).text == "(42, 2)"
        assert sb.restarts == 1 and sb.server_pid not in (None, old)
        fresh = await sb.session()  # new sessions start from the new server
        assert (await fresh.run("1 + 1")).value == "2"


def test_only_calls_that_ran_code_are_replayed():
    """A resumed program reruns the calls that built its session's state: those that ran code
    to the end or raised in it; a call with no code (the trace tool's) has nothing to rerun."""
    calls = [ToolCall(0, "python", {"code": "x = 1"}, "", "ok", 0.1),
             ToolCall(1, "python", {"code": "1/0"}, "ZeroDivisionError", "error", 0.1, "error"),
             ToolCall(2, "python", {"code": "while True: pass"}, "", "timeout", 1.0, "timeout"),
             ToolCall(3, "python", {}, "", "ok", 0.1),
             ToolCall(4, "other", {"code": "y = 2"}, "", "ok", 0.1)]
    assert [c.turn for c in replayable(calls, "python")] == [0, 1]


async def test_a_failed_call_records_the_exception_line_and_shows_no_host_path():
    tool, traj = PythonTool(), trajectory()
    async with LocalSandbox(prewarm=0) as sb:
        s = await sb.session()
        out = await call(tool, s, traj, "print(864 + 29855) * 39206 87)")
        assert (out.status, out.error) == ("error", "SyntaxError: unmatched ')'")
        assert 'File "<code>", line 1' in out.text and "^" in out.text and ".py" not in out.text, out.text
        out = await call(tool, s, traj, "import json\njson.loads('{')")
        assert out.error.startswith("json.decoder.JSONDecodeError: Expecting property name"), out.error
        assert "json/" not in out.text and "decoder.py" not in out.text, out.text
        assert [c.turn for c in replayable(traj.tool_calls, "python")] == [0, 1]  # raised in the code
        await s.aclose()


def test_calls_recorded_before_the_error_line_are_still_replayed():
    calls = [ToolCall(0, "python", {"code": "1/0"}, "ZeroDivisionError", "error", 0.1, "error"),
             ToolCall(1, "python", {"code": "1/0"}, "", "error", 0.1, "ZeroDivisionError: division by zero"),
             ToolCall(2, "python", {"code": "import os; os._exit(1)"}, "", "error", 0.1, "crashed")]
    assert [c.turn for c in replayable(calls, "python")] == [0, 1]
