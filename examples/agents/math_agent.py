"""A stand-alone agent script, in no way tied to agentenv: the ``openai`` SDK reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment, the task comes as JSON on
stdin (``{"id", "question", "answer", "data"}``), the answer goes to stdout.

    python math_agent.py < task.json

It offers the model a ``python`` tool that it runs itself, and safely: only arithmetic on
numbers, assignments to names, ``print()`` and a last bare expression (a command agent runs its own tools; anything
else is answered with an error for the model to read).
"""

from __future__ import annotations

import ast
import json
import operator
import sys

from openai import OpenAI

#: The prompt the bundled tiny-hermes model was trained on (agentenv.envs.retool_math.HERMES_PROMPT).
PROMPT = (
    "Solve the problem with Python. Think between <think> and </think> first, then call the python tool: "
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 3)"}}\n</tool_call>. '
    "Its output comes back between <tool_response> and </tool_response>. "
    "Give the final answer as \\boxed{answer}."
)
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
MAX_CALLS = 4
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node: ast.AST, names: dict[str, float]) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, names), _value(node.right, names))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand, names))
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:60]}")


def run_python(code: str) -> str:
    """What ``code`` prints (arithmetic, names, print() and a last bare expression only); an error line
    otherwise."""
    names: dict[str, float] = {}
    out = []
    try:
        body = ast.parse(code).body
        for stmt in body:
            if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
                names.update({t.id: _value(stmt.value, names) for t in stmt.targets})
            elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                  and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "print"):
                out.append(" ".join(str(_value(a, names)) for a in stmt.value.args))
            elif isinstance(stmt, ast.Expr) and stmt is body[-1]:  # a last bare expression shows, as in a notebook
                out.append(str(_value(stmt.value, names)))
            else:
                raise ValueError(f"not supported here: {ast.unparse(stmt)[:60]}")
    except (SyntaxError, ValueError, ArithmeticError) as exc:
        out.append(f"Error: {type(exc).__name__}: {exc}")
    return "\n".join(out)


def solve(question: str) -> str | None:
    client = OpenAI()
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": question}]
    for _ in range(MAX_CALLS):
        message = (
            client.chat.completions.create(model="tiny-hermes", messages=messages, tools=[PYTHON]).choices[0].message
        )
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            code = json.loads(call.function.arguments).get("code", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_python(str(code))})
    return None


if __name__ == "__main__":
    print(solve(json.loads(sys.stdin.read())["question"]) or "")
