"""The exception tree (``agentenv.errors``): one root, each error also the built-in type a
caller would catch, the module's drawing of the tree complete, and ``describe`` naming the
causes inside a real task group's failure."""

from __future__ import annotations

import inspect
import re

import anyio
import pytest

from agentenv import errors
from agentenv.errors import (AgentEnvError, ConfigError, EngineError, EnvCheckError, EnvNotFoundError,
                             ModelNotFoundError, PromptTooLongError, SandboxError, TrajectoryError, describe)

ERRORS = [c for _, c in inspect.getmembers(errors, inspect.isclass)
          if issubclass(c, BaseException) and c.__module__ == errors.__name__]


def test_every_error_is_an_agentenv_error_and_the_builtin_a_caller_expects():
    assert len(ERRORS) >= 10 and all(issubclass(c, AgentEnvError) for c in ERRORS)
    for cls, builtin in ((ConfigError, ValueError), (ModelNotFoundError, ConfigError), (EnvNotFoundError, KeyError),
                         (EnvCheckError, TypeError), (EngineError, RuntimeError), (PromptTooLongError, EngineError),
                         (SandboxError, RuntimeError), (TrajectoryError, ValueError)):
        assert issubclass(cls, builtin), (cls, builtin)
    # KeyError would quote its message; this one reads as written.
    assert str(EnvNotFoundError("no env 'x'. Did you mean 'y'?")) == "no env 'x'. Did you mean 'y'?"
    assert str(EnvNotFoundError()) == ""


def test_the_module_docstring_draws_every_error():
    drawn = set(re.findall(r"^\s*(?:[│├└─ ]+)?(\w+Error)\b", errors.__doc__, re.M))
    assert drawn == {c.__name__ for c in ERRORS}, "the tree in agentenv/errors.py's docstring is not the classes"


@pytest.mark.anyio
async def test_describe_names_each_cause_in_a_task_groups_failure():
    assert describe(PromptTooLongError("2049 tokens")) == "PromptTooLongError: 2049 tokens"
    go, waiting = anyio.Event(), []

    async def fail(exc: Exception) -> None:
        with anyio.CancelScope(shield=True):  # every task reaches its raise, none is cancelled first
            waiting.append(exc)
            await go.wait()
        raise exc

    async def inner() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fail, KeyError("task-3"))

    with pytest.raises(BaseExceptionGroup) as info:
        async with anyio.create_task_group() as tg:
            for job in ((fail, SandboxError("worker died")), (fail, EngineError("engine core died")), (inner,)):
                tg.start_soon(*job)
            while len(waiting) < 3:
                await anyio.wait_all_tasks_blocked()
            go.set()
    text = describe(info.value)
    assert sorted(text.split("; ")) == [
        "EngineError: engine core died",
        "KeyError: 'task-3'",
        "SandboxError: worker died",
    ]
    assert "ExceptionGroup" not in text and "TaskGroup" not in text
    nested = BaseExceptionGroup("outer", [ValueError("a"), ExceptionGroup("inner", [KeyError("b"), OSError("c")])])
    assert describe(nested) == "ValueError: a; KeyError: 'b'; OSError: c"
