"""Settings, declared once, by concern: each field is an option (``agentenv.options``) whose
flag, help, default and check the CLI derives, validated once at the boundary.

* :class:`RolloutConfig`: how programs run (limits, scheduling, and their sampling, a
  :class:`SamplingConfig`); what a :class:`~agentenv.Reactor` takes.
* :class:`EnvOptions` / :class:`EnvModules`: which environment, with which arguments.
* :class:`EngineOptions`: which engine serves which model (see ``engines.spec.EngineSpec``).
* :class:`SandboxOptions`, :class:`ClusterOptions`: where tools run, where workers run.
* :class:`RunOptions`, :class:`OutputOptions`, :class:`EvalOptions`: what a rollout or an
  evaluation run does and where it writes.

The trainer's settings (``agentenv.train.config.TrainConfig``) hold the concerns they share
with a rollout run (env, engine, rollout with its sampling, sandbox, judge) and add training's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from .engines.base import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from .errors import ConfigError
from .options import NON_NEGATIVE, POSITIVE, UNIT, Check, concern, flat_concern, option, validate


@dataclass(slots=True, frozen=True)
class SamplingConfig:
    """How tokens are sampled: the engine's sampling parameters, their defaults the engines'
    own (``agentenv.engines.base``)."""

    GROUP: ClassVar[str] = "sampling"

    temperature: float = option(DEFAULT_TEMPERATURE, "sampling temperature", check=NON_NEGATIVE, resume=True)
    top_p: float = option(DEFAULT_TOP_P, "nucleus sampling mass (default {default}; 1.0: off)", check=UNIT, resume=True)
    top_k: int = option(DEFAULT_TOP_K, "sample among the k most likely tokens (default {default}; 0: off)",
                        check=NON_NEGATIVE, resume=True)

    def __post_init__(self) -> None:
        validate(self)


@flat_concern("sampling")
@dataclass(slots=True, frozen=True)
class RolloutConfig:
    """How a run's programs go: their limits, how they are scheduled, how tokens are sampled
    (``sampling``; its options are taken and read by their own names too:
    ``RolloutConfig(temperature=0.7).temperature``)."""

    GROUP: ClassVar[str] = "rollout"

    max_turns: int | None = option(
        None, "model turns per program (a turn = one generation request; default: the env's max_turns)",
        check=POSITIVE, resume=True)
    max_new_tokens: int = option(384, "sampled tokens per program, all turns together", check=POSITIVE, resume=True)
    max_tokens_per_turn: int = option(256, "sampled tokens per turn", check=POSITIVE, resume=True)
    concurrency: int = option(
        32, "engine requests in flight, the decode slots (default {default}); with --scheduling fifo or lockstep "
            "also the programs in flight, each holding its slot throughout", check=POSITIVE)
    scheduling: Literal["program", "fifo", "lockstep"] = option(
        "program", "program: KV-aware, a program on a tool holds no slot, sandboxes prepared ahead; "
                   "fifo: each program holds a slot from sandbox start to end; lockstep: turn by turn "
                   "(see agentenv.scheduler; default {default})")
    max_programs: int | None = option(
        None, "programs admitted at once, paused ones included (bounds open sandbox sessions) under --scheduling "
              "program or lockstep (default 8 x concurrency, at most the sandbox's 256 sessions; the engine's KV "
              "capacity bounds it too)", check=POSITIVE)
    session_lookahead: int = option(16, "with --scheduling program: queued programs whose sandbox session is "
                                        "prepared ahead", check=NON_NEGATIVE, former=("--env-lookahead",))
    tool_timeout: float | None = option(None, "seconds per tool call (default: the env's tool_timeout)",
                                        check=POSITIVE, resume=True)
    reward_timeout: float = option(60.0, "seconds per reward computation", check=POSITIVE)
    sampling: SamplingConfig = concern(SamplingConfig)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def env_lookahead(self) -> int:
        """The former name of :attr:`session_lookahead` (deprecated: "env" is the Environment)."""
        return self.session_lookahead

    def for_env(self, env: object) -> "RolloutConfig":
        """The limits left as None filled in from the environment's (``max_turns``,
        ``tool_timeout``): what a :class:`~agentenv.Reactor` runs with."""
        return replace(
            self,
            max_turns=self.max_turns if self.max_turns is not None else int(getattr(env, "max_turns", 4)),
            tool_timeout=self.tool_timeout
            if self.tool_timeout is not None
            else float(getattr(env, "tool_timeout", 5.0)),
        )


def _env_args(items: list[str], earlier: dict[str, Any]) -> dict[str, Any]:
    from .registry import env_kwargs

    return env_kwargs(earlier["env"], items)


def _load_modules(items: list[str], earlier: dict[str, Any]) -> list[str]:
    """Import them now: the environment options declared after this one name what they register."""
    from .registry import load_env_modules

    load_env_modules(items)
    return items


def engine_args(items: list[str], earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """``KEY=VALUE`` strings as engine keyword arguments, each VALUE parsed as JSON when it can be."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


