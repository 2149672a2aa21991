"""One program: the coroutine that drives a single rollout, turn by turn.

    prompt ids ──► engine.generate ──► sampled ids appended verbatim (mask 1, logprob, version)
         ▲                                   │ decoded only to *parse* the tool call
         │                                   ▼
    env text ids (mask 0) ◄── format.observation ◄── tool runs in the program's sandbox

Every turn is a new engine request whose prompt is the whole sequence so far, so the engine's
prefix cache serves everything but the newly spliced tool output. Failures are data: an
engine, sandbox or environment error ends this program with ``finish_reason="error:<where>"``
and the message in ``error``; the run goes on. Cancellation propagates (after the engine
request is aborted).

The program does not decide when it runs: before each turn it asks its :class:`ProgramHooks`
(the reactor's scheduler: :mod:`agentenv.scheduler`) and waits for the go, reports the turn's
end, and gets its sandbox session from them only when a tool needs it (prepared ahead).

Finish reasons:
  stop              the model ended a turn with a stop token and asked for no tool
  length            the program's sampled-token budget (max_new_tokens) ran out
  max_turns         the last allowed turn still asked for a tool (it is not run)
  context_overflow  the sequence reached the engine's context window
  error:engine | error:sandbox | error:env | error:<ExceptionType>
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from .config import RolloutConfig
from .engines.base import Engine, SamplingParams
from .env import Environment, Task
from .errors import EngineError, PromptTooLongError, SandboxError, TrajectoryError
from .formats import MalformedCall, ToolFormat
from .literals import literals
from .tools import PythonTool, Tool, ToolContext, replay, replayable
from .trajectory import ToolCall, Trajectory, TurnStats


@dataclass(slots=True)
class ProgramContext:
    """What every program of a run shares."""

    engine: Engine
    env: Environment
    sandbox: Any  # agentenv.sandboxes.base.Sandbox
    config: RolloutConfig
    fmt: ToolFormat
    tools: dict[str, Tool]
    prompt_cache: dict[str, list[int]]
    stop_token_ids: tuple[int, ...]
    journal: Any = None  # agentenv.journal.ProgramLog: every completed turn is logged

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def prompt_ids(self, task: Task) -> list[int]:
        ids = self.prompt_cache.get(task.id)
        if ids is None:
            offered = [t.schema() for t in self.tools.values()] if getattr(self.env, "tools_in_prompt", False) else None
            ids = render_prompt(self.tokenizer, self.env.prompt(task), offered)
            self.prompt_cache[task.id] = ids
        return list(ids)


class ProgramHooks(Protocol):
    """How a program meets its scheduler (see ``agentenv.reactor``)."""

    async def before_turn(self, tokens: int, max_tokens: int) -> int:
        """Wait until this turn may be submitted; return the engine request priority."""

    def after_turn(self, tokens: int, prefilled: int = 0) -> None:
        """The engine returned the turn; the program is ``tokens`` long and acting.
        ``prefilled``: the turn's prompt tokens the engine computed (not in its prefix cache)."""

    async def session(self) -> Any:
        """The program's sandbox session (prepared ahead; waited for only here)."""


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A program's prompt ids: the chat template's text (with the generation prompt, and
    ``tools``' JSON schemas where given, as the template lists tools), encoded once, without
    adding special tokens (the template writes its own); a special token's text inside a
    message or a tool's schema (an MCP server's description) is text (``agentenv.literals``)."""
    lit = literals(tokenizer)
    extra = {"tools": lit.protect_value(tools)} if tools else {}
    text = tokenizer.apply_chat_template([lit.protect_message(m) for m in messages], tokenize=False,
                                         add_generation_prompt=True, **extra)
    return lit.encode(text)


def observation_ids(fmt: ToolFormat, tokenizer: Any, outputs: list[str], ended_with_eos: bool) -> list[int]:
    """The environment tokens spliced after a model turn: the format's text for the tool
    outputs, encoded on its own (the model's sampled ids before it are never re-encoded). What
    a tool printed is text: a special token's text in it is never a control token
    (``agentenv.literals``), so code cannot end the turn or forge one."""
    lit = literals(tokenizer)
    return lit.encode(fmt.observation([lit.protect(o) for o in outputs], tokenizer, ended_with_eos))


def stop_token_ids(tokenizer: Any, fmt: ToolFormat) -> tuple[int, ...]:
    """EOS plus the single-token ids of the format's end-of-call strings."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for s in fmt.stop_strings:
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) == 1:
            ids.append(enc[0])
    return tuple(dict.fromkeys(ids))


