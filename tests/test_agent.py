"""``agentenv.agent``: an environment whose programs run the user's own agent. The command form
as real processes (what reaches the program, what it answers, how it fails, a deadline), and
what the base class gives an agent environment."""

from __future__ import annotations

import datetime
import json
import sys

import anyio
import psutil
import pytest

from agentenv.agent import AgentEnvironment, AgentFailed, run_command, sandbox_session, task_json
from agentenv.env import Task

from .cancelling import left_behind
from .waiting import until

pytestmark = pytest.mark.anyio

TASK = Task("t/1", "What is 2 + 3?", 5, {"level": 1})
#: A command agent that answers with everything it was given.
ECHO = """
import json, os, sys
stdin = sys.stdin.read()
keys = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AGENTENV_TASK", "EXTRA")
print("  " + json.dumps({"stdin": stdin, **{k: os.environ.get(k) for k in keys}}) + "\\n")
"""


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_a_command_gets_the_task_and_the_gateway_and_its_stripped_stdout_is_the_answer():
    out = await run_command(python(ECHO), TASK, base_url="http://127.0.0.1:5/v1/", api_key="ae-key",
                            env={"EXTRA": "x"})
    got = json.loads(out)  # stripped: the JSON line alone
    assert json.loads(got["stdin"]) == json.loads(got["AGENTENV_TASK"]) == {
        "id": "t/1", "question": "What is 2 + 3?", "answer": 5, "data": {"level": 1}}
    assert (got["OPENAI_BASE_URL"], got["OPENAI_API_KEY"], got["EXTRA"]) == ("http://127.0.0.1:5/v1", "ae-key", "x")


async def test_a_command_that_exits_non_zero_fails_with_its_stderrs_tail():
    code = "import sys; sys.stderr.write('x' * 2000 + 'the agent gave up'); sys.exit(3)"
    with pytest.raises(AgentFailed) as caught:
        await run_command(python(code), TASK, base_url="u", api_key="k")
    assert caught.value.reason == "error:agent_exit"
    message = str(caught.value)
    assert message.startswith(f"{sys.executable} exited with 3: x") and message.endswith("the agent gave up")
    assert len(message) == len(f"{sys.executable} exited with 3: ") + 500  # the last 500 characters


async def test_a_command_that_never_reads_its_task_from_stdin_still_answers_or_fails_as_itself():
    """The task is on stdin and in ``AGENTENV_TASK``: a command may read either. One that exits
    without reading stdin may close the pipe before or while the task is written to it (about
    every other run of a shell that exits at once): its answer or its exit is what counts."""
    task = Task("t/big", "q" * 60_000)
    for _ in range(20):
        assert await run_command(["sh", "-c", "echo done"], task, base_url="u", api_key="k") == "done"
        with pytest.raises(AgentFailed, match="^sh exited with 4: gave up$"):
            await run_command(["sh", "-c", "echo gave up >&2; exit 4"], task, base_url="u", api_key="k")


async def test_a_command_writing_more_than_a_pipe_holds_on_both_streams_finishes():
    code = "import sys; sys.stderr.write('e' * 300_000); sys.stdout.write('o' * 300_000)"
    with anyio.fail_after(120):  # a hang guard: both pipes are drained at once
        assert await run_command(python(code), TASK, base_url="u", api_key="k") == "o" * 300_000


async def test_a_command_past_its_deadline_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    async with anyio.create_task_group() as tg:
        async def agent() -> None:
            await run_command(python(code), TASK, base_url="u", api_key="k")

        tg.start_soon(agent)
        await until(lambda: pid_file.exists() and pid_file.read_text(), "the agent started")
        # Held as a process, not a pid: a busy machine may give the pid to another process once
        # this one is reaped (is_running tells them apart by their start time).
        command = psutil.Process(int(pid_file.read_text()))
        tg.cancel_scope.cancel()
    assert not command.is_running()  # killed and reaped (a zombie would still be running), not left running


def test_a_command_cancelled_while_it_starts_is_killed_and_reaped():
    """Cancelled at each early point of its start (forked, its pipes not yet connected, and
    later), the command is gone when the cancellation has finished: asyncio kills a child whose
    start is cancelled, but its wait for the exit was cancelled too, which left it a zombie or,
    under load, still running (10 and 18 of 36 starts in two runs before)."""
    start = 'await run_command([sys.executable, "-c", "import time; time.sleep(3600)"], Task("t", "q"), ' \
            'base_url="u", api_key="k")'
    steps = [k for k in range(1, 13) for _ in range(3)]
    assert left_behind("from agentenv.agent import run_command\nfrom agentenv.env import Task", start, steps) == 0


def test_the_task_is_json_even_with_data_json_cannot_hold():
    when = datetime.date(2026, 1, 2)
    assert json.loads(task_json(Task("t", "q", None, {"when": when}))) == {
        "id": "t", "question": "q", "answer": None, "data": {"when": "2026-01-02"}}


class NoAgent(AgentEnvironment):
    id = "no-agent"

    def tasks(self, n, seed=0):
        return [TASK]


async def test_an_agent_environment_without_an_agent_or_a_command_says_so():
    with pytest.raises(NotImplementedError, match="NoAgent defines neither agent\\(\\) nor agent_command"):
        await NoAgent().agent(TASK, None, "m")


async def test_the_command_form_runs_with_the_clients_gateway_and_the_environments_variables():
    from openai import AsyncOpenAI

    class Command(NoAgent):
        agent_command = python(ECHO)

        def command_env(self, task):
            return {"EXTRA": task.id}

    client = AsyncOpenAI(base_url="http://127.0.0.1:7/v1", api_key="ae-abc")
    got = json.loads(await Command().agent(TASK, client, "m"))
    assert (got["OPENAI_BASE_URL"], got["OPENAI_API_KEY"], got["EXTRA"]) == ("http://127.0.0.1:7/v1", "ae-abc", "t/1")
    assert NoAgent().command_env(TASK) == {}


def test_a_sandbox_user_gets_a_python_tool_so_the_reactor_prepares_its_sessions():
    class Sandboxed(NoAgent):
        uses_sandbox = True

    assert NoAgent().tools() == []
    assert [t.name for t in Sandboxed().tools()] == ["python"]
    defaults = (NoAgent.tool_format, NoAgent.max_turns, NoAgent.agent_timeout, NoAgent.agent_command)
    assert defaults == ("hermes", 16, 300.0, None)


async def test_a_sandbox_session_outside_an_agent_program_is_refused():
    with pytest.raises(RuntimeError, match=r"sandbox_session\(\) is for the agent\(\) of an AgentEnvironment with "
                                           "uses_sandbox = True"):
        await sandbox_session()
