"""The Environment base class users subclass.

An environment is a task source, a prompt, tools with a tool-call format, and a reward that
may be slow. The reactor owns the loop (generate, parse, run tools, splice); the environment
only answers questions about its tasks. Override:

* ``tasks(n, seed)``            -> list of :class:`Task` (seeded, each with a stable id)
* ``prompt(task)``              -> chat messages, rendered by the tokenizer's chat template
* ``tools()``                   -> the tools (default: one sandboxed ``python`` tool)
* optional ``use_format(fmt)``  -> adapt the prompt to the run's tool format (the model's own
  unless ``tool_format`` pins one; :func:`bind_tool_format`)
* ``async reward(task, traj)``  -> float, or a dict of named components (summed)
* optional ``async group_reward(task, trajs)`` over the G samples of one task (GRPO group)
* optional ``async on_turn(task, traj, turn_text)`` -> :class:`TurnAction` or None
* optional ``sandbox_setup()``  -> code run once in each program's session before the model
* optional ``plan_turn(task, traj, turn)`` -> :class:`TurnPlan` (this turn's token cap, whether
  stop tokens end it, whether it is the last), e.g. thinking budgets or trace workloads

Rewards run after a program ends, concurrently with other programs still decoding. A reward
that raises is recorded on the trajectory (``error``) with reward ``None``; it never stops the
run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .formats import ToolFormat, get_format
from .tools import PythonTool, Tool

if TYPE_CHECKING:
    from .trajectory import Trajectory

Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Task:
    """One problem of an environment: what the model is asked, and what the reward checks."""

    id: str
    """A stable id (the same for the same task whatever the seed): rows, resumes and reports
    are keyed by it."""
    question: str
    """The user turn :meth:`Environment.prompt` asks (by default, after the system prompt)."""
    answer: Any = None
    """The expected answer, for the reward (``correct_answer`` compares the final answer to it)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Anything else the environment keeps with the task (JSON-serialisable)."""


@dataclass(slots=True)
class TurnAction:
    """What ``on_turn`` may ask for: end the program, and/or inject text (mask 0)."""

    stop: bool = False
    """End the program after this turn."""
    inject: str | None = None
    """Text spliced into the context after this turn, with loss mask 0, as written: the
    environment's own markup, so a special token's text in it is that control token (a new
    user turn may be written so). Unlike a tool's output or a task's prompt, it is not read as
    text (``agentenv.literals``): quote what untrusted text it carries with care."""


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What ``plan_turn`` may say about the next turn."""

    max_tokens: int | None = None
    """Sampled-token cap for this turn (None: the rollout config's ``max_tokens_per_turn``)."""
    stop: bool = True
    """False: no stop token ends the turn (it runs to ``max_tokens``; EOS included)."""
    last: bool = False
    """The program ends after this turn (finish reason ``stop``), whatever the model wrote."""