ENGINE_ARG_HELP = ("engine setting, repeatable; VALUE is parsed as JSON when it can be. embedded: kv_cache_tokens, "
                   "page_size, max_batch_tokens, max_model_len; vllm: any AsyncEngineArgs field (block_size=32, "
                   "kv_cache_memory_bytes=268435456, tensor_parallel_size=2, max_model_len=4096), max_restarts, and "
                   "sessions=true (one vLLM streaming-input request per program, kept across its turns: a turn "
                   "prefills only its new tokens), nice=N "
                   "(the engine core's niceness; 10 on CPU, 0 leaves it be)")


@dataclass(frozen=True)
class EnvModules:
    """Modules that register environments, imported before any environment is named."""

    GROUP: ClassVar[str] = "env"

    env_modules: list[str] = option(
        factory=list, flag="--env-module", metavar="MODULE", convert=_load_modules,
        help="a module or path/to/file.py to import first, so the environments it register()s can be named by id; "
             "repeatable (also AGENTENV_ENV_MODULES, separated by ':')")


@dataclass(frozen=True)
class EnvOptions:
    """Which environment, made with which constructor arguments."""

    GROUP: ClassVar[str] = "env"

    env: str = option("retool-math", "environment: a registered id, package.module:Class or path/to/file.py[:Class] "
                                     "(default {default}; `agentenv envs` lists them)", resume=True)
    env_kwargs: dict[str, Any] = option(
        factory=dict, flag="--env-arg", metavar="KEY=VALUE", convert=_env_args, resume="env_args",
        help="environment constructor argument, repeatable (e.g. extra_digits=1); checked against the constructor "
             "and converted to its annotated type")


@dataclass(frozen=True)
class EngineOptions:
    """Which engine serves which model."""

    GROUP: ClassVar[str] = "engine"

    engine: Literal["embedded", "vllm", "openai"] = option(
        "embedded", "embedded (CPU), vllm (in-process AsyncLLM), openai (HTTP server)")
    model: str | None = option(None, "local Hugging Face model directory or a bundled model's name (default: the "
                               "bundled model that speaks the env's pinned tool format, else tiny-retool)",
                               resume=True)
    engine_kwargs: dict[str, Any] = option(factory=dict, flag="--engine-arg", metavar="KEY=VALUE",
                                           convert=engine_args, help=ENGINE_ARG_HELP)
    base_urls: list[str] | None = option(None, "server URL for --engine openai, http(s)://HOST[:PORT][/PATH] "
                                               "(repeat for several replicas)", flag="--base-url", metavar="URL")

    def __post_init__(self) -> None:
        validate(self)
        for url in self.base_urls or []:
            _check_url(url)


