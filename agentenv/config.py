"""Rollout settings, validated once at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ConfigError


@dataclass(slots=True, frozen=True)
class RolloutConfig:
    #: Model turns per program (a turn = one generation request); None: the environment's
    #: ``max_turns`` (as the CLI does).
    max_turns: int | None = None
    #: Sampled tokens per program, all turns together (the CLI's default too).
    max_new_tokens: int = 384
    #: Sampled tokens per turn.
    max_tokens_per_turn: int = 256
    #: Engine requests in flight at once (decode slots). Under the ``fifo`` policy also the
    #: number of programs in flight, each holding its slot throughout.
    concurrency: int = 32
    #: How programs are scheduled: ``program`` (KV-aware, programs decoupled from decode
    #: slots, environments prepared ahead), ``fifo`` (a program holds a slot from its sandbox
    #: start to its end) or ``lockstep`` (the batch advances turn by turn). See
    #: ``agentenv.scheduler``.
    scheduling: str = "program"
    #: Programs admitted at once, paused ones included (bounds open sandbox sessions); None:
    #: 8 x concurrency, capped by the sandbox's ``max_workers`` when the env uses one. ``program``: the engine's KV capacity bounds it too; ``lockstep``: the
    #: batch that advances turn by turn (its requests all go to the engine together).
    max_programs: int | None = None
    #: ``program`` policy: queued programs whose sandbox session is prepared ahead.
    env_lookahead: int = 16
    #: Wall-clock limit of one tool call; None: the environment's ``tool_timeout``.
    tool_timeout: float | None = None
    #: Wall-clock limit of one reward computation.
    reward_timeout: float = 60.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_tokens_per_turn", "concurrency"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tool_timeout", "reward_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.scheduling not in ("program", "fifo", "lockstep"):
            raise ConfigError(f"scheduling must be program, fifo or lockstep, got {self.scheduling!r}")
        if self.max_programs is not None and self.max_programs < 1:
            raise ConfigError(f"max_programs must be >= 1, got {self.max_programs}")
        if self.env_lookahead < 0:
            raise ConfigError(f"env_lookahead must be >= 0, got {self.env_lookahead}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    def for_env(self, env: object) -> "RolloutConfig":
        """The limits left as None filled in from the environment's (``max_turns``,
        ``tool_timeout``): what a :class:`~agentenv.Reactor` runs with."""
        return replace(
            self,
            max_turns=self.max_turns if self.max_turns is not None else int(getattr(env, "max_turns", 4)),
            tool_timeout=self.tool_timeout if self.tool_timeout is not None else float(getattr(env, "tool_timeout", 5.0)),
        )
