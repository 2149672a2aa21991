"""Tools a model may call.

A tool has a name, a JSON-schema description (for chat templates that list tools) and an
async ``__call__(ctx, **arguments) -> ToolOutput``. Two kinds ship:

* :class:`PythonTool` runs code in the program's sandbox session (the ReTool tool);
* :class:`FunctionTool` wraps a plain (sync or async) Python function; its arguments are
  checked against the function's signature, so wrong arguments become an observation.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

if TYPE_CHECKING:
    from agentenv.sandboxes.base import Session

    from .trajectory import Trajectory

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass(slots=True)
class ToolContext:
    """What a tool may use while it runs for one program."""

    session: "Session | None"
    timeout: float
    trajectory: "Trajectory | None" = None  # the calling program, read-only by convention
    turn: int = 0


@dataclass(slots=True)
class ToolOutput:
    text: str
    status: str = "ok"  # ok | error | timeout
    error: str | None = None
    #: The session died in this call and was rebuilt: {"replayed_calls", "replay_mismatches",
    #: "complete"} (see :func:`replay`).
    restored: dict[str, Any] | None = None


class Tool:
    name: str = ""
    description: str = ""

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description}}

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """A message when ``arguments`` do not fit the tool, else None."""
        return None

    async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:  # pragma: no cover
        raise NotImplementedError

    async def end_program(self, trajectory: "Trajectory") -> None:
        """The program ``trajectory`` has ended (whatever way): release what the tool holds for
        it (an MCP tool's per-program server). Called once per program by each tool object."""


def replayable(calls: list[Any], name: str) -> list[Any]:
    """The earlier calls of tool ``name`` whose effects make up a session's state: those that
    ran to the end (``ok``) or raised in the code (``error``); timed-out, crashed and malformed
    calls left nothing reliable behind, and running them again would only fail again. A call
    with no ``code`` argument (a tool built on :class:`PythonTool` that runs code of its own,
    like the trace workload's) has nothing to run again."""
    return [c for c in calls if c.name == name and isinstance(c.arguments.get("code"), str)
            and (c.status == "ok" or (c.status == "error" and c.error != "crashed"))]


async def replay(session: "Session", calls: list[Any], timeout: float) -> dict[str, Any]:
    """Rebuild a session's state by running ``calls`` (``ToolCall`` records) again, in order,
    notebook-style ("restart and run all above"). Outputs that differ from the recorded ones
    are counted, not hidden; a replayed call that kills the session stops the replay."""
    mismatches, done = 0, 0
    for call in calls:
        res = await session.run(call.arguments["code"], timeout=timeout)
        if res.status in ("crashed", "timeout") or (res.state_lost and done):  # it died again
            return {"replayed_calls": done, "replay_mismatches": mismatches + 1, "complete": False}
        done += 1
        res.state_lost = False  # the first replayed call starts the new worker: expected
        mismatches += res.render() != call.output
    return {"replayed_calls": done, "replay_mismatches": mismatches, "complete": True}


#: Characters of an exception's line kept in a tool call's ``error``.
ERROR_LINE_CAP = 300


def call_error(res: Any) -> str:
    """A failed call's ``error`` field: ``crashed`` when the interpreter died, else the
    exception's type and message, the last line of its traceback (``SyntaxError: invalid
    syntax``, ``TimeoutError: execution exceeded 5s and was killed``)."""
    if res.status == "crashed":
        return "crashed"
    lines = [ln for ln in (res.error or "").splitlines() if ln.strip()]
    return lines[-1].strip()[:ERROR_LINE_CAP] if lines else res.status


def needs_sandbox(env: Any) -> bool:
    """Whether ``env``'s programs run code in a sandbox session (it has a :class:`PythonTool`)."""
    return any(isinstance(t, PythonTool) for t in env.tools())


class PythonTool(Tool):
    """Runs Python code in the program's stateful sandbox session.

    ``restore`` (default on): when a call kills the session (a crash, a worker killed from
    outside, a timeout the code would not stop for), the session is replaced and the program's
    earlier calls are run again in it, so the next call finds the variables it expects; the
    model is told so in the observation, and the trajectory records the replay.
    """

    name = "python"
    description = "Run Python code in a persistent interpreter; the last expression's value is shown."

    def __init__(self, restore: bool = True) -> None:
        self.restore = restore

    def schema(self) -> dict[str, Any]:
        s = super().schema()
        s["function"]["parameters"] = {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        }
        return s

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        if set(arguments) != {"code"} or not isinstance(arguments.get("code"), str):
            return "python takes exactly one string argument: code"
        return None

    async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:
        if ctx.session is None:
            return ToolOutput("", "error", "no sandbox session for this program")
        res = await ctx.session.run(arguments["code"], timeout=ctx.timeout)
        status = {"ok": "ok", "timeout": "timeout"}.get(res.status, "error")
        restored = None
        if res.state_lost and res.status != "ok" and self.restore and ctx.trajectory is not None:
            restored = await replay(ctx.session, replayable(ctx.trajectory.tool_calls, self.name), ctx.timeout)
        text = res.render(restored=None if restored is None else restored["replayed_calls"])
        return ToolOutput(text, status, None if status == "ok" else call_error(res), restored)


class FunctionTool(Tool):
    """A Python function as a tool: ``FunctionTool(add)`` exposes ``add(a: int, b: int)``."""

    def __init__(self, fn: Callable[..., Any | Awaitable[Any]], name: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = inspect.getdoc(fn) or ""
        self.signature = inspect.signature(fn)

    def schema(self) -> dict[str, Any]:
        props, required = {}, []
        for p in self.signature.parameters.values():
            props[p.name] = {"type": _JSON_TYPES.get(p.annotation, "string")}
            if p.default is inspect.Parameter.empty:
                required.append(p.name)
        s = super().schema()
        s["function"]["parameters"] = {"type": "object", "properties": props, "required": required}
        return s

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        try:
            self.signature.bind(**arguments)
        except TypeError as exc:
            return f"wrong arguments for {self.name}: {exc}"
        return None

    async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:
        start = time.perf_counter()
        try:
            with anyio.fail_after(ctx.timeout):
                if inspect.iscoroutinefunction(self.fn):
                    out = await self.fn(**arguments)
                else:
                    out = await anyio.to_thread.run_sync(lambda: self.fn(**arguments), abandon_on_cancel=True)
        except TimeoutError:
            return ToolOutput("", "timeout", f"{self.name} took more than {time.perf_counter() - start:.1f}s")
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation
            return ToolOutput(f"{type(exc).__name__}: {exc}", "error", type(exc).__name__)
        return ToolOutput(out if isinstance(out, str) else repr(out))
