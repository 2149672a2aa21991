"""The trainer's settings (:class:`TrainConfig`), in a module of their own that imports no
torch: the CLI builds ``agentenv train``'s parser from its defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ..errors import ConfigError


@dataclass
class TrainConfig:
    env: str = "retool-math"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # a local HF model dir; default: the bundled tiny model
    engine: str = "embedded"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    base_urls: list[str] | None = None
    sandbox: str = "local"
    mode: Literal["async", "sync"] = "async"
    steps: int = 40
    groups_per_step: int = 8
    group_size: int = 4
    max_staleness: int = 1
    partial: Literal["continue", "drain"] = "continue"
    lr: float = 2e-5
    max_grad_norm: float = 1.0
    micro_batch: int = 16
    #: At most this many padded tokens per forward/backward pass (rows are grouped by length,
    #: so a long sample does not widen a pass of short ones); None: only ``micro_batch`` bounds it.
    micro_batch_tokens: int | None = 8192
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0
    aggregation: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0  # KL-to-reference penalty (0: off, no reference model)
    concurrency: int = 32
    scheduling: str = "program"  # program | fifo | lockstep (agentenv.scheduler)
    max_turns: int | None = None
    max_new_tokens: int = 384
    temperature: float = 1.0
    tool_timeout: float | None = None
    seed: int = 0
    out_dir: str = "runs/train"
    checkpoint_every: int = 10
    resume: bool = False
    report_to: list[str] | None = None  # tensorboard / wandb; None: tensorboard when installed
    eval_every: int = 0  # held-out evaluation every this many steps (and before the first, and after the last)
    eval_tasks: int = 32  # held-out tasks: env.tasks(eval_tasks, seed=EVAL_SEED - seed), never trained on
    eval_k: int = 4  # samples per held-out task (pass@1 .. pass@k)
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"split": "test"} for a dataset env
    cluster: Literal["none", "ray"] = "none"  # ray: the policy as trainer_ranks data-parallel Ray actors
    trainer_ranks: int = 2  # with cluster="ray" (agentenv.train.distributed)
    engines: int = 0  # with cluster="ray": generation on this many engine actors (engines.actors); 0: here
    fsdp: bool = False  # with cluster="ray": the ranks shard parameters, gradients and optimiser state (FSDP2)
    rank_restarts: int = 2  # with cluster="ray": a rank that dies -> new ranks from the last checkpoint, this often

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"mode must be async or sync, got {self.mode!r}")
        if self.partial not in ("continue", "drain"):
            raise ConfigError(f"partial must be continue or drain, got {self.partial!r}")
        for name in ("steps", "groups_per_step", "group_size", "micro_batch", "concurrency", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.lora_rank < 0:
            raise ConfigError("max_staleness and lora_rank must be >= 0")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be >= 1 or None, got {self.micro_batch_tokens}")
        if self.group_size < 2:
            raise ConfigError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.eval_every < 0 or self.eval_tasks < 1 or self.eval_k < 1:
            raise ConfigError("eval_every must be >= 0, eval_tasks and eval_k >= 1")
        if self.cluster not in ("none", "ray"):
            raise ConfigError(f"cluster must be none or ray, got {self.cluster!r}")
        if self.cluster == "ray" and not 1 <= self.trainer_ranks <= self.groups_per_step * self.group_size:
            raise ConfigError(f"trainer_ranks must be between 1 and the batch's {self.groups_per_step * self.group_size} "
                              f"trajectories (groups_per_step x group_size), got {self.trainer_ranks}")
        if self.rank_restarts < 0:
            raise ConfigError(f"rank_restarts must be >= 0, got {self.rank_restarts}")
        if self.fsdp and self.cluster != "ray":
            raise ConfigError("fsdp (sharding over trainer ranks) needs cluster='ray'")
        if self.engines < 0 or (self.engines and self.cluster != "ray"):
            raise ConfigError(f"engines (engine actors) must be >= 0 and need cluster='ray', got {self.engines}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")

    @classmethod
    def for_env(cls, env: str = "retool-math", **settings: Any) -> "TrainConfig":
        """A config for ``env`` with its ``train_defaults`` where ``settings`` give no value
        (its ``env_kwargs`` merged under the ones given), as ``agentenv train`` does."""
        from ..registry import describe

        defaults = describe(env)["train_defaults"]
        unknown = set(defaults) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"environment {env!r}: train_defaults has unknown settings {sorted(unknown)}")
        merged = {**defaults, **settings, "env": env}
        merged["env_kwargs"] = {**defaults.get("env_kwargs", {}), **settings.get("env_kwargs", {})}
        return cls(**merged)

    @property
    def staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    # Settings a resumed run must share with the checkpoint (the rest may change).
    RESUME_KEYS = ("env", "env_kwargs", "model", "groups_per_step", "group_size", "lora_rank", "seed")