def _check_url(url: str) -> None:
    """``url`` is http(s)://HOST[:PORT][/PATH]; else ConfigError naming it."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port, True)[1]
    except ValueError:  # a port that is not a number, or out of range
        ok = False
    if not ok:
        raise ConfigError(f"--base-url {url!r} is not a server URL: give http(s)://HOST[:PORT][/PATH], "
                          "e.g. http://127.0.0.1:8000")


#: The local sandbox's per-session limits the command line sets: option -> ``Limits`` field.
SANDBOX_LIMITS = {"sandbox_memory_mb": "memory_mb", "sandbox_cpus": "cpus", "sandbox_cpu_s": "cpu_s",
                  "sandbox_pids": "pids", "sandbox_tmp_mb": "tmp_mb"}


@dataclass(frozen=True)
class SandboxOptions:
    """Where tool calls run, and what one local sandbox session may use: the fields of
    ``agentenv.sandboxes.local.Limits`` (None keeps the sandbox's own default, stated there
    once) and the time its setup code may take."""

    GROUP: ClassVar[str] = "sandbox"

    sandbox: Literal["local", "e2b"] = option(
        "local", "tool sandbox: the isolated local pool or E2B (E2B_API_KEY)")
    sandbox_memory_mb: int | None = option(
        None, "MB of memory per session: address space per process and the session's cgroup memory "
              "(default: the local sandbox's own)", check=POSITIVE)
    sandbox_cpus: float | None = option(
        None, "a hard CPU cap per session, in CPUs (default: none, each session an equal share)", check=POSITIVE)
    sandbox_cpu_s: int | None = option(
        None, "CPU seconds per session worker over its life (default: the local sandbox's own)", check=POSITIVE)
    sandbox_pids: int | None = option(
        None, "processes and threads per session (default: the local sandbox's own)", check=POSITIVE)
    sandbox_tmp_mb: int | None = option(
        None, "MB of a session's private /tmp (default: the local sandbox's own)", check=POSITIVE)
    sandbox_setup_timeout: float | None = option(
        None, "seconds the environment's sandbox_setup code may take in a new session (default: the local "
              "sandbox's own)", check=POSITIVE)
    sandbox_unisolated: bool = option(
        False, "on a host that lacks part of the local sandbox's isolation (writable cgroups, namespaces, "
               "seccomp: a container, say), run with what it has, warning each time, instead of refusing: NOT "
               "safe for untrusted model code")

    def __post_init__(self) -> None:
        validate(self)
        given = [n for n in (*SANDBOX_LIMITS, "sandbox_setup_timeout") if getattr(self, n) is not None]
        given += ["sandbox_unisolated"] if self.sandbox_unisolated else []
        if given and self.sandbox != "local":
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag} is a setting of the local sandbox; --sandbox {self.sandbox} has its own "
                              "(leave it out, or use --sandbox local)")

    def sandbox_kwargs(self) -> dict[str, Any]:
        """The sandbox's constructor arguments: the limits given over ``Limits``' defaults, the
        setup timeout if given."""
        limits = {f: getattr(self, o) for o, f in SANDBOX_LIMITS.items() if getattr(self, o) is not None}
        out: dict[str, Any] = {}
        if limits:
            from .sandboxes.local.limits import Limits

            out["limits"] = Limits(**limits)
        if self.sandbox_setup_timeout is not None:
            out["setup_timeout"] = self.sandbox_setup_timeout
        if self.sandbox_unisolated:
            out["allow_unisolated"] = True
        return out


def open_sandbox(spec: "SandboxOptions | str") -> Any:
    """The sandbox ``spec`` describes (unopened: ``async with`` it): a :class:`SandboxOptions`,
    or just its kind, ``local`` or ``e2b``, with the default limits."""
    from .sandboxes import default_sandbox

    options = SandboxOptions(sandbox=spec) if isinstance(spec, str) else spec  # type: ignore[arg-type]
    return default_sandbox(options.sandbox, **options.sandbox_kwargs())


@dataclass(frozen=True)
class RunOptions:
    """What a rollout run samples."""

    GROUP: ClassVar[str] = "rollout"

    tasks: int = option(32, "number of tasks", check=POSITIVE, resume=True)
    group_size: int = option(4, "samples per task, a GRPO group", check=POSITIVE, resume=True)
    seed: int = option(0, "task and sampling seed", resume=True)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class OutputOptions:
    """Where a rollout run writes, and what it does with an earlier run there."""

    GROUP: ClassVar[str] = "output"

    out: Path = option(Path("rollouts.jsonl"), "output JSONL file of trajectories; its event log is written beside "
                                               "it as OUT.log (default {default})")
    resume: bool = option(False, "continue an interrupted run with the same arguments: finished trajectories are "
                                 "kept, programs in flight continue from their last logged turn")
    overwrite: bool = option(False, "replace an existing non-empty --out (and its log)")
    progress: bool = option(True, "no progress bar", flag="--no-progress")

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")


@dataclass(frozen=True)
class ClusterOptions:
    """Where a rollout run's workers run."""

    GROUP: ClassVar[str] = "cluster"

    cluster: Literal["none", "ray"] = option(
        "none", "none: this process; ray: rollout workers as Ray actors (RAY_ADDRESS, or a local cluster "
                "started for the run; pip install 'agentenv[ray]')")
    workers: int = option(2, "rollout workers with --cluster ray, each with its own reactor and sandbox pool, and "
                             "its own engine unless --engines is given; at most one per group (--tasks), and on a "
                             "local cluster started for the run at most one per CPU (default {default})",
                          check=POSITIVE)
    engines: int = option(0, "with --cluster ray: engine actors of --engine serving every worker, programs placed "
                             "by KV room (default {default}; 0: each worker opens its own engine)", check=NON_NEGATIVE)
    engine_gpus: float = option(0.0, "GPUs per engine actor with --engines (e.g. 1 for vllm; default {default})",
                                check=NON_NEGATIVE)

    def __post_init__(self) -> None:
        validate(self)
        if (self.engines or self.engine_gpus) and self.cluster != "ray":
            raise ConfigError("--engines and --engine-gpus need --cluster ray")
        if self.workers != _default(ClusterOptions, "workers") and self.cluster != "ray":
            raise ConfigError(f"--workers {self.workers} needs --cluster ray (without it the run is this one process)")
        if self.engine_gpus and not self.engines:
            raise ConfigError(f"--engine-gpus {self.engine_gpus:g} needs --engines N: the GPUs go to engine actors, "
                              "and with --engines 0 each worker opens its own engine")


