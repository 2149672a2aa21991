"""The trainer's settings (:class:`TrainConfig`), in a module of their own that imports no
torch: the CLI builds ``agentenv train``'s parser from its fields.

Each field is an option (``agentenv.options``): its flag, help, default and check are declared
here once; the options a rollout run has too (the environment, the engine, the scheduling
limits) are :func:`~agentenv.options.same_as` those of ``agentenv.config``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal

from ..config import EngineOptions, EnvOptions, JudgeOptions, RolloutConfig, RunOptions, SandboxOptions
from ..errors import ConfigError
from ..devices import DEVICE
from ..options import NON_NEGATIVE, POSITIVE, option, resume_keys, same_as, validate

_RAY = "(RAY_ADDRESS, or a local cluster started for the run; pip install 'agentenv[ray]')"


@dataclass
class TrainConfig:
    """Everything one training run is given (``agentenv train``'s options)."""

    env: str = same_as(EnvOptions, "env")
    env_kwargs: dict[str, Any] = same_as(EnvOptions, "env_kwargs", resume="env_kwargs")
    model: str | None = same_as(EngineOptions, "model")  # a local HF model dir; default: the bundled tiny model
    engine: Literal["embedded", "vllm", "openai"] = same_as(EngineOptions, "engine")
    engine_kwargs: dict[str, Any] = same_as(EngineOptions, "engine_kwargs")
    base_urls: list[str] | None = same_as(EngineOptions, "base_urls")
    sandbox: Literal["local", "e2b"] = same_as(SandboxOptions, "sandbox")
    sandbox_memory_mb: int | None = same_as(SandboxOptions, "sandbox_memory_mb")
    sandbox_cpus: float | None = same_as(SandboxOptions, "sandbox_cpus")
    sandbox_cpu_s: int | None = same_as(SandboxOptions, "sandbox_cpu_s")
    sandbox_pids: int | None = same_as(SandboxOptions, "sandbox_pids")
    sandbox_tmp_mb: int | None = same_as(SandboxOptions, "sandbox_tmp_mb")
    sandbox_setup_timeout: float | None = same_as(SandboxOptions, "sandbox_setup_timeout")
    mode: Literal["async", "sync", "colocated"] = option(
        "async", "async: generation and training overlap; sync: generate, train, sync in turn; colocated: as sync, "
                 "and the engine sleeps (frees its KV cache, offloads or drops its weights: --sleep-level) while the "
                 "optimiser step runs on the same device, then wakes with the new weights", group="staleness")
    sleep_level: Literal[1, 2] = option(
        1, "colocated: 1 frees the engine's KV cache and moves its weights to host memory; 2 frees the KV cache "
           "and drops the weights, which the sync after the step installs again (on CPU the weights are in host "
           "memory already: level 1 frees the KV cache only)", group="staleness")
    steps: int = option(40, "optimiser steps", check=POSITIVE, group="optimiser")
    groups_per_step: int = option(8, "GRPO groups (tasks) per step", check=POSITIVE, resume=True, group="rollout")
    group_size: int = same_as(RunOptions, "group_size", help="samples per task, a GRPO group (at least 2)")
    max_staleness: int = option(1, "async: a program starts only if consumed within this many versions",
                                check=NON_NEGATIVE, group="staleness")
    partial: Literal["continue", "drain"] = option(
        "continue", "programs in flight at a weight update: continue with the new weights or drain first",
        group="staleness")
    lr: float = option(2e-5, "learning rate", check=POSITIVE, group="optimiser")
    max_grad_norm: float = option(1.0, "gradients are clipped to this global norm", check=POSITIVE, group="optimiser")
    micro_batch: int = option(16, "sequences per forward/backward, gradients accumulated", check=POSITIVE,
                              group="optimiser")
    micro_batch_tokens: int | None = option(
        8192, "at most this many tokens per forward/backward: the rows' own tokens when packed; with --no-pack, rows "
              "x the longest (rows are grouped by length, so a long sample does not widen a pass of short ones)",
        check=POSITIVE, group="optimiser")
    pack: bool = option(True, "pad each forward/backward's rows to the longest instead of packing them into one "
                              "sequence (packed: no padding, attention kept within each row, the same loss and "
                              "gradients)", flag="--no-pack", group="optimiser")
    logprob_chunk: int = option(
        512, "positions of the output head computed at a time for the per-token logprobs, each chunk recomputed in "
              "the backward pass, so memory does not grow with row length x vocabulary (default {default}; 0: the "
              "whole logits at once)", check=NON_NEGATIVE, group="optimiser")
    device: str = option("auto", "where the policy trains: auto (a CUDA GPU where torch sees one, else the CPU), cpu, "
                                 "cuda or cuda:N; with --cluster ray each rank takes one GPU (auto: when the cluster "
                                 "has one for every rank)", check=DEVICE, group="optimiser")
    precision: Literal["auto", "fp32", "bf16"] = option(
        "auto", "auto: bf16 on a CUDA GPU that supports it, else fp32; bf16: the forward under bf16 autocast, weights "
                "and optimiser state kept in float32 (on the CPU too)", group="optimiser")
    activation_checkpointing: bool = option(
        False, "recompute each decoder layer's activations in the backward pass instead of keeping them: less "
               "memory for long rows, about one more forward of compute", group="optimiser")
    lora_rank: int = option(
        0,
        "train a LoRA adapter of this rank and sync only it (default {default}; 0: full fine-tuning)",
        check=NON_NEGATIVE,
        resume=True,
        group="optimiser",
    )
    lora_alpha: float = option(16.0, "LoRA scaling numerator: the update is scaled by alpha/rank", check=POSITIVE,
                               group="optimiser")
    clip_low: float = option(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low)", group="loss")
    clip_high: float = option(0.28, "PPO ratio clip above 1, DAPO's clip-higher (ratio <= 1 + clip_high)", group="loss")
    is_cap: float = option(2.0, "truncation of the per-token importance weight behaviour -> current policy",
                           check=POSITIVE, group="loss")
    aggregation: Literal["token", "sequence"] = option(
        "token", "loss mean over all tokens of the batch, or per sequence then over sequences", group="loss")
    kl_coef: float = option(0.0, "weight of a per-token KL(policy || starting model) penalty in the loss; 0 turns it "
                                 "off and loads no reference model (default {default})", check=NON_NEGATIVE,
                                group="loss")
    concurrency: int = same_as(RolloutConfig, "concurrency")
    scheduling: Literal["program", "fifo", "lockstep"] = same_as(RolloutConfig, "scheduling")
    max_turns: int | None = same_as(RolloutConfig, "max_turns", resume=False)
    max_new_tokens: int = same_as(RolloutConfig, "max_new_tokens", resume=False)
    # Training divides the logits by it, so it is > 0 (rollouts may sample greedily).
    temperature: float = same_as(RolloutConfig, "temperature", check=POSITIVE, resume=False)
    tool_timeout: float | None = same_as(RolloutConfig, "tool_timeout", resume=False)
    seed: int = same_as(RunOptions, "seed", help="task, sampling and init seed")
    out_dir: str = option("runs/train", "run directory: metrics.jsonl, checkpoints/", group="output")
    checkpoint_every: int = option(10, "steps between checkpoints; one is also written at the end", check=POSITIVE,
                                   group="checkpoints")
    resume: bool = option(False, "continue from the latest checkpoint in --out-dir", group="checkpoints")
    report_to: list[Literal["tensorboard", "wandb", "none"]] | None = option(
        None, "experiment tracker, repeatable: tensorboard (OUT_DIR/tensorboard), wandb (WANDB_PROJECT, "
              "WANDB_MODE=offline works without an account) or none (default: tensorboard when installed)",
        group="tracking")
    eval_every: int = option(0, "evaluate on held-out tasks every N steps, before the first and after the last; "
                                "results in OUT_DIR/eval.jsonl and the trackers (default {default}; 0: never)",
                         check=NON_NEGATIVE, group="evaluation")
    eval_tasks: int = option(32, "held-out tasks per evaluation, from a seed training never uses", check=POSITIVE,
                             group="evaluation")
    eval_k: int = option(4, "samples per held-out task: pass@1 .. pass@k", check=POSITIVE, group="evaluation")
    eval_env_kwargs: dict[str, Any] = same_as(
        EnvOptions, "env_kwargs", flag="--eval-env-arg", resume=False, convert=lambda items, earlier: _env_args(
            earlier["env"], items, "--eval-env-arg"),
        help="environment argument for the held-out tasks only, e.g. split=test for the dataset env",
        group="evaluation")
    # A resumed training run may change its judge, as it may its sampling (checkpoints written
    # before these options existed resume too).
    judge: str | None = same_as(JudgeOptions, "judge", resume=False)
    judge_deadline: float = same_as(JudgeOptions, "judge_deadline")
    judge_concurrency: int = same_as(JudgeOptions, "judge_concurrency")
    judge_weight: float = same_as(JudgeOptions, "judge_weight", resume=False)
    judge_group: bool = same_as(JudgeOptions, "judge_group", resume=False)
    cluster: Literal["none", "ray"] = option(
        "none", "none: train in this process; ray: the policy as --trainer-ranks data-parallel Ray actors "
                f"(torch.distributed, gloo), generation here or on --engines engine actors {_RAY}", group="cluster")
    trainer_ranks: int = option(2, "trainer ranks with --cluster ray, each a whole copy of the policy", check=POSITIVE,
                                group="cluster")
    engines: int = option(0, "with --cluster ray: generate on this many engine actors of --engine, weights sent to "
                             "each through the object store (default {default}; 0: the engine runs in this process)",
                          check=NON_NEGATIVE, group="cluster")
    fsdp: bool = option(False, "with --cluster ray: the trainer ranks shard parameters, gradients and optimiser "
                               "state (FSDP2) instead of each holding a whole copy", group="cluster")
    rank_restarts: int = option(2, "with --cluster ray: when a trainer rank dies, start the ranks again from the "
                                   "last checkpoint, at most this often", check=NON_NEGATIVE, group="cluster")
    weight_sync: Literal["auto", "group", "host"] = option(
        "auto", "how weights reach a vllm or openai engine's workers: group (broadcast over a weight-update group, "
                "gloo on CPU, NCCL with CUDA, loaded in place), host (serialised through the engine's RPC) or auto "
                "(the group where it can be formed, else the host, with a log line saying why)", group="engine")

    #: Settings a resumed run must share with the checkpoint (the rest may change): the
    #: fields declared with ``resume``.
    RESUME_KEYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        validate(self)
        if self.group_size < 2:
            raise ConfigError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        if self.cluster == "ray" and not 1 <= self.trainer_ranks <= self.groups_per_step * self.group_size:
            raise ConfigError(
                f"trainer_ranks must be between 1 and the batch's {self.groups_per_step * self.group_size} "
                f"trajectories (groups_per_step x group_size), got {self.trainer_ranks}"
            )
        if self.fsdp and self.cluster != "ray":
            raise ConfigError("fsdp (sharding over trainer ranks) needs cluster='ray'")
        if self.weight_sync != "auto" and self.engine not in ("vllm", "openai"):
            raise ConfigError(f"weight_sync={self.weight_sync!r} needs a vllm or openai engine, got engine="
                              f"{self.engine!r} (the embedded engine shares the trainer's process: its weights are "
                              "not sent); leave weight_sync at 'auto'")
        if self.engines and self.cluster != "ray":
            raise ConfigError(f"engines (engine actors) need cluster='ray', got engines={self.engines}")
        self.sandbox_options()  # the limits given suit the sandbox

    @classmethod
    def for_env(cls, env: str = "retool-math", **settings: Any) -> "TrainConfig":
        """A config for ``env`` with its ``train_defaults`` where ``settings`` give no value
        (its ``env_kwargs`` merged under the ones given), as ``agentenv train`` does."""
        defaults = env_train_defaults(env)
        merged = {**defaults, **settings, "env": env}
        merged["env_kwargs"] = {**defaults.get("env_kwargs", {}), **settings.get("env_kwargs", {})}
        cfg = cls(**merged)
        return cfg if "eval_tasks" in settings else replace(cfg, eval_tasks=scaled_eval_tasks(cfg))

    def sandbox_options(self) -> SandboxOptions:
        """The sandbox's settings: its kind and the limits given (``sandbox_*``)."""
        return SandboxOptions(**{f.name: getattr(self, f.name) for f in fields(SandboxOptions)})

    def engine_args(self) -> dict[str, Any]:
        """The engine's constructor arguments: ``--engine-arg``'s, over ``weight_sync`` for the
        engines that load weights into vLLM's workers (vllm, openai)."""
        sync = {"weight_sync": self.weight_sync} if self.engine in ("vllm", "openai") else {}
        return {**sync, **self.engine_kwargs}

    @property
    def staleness(self) -> int:
        return 0 if self.mode in ("sync", "colocated") else self.max_staleness


TrainConfig.RESUME_KEYS = resume_keys(TrainConfig)


#: The fewest held-out tasks a default evaluation scaled to a short run keeps.
MIN_EVAL_TASKS = 8


def evaluations(cfg: TrainConfig) -> int:
    """How many held-out evaluations a fresh run of ``cfg`` makes: before the first step, every
    ``eval_every`` steps in between, after the last (0 when ``eval_every`` is 0)."""
    return 2 + (cfg.steps - 1) // cfg.eval_every if cfg.eval_every else 0


def scaled_eval_tasks(cfg: TrainConfig) -> int:
    """The default held-out tasks per evaluation, scaled to the run: ``cfg.eval_tasks``, but
    no more than keeps all the evaluations' programs (tasks x ``eval_k``) within half the
    training's (steps x groups_per_step x group_size), and at least :data:`MIN_EVAL_TASKS`.
    A 5-step run of retool-math's defaults evaluates 10 tasks instead of 128; its 100-step
    run keeps 128. A value the user gives is used as given."""
    n = evaluations(cfg)
    if not n:
        return cfg.eval_tasks
    trained = cfg.steps * cfg.groups_per_step * cfg.group_size
    return min(cfg.eval_tasks, max(MIN_EVAL_TASKS, trained // (2 * n * cfg.eval_k)))


def evaluation_cost(cfg: TrainConfig, scaled_from: int | None = None) -> str:
    """One line saying what ``cfg``'s held-out evaluations cost against the training, and
    the options that change them; ``scaled_from``: the tasks the default would have been."""
    n = evaluations(cfg)
    if not n:
        return "held-out evaluation: none (--eval-every 0)"
    scaled = f" (scaled to the run from {scaled_from}; --eval-tasks N sets them)" if scaled_from else ""
    return (f"held-out evaluation: {n} x {cfg.eval_tasks} tasks x {cfg.eval_k} samples = "
            f"{n * cfg.eval_tasks * cfg.eval_k} programs{scaled}, beside the training's "
            f"{cfg.steps * cfg.groups_per_step * cfg.group_size}; --eval-every 0 skips them")


def env_train_defaults(env: str) -> dict[str, Any]:
    """The environment's ``train_defaults``, checked to name settings :class:`TrainConfig` has."""
    from ..registry import describe

    defaults = describe(env)["train_defaults"]
    unknown = set(defaults) - {f.name for f in fields(TrainConfig)}
    if unknown:
        raise ConfigError(f"environment {env!r}: train_defaults has unknown settings {sorted(unknown)}")
    return defaults


def _env_args(env: str, items: list[str], flag: str) -> dict[str, Any]:
    from ..registry import env_kwargs

    return env_kwargs(env, items, flag)
