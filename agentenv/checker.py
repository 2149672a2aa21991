"""``check_env``: validate a user's Environment with messages that say what to fix.

Checks the class contract without running a model: the required methods are overridden,
``tasks`` is seeded (same seed, same tasks) with unique string ids, prompts are non-empty
chat messages, tools have unique names, the tool format exists, and hooks that must be
async are. With ``tokenizer=`` it also renders a prompt with the chat template and checks
that the format's end-of-call tag is a single token (else the engine cannot stop on it).
"""

from __future__ import annotations

import inspect
from typing import Any

from .env import Environment, Task
from .errors import ConfigError, EnvCheckError
from .formats import get_format


def _fail(env: Any, msg: str) -> None:
    raise EnvCheckError(f"{type(env).__name__}: {msg}")


def check_env(env: Environment | type[Environment], tokenizer: Any = None, n: int = 4) -> None:
    """Check an environment instance, or a class (created with no arguments)."""
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
    cls = type(env)
    if not isinstance(env.id, str):
        _fail(env, f"id must be a string (the registry id; '' lets make() use its spec), got {env.id!r}")
    if isinstance(env.max_turns, bool) or not isinstance(env.max_turns, int) or env.max_turns < 1:
        _fail(env, f"max_turns must be an int >= 1, got {env.max_turns!r}")
    if isinstance(env.tool_timeout, bool) or not isinstance(env.tool_timeout, (int, float)) or env.tool_timeout <= 0:
        _fail(env, f"tool_timeout must be a number of seconds > 0, got {env.tool_timeout!r}")
    for name in ("tasks", "reward"):
        if getattr(cls, name) is getattr(Environment, name):
            _fail(env, f"must override {name}()")
    for name in ("reward", "group_reward", "on_turn"):
        if not inspect.iscoroutinefunction(getattr(cls, name)):
            _fail(env, f"{name}() must be 'async def'")
    try:
        fmt = get_format(env.tool_format)
    except ConfigError as exc:
        _fail(env, str(exc))
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
    for t in a:
        msgs = env.prompt(t)
        if not isinstance(msgs, list) or not msgs:
            _fail(env, "prompt(task) must return a non-empty list of chat messages")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                _fail(env, f"each message needs string 'role' and 'content', got {m!r}")
    tools = env.tools()
    names = [t.name for t in tools]
    if len(set(names)) != len(names) or not all(names):
        _fail(env, f"tool names must be unique and non-empty, got {names}")
    if tokenizer is not None:
        try:
            tokenizer.apply_chat_template(env.prompt(a[0]), tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001
            _fail(env, f"the tokenizer's chat template cannot render prompt(): {exc}")
        for s in fmt.stop_strings:
            if len(tokenizer.encode(s, add_special_tokens=False)) != 1:
                _fail(env, f"{s!r} is not a single token for this tokenizer; the engine cannot stop on it "
                           "(add it as a token, or pick a format whose end tag is one)")