class Environment:
    """The base class of an environment: subclass it, set the class attributes, and override
    :meth:`tasks` and :meth:`reward` (required), then what else the environment needs
    (:meth:`prompt`, :meth:`tools`, :meth:`sandbox_setup`, :meth:`on_turn`, :meth:`plan_turn`,
    :meth:`group_reward`). The constructor's keyword arguments are the environment's
    ``--env-arg`` options; a subclass that takes some declares them in its own ``__init__``."""

    id: ClassVar[str] = ""
    """The registry id, e.g. ``"retool-math"`` (``make(id)``, ``--env id``)."""
    tool_format: ClassVar[str | ToolFormat | None] = None
    """How the model writes tool calls and reads their results. None (the default): the model's
    own format (:mod:`agentenv.models.native`), given to :meth:`use_format` when a run starts.
    An id (``"retool"``, ``"hermes"``, ``"llama3-json"``) or a
    :class:`~agentenv.formats.ToolFormat` instance pins one: a model that speaks another gets a
    warning line, not a switch."""
    max_turns: ClassVar[int] = 4
    """Model turns per program by default (each may call tools); ``--max-turns`` overrides it."""
    tool_timeout: ClassVar[float] = 5.0
    """Seconds one tool call may take by default; a call past it is a tool error."""
    system_prompt: ClassVar[str | None] = None
    """The system message :meth:`prompt` puts first (None: no system message)."""
    tools_in_prompt: ClassVar[bool] = False
    """True: the chat template lists the tools (their ``schema()``: name, description,
    JSON-schema arguments) in the prompt, the way the model's own template offers tools (Qwen's
    ``<tools>`` block, Llama 3.1's function list); False: the prompt says what it says."""
    train_defaults: ClassVar[dict[str, Any]] = {}
    """Training settings that make this environment learn (``TrainConfig``'s flat option names,
    e.g. ``lr`` or ``max_turns``, ``env_kwargs`` among them); ``agentenv train`` and
    ``TrainConfig.for_env`` use them where the user gave no value of their own."""

    def __init__(self, **kwargs: Any) -> None:
        self.options = kwargs
        """The keyword arguments this base class was given (a subclass that declares its
        own in ``__init__`` keeps them as it likes)."""

    # -- required ------------------------------------------------------------------------
    def tasks(self, n: int, seed: int = 0) -> list[Task]:
        """Required: ``n`` tasks drawn from ``seed`` (the same seed gives the same tasks),
        each with a stable id."""
        raise NotImplementedError

    async def reward(self, task: Task, trajectory: "Trajectory") -> float | dict[str, float]:
        """Required: the reward of a finished program, a float or a dict of named components
        (with ``"reward"``, the total, or else summed; a :class:`~agentenv.rewards.Rubric`
        returns one). It runs after the program ends, concurrently with programs still
        decoding; one that raises is recorded on the trajectory (reward None), not raised."""
        raise NotImplementedError

    # -- optional ------------------------------------------------------------------------
    def prompt(self, task: Task) -> Messages:
        """The chat messages the program starts from, rendered by the model's chat template:
        by default :attr:`system_prompt` (if any), then the task's question as the user turn."""
        msgs: Messages = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": task.question})
        return msgs

    def tools(self) -> list[Tool]:
        """The tools the model may call, offered in :attr:`tool_format`: by default one
        sandboxed ``python`` tool (:class:`~agentenv.tools.PythonTool`)."""
        return [PythonTool()]

    def sandbox_setup(self) -> str | None:
        """Python run once in each program's sandbox session before the model's first turn
        (imports, helper functions, data); None: nothing."""
        return None

    def use_format(self, fmt: ToolFormat) -> None:
        """Take ``fmt`` as this environment's tool-call format: called once, before any prompt,
        when ``tool_format`` is None (the run found the model's own). Override it to write the
        prompt for the format (call ``super().use_format(fmt)``)."""
        self.tool_format = fmt  # type: ignore[misc]  # the instance's, over the class's None

    def plan_turn(self, task: Task, trajectory: "Trajectory", turn: int) -> TurnPlan | None:
        """Limits for turn ``turn`` (0-based) of this program; None: the config's."""
        return None

    async def on_turn(self, task: Task, trajectory: "Trajectory", turn_text: str) -> TurnAction | None:
        """Called after each model turn that called tools, once their output is spliced in,
        with the turn's text: a :class:`TurnAction` ends the program or injects text (loss
        mask 0); None: go on."""
        return None

    async def group_reward(
        self, task: Task, trajectories: list["Trajectory"]
    ) -> list[float | dict[str, float]] | None:
        """Rewards for a whole GRPO group, or None to keep the per-sample rewards. Each
        trajectory's ``reward`` here is its per-sample one, also when a resumed group is scored
        again (the per-sample reward is kept in ``metadata["sample_reward"]``)."""
        return None

    def has_group_reward(self) -> bool:
        """Whether this environment rewards whole groups: its class overrides
        :meth:`group_reward` (as the checker tests overrides). Then a group's results are
        written and judged together."""
        return type(self).group_reward is not Environment.group_reward

    async def aclose(self) -> None:
        """Release anything the environment holds (called once by the runner)."""


def bind_tool_format(env: Environment, model: Any) -> str | None:
    """Settle ``env``'s tool format for a run on ``model`` (a model directory, a bundled
    model's name, or a loaded tokenizer): an unpinned environment (``tool_format`` None) takes
    the model's own (:func:`agentenv.models.native.native_format`; ``retool`` when it cannot
    be told). Returns, for a pinned format that differs from the one the model speaks, the
    warning line to show (naming both and how to switch), else None."""
    from .models.native import native_format

    native = native_format(model)
    if env.tool_format is None:
        env.use_format(get_format(native.name))
        return None
    pinned = get_format(env.tool_format).name
    if native.name is None or native.name == pinned:
        return None
    cls = type(env).__name__
    takes_format = "format" in inspect.signature(type(env).__init__).parameters
    switch = (f"--env-arg format={native.name} switches to it" if takes_format else
              f"set tool_format = None in {cls} to follow the model")
    return (f"tool format: {env.id or cls} pins {pinned!r} but the model speaks {native.name!r} "
            f"(from {native.source}); {switch}")
