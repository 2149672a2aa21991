"""``retool-math``: arithmetic, word problems, small algebra and digit sums solved with Python.

The model writes ``<code>...</code>``, the sandbox answers in ``<interpreter>...</interpreter>``,
and the final answer goes in ``\\boxed{...}`` (or ``<answer>...</answer>``). Reward: 1.0 for an
exact numeric match, else 0.0; the component ``tool_ran`` reports whether a tool call ran
cleanly (informational, not added to the reward).
"""

from __future__ import annotations

import random
import re

from agentenv.env import Environment, Task
from agentenv.trajectory import Trajectory

from .problems import generate

SYSTEM_PROMPT = (
    "Solve the problem with Python. Write code between <code> and </code>; its output "
    "comes back between <interpreter> and </interpreter>. Give the final answer as \\boxed{answer}."
)

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{...}`` or ``<answer>...</answer>`` in ``text``."""
    found = [(m.start(), m.group(1)) for m in _BOXED.finditer(text)]
    found += [(m.start(), m.group(1)) for m in _ANSWER.finditer(text)]
    return max(found)[1].strip() if found else None


def answers_match(given: str | None, expected: object) -> bool:
    if given is None:
        return False
    g = given.replace(",", "").replace("$", "").strip()
    try:
        return abs(float(g) - float(expected)) < 1e-6  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return g == str(expected)


class RetoolMathEnv(Environment):
    """Arithmetic word problems the model solves by writing Python (ReTool style); reward 1
    for the right final answer in \\boxed{}. ``extra_digits`` makes the numbers longer.

    The bundled demo environment: tasks are generated from the seed, so any count works."""

    id = "retool-math"
    tool_format = "retool"
    max_turns = 4
    tool_timeout = 5.0
    system_prompt = SYSTEM_PROMPT

    def __init__(self, extra_digits: int = 2) -> None:
        super().__init__()
        if not 0 <= extra_digits <= 12:
            raise ValueError("extra_digits must be between 0 and 12")
        self.extra_digits = extra_digits

    def tasks(self, n: int, seed: int = 0) -> list[Task]:
        rng = random.Random(f"retool-math:{seed}")
        out = []
        for i in range(n):
            kind, (question, answer, solution) = generate(rng, self.extra_digits)
            out.append(Task(f"retool-math/{seed}/{i}", question, answer, {"kind": kind, "solution": solution}))
        return out

    async def reward(self, task: Task, trajectory: Trajectory) -> dict[str, float]:
        completion = trajectory.text or ""
        # Only the model's final words count: an answer inside tool output is not the model's.
        final = completion.rsplit("</interpreter>", 1)[-1]
        correct = answers_match(extract_answer(final), task.answer)
        ran = any(c.status == "ok" for c in trajectory.tool_calls)
        return {"reward": float(correct), "tool_ran": float(ran)}