async def run_program(ctx: ProgramContext, task: Task, group_id: str, sample_index: int, hooks: ProgramHooks,
                      program_id: str | None = None, resume: Trajectory | None = None) -> Trajectory:
    """Run one program. ``resume`` (its trajectory as of its last logged turn, from
    ``agentenv.journal.load_state`` or ``restore``) continues a program from there: the same
    id, ids, logprobs and versions so far, its notebook rebuilt by replaying its tool calls."""
    tok = ctx.tokenizer
    traj = Trajectory(
        id=resume.id if resume is not None else program_id or uuid.uuid4().hex[:16],
        env=ctx.env.id,
        task_id=task.id,
        group_id=group_id,
        sample_index=sample_index,
        prompt_ids=list(resume.prompt_ids) if resume is not None else ctx.prompt_ids(task),
    )
    if resume is not None:
        traj.segments, traj.tool_calls, traj.turns = list(resume.segments), list(resume.tool_calls), list(resume.turns)
        if ctx.journal is not None:
            ctx.journal.resumed(traj)
    elif ctx.journal is not None:
        ctx.journal.start(traj)
    start = time.perf_counter()
    try:
        if resume is not None and traj.turns:
            await _replay(ctx, traj, hooks)
        traj.finish_reason = await _turns(ctx, task, traj, hooks)
    except PromptTooLongError as exc:
        traj.finish_reason, traj.error = "context_overflow", str(exc)
    except EngineError as exc:
        traj.finish_reason, traj.error = "error:engine", f"{type(exc).__name__}: {exc}"
    except SandboxError as exc:
        traj.finish_reason, traj.error = "error:sandbox", f"{type(exc).__name__}: {exc}"
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # noqa: BLE001 - a bad rollout is data, not a crash
        traj.finish_reason, traj.error = f"error:{type(exc).__name__}", f"{type(exc).__name__}: {exc}"
    finally:
        traj.duration_s = time.perf_counter() - start
        with anyio.CancelScope(shield=True):
            await _end_program(ctx, traj)
    traj.text = tok.decode(traj.completion_ids, skip_special_tokens=False)
    return traj


async def _end_program(ctx: ProgramContext, traj: Trajectory) -> None:
    """Tell each tool the program ended (within a deadline: a stuck release is not the run's)."""
    with anyio.move_on_after(10):
        for tool in {id(t): t for t in ctx.tools.values()}.values():
            try:
                await tool.end_program(traj)
            except Exception:  # noqa: BLE001 - the program's result stands; the tool cleans up late
                pass


async def _replay(ctx: ProgramContext, traj: Trajectory, hooks: ProgramHooks) -> None:
    """Rebuild a resumed program's notebook: run its logged sandbox calls again, in order, in
    a fresh session. Outputs that differ from the log are counted on the trajectory."""
    done: dict[str, Any] = {"replayed_calls": 0, "replay_mismatches": 0}
    for name, tool in ctx.tools.items():
        calls = replayable(traj.tool_calls, name) if isinstance(tool, PythonTool) else []
        if calls:
            r = await replay(await hooks.session(), calls, ctx.config.tool_timeout)
            done = {k: done[k] + r[k] for k in done}
    traj.metadata["resumed"] = {"from_turn": len(traj.turns), **done}


