"""One agent program: the user's agent run once, its model calls served by the gateway, its
trajectory assembled from the token sequences the gateway recorded.

    session (key) ─► env.agent(task, client, model) under agent_timeout
                 ─► its requests: ProgramSession.complete (scheduler, engine, journal)
    trajectory = branch 0 as prompt_ids + segments, the others as ``branches`` (role each);
    text = the agent's answer; finish_reason stop | error:agent | error:agent_timeout |
    error:agent_exit | error:engine

A resumed program (its journal records: ``call``) runs its agent again from the start; the
session answers from the journal while the requests match, then live. A request that does not
match cancels the attempt and the agent starts once more, fresh, with nothing replayed
(counted: ``metadata["gateway"]["restarts"]``).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import anyio

from ..agent import _PROGRAM, AgentEnvironment, AgentFailed
from ..env import Task
from ..program import ProgramContext
from ..trajectory import Trajectory, TokenSequence
from .server import Gateway
from .session import ProgramSession

log = logging.getLogger(__name__)
TRACEBACK_CAP = 8000  # characters of an agent's traceback kept on its row
_logged: set[tuple[str, str]] = set()  # (environment, exception type or "None") already logged


async def run_agent_program(ctx: ProgramContext, gateway: Gateway, task: Task, group_id: str, sample_index: int,
                            hooks: Any, program_id: str, resume: Trajectory | None = None) -> Trajectory:
    env = ctx.env
    assert isinstance(env, AgentEnvironment)
    traj = Trajectory(id=resume.id if resume is not None else program_id, env=env.id, task_id=task.id,
                      group_id=group_id, sample_index=sample_index, prompt_ids=[])
    replay = list(resume.metadata.get("gateway_log", [])) if resume is not None else []
    if ctx.journal is not None:
        (ctx.journal.resumed if resume is not None else ctx.journal.start)(traj)
    start, restarts = time.perf_counter(), 0
    eos = ctx.tokenizer.eos_token_id
    stops = () if eos is None else (eos,)  # a reply ends where the model ends its turn (parallel calls included)
    while True:
        session = ProgramSession(program=traj.id, engine=ctx.engine, hooks=hooks, config=ctx.config, fmt=ctx.fmt,
                                 stop_ids=stops, journal=ctx.journal, replay=replay)
        gateway.open(session)
        try:
            token = _PROGRAM.set(hooks)
            try:
                reason, error, answer, trace = await _attempt(env, task, session, gateway)
            finally:
                _PROGRAM.reset(token)
        finally:
            gateway.close(session)
        if session.mismatch and restarts == 0:
            restarts, replay = 1, []
            if ctx.journal is not None:
                ctx.journal.start(traj)  # a new start record: the old attempt's calls are not replayed again
            continue
        break
    if session.engine_error is not None:
        reason, error = "error:engine", session.engine_error
    elif session.mismatch:
        reason, error = "error:replay_mismatch", "the agent's requests differed from the journal's twice"
    _assemble(traj, session, restarts, len(replay))
    traj.finish_reason, traj.error, traj.text = reason, error, answer
    if trace is not None:
        traj.metadata["gateway"]["traceback"] = trace
    traj.duration_s = time.perf_counter() - start
    return traj


def _traceback(env: AgentEnvironment, exc: Exception) -> str:
    """The agent's traceback, capped, for the row; the first of each exception type an
    environment raises is also logged, so a run whose agent fails shows why where it runs."""
    text = "".join(traceback.format_exception(exc))
    if len(text) > TRACEBACK_CAP:
        text = text[:TRACEBACK_CAP // 4] + "\n...\n" + text[-(3 * TRACEBACK_CAP) // 4:]
    key = (env.id or type(env).__name__, type(exc).__name__)
    if key not in _logged:
        _logged.add(key)
        log.warning("%s: the agent raised %s (its programs end error:agent; the row's metadata.gateway.traceback "
                    "keeps each one's traceback). The first:\n%s", key[0], key[1], text.rstrip())
    return text


def _returned_none(env: AgentEnvironment) -> None:
    """Logged once per environment: an agent that returns nothing leaves its row no ``text``,
    which a reward reading ``text`` scores as wrong (often a loop left by ``break``)."""
    key = (env.id or type(env).__name__, "None")
    if key not in _logged:
        _logged.add(key)
        log.warning("%s: the agent returned None, so its trajectory has no text for the reward; return the final "
                    "answer (e.g. the last message's content) from agent()", key[0])


async def _attempt(env: AgentEnvironment, task: Task, session: ProgramSession,
                   gateway: Gateway) -> tuple[str, str | None, str | None, str | None]:
    """Run the agent once: (finish reason, error, answer, the agent's traceback if it raised)."""
    client = gateway.client(session.key, env.agent_timeout)  # shares the gateway's connection pool: not closed here
    try:
        with anyio.CancelScope() as attempt:
            session.on_mismatch = attempt.cancel
            with anyio.move_on_after(env.agent_timeout) as deadline:
                try:
                    answer = await env.agent(task, client, gateway.model_name)
                except anyio.get_cancelled_exc_class():
                    raise
                except AgentFailed as exc:
                    return exc.reason, str(exc), None, None
                except Exception as exc:  # noqa: BLE001 - the agent's failure is the trajectory's, as data
                    return "error:agent", f"{type(exc).__name__}: {exc}", None, _traceback(env, exc)
            if deadline.cancelled_caught:
                return "error:agent_timeout", f"the agent ran past agent_timeout={env.agent_timeout}s", None, None
        if attempt.cancelled_caught:
            return "error:replay_mismatch", "a request differed from the journal's", None, None
        if answer is None:
            _returned_none(env)
        return "stop", None, None if answer is None else str(answer), None
    finally:
        session.on_mismatch = lambda: None


def _assemble(traj: Trajectory, session: ProgramSession, restarts: int, logged: int) -> None:
    """The trajectory from the session's branches, tool calls, turns and counters."""
    branches = session.branches.all
    if branches:
        main = branches[0]
        traj.prompt_ids, traj.segments = list(main.prompt_ids), list(main.segments)
        traj.branches = [TokenSequence(b.role, list(b.prompt_ids), list(b.segments)) for b in branches[1:]]
    traj.tool_calls, traj.turns = list(session.tool_calls), list(session.turns)
    traj.metadata["gateway"] = {
        "calls": session.calls, "extended": session.branches.extended, "branched": session.branches.branched,
        "roles": [b.role for b in branches], "replayed": session.replayed, "logged": logged,
        "restarts": restarts, "malformed_tool_calls": sum(c.status == "malformed" for c in session.tool_calls)}
