"""Trace workloads: synthetic agent programs that measure the rollout system, not the model.

A trace fixes, for every program, how many turns it takes (heavy-tailed, 1 to ``max_turns``),
how many tokens each turn samples, how many tokens each tool call returns, and how long each
tool call takes. Turn lengths are enforced through ``max_tokens`` with no stop token (the
model's own behaviour does not matter), so every scheduling policy does exactly the same
work: same seed, same workload.

Tool-latency profiles:

* ``lognormal``: heavy-tailed (median ``tool_median`` seconds, sigma 1, capped), like web
  calls and big computations;
* ``swe``: low variance around ``tool_median`` (sigma 0.15), like running a test suite.

:class:`TraceEnv` is an ordinary :class:`~agentenv.Environment` (registered as ``trace``), so
the reactor, the CLI and the benchmark run it like any other; each tool call also makes a
real round trip to the program's sandbox session (``sandbox=True``), so session preparation
is part of what is measured. The discrete-event simulator (:mod:`agentenv.simulator`) reads
the same :class:`ProgramTrace` objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import random
import typing
from dataclasses import dataclass
from typing import Any, Sequence

import anyio

from .env import Environment, Task, TurnPlan
from .formats import ToolFormat, ToolRequest
from .tools import PythonTool, ToolContext, ToolOutput

PROFILES = ("lognormal", "swe")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    profile: str = "lognormal"
    #: Turns per program: 1 + a geometric-like heavy tail, capped.
    mean_turns: float = 6.0
    max_turns: int = 30
    #: Sampled tokens per turn: log-normal around this median, clipped to [8, max_turn_tokens].
    turn_tokens: int = 48
    max_turn_tokens: int = 256
    #: Tool-output tokens per call: log-normal around this median, clipped to [4, 256].
    tool_tokens: int = 24
    #: Tool latency median in seconds, and the cap of the heavy tail.
    tool_median: float = 0.5
    tool_cap: float = 10.0
    #: Share of each call's latency spent computing in the program's sandbox (a busy loop),
    #: the rest waiting: 0 is an I/O-bound tool (an API, a search), 1 a CPU-bound one.
    tool_cpu: float = 0.0
    #: Prompt tokens per program (each prompt is distinct, so prompts do not share a cache).
    prompt_tokens: int = 64
    #: A program's whole sequence stays below this (turns past it are dropped): the context.
    max_total_tokens: int = 1900

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        if not 0.0 <= self.tool_cpu <= 1.0:
            raise ValueError(f"tool_cpu must be between 0 and 1, got {self.tool_cpu}")


@dataclass(frozen=True, slots=True)
class ProgramTrace:
    turn_tokens: tuple[int, ...]  # sampled tokens of each turn
    tool_tokens: tuple[int, ...]  # tokens each tool call returns (one per turn but the last)
    tool_latency: tuple[float, ...]  # seconds each tool call takes
    prompt_tokens: int

    @property
    def turns(self) -> int:
        return len(self.turn_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + sum(self.turn_tokens) + sum(self.tool_tokens)


def _parse_id(task_id: str) -> tuple[int, int]:
    try:
        kind, seed, i = task_id.split("/")
        if kind != "trace":
            raise ValueError
        return int(seed), int(i)
    except ValueError:
        raise ValueError(f"not a trace task id: {task_id!r} (expected trace/<seed>/<index>)") from None


def program_trace(spec: WorkloadSpec, key: str) -> ProgramTrace:
    """The trace of one program, a pure function of the spec and the program's key."""
    rng = random.Random(hashlib.sha256(f"{spec}|{key}".encode()).digest())
    # Heavy-tailed turn count: log-normal with sigma 0.9 around a median chosen so the mean
    # (before the cap) is about mean_turns.
    median = max(1.0, spec.mean_turns / math.exp(0.9**2 / 2))
    turns = max(1, min(spec.max_turns, round(median * math.exp(0.9 * rng.gauss(0, 1)))))
    clip = lambda x, lo, hi: max(lo, min(hi, int(round(x))))  # noqa: E731
    toks = tuple(clip(spec.turn_tokens * math.exp(0.6 * rng.gauss(0, 1)), 8, spec.max_turn_tokens)
                 for _ in range(turns))
    tool = tuple(clip(spec.tool_tokens * math.exp(0.6 * rng.gauss(0, 1)), 4, 256) for _ in range(turns - 1))
    sigma = 1.0 if spec.profile == "lognormal" else 0.15
    lat = tuple(min(spec.tool_cap, spec.tool_median * math.exp(sigma * rng.gauss(0, 1))) for _ in range(turns - 1))
    total, keep = spec.prompt_tokens, 0
    for i, n in enumerate(toks):  # the context bounds the program
        total += n + (tool[i] if i < len(tool) else 0)
        if total > spec.max_total_tokens and keep:
            break
        keep += 1
    return ProgramTrace(toks[:keep], tool[: keep - 1], lat[: keep - 1], spec.prompt_tokens)


def workload(spec: WorkloadSpec, tasks: int, group_size: int, seed: int = 0) -> list[list[ProgramTrace]]:
    """Traces for ``tasks`` x ``group_size`` programs (task-major, like the reactor)."""
    return [[program_trace(spec, f"{seed}/{t}/{g}") for g in range(group_size)] for t in range(tasks)]