@dataclass(frozen=True)
class EvalOptions:
    """How an evaluation scores and reports its samples."""

    GROUP: ClassVar[str] = "evaluation"

    pass_threshold: float = option(1.0, "a sample passes when its reward is at least this")
    report: Path | None = option(None, "JSON report: overall and per-task pass@k and components "
                                       "(default: beside --out, its .jsonl replaced by .report.json: "
                                       "eval.jsonl -> eval.report.json)")



JUDGE_SPEC = Check(lambda v: v == "policy" or v.startswith(("embedded", "vllm:", "http://", "https://")),
                   "must be policy, embedded[:MODEL_DIR], vllm:MODEL_DIR or http(s)://HOST:PORT/v1")


@dataclass(frozen=True)
class JudgeOptions:
    """A model that grades each program's answer, a reward component named ``judge``
    (``agentenv.judge``)."""

    GROUP: ClassVar[str] = "judge"

    judge: str | None = option(
        None, "grade each answer with a model: policy (the run's own engine), embedded[:MODEL_DIR] or "
              "vllm:MODEL_DIR (a second engine; default: --model), or an OpenAI-compatible server's URL "
              "(http://HOST:PORT/v1); its score (0 to 1) is the reward component judge", check=JUDGE_SPEC,
        resume=True)
    judge_deadline: float = option(30.0, "seconds per judge call, its wait for a slot included; a call past it "
                                         "scores 0 and counts as a failure", check=POSITIVE)
    judge_concurrency: int = option(16, "judge calls in flight at once", check=POSITIVE)
    # What the judge is, its weight and its mode make the reward: a resumed run must keep them.
    judge_weight: float = option(1.0, "weight of the judge's score in the reward", resume=True)
    judge_group: bool = option(False, "the judge ranks each group's answers in one call (best 1, worst 0; a group "
                                      "reward) instead of grading each answer alone", resume=True)

    def __post_init__(self) -> None:
        validate(self)
        if self.judge:
            return
        for name in ("judge_weight", "judge_group", "judge_deadline", "judge_concurrency"):
            value = getattr(self, name)
            if value != _default(JudgeOptions, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}{'' if isinstance(value, bool) else f' {value:g}'} needs --judge (without "
                                  "it no judge grades the answers)")