async def _turns(ctx: ProgramContext, task: Task, traj: Trajectory, hooks: ProgramHooks) -> str:
    cfg, tok, engine = ctx.config, ctx.tokenizer, ctx.engine
    first = len(traj.turns)
    mark = [len(traj.segments), len(traj.tool_calls), len(traj.turns)]
    for turn in range(first, cfg.max_turns):
        if turn > first and ctx.journal is not None:  # the previous turn is complete: log it
            ctx.journal.turn(traj, mark)
        plan = ctx.env.plan_turn(task, traj, turn)
        budget = cfg.max_new_tokens - traj.num_sampled_tokens
        room = engine.max_model_len - traj.num_tokens
        if room <= 0:
            return "context_overflow"
        if budget <= 0:
            return "length"
        cap = cfg.max_tokens_per_turn if plan is None or plan.max_tokens is None else plan.max_tokens
        params = SamplingParams(
            max_tokens=min(cap, budget, room),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_token_ids=ctx.stop_token_ids if plan is None or plan.stop else (),
        )
        priority = await hooks.before_turn(traj.num_tokens, params.max_tokens)
        gen = await engine.generate_turn(traj.id, traj.input_ids, params, f"{traj.id}-{turn}", priority=priority)
        hooks.after_turn(traj.num_tokens + len(gen.token_ids), gen.prompt_tokens - gen.cached_tokens)
        traj.add_model(gen.token_ids, gen.logprobs, gen.versions)
        traj.turns.append(
            TurnStats(gen.prompt_tokens, gen.cached_tokens, len(gen.token_ids), gen.finish_reason,
                      gen.latency_s, gen.weight_version)
        )
        # Decoded only to find the tool call; the ids above are what the trajectory keeps.
        text = tok.decode(gen.token_ids, skip_special_tokens=False)
        calls = ctx.fmt.parse(text, list(ctx.tools))
        if plan is not None and plan.last:
            return "stop"
        if gen.finish_reason == "length":
            if traj.num_tokens >= engine.max_model_len:
                return "context_overflow"
            if traj.num_sampled_tokens >= cfg.max_new_tokens:
                return "length"
        if not calls:
            if gen.finish_reason == "stop":
                return "stop"
            continue  # hit the per-turn cap mid-thought: let the model go on next turn
        if turn == cfg.max_turns - 1:
            return "max_turns"
        outputs = [await _run_call(ctx, call, turn, traj, hooks) for call in calls]
        ended_with_eos = gen.stop_token_id is not None and gen.stop_token_id == tok.eos_token_id
        obs_ids = observation_ids(ctx.fmt, tok, outputs, ended_with_eos)
        if traj.num_tokens + len(obs_ids) >= engine.max_model_len:
            return "context_overflow"
        traj.add_env(obs_ids)
        action = await ctx.env.on_turn(task, traj, text)
        if action is not None:
            if action.inject:
                traj.add_env(tok.encode(action.inject, add_special_tokens=False))
            if action.stop:
                return "stop"
    return "max_turns"


async def _run_call(ctx: ProgramContext, call: Any, turn: int, traj: Trajectory, hooks: ProgramHooks) -> str:
    start = time.perf_counter()
    if isinstance(call, MalformedCall):
        text = ctx.fmt.error_text(call)
        traj.tool_calls.append(ToolCall(turn, call.name, {"raw": call.raw}, text, "malformed", 0.0, call.reason))
        return text
    tool = ctx.tools[call.name]
    problem = tool.check_arguments(call.arguments)
    if problem is not None:
        text = ctx.fmt.error_text(MalformedCall(problem))
        traj.tool_calls.append(ToolCall(turn, call.name, call.arguments, text, "malformed", 0.0, problem))
        return text
    session = await hooks.session() if isinstance(tool, PythonTool) else None
    out = await tool(ToolContext(session, ctx.config.tool_timeout, traj, turn), **call.arguments)
    if out.restored is not None:  # the session died in this call and was rebuilt by replay
        traj.metadata.setdefault("session_restores", []).append({"turn": turn, **out.restored})
    traj.tool_calls.append(
        ToolCall(turn, call.name, call.arguments, out.text, out.status, time.perf_counter() - start, out.error)  # type: ignore[arg-type]
    )
    return out.text


def apply_reward(traj: Trajectory, value: float | dict[str, float]) -> None:
    """Record what ``Environment.reward`` (or ``group_reward``) returned: a number, or named
    components (their sum is the reward unless one is named ``reward``)."""
    if isinstance(value, dict):
        comps = {k: float(v) for k, v in value.items()}
        traj.reward = comps.pop("reward") if "reward" in comps else float(sum(comps.values()))
        traj.reward_components = comps
    else:
        traj.reward = float(value)
    if traj.reward is not None and not math.isfinite(traj.reward):
        raise ValueError(f"reward is not a finite number: {traj.reward}")


def reward_failed(traj: Trajectory, exc: BaseException) -> None:
    """The reward raised: the trajectory is kept, with ``error:reward`` and no reward."""
    traj.metadata["program_finish_reason"] = traj.finish_reason
    traj.finish_reason = "error:reward"
    traj.reward = None
    traj.error = f"reward: {type(exc).__name__}: {exc}"


async def score_program(env: Environment, task: Task, traj: Trajectory, timeout: float) -> None:
    """Score a finished program with the environment's reward (a failure or a timeout is
    recorded on the trajectory, not raised), then check its arrays are consistent."""
    try:
        with anyio.fail_after(timeout):
            apply_reward(traj, await env.reward(task, traj))
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:  # noqa: BLE001 - recorded on the trajectory
        reward_failed(traj, exc)
    try:
        traj.validate()
    except TrajectoryError as exc:  # an engine returned inconsistent data: keep it, flagged
        traj.finish_reason, traj.error = "error:trajectory", str(exc)
