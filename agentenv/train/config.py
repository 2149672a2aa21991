"""The trainer's settings (:class:`TrainConfig`), in a module of their own that imports no
torch: the CLI builds ``agentenv train``'s parser from its fields.

A :class:`TrainConfig` is composed by concern. The options a rollout run has too are the
rollout's own concerns, held whole (``env``: :class:`~agentenv.config.EnvOptions`, ``sandbox``,
``judge``) or in part (``rollout``: the :class:`~agentenv.config.RolloutConfig` options a
training run takes, and of its ``sampling`` (:class:`~agentenv.config.SamplingConfig`, also read
as ``cfg.sampling``) the temperature; ``engine``: :class:`TrainEngineOptions`, the rollout's
engine and how weights reach it); training's own are the concerns below (``batch``, ``output``,
``evaluation``, ``checkpoints``, ``staleness``, ``optimiser``, ``loss``, ``tracking``,
``cluster``). Each field is an option (``agentenv.options``): its flag, help, default and check
are declared once, in its concern.

Every option has a flat name unique across the concerns (``lr`` is ``optimiser.lr``), so
``TrainConfig(steps=2, lr=1e-3, env="x")``, an environment's ``train_defaults`` and
:meth:`TrainConfig.replace` take flat names; :meth:`TrainConfig.settings` reads them flat."""

from __future__ import annotations

import difflib
import functools
import typing
import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass
from dataclasses import replace as _replace
from typing import Any, ClassVar, Literal, Mapping

from ..config import (EngineOptions, EnvOptions, JudgeOptions, RolloutConfig, RunOptions, SamplingConfig,
                      SandboxOptions)
from ..devices import DEVICE
from ..engines.base import DEFAULT_TOP_K, DEFAULT_TOP_P
from ..errors import ConfigError
from ..options import NON_NEGATIVE, POSITIVE, concern, option, option_of, same_as, validate, walk

_RAY = "(RAY_ADDRESS, or a local cluster started for the run; pip install 'agentenv[ray]')"


