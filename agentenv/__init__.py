"""agentenv: token-exact, async rollouts for RL on tool-calling reasoning models."""

from .agent import AgentEnvironment
from .bridge import BridgeReport, check_tokenizer
from .checker import EnvReport, check_env
from .config import RolloutConfig
from . import journal
from .env import Environment, Task, TurnAction
from .errors import (
    AgentEnvError,
    ConfigError,
    EngineError,
    EnvCheckError,
    EnvNotFoundError,
    MissingExtraError,
    ModelNotFoundError,
    PromptTooLongError,
    SandboxError,
    TrajectoryError,
)
from .reactor import Group, Reactor
from .registry import make, register, registered
from .tools import FunctionTool, PythonTool, Tool
from .trajectory import SCHEMA_VERSION, Segment, ToolCall, Trajectory, TurnStats

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "RolloutProducer":  # lazily: it pulls in the training stack (torch, peft)
        from .train.producer import RolloutProducer

        return RolloutProducer
    raise AttributeError(f"module 'agentenv' has no attribute {name!r}")

__all__ = [
    "AgentEnvError",
    "AgentEnvironment",
    "BridgeReport",
    "check_tokenizer",
    "ConfigError",
    "EngineError",
    "EnvCheckError",
    "EnvNotFoundError",
    "EnvReport",
    "Environment",
    "FunctionTool",
    "Group",
    "MissingExtraError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "PythonTool",
    "Reactor",
    "RolloutConfig",
    "RolloutProducer",
    "SCHEMA_VERSION",
    "SandboxError",
    "Segment",
    "Task",
    "Tool",
    "ToolCall",
    "Trajectory",
    "TrajectoryError",
    "TurnAction",
    "TurnStats",
    "check_env",
    "make",
    "register",
    "journal",
    "registered",
]
