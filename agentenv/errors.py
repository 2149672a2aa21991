"""The one exception tree of agentenv.

Errors raised to the caller are about how agentenv was asked to run (bad configuration, an
unknown environment, a missing model or dependency). Failures *inside* a rollout (engine,
sandbox, reward, a malformed tool call) are not raised: they are recorded on the trajectory
as data (``Trajectory.finish_reason == "error:<type>"`` or a tool call with an error status).

    AgentEnvError
    ├── ConfigError            bad arguments or settings
    │   ├── ModelNotFoundError a --model path that is not a model directory
    │   └── MissingExtraError  an optional dependency is not installed (names the extra)
    ├── EnvNotFoundError       unknown environment id (with "did you mean ...")
    ├── EnvCheckError          a user Environment class that fails check_env()
    ├── EngineError            the inference engine failed or was closed
    │   ├── PromptTooLongError a prompt longer than the engine's context
    │   └── RankDiedError      a trainer rank (a Ray actor) died with its process group
    ├── ProgramEndedError      a turn asked for by a program that has ended (a gateway request)
    ├── SandboxError           a sandbox could not be started or was closed
    └── TrajectoryError        a trajectory whose arrays disagree (schema violation)
"""

from __future__ import annotations

from typing import Sequence


class AgentEnvError(Exception):
    """Root of every exception agentenv raises."""


class ConfigError(AgentEnvError, ValueError):
    """Invalid configuration or arguments."""


class ModelNotFoundError(ConfigError):
    """The model path does not hold a loadable model."""


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency is not installed. The message names the extra of the package
    that installs everything the part needs (``pip install 'agentenv[openai]'``);
    :func:`agentenv.extras.require` raises it."""

    def __init__(self, message: str, *, extra: str = "", missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        #: The extra that installs what is missing.
        self.extra = extra
        #: The modules that could not be imported.
        self.missing = list(missing)


class EnvNotFoundError(AgentEnvError, KeyError):
    """No environment is registered under that id."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class EnvCheckError(AgentEnvError, TypeError):
    """An Environment subclass does not satisfy the Environment contract."""


class EngineError(AgentEnvError, RuntimeError):
    """The inference engine failed, was aborted, or is closed."""


class PromptTooLongError(EngineError):
    """The prompt does not fit in the engine's context window."""


class RankDiedError(EngineError):
    """A trainer rank (a Ray actor of ``RayPolicy``) died: its process group is gone. The
    trainer restarts its ranks from the last checkpoint (``TrainConfig.cluster.rank_restarts``)."""


class ProgramEndedError(AgentEnvError, RuntimeError):
    """A turn was asked for a program that has already ended (a gateway request that outlived
    its agent program, e.g. when a training run stops with agents in flight)."""


class SandboxError(AgentEnvError, RuntimeError):
    """A sandbox session could not be created or used."""


class TrajectoryError(AgentEnvError, ValueError):
    """A trajectory violates its schema (misaligned arrays, bad segment)."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception; for an exception group (a task group's failure), of
    each exception it holds, however nested, so the cause is named rather than the group."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"
