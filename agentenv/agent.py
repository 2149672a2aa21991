"""``AgentEnvironment``: bring your own agent, written against the OpenAI API.

An agent environment has the same ``tasks``, ``reward``, ``group_reward``, registry and
``check_env`` as any :class:`~agentenv.Environment`; instead of the reactor's own turn loop,
each program runs the user's agent, whose model calls go through the gateway
(``agentenv.gateway``) into the run's engine and scheduler, token-exact:

    class MyAgentEnv(AgentEnvironment):
        id = "my-agent"

        def tasks(self, n, seed=0): ...

        async def agent(self, task, client, model):      # client: openai.AsyncOpenAI
            r = await client.chat.completions.create(model=model, messages=[...], tools=[...])
            ...
            return final_answer                            # kept as trajectory.text

        async def reward(self, task, trajectory):
            return float(trajectory.text == task.answer)

Or any program in any language (``agent_command = ["python", "my_agent.py"]``): it runs as a
subprocess with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set, the task as JSON on its stdin
and in ``AGENTENV_TASK``; its stdout is the answer. An agent that raises, runs past
``agent_timeout`` or (a command) exits non-zero is a failed trajectory with its reason.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar

from .env import Environment, Task
from .formats import ToolFormat

if TYPE_CHECKING:
    from .tools import Tool


#: The running agent program's hooks (its sandbox session comes from them).
_PROGRAM: ContextVar[Any] = ContextVar("agentenv_agent_program", default=None)


async def sandbox_session() -> Any:
    """The running agent program's sandbox session (``agentenv.sandboxes``: ``await
    session.run(code, timeout)``), from the run's pool, prepared ahead like a native program's.
    Call it inside ``agent()`` of an environment with ``uses_sandbox = True``."""
    hooks = _PROGRAM.get()
    if hooks is None:
        raise RuntimeError("sandbox_session() is for the agent() of an AgentEnvironment with uses_sandbox = True")
    return await hooks.session()


class AgentFailed(Exception):
    """The agent did not finish: ``reason`` is the trajectory's finish reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AgentEnvironment(Environment):
    #: How the model writes tool calls (its chat template's format): "hermes" (Qwen-style
    #: ``<tool_call>`` JSON) or "llama3-json"; the gateway parses replies into ``tool_calls`` by it.
    tool_format: ClassVar[str | ToolFormat] = "hermes"
    #: The most model calls a program makes (each further call gets an empty reply).
    max_turns: ClassVar[int] = 16
    #: Seconds an agent program may run, all its calls and tools together.
    agent_timeout: ClassVar[float] = 300.0
    #: The command form: a program run per sample (see the module docstring); None: ``agent()``.
    agent_command: ClassVar[list[str] | None] = None

    #: True: each program gets a session of the run's sandbox pool (:func:`sandbox_session`),
    #: for model-written code the agent runs.
    uses_sandbox: ClassVar[bool] = False

    def tools(self) -> list["Tool"]:
        """The agent runs its own tools; a ``python`` tool here only makes the reactor prepare a
        sandbox session per program (``uses_sandbox``)."""
        from .tools import PythonTool

        return [PythonTool()] if self.uses_sandbox else []

    async def agent(self, task: Task, client: Any, model: str) -> str | None:
        """Run the agent on ``task`` through ``client`` (an ``openai.AsyncOpenAI`` whose base
        URL is the gateway and whose key is this program's) with model name ``model``; return
        its final answer. The default runs :attr:`agent_command`."""
        if not self.agent_command:
            raise NotImplementedError(f"{type(self).__name__} defines neither agent() nor agent_command")
        return await run_command(list(self.agent_command), task, base_url=str(client.base_url),
                                 api_key=str(client.api_key), env=self.command_env(task))

    def command_env(self, task: Task) -> dict[str, str]:
        """Extra environment variables for :attr:`agent_command` (none by default)."""
        return {}


def task_json(task: Task) -> str:
    return json.dumps({"id": task.id, "question": task.question, "answer": task.answer, "data": task.data},
                      default=str)


async def run_command(command: list[str], task: Task, *, base_url: str, api_key: str,
                      env: dict[str, str] | None = None) -> str:
    """Run ``command`` for ``task`` (see the module docstring); its stdout, stripped. Raises
    :class:`AgentFailed` (``error:agent_exit``) when it exits non-zero. Cancelled (the deadline),
    the process is killed."""
    import subprocess

    import anyio

    payload = task_json(task)
    child_env = {**os.environ, **(env or {}), "OPENAI_BASE_URL": base_url.rstrip("/"), "OPENAI_API_KEY": api_key,
                 "AGENTENV_TASK": payload}
    # The start is shielded: cancelled half way (forked, its pipes not yet connected), asyncio
    # kills the child but its wait for the exit is cancelled too, so it would be left unreaped.
    # Started whole, a cancellation lands in the ``try`` below, which kills and reaps it.
    with anyio.CancelScope(shield=True):
        started = await anyio.open_process(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, env=child_env)
    async with started as proc:
        out, err = bytearray(), bytearray()

        async def drain(stream: Any, into: bytearray) -> None:
            async for chunk in stream:
                into.extend(chunk)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, proc.stdout, out)
                tg.start_soon(drain, proc.stderr, err)
                try:
                    await proc.stdin.send(payload.encode())
                    await proc.stdin.aclose()
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # it closed its stdin unread (it has the task in AGENTENV_TASK): its exit tells
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()
    if code != 0:
        tail = err.decode(errors="replace").strip()[-500:]
        raise AgentFailed("error:agent_exit", f"{command[0]} exited with {code}: {tail}")
    return out.decode(errors="replace").strip()


__all__ = ["AgentEnvironment", "AgentFailed", "run_command", "sandbox_session"]
