"""``check_env``: validate a user's Environment with messages that say what to fix.

Checks the class contract without running a model: the required methods are overridden,
``tasks`` is seeded (same seed, same tasks) with unique string ids, prompts are non-empty
chat messages, tools have unique names, the tool format exists, and hooks that must be
async are. With ``tokenizer=`` it also renders a prompt with the chat template and checks
that the format's end-of-call tag is a single token (else the engine cannot stop on it).

A failed check raises :class:`~agentenv.errors.EnvCheckError`; a passed one returns an
:class:`EnvReport` that says what was checked, and what was not:

    >>> check_env(RetoolMathEnv)
    RetoolMathEnv passes check_env (8 checks, 1 warning)
      [ok] an Environment: RetoolMathEnv, id 'retool-math'
      [ok] limits: max_turns 4, tool_timeout 5.0 s
      ...
      [ok] tools: python
      warning: no tokenizer given: the chat template and the format's stop tags were not checked ...
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .agent import AgentEnvironment
from .env import Environment, Task, bind_tool_format
from .errors import ConfigError, EnvCheckError
from .formats import ToolFormat, get_format
from .models.native import native_format


@dataclass
class EnvReport:
    """What :func:`check_env` checked on an environment that passed: each check with what it
    found, and warnings (what was not checked, or what works but may not be meant)."""

    env: str  #: the class's name
    checks: dict[str, str] = field(default_factory=dict)  #: check -> what it found
    warnings: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        w = len(self.warnings)
        head = f"{self.env} passes check_env ({len(self.checks)} checks" + (
            f", {w} warning{'s' if w != 1 else ''})" if w else ")")
        return "\n".join([head, *(f"  [ok] {name}: {found}" for name, found in self.checks.items()),
                          *(f"  warning: {text}" for text in self.warnings)])

    __repr__ = __str__  # what the REPL shows after check_env(MyEnv)


def _fail(env: Any, msg: str) -> NoReturn:
    raise EnvCheckError(f"{type(env).__name__}: {msg}")


def check_env(env: Environment | type[Environment], tokenizer: Any = None, n: int = 4) -> EnvReport:
    """Check an environment instance, or a class (created with no arguments); raises
    :class:`~agentenv.errors.EnvCheckError` naming what to fix, else returns the report of
    what was checked. ``tokenizer``: also check the chat template and the stop tags;
    ``n``: how many tasks to draw."""
    if isinstance(env, type):
        if not issubclass(env, Environment):
            raise EnvCheckError(f"{env.__name__}: must subclass agentenv.Environment")
        try:
            env = env()
        except TypeError as exc:
            raise EnvCheckError(f"{env.__name__}: cannot be created with no arguments ({exc}); "
                                "pass an instance: check_env(MyEnv(...))") from exc
    if not isinstance(env, Environment):
        _fail(env, "must be an instance of agentenv.Environment (subclass it)")
    report = EnvReport(type(env).__name__)
    fmt = _check_class(env, report, tokenizer)
    tasks = _check_tasks(env, n, report)
    if tokenizer is not None:
        _check_tokenizer(env, tasks[0], fmt, tokenizer, report)
    else:
        report.warnings.append("no tokenizer given: the chat template and the format's stop tags were not "
                               "checked (check_env(env, tokenizer=...) does)")
    if not (type(env).__doc__ or "").strip():
        report.warnings.append("the class has no docstring: `agentenv envs` describes an environment by its "
                               "docstring's first paragraph")
    return report


def _check_class(env: Environment, report: EnvReport, tokenizer: Any = None) -> ToolFormat:
    """The attributes and methods the class must have; returns its tool format: the pinned one,
    or for an unpinned environment the tokenizer's model's own (``env`` takes it)."""
    cls = type(env)
    if not isinstance(env.id, str):
        _fail(env, f"id must be a string (the registry id; '' lets make() use its spec), got {env.id!r}")
    report.checks["an Environment"] = f"{cls.__name__}, id {env.id!r}" + ("" if env.id else " (make() names it)")
    if isinstance(env.max_turns, bool) or not isinstance(env.max_turns, int) or env.max_turns < 1:
        _fail(env, f"max_turns must be an int >= 1, got {env.max_turns!r}")
    if isinstance(env.tool_timeout, bool) or not isinstance(env.tool_timeout, (int, float)) or env.tool_timeout <= 0:
        _fail(env, f"tool_timeout must be a number of seconds > 0, got {env.tool_timeout!r}")
    report.checks["limits"] = f"max_turns {env.max_turns}, tool_timeout {env.tool_timeout} s"
    for name in ("tasks", "reward"):
        if getattr(cls, name) is getattr(Environment, name):
            _fail(env, f"must override {name}()")
    report.checks["overrides"] = "tasks() and reward()" + "".join(
        f", {h}()" for h in ("prompt", "tools", "group_reward", "on_turn") if getattr(cls, h) is not getattr(
            Environment, h))
    hooks = ("reward", "group_reward", "on_turn") + (("agent",) if isinstance(env, AgentEnvironment) else ())
    for name in hooks:
        if not inspect.iscoroutinefunction(getattr(cls, name)):
            _fail(env, f"{name}() must be 'async def'" + (
                " and await the client's calls (client is an openai.AsyncOpenAI)" if name == "agent" else ""))
    if isinstance(env, AgentEnvironment) and cls.agent is AgentEnvironment.agent and not env.agent_command:
        _fail(env, "must override agent() (async def agent(self, task, client, model)) or set agent_command")
    report.checks["async hooks"] = ", ".join(f"{h}()" for h in hooks[:-1]) + f" and {hooks[-1]}() are 'async def'"
    pinned = env.tool_format is not None
    try:
        mismatch = bind_tool_format(env, tokenizer) if tokenizer is not None else None
        fmt = get_format(env.tool_format)
    except ConfigError as exc:
        _fail(env, str(exc))
    name = getattr(fmt, "name", "") or type(fmt).__name__
    report.checks["tool format"] = f"{name} (pinned by the environment)" if pinned else (
        f"{name} (the model's own: {native_format(tokenizer).source})" if tokenizer is not None else
        f"{name} (not pinned: a run uses the model's own; without a tokenizer, {name} is checked)")
    if mismatch:
        report.warnings.append(mismatch)
    return fmt


def _check_tasks(env: Environment, n: int, report: EnvReport) -> list[Task]:
    """``tasks``, ``prompt`` and ``tools``; returns the tasks drawn."""
    try:
        a, b = env.tasks(n, seed=0), env.tasks(n, seed=0)
    except Exception as exc:  # noqa: BLE001
        _fail(env, f"tasks(n, seed) raised {type(exc).__name__}: {exc}")
    if not isinstance(a, list) or len(a) != n or not all(isinstance(t, Task) for t in a):
        _fail(env, f"tasks({n}, seed=0) must return a list of {n} Task objects")
    if [t.id for t in a] != [t.id for t in b] or [t.question for t in a] != [t.question for t in b]:
        _fail(env, "tasks() is not deterministic for a fixed seed (derive all randomness from the seed)")
    ids = [t.id for t in a]
    if len(set(ids)) != len(ids) or not all(isinstance(i, str) and i for i in ids):
        _fail(env, "task ids must be unique non-empty strings")
    report.checks["tasks"] = f"tasks({n}, seed=0) twice: the same {n} tasks, unique ids ({ids[0]!r}, ...)"
    sizes = set()
    for t in a:
        msgs = env.prompt(t)
        if not isinstance(msgs, list) or not msgs:
            _fail(env, "prompt(task) must return a non-empty list of chat messages")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                _fail(env, f"each message needs string 'role' and 'content', got {m!r}")
        sizes.add(len(msgs))
    report.checks["prompts"] = f"{n} chat prompts of {'-'.join(str(s) for s in sorted({min(sizes), max(sizes)}))} " \
                               "messages with string role and content"
    names = [t.name for t in env.tools()]
    if len(set(names)) != len(names) or not all(names):
        _fail(env, f"tool names must be unique and non-empty, got {names}")
    report.checks["tools"] = ", ".join(names) if names else "none"
    if not names:
        report.warnings.append("no tools: the model has nothing to call (a chat-only environment)")
    return a


def _check_tokenizer(env: Environment, task: Task, fmt: ToolFormat, tokenizer: Any, report: EnvReport) -> None:
    """The chat template renders a prompt; each of the format's stop strings is one token."""
    try:
        tokenizer.apply_chat_template(env.prompt(task), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001
        _fail(env, f"the tokenizer's chat template cannot render prompt(): {exc}")
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    report.checks["chat template"] = f"{name} renders prompt()"
    for s in fmt.stop_strings:
        if len(tokenizer.encode(s, add_special_tokens=False)) != 1:
            _fail(env, f"{s!r} is not a single token for this tokenizer; the engine cannot stop on it "
                       "(add it as a token, or pick a format whose end tag is one)")
    stops = fmt.stop_strings
    report.checks["stop tags"] = (", ".join(repr(s) for s in stops) + (" is a single token" if len(stops) == 1 else
                                                                       " are single tokens")) if stops else "none"
