"""``retool-math``: arithmetic, word problems, small algebra and digit sums solved with Python.

The model writes ``<code>...</code>``, the sandbox answers in ``<interpreter>...</interpreter>``,
and the final answer goes in ``\\boxed{...}`` (or ``<answer>...</answer>``). Reward: 1.0 for the
right final answer (``correct``: the model's last words after any tool output, compared
exactly as a number), else 0.0; the component ``tool_ran`` reports whether a tool call ran
cleanly (weight 0: informational, not added to the reward).

The tool-call format follows the model (:mod:`agentenv.models.native`): with the bundled
``tiny-hermes`` (or a Qwen model) it asks for Hermes calls instead: the model thinks in
``<think>...</think>``, calls ``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``,
and reads the output in a ``<tool_response>`` turn rendered by its chat template; calls written
inside ``<think>`` are not run unless ``calls_in_think=True``. A Llama 3.1 model is asked for its
JSON calls. ``format=`` (``--env-arg format=hermes``) pins one whatever the model; rollout, eval
and training all parse with the one format object the environment holds.
"""

from __future__ import annotations

import random

from agentenv.env import Environment, Task
from agentenv.formats import HermesFormat, Llama3JsonFormat, ReToolFormat, ToolFormat
from agentenv.rewards import Rubric, correct_answer, tool_ran
from agentenv.trajectory import Trajectory

from .problems import generate

SYSTEM_PROMPT = (
    "Solve the problem with Python. Write code between <code> and </code>; its output "
    "comes back between <interpreter> and </interpreter>. Give the final answer as \\boxed{answer}."
)
HERMES_PROMPT = (
    "Solve the problem with Python. Think between <think> and </think> first, then call the python tool: "
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 3)"}}\n</tool_call>. '
    "Its output comes back between <tool_response> and </tool_response>. "
    "Give the final answer as \\boxed{answer}."
)
LLAMA_PROMPT = (
    "Solve the problem with Python. To run code, answer with only a JSON call: "
    '{"name": "python", "parameters": {"code": "print(2 + 3)"}}. Its output comes back as the tool\'s message. '
    "Give the final answer as \\boxed{answer}."
)
FORMATS = ("retool", "hermes", "llama3-json")


class RetoolMathEnv(Environment):
    """Arithmetic word problems the model solves by writing Python (ReTool style); reward 1
    for the right final answer in \\boxed{}. ``extra_digits`` makes the numbers longer;
    the tool-call format is the model's own; ``format="hermes"`` asks for Hermes calls after a
    ``<think>`` block (the ``tiny-hermes`` model's format) whatever the model (``format="retool"``
    and ``format="llama3-json"`` likewise), and ``calls_in_think=True`` runs calls written inside that block.

    The bundled demo environment: tasks are generated from the seed, so any count works."""

    id = "retool-math"
    tool_format = None  # the model's own, unless format= pins one
    max_turns = 4
    tool_timeout = 5.0
    system_prompt = SYSTEM_PROMPT
    #: What ``agentenv train --env retool-math`` uses unless told otherwise: the bundled model is
    #: nearly deterministic at temperature 1.0 (most groups score alike, so GRPO has no signal);
    #: at 1.6 on one fewer digit most groups are mixed, and sequence aggregation at lr 2e-4 is
    #: stable (token aggregation at 5e-4 collapsed). 100 steps: shorter runs stay within the
    #: noise of a held-out evaluation (see docs/training.md). Right answers take
    #: under 60 sampled tokens, so 128 cuts only failing samples short (they score 0 either way)
    #: and keeps their long tail from widening the training passes and delaying their groups.
    train_defaults = {"temperature": 1.6, "lr": 2e-4, "aggregation": "sequence", "groups_per_step": 4,
                      "group_size": 8, "steps": 100, "eval_every": 50, "eval_tasks": 128,
                      "max_new_tokens": 128, "micro_batch_tokens": 1024,
                      "env_kwargs": {"extra_digits": 1}}

    def __init__(self, extra_digits: int = 2, format: str | None = None, calls_in_think: bool = False) -> None:
        super().__init__()
        if not 0 <= extra_digits <= 12:
            raise ValueError("extra_digits must be between 0 and 12")
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
        self.extra_digits, self.calls_in_think = extra_digits, calls_in_think
        if format is not None:  # pinned: the run warns when the model speaks another
            self.use_format(ReToolFormat() if format == "retool" else Llama3JsonFormat()
                            if format == "llama3-json" else HermesFormat())

    def use_format(self, fmt: ToolFormat) -> None:
        """The prompt that asks for ``fmt``'s calls (instance attributes over the class's: what
        the reactor, checker and trainer read)."""
        if isinstance(fmt, HermesFormat) and not isinstance(fmt, Llama3JsonFormat):
            fmt = HermesFormat(calls_in_think=self.calls_in_think)
        super().use_format(fmt)
        self.system_prompt = {"hermes": HERMES_PROMPT, "llama3-json": LLAMA_PROMPT}.get(  # type: ignore[misc]
            fmt.name, SYSTEM_PROMPT)

    def tasks(self, n: int, seed: int = 0) -> list[Task]:
        rng = random.Random(f"retool-math:{seed}")
        out = []
        for i in range(n):
            kind, (question, answer, solution) = generate(rng, self.extra_digits)
            out.append(Task(f"retool-math/{seed}/{i}", question, answer, {"kind": kind, "solution": solution}))
        return out

    #: ``correct`` (weight 1; the answers are integers, so a numeric comparison) + ``tool_ran``
    #: (weight 0, reported only); see agentenv.rewards.
    rubric = Rubric(correct_answer(symbolic=False), (tool_ran, 0.0))

    async def reward(self, task: Task, trajectory: Trajectory) -> dict[str, float]:
        return await self.rubric(task, trajectory)
