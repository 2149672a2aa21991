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
    from sandboxes.base import Session

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


class PythonTool(Tool):
    """Runs Python code in the program's stateful sandbox session."""

    name = "python"
    description = "Run Python code in a persistent interpreter; the last expression's value is shown."

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
        return ToolOutput(res.render(), status, None if status == "ok" else res.status)


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