#: The concerns ``--help`` groups the flags by, in the order it lists them (the common first),
#: with their headings; every option belongs to one (its own ``group`` or its config's ``GROUP``).
HELP_GROUPS: dict[str, str] = {
    "env": "environment (which one, with which arguments)",
    "engine": "engine (which model, served how)",
    "rollout": "rollout (tasks, samples, limits and scheduling of each program)",
    "sampling": "sampling",
    "output": "output",
    "evaluation": "evaluation",
    "checkpoints": "checkpoints",
    "staleness": "staleness (how generation and training overlap)",
    "optimiser": "optimiser (steps, batches, precision, LoRA)",
    "loss": "loss (GRPO clipping, importance weights, KL)",
    "tracking": "tracking",
    "sandbox": "sandbox (where tool calls run, and their limits)",
    "judge": "judge (a model grading each answer)",
    "cluster": "cluster (Ray)",
}


def _default(cls: type, name: str) -> Any:
    return cls.__dataclass_fields__[name].default  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RolloutRunConfig:
    """A rollout run's options (``agentenv rollout``), by concern."""

    modules: EnvModules = field(default_factory=EnvModules)
    env: EnvOptions = field(default_factory=EnvOptions)
    run: RunOptions = field(default_factory=RunOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    sandbox: SandboxOptions = field(default_factory=SandboxOptions)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    judge: JudgeOptions = field(default_factory=JudgeOptions)

    #: How the command line names and defaults its options where they differ from the
    #: fields' own (dotted path -> ``Option`` settings, dotted path -> default).
    CHANGES: ClassVar[dict[str, dict[str, Any]]] = {}
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    @property
    def sampling(self) -> SamplingConfig:
        """How the rollout samples (``rollout.sampling``: the concern the rollout holds)."""
        return self.rollout.sampling

    def __post_init__(self) -> None:
        # A worker runs whole groups: workers beyond the groups would hold an engine and a
        # sandbox pool each and run nothing.
        tasks, workers = self.run.tasks, self.cluster.workers
        if self.cluster.cluster == "ray" and workers > tasks:
            raise ConfigError(f"--workers {workers} is more than the run's {tasks} groups (--tasks {tasks}): a worker "
                              f"runs whole groups, so give at most --workers {tasks}")


@dataclass(frozen=True)
class EvalRunConfig(RolloutRunConfig):
    """An evaluation's options (``agentenv eval``): a rollout of k samples per task, then its report."""

    evaluation: EvalOptions = field(default_factory=EvalOptions)

    CHANGES: ClassVar[dict[str, dict[str, Any]]] = {"run.group_size": {
        "flag": "--k", "metavar": "K", "help": "samples per task; pass@1, pass@2, ... up to pass@k are reported"}}
    DEFAULTS: ClassVar[dict[str, Any]] = {"output.out": Path("eval.jsonl")}

    @property
    def report_path(self) -> Path:
        """Where the JSON report goes: ``--report``, or beside ``--out``."""
        out = self.output.out
        if self.evaluation.report is not None:
            return self.evaluation.report
        return Path(f"{out}.report.json") if out.suffix != ".jsonl" else out.with_suffix(".report.json")


__all__ = [
    "HELP_GROUPS",
    "SANDBOX_LIMITS",
    "ClusterOptions",
    "EngineOptions",
    "EnvModules",
    "EnvOptions",
    "EvalOptions",
    "EvalRunConfig",
    "JudgeOptions",
    "OutputOptions",
    "RolloutConfig",
    "RolloutRunConfig",
    "RunOptions",
    "SamplingConfig",
    "SandboxOptions",
    "engine_args",
    "open_sandbox",
]