class TraceFormat(ToolFormat):
    """Every turn ends in one call of the ``trace`` tool (the model's text is not parsed)."""

    name = "trace"
    stop_strings = ()

    def parse(self, text: str, tool_names: Sequence[str]) -> list[Any]:
        return [ToolRequest("trace", {})]

    def observation(self, outputs: list[str], tokenizer: Any, ended_with_eos: bool) -> str:
        return "".join(outputs)


class TraceTool(PythonTool):
    """Sleeps the trace's latency, makes a real sandbox round trip (optional), and returns
    the trace's number of filler tokens."""

    name = "trace"
    description = "A synthetic tool call of a trace workload."

    def __init__(self, env: "TraceEnv") -> None:
        self.env = env

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        return None

    async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:
        t = ctx.trajectory
        assert t is not None
        trace = self.env.trace_of(t.task_id, t.sample_index)
        i = min(ctx.turn, len(trace.tool_latency) - 1)
        busy = trace.tool_latency[i] * self.env.spec.tool_cpu if ctx.session is not None else 0.0
        if ctx.session is not None:
            code = ("import time\nt = time.process_time()\nwhile time.process_time() - t < %r:\n    pass" % busy
                    if busy > 0 else "None")
            res = await ctx.session.run(code, timeout=ctx.timeout)
            if res.status != "ok":
                return ToolOutput(res.render(), "error", res.status)
        await anyio.sleep(trace.tool_latency[i] - busy)
        return ToolOutput(self.env.filler * trace.tool_tokens[i])


class TraceEnv(Environment):
    """Programs that follow a trace. Arguments: the :class:`WorkloadSpec` fields, plus
    ``sandbox`` (default True: each tool call also runs in the program's sandbox session)."""

    id = "trace"
    tool_format = TraceFormat()
    #: A program takes its trace's turns, at most the spec's ``max_turns``: the cap is that one.
    max_turns: int = WorkloadSpec.__dataclass_fields__["max_turns"].default
    tool_timeout = 30.0
    #: One token per repetition in the bundled tokenizer (byte-level BPE without merges for it).
    filler = " x"

    def __init__(self, sandbox: bool = True, **spec: Any) -> None:
        super().__init__(sandbox=sandbox, **spec)
        self.spec = WorkloadSpec(**spec)  # an unknown field is a TypeError: make() reports it
        self.max_turns = self.spec.max_turns
        self.use_sandbox = sandbox
        self._tasks: dict[str, tuple[int, int]] = {}
        # Traces of the programs under way: a trace is asked for at every turn and tool call.
        self._traces: dict[tuple[str, int], ProgramTrace] = {}

    def tasks(self, n: int, seed: int = 0) -> list[Task]:
        out = []
        for i in range(n):
            tid = f"trace/{seed}/{i}"
            self._tasks[tid] = (seed, i)
            question = f"program {seed}-{i}:" + self.filler * max(1, self.spec.prompt_tokens - 16)
            out.append(Task(tid, question, None, {"seed": seed, "index": i}))
        return out

    def trace_of(self, task_id: str, sample: int) -> ProgramTrace:
        # The id says which program it is ("trace/<seed>/<i>"), so an instance that did not
        # make the task (a rollout worker on another machine) plays the same trace.
        trace = self._traces.get((task_id, sample))
        if trace is None:
            seed, i = self._tasks.get(task_id) or _parse_id(task_id)
            trace = program_trace(self.spec, f"{seed}/{i}/{sample}")
            if len(self._traces) >= 65_536:  # bounded: the oldest half goes
                for key in list(self._traces)[:32_768]:
                    del self._traces[key]
            self._traces[(task_id, sample)] = trace
        return trace

    def tools(self) -> list[Any]:
        tool = TraceTool(self)
        if not self.use_sandbox:
            # A plain Tool: no session is prepared or used.
            from .tools import Tool

            class _NoSandbox(Tool):
                name, description = tool.name, tool.description

                async def __call__(self, ctx: ToolContext, **arguments: Any) -> ToolOutput:
                    return await TraceTool.__call__(tool, ToolContext(None, ctx.timeout, ctx.trajectory, ctx.turn))

            return [_NoSandbox()]
        return [tool]

    def plan_turn(self, task: Task, trajectory: Any, turn: int) -> TurnPlan:
        trace = self.trace_of(task.id, trajectory.sample_index)
        return TurnPlan(max_tokens=trace.turn_tokens[turn], stop=False, last=turn >= trace.turns - 1)

    async def reward(self, task: Task, trajectory: Any) -> float:
        return 0.0


def _trace_signature() -> inspect.Signature:
    """TraceEnv's arguments as the registry (``agentenv envs``, ``--env-arg``) sees them: the
    WorkloadSpec fields with their types and defaults, plus ``sandbox``."""
    hints = typing.get_type_hints(WorkloadSpec)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("sandbox", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool)]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
               for f in dataclasses.fields(WorkloadSpec)]
    return inspect.Signature(params)


TraceEnv.__init__.__signature__ = _trace_signature()  # type: ignore[attr-defined]
