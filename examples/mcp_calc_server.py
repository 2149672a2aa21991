"""A small MCP server built with the official ``mcp`` SDK: a calculator and a key-value store.

    python examples/mcp_calc_server.py                       # stdio (what MCPServer(command=...) starts)
    python examples/mcp_calc_server.py --http 8765           # streamable HTTP on 127.0.0.1:8765/mcp
    python examples/mcp_calc_server.py --faults              # also crash() and hang(), for tests

Tools: ``python(code)`` evaluates Python *arithmetic* the way the bundled models write it
(``print(31 * 24533 + 63)``, names assigned on earlier lines; nothing else: no imports, no
attributes), ``add(a, b)``, ``kv_set(key, value)`` and ``kv_get(key)``. It is a calculator, not
an interpreter: the model's code is parsed and only arithmetic is evaluated.
"""

from __future__ import annotations

import argparse
import ast
import operator
import os
import time

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as Server
    from mcp.server.fastmcp.exceptions import ToolError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCS = {"abs": abs, "round": round, "min": min, "max": max, "int": int, "float": float, "sum": sum}
store: dict[str, str] = {}


def _value(node: ast.AST, names: dict[str, object]) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, names), _value(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:  # type: ignore[arg-type]
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand, names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        return _FUNCS[node.func.id](*(_value(a, names) for a in node.args))
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, names) for e in node.elts]
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:60]}")


def calculate(code: str) -> str:
    """Evaluate arithmetic lines: assignments, print(...) calls, and a last expression (shown)."""
    names: dict[str, object] = {}
    out: list[str] = []
    body = ast.parse(code).body
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            value = _value(stmt.value, names)
            names.update({t.id: value for t in stmt.targets})  # type: ignore[attr-defined]
        elif (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", "") == "print"
        ):
            out.append(" ".join(str(_value(a, names)) for a in stmt.value.args))
        elif isinstance(stmt, ast.Expr) and i == len(body) - 1:
            out.append(repr(_value(stmt.value, names)))
        else:
            raise ValueError(f"not arithmetic: {ast.unparse(stmt)[:60]}")
    return "\n".join(out)


def build(faults: bool = False) -> Server:
    server = Server("agentenv-calc")

    @server.tool()
    def python(code: str) -> str:
        """Evaluate Python arithmetic (print(...) lines, assignments); the printed values come back."""
        try:
            return calculate(code)
        except (ValueError, SyntaxError, ArithmeticError, TypeError) as exc:
            raise ToolError(f"{type(exc).__name__}: {exc}") from None  # the model reads this message

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def kv_set(key: str, value: str) -> str:
        """Store value under key (in this server process)."""
        store[key] = value
        return "ok"

    @server.tool()
    def kv_get(key: str) -> str:
        """The value stored under key, or '' when there is none."""
        return store.get(key, "")

    if faults:
        @server.tool()
        def crash() -> str:
            """Kill this server process mid-call."""
            os._exit(3)

        @server.tool()
        def hang(seconds: float = 3600) -> str:
            """Block the whole server for `seconds` (a stuck server)."""
            time.sleep(seconds)
            return "woke"

        @server.tool()
        def pid() -> int:
            """This server's process id."""
            return os.getpid()

    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT/mcp")
    ap.add_argument("--faults", action="store_true", help="add crash(), hang() and pid() (for tests)")
    a = ap.parse_args()
    server = build(a.faults)
    if a.http:
        server.run("streamable-http", host="127.0.0.1", port=a.http)
    else:
        server.run()


if __name__ == "__main__":
    main()