@dataclass(frozen=True)
class TrainEngineOptions(EngineOptions):
    """The rollout's engine options, and how the trainer's weights reach the engine."""

    weight_sync: Literal["auto", "group", "host"] = option(
        "auto", "how weights reach a vllm or openai engine's workers: group (broadcast over a weight-update group, "
                "gloo on CPU, NCCL with CUDA, loaded in place), host (serialised through the engine's RPC) or auto "
                "(the group where it can be formed, else the host, with a log line saying why)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync != "auto" and self.engine not in ("vllm", "openai"):
            raise ConfigError(f"weight_sync={self.weight_sync!r} needs a vllm or openai engine, got engine="
                              f"{self.engine!r} (the embedded engine shares the trainer's process: its weights are "
                              "not sent); leave weight_sync at 'auto'")

    def engine_args(self) -> dict[str, Any]:
        """The engine's constructor arguments: ``--engine-arg``'s, over ``weight_sync`` for the
        engines that load weights into vLLM's workers (vllm, openai)."""
        sync = {"weight_sync": self.weight_sync} if self.engine in ("vllm", "openai") else {}
        return {**sync, **self.engine_kwargs}


@dataclass(frozen=True)
class BatchOptions:
    """What an optimiser step learns from: groups of samples of a task each, and the seed."""

    GROUP: ClassVar[str] = "rollout"

    groups_per_step: int = option(8, "GRPO groups (tasks) per step", check=POSITIVE, resume=True)
    group_size: int = same_as(RunOptions, "group_size", help="samples per task, a GRPO group (at least 2)")
    seed: int = same_as(RunOptions, "seed", help="task, sampling and init seed")

    def __post_init__(self) -> None:
        validate(self)
        if self.group_size < 2:
            raise ConfigError("GRPO needs group_size >= 2 (advantages are relative to the group)")

    @property
    def trajectories(self) -> int:
        """The samples one step trains on: groups_per_step x group_size."""
        return self.groups_per_step * self.group_size


@dataclass(frozen=True)
class TrainOutputOptions:
    """Where a training run writes."""

    GROUP: ClassVar[str] = "output"

    out_dir: str = option("runs/train", "run directory: metrics.jsonl, checkpoints/")


@dataclass(frozen=True)
class EvaluationOptions:
    """Held-out evaluations during training (``agentenv.train.evaluator``)."""

    GROUP: ClassVar[str] = "evaluation"

    eval_every: int = option(0, "evaluate on held-out tasks every N steps, before the first and after the last; "
                                "results in OUT_DIR/eval.jsonl and the trackers (default {default}; 0: never)",
                             check=NON_NEGATIVE)
    eval_tasks: int = option(32, "held-out tasks per evaluation, from a seed training never uses", check=POSITIVE)
    eval_k: int = option(4, "samples per held-out task: pass@1 .. pass@k", check=POSITIVE)
    # Typed against the environment the config holds before this concern.
    eval_env_kwargs: dict[str, Any] = same_as(
        EnvOptions, "env_kwargs", flag="--eval-env-arg", resume=False, convert=lambda items, earlier: _env_args(
            earlier["env"], items, "--eval-env-arg"),
        help="environment argument for the held-out tasks only, e.g. split=test for the dataset env",
        group="evaluation")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class CheckpointOptions:
    """How often a run saves itself, and whether it continues an earlier one."""

    GROUP: ClassVar[str] = "checkpoints"

    checkpoint_every: int = option(10, "steps between checkpoints; one is also written at the end", check=POSITIVE)
    resume: bool = option(False, "continue from the latest checkpoint in --out-dir")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class StalenessOptions:
    """How generation and training overlap."""

    GROUP: ClassVar[str] = "staleness"

    mode: Literal["async", "sync", "colocated"] = option(
        "async", "async: generation and training overlap; sync: generate, train, sync in turn; colocated: as sync, "
                 "and the engine sleeps (frees its KV cache, offloads or drops its weights: --sleep-level) while the "
                 "optimiser step runs on the same device, then wakes with the new weights")
    sleep_level: Literal[1, 2] = option(
        1, "colocated: 1 frees the engine's KV cache and moves its weights to host memory; 2 frees the KV cache "
           "and drops the weights, which the sync after the step installs again (on CPU the weights are in host "
           "memory already: level 1 frees the KV cache only)")
    max_staleness: int = option(1, "async: a program starts only if consumed within this many versions",
                                check=NON_NEGATIVE)
    partial: Literal["continue", "drain"] = option(
        "continue", "programs in flight at a weight update: continue with the new weights or drain first")

    def __post_init__(self) -> None:
        validate(self)

    @property
    def limit(self) -> int:
        """The versions a consumed program may lag behind the policy: ``max_staleness`` in async
        mode, 0 when generation and training take turns."""
        return 0 if self.mode in ("sync", "colocated") else self.max_staleness


@dataclass(frozen=True)
class OptimiserOptions:
    """The optimiser's steps, batches, precision and LoRA (what ``Policy`` is made with)."""

    GROUP: ClassVar[str] = "optimiser"

    steps: int = option(40, "optimiser steps", check=POSITIVE)
    lr: float = option(2e-5, "learning rate", check=POSITIVE)
    max_grad_norm: float = option(1.0, "gradients are clipped to this global norm", check=POSITIVE)
    micro_batch: int = option(16, "sequences per forward/backward, gradients accumulated", check=POSITIVE)
    micro_batch_tokens: int | None = option(
        8192, "at most this many tokens per forward/backward: the rows' own tokens when packed; with --no-pack, rows "
              "x the longest (rows are grouped by length, so a long sample does not widen a pass of short ones)",
        check=POSITIVE)
    pack: bool = option(True, "pad each forward/backward's rows to the longest instead of packing them into one "
                              "sequence (packed: no padding, attention kept within each row, the same loss and "
                              "gradients)", flag="--no-pack")
    logprob_chunk: int = option(
        512, "positions of the output head computed at a time for the per-token logprobs, each chunk recomputed in "
              "the backward pass, so memory does not grow with row length x vocabulary (default {default}; 0: the "
              "whole logits at once)", check=NON_NEGATIVE)
    device: str = option("auto", "where the policy trains: auto (a CUDA GPU where torch sees one, else the CPU), cpu, "
                                 "cuda or cuda:N; with --cluster ray each rank takes one GPU (auto: when the cluster "
                                 "has one for every rank)", check=DEVICE)
    precision: Literal["auto", "fp32", "bf16"] = option(
        "auto", "auto: bf16 on a CUDA GPU that supports it, else fp32; bf16: the forward under bf16 autocast, weights "
                "and optimiser state kept in float32 (on the CPU too)")
    activation_checkpointing: bool = option(
        False, "recompute each decoder layer's activations in the backward pass instead of keeping them: less "
               "memory for long rows, about one more forward of compute")
    lora_rank: int = option(0, "train a LoRA adapter of this rank and sync only it (default {default}; 0: full "
                               "fine-tuning)", check=NON_NEGATIVE, resume=True)
    lora_alpha: float = option(16.0, "LoRA scaling numerator: the update is scaled by alpha/rank", check=POSITIVE)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class LossConfig:
    """The GRPO loss: ratio clipping, importance-weight truncation, aggregation, KL
    (``agentenv.train.loss.grpo_loss`` takes it)."""

    GROUP: ClassVar[str] = "loss"

    clip_low: float = option(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = option(0.28, "PPO ratio clip above 1, DAPO's clip-higher (ratio <= 1 + clip_high)")
    is_cap: float = option(2.0, "truncation of the per-token importance weight behaviour -> current policy",
                           check=POSITIVE)
    aggregation: Literal["token", "sequence"] = option(
        "token", "loss mean over all tokens of the batch, or per sequence then over sequences")
    kl_coef: float = option(0.0, "weight of a per-token KL(policy || starting model) penalty in the loss; 0 turns it "
                                 "off and loads no reference model (default {default})", check=NON_NEGATIVE)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class TrackingOptions:
    """Where a run's curves are reported besides metrics.jsonl."""

    GROUP: ClassVar[str] = "tracking"

    report_to: list[Literal["tensorboard", "wandb", "none"]] | None = option(
        None, "experiment tracker, repeatable: tensorboard (OUT_DIR/tensorboard), wandb (WANDB_PROJECT, "
              "WANDB_MODE=offline works without an account) or none (default: tensorboard when installed)")


@dataclass(frozen=True)
class TrainClusterOptions:
    """Where a training run's policy and engines run: this process, or Ray actors (the rollout's
    :class:`~agentenv.config.ClusterOptions` places rollout workers instead)."""

    GROUP: ClassVar[str] = "cluster"

    cluster: Literal["none", "ray"] = option(
        "none", "none: train in this process; ray: the policy as --trainer-ranks data-parallel Ray actors "
                f"(torch.distributed, gloo), generation here or on --engines engine actors {_RAY}")
    trainer_ranks: int = option(2, "trainer ranks with --cluster ray, each a whole copy of the policy", check=POSITIVE)
    engines: int = option(0, "with --cluster ray: generate on this many engine actors of --engine, weights sent to "
                             "each through the object store (default {default}; 0: the engine runs in this process)",
                          check=NON_NEGATIVE)
    fsdp: bool = option(False, "with --cluster ray: the trainer ranks shard parameters, gradients and optimiser "
                               "state (FSDP2) instead of each holding a whole copy")
    rank_restarts: int = option(2, "with --cluster ray: when a trainer rank dies, start the ranks again from the "
                                   "last checkpoint, at most this often", check=NON_NEGATIVE)

    def __post_init__(self) -> None:
        validate(self)
        if self.fsdp and self.cluster != "ray":
            raise ConfigError("fsdp (sharding over trainer ranks) needs cluster='ray'")
        if self.engines and self.cluster != "ray":
            raise ConfigError(f"engines (engine actors) need cluster='ray', got engines={self.engines}")


#: The rollout options a training run takes, of its sampling the temperature alone (training
#: learns from the whole distribution: no top-p, no top-k); a resumed run may change them (its
#: sampling limits), and training divides the logits by the temperature, so it is > 0 (a
#: rollout may sample greedily).
_ROLLOUT = concern(RolloutConfig, only=("concurrency", "scheduling", "max_turns", "max_new_tokens", "tool_timeout",
                                        "sampling"),
                   max_turns={"resume": False}, max_new_tokens={"resume": False}, tool_timeout={"resume": False},
                   sampling=concern(SamplingConfig, only=("temperature",),
                                    temperature={"check": POSITIVE, "resume": False}))
# A resumed training run may change its judge, as it may its sampling (checkpoints written
# before these options existed resume too).
_JUDGE = concern(JudgeOptions, judge={"resume": False}, judge_weight={"resume": False}, judge_group={"resume": False})


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything one training run is given (``agentenv train``'s options), by concern.

    Made from concerns (``TrainConfig(optimiser=OptimiserOptions(lr=1e-3))``), from flat option
    names (``TrainConfig(lr=1e-3, env="x")``: each goes to the concern holding it, the rest of
    that concern keeps its defaults), or both (an option given changes the concern given). A name
    that is a concern's and an option's (``env``, ``engine``, ``sandbox``, ``judge``, ``cluster``)
    is the concern when given one, else the option. The rollout's ``sampling`` is given and read
    as a concern too (``TrainConfig(sampling=SamplingConfig(temperature=0.8))``, ``cfg.sampling``)."""

    env: EnvOptions = concern(EnvOptions)
    engine: TrainEngineOptions = concern(TrainEngineOptions)
    batch: BatchOptions = concern(BatchOptions)
    rollout: RolloutConfig = _ROLLOUT
    output: TrainOutputOptions = concern(TrainOutputOptions)
    evaluation: EvaluationOptions = concern(EvaluationOptions)
    checkpoints: CheckpointOptions = concern(CheckpointOptions)
    staleness: StalenessOptions = concern(StalenessOptions)
    optimiser: OptimiserOptions = concern(OptimiserOptions)
    loss: LossConfig = concern(LossConfig)
    tracking: TrackingOptions = concern(TrackingOptions)
    sandbox: SandboxOptions = concern(SandboxOptions)
    judge: JudgeOptions = _JUDGE
    cluster: TrainClusterOptions = concern(TrainClusterOptions)

    #: Settings a resumed run must share with the checkpoint (the rest may change), by flat
    #: name: the options declared with ``resume``.
    RESUME_KEYS: ClassVar[tuple[str, ...]]
    #: Flat option name -> dotted path (``"lr"`` -> ``"optimiser.lr"``).
    PATHS: ClassVar[dict[str, str]]

    def __init__(self, **settings: Any) -> None:
        concerns = _concerns()
        if set(concerns) <= set(settings):  # every concern named: ``dataclasses.replace(cfg, ...)``
            lost = [n for n in concerns if not isinstance(settings[n], concerns[n])]
            if lost:  # that concern's other options are gone: a silent reset of them
                raise ConfigError(f"dataclasses.replace(cfg, {lost[0]}=...) would reset the rest of cfg.{lost[0]}; "
                                  f"write cfg.replace({lost[0]}={settings[lost[0]]!r})")
        whole, parts = _route(settings)
        for name, cls in _concerns().items():
            if name in whole:  # its options given too change it (``dataclasses.replace(cfg, lr=...)``)
                value = _replace(whole[name], **parts[name]) if name in parts else whole[name]
            else:
                value = cls(**parts.get(name, {}))
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        validate(self)  # what the held concerns' options are re-declared with (temperature > 0)
        sampling = self.sampling
        if (sampling.top_p, sampling.top_k) != (DEFAULT_TOP_P, DEFAULT_TOP_K):
            raise ConfigError("a training run samples the whole distribution it learns from: leave the rollout's "
                              f"top_p and top_k off, got top_p={sampling.top_p}, top_k={sampling.top_k}")
        trajectories = self.batch.trajectories
        if self.cluster.cluster == "ray" and not 1 <= self.cluster.trainer_ranks <= trajectories:
            raise ConfigError(
                f"trainer_ranks must be between 1 and the batch's {trajectories} "
                f"trajectories (groups_per_step x group_size), got {self.cluster.trainer_ranks}"
            )

    def __getattr__(self, name: str) -> Any:
        # A former flat read (``cfg.lr``), for code written before the concerns: deprecated.
        # Only names that are no concern's reach here (``cfg.env`` is the env concern).
        path = None if name.startswith("_") else TrainConfig.PATHS.get(name)
        if path is None:
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        warnings.warn(f"TrainConfig.{name} is deprecated: read cfg.{path}", DeprecationWarning, stacklevel=2)
        return _read(self, path)

    @property
    def sampling(self) -> SamplingConfig:
        """How the rollout samples (``cfg.rollout.sampling``: the concern the rollout holds)."""
        return self.rollout.sampling

    def engine_args(self) -> dict[str, Any]:
        """Deprecated: ``cfg.engine.engine_args()``."""
        warnings.warn("TrainConfig.engine_args() is deprecated: call cfg.engine.engine_args()", DeprecationWarning,
                      stacklevel=2)
        return self.engine.engine_args()

    def sandbox_options(self) -> SandboxOptions:
        """Deprecated: ``cfg.sandbox``."""
        warnings.warn("TrainConfig.sandbox_options() is deprecated: read cfg.sandbox", DeprecationWarning, stacklevel=2)
        return self.sandbox

    def replace(self, **settings: Any) -> "TrainConfig":
        """This config with ``settings`` (flat option names, or whole concerns) changed; unlike
        ``dataclasses.replace``, a name that is a concern's and an option's (``env="x"``) changes
        only that option."""
        whole, parts = _route(settings)
        held = {name: whole.get(name, getattr(self, name)) for name in _concerns()}
        for name, changes in parts.items():
            held[name] = _replace(held[name], **changes)
        return TrainConfig(**held)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Each concern's options by flat name (``{"optimiser": {"lr": 2e-05, ...}, ...}``): what
        a run's ``config.json`` and each checkpoint store (:func:`saved_settings` reads it). A
        concern held inside one is among its holder's options (``"rollout": {..., "temperature":
        1.0}``): one layout for every run's files, whichever version wrote them."""
        out: dict[str, dict[str, Any]] = {}
        for name in _concerns():
            part = asdict(getattr(self, name))
            for inner, (holder, _) in _held().items():
                if holder == name:
                    part.update(part.pop(inner))
            out[name] = part
        return out

    def settings(self) -> dict[str, Any]:
        """Every option by its flat name (``{"lr": 2e-05, "env": "retool-math", ...}``)."""
        return {name: _read(self, path) for name, path in self.PATHS.items()}

    @classmethod
    def for_env(cls, env: str = "retool-math", **settings: Any) -> "TrainConfig":
        """A config for ``env`` with its ``train_defaults`` where ``settings`` give no value
        (its ``env_kwargs`` merged under the ones given), as ``agentenv train`` does."""
        defaults = env_train_defaults(env)
        # A concern given whole is as given: the env's defaults fill only the others. (A name
        # that is a concern's and an option's, ``engine="vllm"``, given as a value is the option.)
        concerns = {**_concerns(), **{name: held for name, (_, held) in _held().items()}}
        whole = {name for name, value in settings.items() if name in concerns and isinstance(value, concerns[name])}
        defaults = {k: v for k, v in defaults.items()
                    if k == "env_kwargs" or not whole & set(cls.PATHS[k].split(".")[:-1])}
        merged = {**defaults, **settings, "env": env}
        merged["env_kwargs"] = {**defaults.get("env_kwargs", {}), **settings.get("env_kwargs", {})}
        cfg = cls(**merged)
        given = "eval_tasks" in settings or "evaluation" in whole
        return cfg if given else cfg.replace(eval_tasks=scaled_eval_tasks(cfg))


@functools.cache
def _concerns() -> dict[str, type]:
    """TrainConfig's concerns: field name -> the config class it holds."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


@functools.cache
def _held() -> dict[str, tuple[str, type]]:
    """The concerns TrainConfig's concerns hold in turn: field name -> (its holder, the config
    class it holds), e.g. ``"sampling"`` -> ``("rollout", SamplingConfig)``."""
    out: dict[str, tuple[str, type]] = {}
    for name, cls in _concerns().items():
        hints = typing.get_type_hints(cls)
        out.update({f.name: (name, hints[f.name]) for f in fields(cls) if is_dataclass(hints[f.name])})
    return out


def _read(cfg: TrainConfig, path: str) -> Any:
    """The option at dotted ``path`` (``"rollout.sampling.temperature"``)."""
    value: Any = cfg
    for part in path.split("."):
        value = object.__getattribute__(value, part)
    return value


def _paths() -> dict[str, str]:
    paths: dict[str, str] = {}
    for path, f, _ in walk(TrainConfig):
        if f.name in paths:
            raise ConfigError(f"TrainConfig: option {f.name} is both {paths[f.name]} and {path}: flat names are unique")
        paths[f.name] = path
    return paths


TrainConfig.PATHS = _paths()
TrainConfig.RESUME_KEYS = tuple(f.name for _, f, _ in walk(TrainConfig) if option_of(f).resume)  # type: ignore[union-attr]


def _route(settings: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``settings`` as whole concerns (name -> config) and options by concern (name -> {option:
    value}); a name that is neither is a ConfigError naming the nearest valid ones."""
    concerns = _concerns()
    whole: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        if name in concerns and isinstance(value, concerns[name]):
            whole[name] = value
        elif name in _held() and isinstance(value, _held()[name][1]):  # the rollout's sampling
            parts.setdefault(_held()[name][0], {})[name] = value
        elif name in TrainConfig.PATHS:
            parts.setdefault(TrainConfig.PATHS[name].split(".")[0], {})[name] = value
        else:
            raise ConfigError(unknown_setting(name))
    return whole, parts


def unknown_setting(name: str) -> str:
    """What to say of a name that is no option of :class:`TrainConfig`."""
    near = difflib.get_close_matches(name, [*TrainConfig.PATHS, *_concerns(), *_held()], n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else " (`agentenv train --help` lists them)"
    return f"TrainConfig has no setting {name!r}{hint}"


def saved_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config (a checkpoint's or config.json's) as flat option names, whichever layout
    wrote it: by concern (:meth:`TrainConfig.to_dict`: ``{"optimiser": {"lr": ...}, ...}``; a
    concern held inside one, ``asdict``'s ``"rollout": {"sampling": {...}}``, read too) or flat,
    as a run before the concerns saved it (``{"lr": ..., "env": "retool-math", ...}``)."""
    concerns = _concerns()
    nested = bool(saved) and all(k in concerns and isinstance(v, dict) for k, v in saved.items())
    if not nested:
        return dict(saved)
    flat: dict[str, Any] = {}
    for part in saved.values():
        for name, value in part.items():
            flat.update(value if name in _held() and isinstance(value, dict) else {name: value})
    return flat


#: The fewest held-out tasks a default evaluation scaled to a short run keeps.
MIN_EVAL_TASKS = 8


def evaluations(cfg: TrainConfig) -> int:
    """How many held-out evaluations a fresh run of ``cfg`` makes: before the first step, every
    ``eval_every`` steps in between, after the last (0 when ``eval_every`` is 0)."""
    every = cfg.evaluation.eval_every
    return 2 + (cfg.optimiser.steps - 1) // every if every else 0


def scaled_eval_tasks(cfg: TrainConfig) -> int:
    """The default held-out tasks per evaluation, scaled to the run: ``eval_tasks``, but
    no more than keeps all the evaluations' programs (tasks x ``eval_k``) within half the
    training's (steps x groups_per_step x group_size), and at least :data:`MIN_EVAL_TASKS`.
    A 5-step run of retool-math's defaults evaluates 10 tasks instead of 128; its 100-step
    run keeps 128. A value the user gives is used as given."""
    n, ev = evaluations(cfg), cfg.evaluation
    if not n:
        return ev.eval_tasks
    trained = cfg.optimiser.steps * cfg.batch.trajectories
    return min(ev.eval_tasks, max(MIN_EVAL_TASKS, trained // (2 * n * ev.eval_k)))


def evaluation_cost(cfg: TrainConfig, scaled_from: int | None = None) -> str:
    """One line saying what ``cfg``'s held-out evaluations cost against the training, and
    the options that change them; ``scaled_from``: the tasks the default would have been."""
    n, ev = evaluations(cfg), cfg.evaluation
    if not n:
        return "held-out evaluation: none (--eval-every 0)"
    scaled = f" (scaled to the run from {scaled_from}; --eval-tasks N sets them)" if scaled_from else ""
    return (f"held-out evaluation: {n} x {ev.eval_tasks} tasks x {ev.eval_k} samples = "
            f"{n * ev.eval_tasks * ev.eval_k} programs{scaled}, beside the training's "
            f"{cfg.optimiser.steps * cfg.batch.trajectories}; --eval-every 0 skips them")


def env_train_defaults(env: str) -> dict[str, Any]:
    """The environment's ``train_defaults``, checked to name settings :class:`TrainConfig` has."""
    from ..registry import describe

    defaults = describe(env)["train_defaults"]
    unknown = set(defaults) - set(TrainConfig.PATHS)
    if unknown:
        raise ConfigError(f"environment {env!r}: train_defaults has unknown settings {sorted(unknown)}")
    return defaults


def _env_args(env: str, items: list[str], flag: str) -> dict[str, Any]:
    from ..registry import env_kwargs

    return env_kwargs(env, items, flag)


__all__ = ["MIN_EVAL_TASKS", "BatchOptions", "CheckpointOptions", "EvaluationOptions", "LossConfig",
           "OptimiserOptions", "StalenessOptions", "TrackingOptions", "TrainClusterOptions", "TrainConfig",
           "TrainEngineOptions", "TrainOutputOptions", "env_train_defaults", "evaluation_cost", "evaluations",
           "saved_settings", "scaled_eval_tasks", "unknown_setting"]
