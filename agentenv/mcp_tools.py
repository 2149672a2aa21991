"""Tools from MCP (Model Context Protocol) servers, through the official ``mcp`` SDK
(``pip install agentenv[mcp]``).

    servers = MCPTools(MCPServer(command=[sys.executable, "calc_server.py"]),
                       MCPServer(url="http://127.0.0.1:8765/mcp"))
    class CalcEnv(Environment):
        def tools(self):
            return servers.tools()          # listed once, from the servers themselves
        async def aclose(self):
            await servers.aclose()

Each server's tools become :class:`MCPTool` objects with the server's names, descriptions and
JSON-schema arguments, so the run's tool format offers and parses them like any other tool
(Hermes or Llama 3.1 JSON calls; ReTool's ``<code>`` reaches only a tool named ``python``).
A call goes to the server and its text comes back as the tool output, spliced with loss mask 0.

* A stdio server (``command``) runs as its own process: one for the whole pool
  (``per="pool"``, the default) or one per program (``per="program"``: started at the
  program's first call, stopped when the program ends). A streamable-HTTP server (``url``,
  loopback only) is connected to, not started.
* Every call has a deadline (``call_timeout``, else the environment's ``tool_timeout``). A
  server that dies during a call, or does not answer in time, makes that call a tool error
  (``error`` / ``timeout``) and is restarted (reconnected, for a URL) for the next call.
* The connections live on one background thread with its own event loop (a
  :class:`anyio.from_thread.BlockingPortal`), so that listing works from synchronous
  ``tools()`` and a stalled server cannot stall the run's loop.

The server is code of your own, run on the host like a :class:`~agentenv.tools.FunctionTool`:
it is not sandboxed; the model only chooses the arguments.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

import anyio

from .errors import ConfigError
from .tools import Tool, ToolContext, ToolOutput

if TYPE_CHECKING:
    from .trajectory import Trajectory

_LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class MCPServer:
    """One MCP server: ``command`` (argv of a stdio server) or ``url`` (streamable HTTP, on
    loopback). ``per``: one process for the pool or one per program (stdio only);
    ``call_timeout``: seconds per call (None: the environment's ``tool_timeout``);
    ``start_timeout``: seconds to start and list; ``prefix``: put before each tool's name
    (two servers with a tool of the same name); ``only``: the tool names to offer (None: all);
    ``env``: extra environment variables for a stdio server; ``stderr``: a file to append the
    server's stderr to (default: discarded)."""

    command: tuple[str, ...] | list[str] | None = None
    url: str | None = None
    per: Literal["pool", "program"] = "pool"
    call_timeout: float | None = None
    start_timeout: float = 30.0
    prefix: str = ""
    only: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    stderr: str | None = None

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ConfigError("MCPServer needs exactly one of command=[...] (a stdio server) or url='http://...'")
        if self.command is not None and (isinstance(self.command, str) or not self.command):
            raise ConfigError(f"MCPServer command must be a non-empty list of arguments, got {self.command!r} "
                              "(e.g. [sys.executable, 'server.py'])")
        if self.url is not None:
            check_loopback(self.url)
            if self.per == "program":
                raise ConfigError(f"per='program' starts a process per program; {self.url} is a server already "
                                  "running: use per='pool'")
        if self.per not in ("pool", "program"):
            raise ConfigError(f"MCPServer per must be 'pool' or 'program', not {self.per!r}")
        for name in ("call_timeout", "start_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"MCPServer {name} must be a number of seconds > 0, got {value!r}")

    @property
    def label(self) -> str:
        return self.url or " ".join(str(c) for c in self.command or ())


def check_loopback(url: str) -> None:
    """Refuse a URL that is not http(s) on this machine's loopback interface."""
    u = urlparse(url)
    host = (u.hostname or "").lower()
    try:
        local = host in _LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if u.scheme not in ("http", "https") or not local:
        raise ConfigError(f"MCPServer url {url!r}: only a streamable-HTTP server on loopback is supported "
                          "(http://127.0.0.1:PORT/mcp or http://localhost:PORT/mcp)")


def _sdk() -> Any:
    from .extras import require

    require("mcp", extra="mcp", what="tools from MCP servers")
    import mcp

    return mcp


class ServerGone(Exception):
    """The server died, or its connection closed, during a call."""


class _Connection:
    """One live client session with one server, hosted by a task on the portal's loop."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.session: Any = None
        self._stop = anyio.Event()
        self._gone = anyio.Event()  # the session ended on its own (the server died)
        self._done = anyio.Event()

    async def host(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the server (or connect) and initialize (a failure here is the starter's),
        then hold the session until stopped; a failure after the start (the server died) only
        ends this connection."""
        started = False
        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(stack))
                from mcp import ClientSession

                self.session = await stack.enter_async_context(ClientSession(read, write))
                with anyio.fail_after(self.server.start_timeout):
                    await self.session.initialize()
                task_status.started()
                started = True
                await self._stop.wait()
        except Exception:  # noqa: BLE001 - after the start: the session ended; calls see _gone
            if not started:
                raise
        finally:
            self._gone.set()
            self._done.set()

    async def list_tools(self) -> list[Any]:
        """Every tool the server lists, all pages."""
        tools, cursor = [], None
        while True:
            if cursor is None:
                page = await self.session.list_tools()
            else:
                try:
                    from mcp import types

                    page = await self.session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
                except TypeError:  # mcp 1.x
                    page = await self.session.list_tools(cursor=cursor)
            tools += page.tools
            cursor = _field(page, "next_cursor", "nextCursor")
            if not cursor:
                return tools

    def _transport(self, stack: AsyncExitStack) -> Any:
        s = self.server
        if s.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            errlog = stack.enter_context(open(s.stderr or os.devnull, "a", encoding="utf-8"))
            params = StdioServerParameters(command=str(s.command[0]), args=[str(a) for a in s.command[1:]],
                                           env=dict(s.env) or None)
            return stdio_client(params, errlog=errlog)
        try:
            from mcp.client.streamable_http import streamable_http_client as http_client
        except ImportError:  # mcp 1.x
            from mcp.client.streamable_http import streamablehttp_client as http_client

        return _two(http_client(s.url))

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server's result for one call; :class:`ServerGone` when the session ends first."""
        async with anyio.create_task_group() as tg:
            result: list[Any] = []

            async def ask() -> None:
                result.append(await self.session.call_tool(name, arguments))
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await self._gone.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(ask)
            tg.start_soon(watch)
        if not result:
            raise ServerGone("the server's session ended during the call")
        return result[0]

    async def close(self) -> None:
        self._stop.set()
        with anyio.move_on_after(10):
            await self._done.wait()


class _two:
    """A transport context yielding (read, write) whatever the SDK version yields more."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm

    async def __aenter__(self) -> tuple[Any, Any]:
        streams = await self.cm.__aenter__()
        return streams[0], streams[1]

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.cm.__aexit__(*exc)


class _Portal:
    """A daemon thread running an event loop that hosts the connections."""

    def __init__(self) -> None:
        from anyio.from_thread import BlockingPortal

        ready = threading.Event()
        self.portal: BlockingPortal | None = None
        self.tg: Any = None

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                async with BlockingPortal() as portal:
                    self.portal = portal
                    ready.set()
                    await portal.sleep_until_stopped()
                tg.cancel_scope.cancel()

        self.thread = threading.Thread(target=anyio.run, args=(main,), name="agentenv-mcp", daemon=True)
        self.thread.start()
        if not ready.wait(30):
            raise RuntimeError("the MCP client thread did not start")

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` (async) on the portal's loop and wait here (synchronous callers)."""
        assert self.portal is not None
        return self.portal.call(fn, *args)

    async def acall(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the portal's loop and await it from another loop; cancelling
        the caller cancels it there."""
        assert self.portal is not None
        return await asyncio.wrap_future(self.portal.start_task_soon(fn, *args))

    def stop(self) -> None:
        if self.portal is not None and self.thread.is_alive():
            self.portal.call(self.portal.stop, True)
        self.thread.join(15)


def _field(obj: Any, *names: str) -> Any:
    """The first of ``names`` ``obj`` has (mcp 2 names fields in snake_case, mcp 1 in camelCase)."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def result_text(result: Any) -> str:
    """A call result's content as the text the model reads: text parts as they are, other
    parts named by kind, the structured content as JSON when there is no text."""
    parts = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        else:
            mime = _field(item, "mime_type", "mimeType")
            parts.append(f"[{kind or type(item).__name__}{': ' + mime if mime else ''}]")
    if not parts and (structured := _field(result, "structured_content", "structuredContent")) is not None:
        parts.append(json.dumps(structured))
    return "\n".join(parts)


class _Server:
    """One server's connections (one for the pool, or one per program), opened when needed
    and replaced after a failure; lives on the portal's loop."""

    def __init__(self, server: MCPServer, portal: _Portal) -> None:
        self.server, self.portal = server, portal
        self.conns: dict[str, _Connection] = {}  # "" for the pool, else the program's id
        self.locks: dict[str, anyio.Lock] = {}
        self.restarts = 0
        self.started = 0

    async def connection(self, key: str) -> _Connection:
        lock = self.locks.setdefault(key, anyio.Lock())
        async with lock:  # one start at a time per key: concurrent first calls share it
            conn = self.conns.get(key)
            if conn is None or conn._gone.is_set():
                if conn is not None:
                    self.restarts += 1
                conn = _Connection(self.server)
                await self.portal.tg.start(conn.host)
                self.started += 1
                self.conns[key] = conn
            return conn

    def drop(self, key: str, conn: _Connection, restart: bool) -> None:
        """Stop ``conn`` (in the background); the next call for ``key`` starts a new one."""
        if self.conns.get(key) is conn:
            del self.conns[key]
            self.restarts += restart
        if not restart:
            self.locks.pop(key, None)
        self.portal.tg.start_soon(conn.close)

    async def call(self, key: str, name: str, arguments: dict[str, Any], timeout: float) -> ToolOutput:
        """One call with its deadline; a dead or silent server is this call's error and is replaced."""
        start = time.perf_counter()
        try:
            with anyio.fail_after(self.server.start_timeout):
                conn = await self.connection(key)
        except Exception as exc:  # noqa: BLE001 - a server that will not start is this call's error
            return ToolOutput(f"Error: the MCP server {self.server.label} did not start: {_what(exc)}",
                              "error", f"server did not start: {_what(exc)}"[:300])
        try:
            with anyio.fail_after(timeout):
                result = await conn.call(name, arguments)
        except TimeoutError:
            self.drop(key, conn, restart=True)
            took = time.perf_counter() - start
            return ToolOutput(f"Error: {name} took more than {took:.1f}s; the MCP server was restarted",
                              "timeout", f"no answer within {timeout:g}s; server restarted")
        except Exception as exc:  # noqa: BLE001 - the server died or the session broke mid-call
            self.drop(key, conn, restart=True)
            return ToolOutput(f"Error: the MCP server failed during {name} ({_what(exc)}); it was restarted",
                              "error", f"server failed: {_what(exc)}"[:300])
        text = result_text(result)
        if _field(result, "is_error", "isError"):
            return ToolOutput(text, "error", f"tool error: {text}"[:300])
        return ToolOutput(text)

    async def release(self, key: str) -> None:
        if (conn := self.conns.get(key)) is not None:
            self.drop(key, conn, restart=False)

    async def close(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        async with anyio.create_task_group() as tg:
            for conn in conns:
                tg.start_soon(conn.close)

    async def listing(self) -> list[Any]:
        """The server's tools, from the pool's connection (a per-program server: from a
        connection opened for the listing and closed after it)."""
        with anyio.fail_after(self.server.start_timeout):
            conn = await self.connection("" if self.server.per == "pool" else "listing")
            try:
                return await conn.list_tools()
            finally:
                if self.server.per == "program":
                    await self.release("listing")


def _what(exc: BaseException) -> str:
    """An exception as one line, a group by its first leaf."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class MCPTool(Tool):
    """One tool of an MCP server, as the model sees it: the server's name (with the server's
    ``prefix``), description and JSON-schema arguments."""

    def __init__(self, owner: "MCPTools", server: _Server, spec: Any) -> None:
        self.owner, self.server = owner, server
        self.remote_name = spec.name
        self.name = server.server.prefix + spec.name
        self.description = spec.description or ""
        self.parameters = _field(spec, "input_schema", "inputSchema") or {"type": "object", "properties": {}}

    def schema(self) -> dict[str, Any]:
        s = super().schema()
        s["function"]["parameters"] = self.parameters
        return s

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        import jsonschema  # the mcp SDK's own dependency

        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as exc:
            return f"wrong arguments for {self.name}: {exc.message}"
        except jsonschema.SchemaError:
            return None  # the server's schema is its own business; the server checks the call
        return None

    async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:
        s = self.server
        key = "" if s.server.per == "pool" else (ctx.trajectory.id if ctx.trajectory is not None else "no-program")
        timeout = s.server.call_timeout or ctx.timeout
        return await self.owner.portal.acall(s.call, key, self.remote_name, dict(arguments), timeout)

    async def end_program(self, trajectory: "Trajectory") -> None:
        if self.server.server.per == "program":
            await self.owner.portal.acall(self.server.release, trajectory.id)


class MCPTools:
    """The tools of one or more MCP servers, for an environment's ``tools()``; close it in the
    environment's ``aclose()``. Nothing starts until :meth:`tools` is first called."""

    def __init__(self, *servers: MCPServer) -> None:
        if not servers:
            raise ConfigError("MCPTools needs at least one MCPServer")
        _sdk()
        self.specs = servers
        self.portal: _Portal | None = None
        self._servers: list[_Server] = []
        self._tools: list[MCPTool] | None = None
        self._lock = threading.Lock()

    def tools(self) -> list[Tool]:
        """The servers' tools (listed once: the first call starts the pool's servers and asks
        each for its tools; later calls return the same objects)."""
        with self._lock:
            if self._tools is None:
                self._tools = self._list()
            return list(self._tools)

    def _list(self) -> list[MCPTool]:
        self.portal = self.portal or _Portal()
        self._servers = [_Server(s, self.portal) for s in self.specs]
        tools: list[MCPTool] = []
        for server in self._servers:
            try:
                listed = self.portal.call(server.listing)
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"MCP server {server.server.label}: cannot start it and list its tools "
                                  f"({_what(exc)})") from None
            only = server.server.only
            tools += [MCPTool(self, server, t) for t in listed if only is None or t.name in only]
        names = [t.name for t in tools]
        if dups := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigError(f"MCP servers offer tools with the same name: {', '.join(dups)}; give a server "
                              "MCPServer(prefix='...')")
        return tools

    def stats(self) -> dict[str, int]:
        """How many server processes (or connections) were started, and how many of them
        replaced one that died or hung."""
        return {"started": sum(s.started for s in self._servers), "restarts": sum(s.restarts for s in self._servers)}

    async def aclose(self) -> None:
        """Stop every server this pool started (and the client thread)."""
        portal, self.portal = self.portal, None
        if portal is None:
            return
        for server in self._servers:
            await portal.acall(server.close)
        await anyio.to_thread.run_sync(portal.stop)
        self._tools = None
