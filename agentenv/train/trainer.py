"""The bundled GRPO trainer: generation and training overlap through a bounded buffer.

Two tasks in one anyio task group share the engine and the reactor:

* the **generator** (:class:`~.generation.Generation`) streams tasks; a new group starts only
  when the :class:`~.buffer.StalenessGate` admits it at the current weight version (so it will
  be consumed within ``max_staleness`` versions); each group's G programs run in the reactor,
  rewards are scored as programs end (delayed, concurrent with other programs decoding), and
  the complete group enters the :class:`~.buffer.RolloutBuffer`;
* the **step loop** (:class:`~.loop.StepLoop`) takes ``groups_per_step`` groups, recomputes
  logprobs on the exact sampled tokens, takes one optimiser step (token-level truncated IS
  against the behaviour logprobs), and pushes the new weights into the engine, which bumps its
  version *while generation continues*: programs in flight keep going and their later turns
  (vLLM: later tokens) carry the new version. ``partial="drain"`` instead waits for the
  programs in flight to finish before each sync.

``mode="sync"`` is the colocated baseline: the gate with ``max_staleness=0`` admits exactly
one batch per version, so generation, training and sync take turns.

:class:`Trainer` opens what a run needs (the environment; its runtime, sandbox, engine and the
reactor, from :func:`~agentenv.runtime.open_runtime`; the policy), restores a
checkpoint (:mod:`~.checkpoints`), and hands the step loop its parts: generation, held-out
evaluations (:mod:`~.evaluator`), the run's log and status bar (:mod:`~.status`).
"""

from __future__ import annotations

import functools
import json
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Callable

import anyio
import torch

from .. import inflight
from ..config import RolloutConfig
from ..devices import check_device
from ..errors import ConfigError, RankDiedError
from ..engines.base import WeightSink, weight_sink
from ..engines.spec import EngineSpec
from ..runtime import Runtime, open_runtime
from .checkpoints import Checkpoints, latest_checkpoint
from .colocate import engine_kwargs
from .config import TrainConfig
from .evaluator import Evaluator
from .generation import Generation, TaskStream
from .loop import StepLoop
from .policy import LoraSpec, Policy
from .status import RunLog, StatusBar


class Trainer:
    """``await Trainer(cfg).run()``; the engine, environment and sandbox may be passed in
    (library use), otherwise they are created from the config and closed at the end."""

    def __init__(self, cfg: TrainConfig, *, engine: Any = None, env: Any = None, sandbox: Any = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None, print_steps: bool = True,
                 progress: bool = False) -> None:
        self.cfg = cfg
        self._engine, self._env, self._sandbox = engine, env, sandbox
        self._actor_cpus: float | None = None  # each Ray actor's CPUs on a local cluster too small for one each
        self._given = (engine is not None, env is not None, sandbox is not None)  # the caller's, kept open
        self.restarts = 0  # times the trainer ranks were started again after one died
        self.on_step = on_step
        self.print_steps = print_steps
        self.progress = progress  # a live status bar on stderr (the CLI's)
        self.out = Path(cfg.output.out_dir)
        self.rows: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []  # held-out evaluations (eval.jsonl)
        self.trackers: dict[str, Path] = {}  # tracker -> its directory
        self.policy: Policy | None = None
        # What an attempt opens (``_open``): its runtime, the one rollout config it runs with, and
        # its in-flight programs (checkpoints save them).
        self.runtime: Runtime | None = None
        self.rollout: RolloutConfig | None = None
        self.programs = inflight.InFlight()

    # -- setup -------------------------------------------------------------------------------
    async def _open(self, stack: AsyncExitStack, sampling_seed: int) -> None:
        from ..engines.embedded import check_model_dir
        from ..models.native import default_model_for
        from ..registry import make

        cfg = self.cfg
        if cfg.engine.model:
            check_model_dir(Path(cfg.engine.model))  # before the environment is made
        if self._env is None:
            self._env = make(cfg.env.env, **cfg.env.env_kwargs)
            stack.push_async_callback(self._env.aclose)
        model = Path(cfg.engine.model) if cfg.engine.model else default_model_for(self._env.tool_format)
        check_model_dir(model)
        self.model_dir = model
        self._eval_env = self._env
        if cfg.evaluation.eval_every and cfg.evaluation.eval_env_kwargs:
            self._eval_env = make(cfg.env.env, **{**cfg.env.env_kwargs, **cfg.evaluation.eval_env_kwargs})
            stack.push_async_callback(self._eval_env.aclose)
        from ..env import bind_tool_format

        warnings = {bind_tool_format(e, model) for e in (self._env, self._eval_env)} - {None}
        for line in sorted(warnings):  # type: ignore[type-var]  # a pinned format the model does not speak
            print(f"warning: {line}", file=sys.stderr, flush=True)
        self._judge = None
        judge = cfg.judge
        if judge.judge:  # the training env's reward only: held-out evaluations keep the env's own
            from ..judge import judge_from_spec, judged

            self._judge = judge_from_spec(judge.judge, model=str(model), deadline=judge.judge_deadline,
                                          concurrency=judge.judge_concurrency)
            stack.push_async_callback(self._judge.aclose)
            self._env = judged(self._env, self._judge, weight=judge.judge_weight, group=judge.judge_group)
        # One rollout config for the run: the runtime's reactor, its prepared sessions and the
        # held-out evaluations run with it.
        self.rollout = cfg.rollout.for_env(self._env)
        self.programs = inflight.InFlight()  # in-flight programs, for the checkpoints
        # The first steps' sessions start while the model loads (see ``open_runtime``).
        sandbox = cfg.sandbox if self._sandbox is None else self._sandbox  # the caller's: left open
        self.runtime = await stack.enter_async_context(open_runtime(
            self._env, self._engine_source(model, sampling_seed), sandbox, self.rollout,
            programs=cfg.batch.trajectories * (cfg.staleness.limit + 1), journal=self.programs))
        self._engine, self._sandbox = self.runtime.engine, self.runtime.sandbox
        weight_sink(self._engine, "agentenv train")  # before the policy is built: it pushes weights every step
        if self._judge is not None:
            self._judge.bind(self._engine)  # --judge policy: the engine it trains
            await self._judge.start()

    def _engine_source(self, model: Path, sampling_seed: int) -> Any:
        """The engine the caller passed in (left open), else the config's: in this process, or
        ``--engines`` engine actors on the cluster (weights reach them through the object store)."""
        if self._engine is not None:
            return self._engine
        cfg = self.cfg
        # A resumed run samples a new stream (seed + step), not the first run's again.
        engine = cfg.engine
        spec = EngineSpec.sampling_as(cfg.rollout, engine.engine, model,
                                      kwargs=engine_kwargs(cfg, engine.engine_args()), base_urls=engine.base_urls,
                                      seed=sampling_seed)
        if not cfg.cluster.engines:
            return spec
        from ..engines.actors import RayEngine

        cpus = {"num_cpus": self._actor_cpus} if self._actor_cpus else None
        return lambda: RayEngine.launch(spec, replicas=cfg.cluster.engines, options=cpus)

    def _policy(self) -> Policy:
        """The policy in this process, or (``cluster="ray"``) data-parallel over Ray actors."""
        cfg, opt = self.cfg, self.cfg.optimiser
        torch.manual_seed(cfg.batch.seed)
        kwargs = dict(optimiser=opt, temperature=cfg.sampling.temperature, loss=cfg.loss)
        if cfg.cluster.cluster == "ray":
            from .distributed import RayPolicy

            return RayPolicy(self.model_dir, ranks=cfg.cluster.trainer_ranks, seed=cfg.batch.seed,  # type: ignore[return-value]
                             shard=cfg.cluster.fsdp,
                             rank_options={"num_cpus": self._actor_cpus} if self._actor_cpus else None, **kwargs)
        return Policy(self.model_dir, **kwargs)

    # -- the run -----------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Train ``steps`` steps. On a Ray cluster, a trainer rank that dies stops the attempt:
        everything the run opened is closed, and a new attempt resumes from the last checkpoint
        (or starts over when there is none), at most ``rank_restarts`` times."""
        while True:
            try:
                return await self._run_once()
            except RankDiedError as exc:
                if self.restarts >= self.cfg.cluster.rank_restarts:
                    raise
                self.restarts += 1
                ckpt = latest_checkpoint(self.out)
                self.cfg = self.cfg.replace(resume=ckpt is not None)
                self._engine, self._env, self._sandbox = (
                    x if given else None for x, given in zip((self._engine, self._env, self._sandbox), self._given)
                )
                print(
                    f"agentenv train: {exc}; starting the trainer ranks again ({self.restarts}/"
                    f"{self.cfg.cluster.rank_restarts}) from {ckpt.name if ckpt else 'the start'}",
                    file=sys.stderr,
                    flush=True,
                )

    async def _run_once(self) -> dict[str, Any]:
        checkpoints = Checkpoints(self.out, self.cfg)
        start_step, ckpt = checkpoints.resume_point()
        if start_step >= self.cfg.optimiser.steps:
            raise ConfigError(f"the checkpoint is at step {start_step}; ask for --steps > {start_step}")
        if self.cfg.cluster.cluster != "ray":  # Ray ranks resolve the device on their own nodes
            check_device(self.cfg.optimiser.device)  # a device this machine lacks: refused before the engine starts
        async with AsyncExitStack() as stack:
            if self.cfg.cluster.cluster == "ray":
                from ..raycluster import connect, cpu_share

                # Here, not in a worker thread: a local cluster's processes die with the thread that started them.
                ray, started = connect()
                if started:
                    stack.callback(ray.shutdown)
                # Trainer ranks and engine actors share one node's CPUs when they need more (else some would wait
                # forever).
                self._actor_cpus = cpu_share(ray, self.cfg.cluster.trainer_ranks + self.cfg.cluster.engines)
            await self._open(stack, sampling_seed=self.cfg.batch.seed + start_step)
            self.policy = await anyio.to_thread.run_sync(self._policy)
            stack.callback(self.policy.close)
            await self._start_weights(self.policy, start_step, ckpt)
            return await self._train(checkpoints, start_step, ckpt)

    async def _start_weights(self, policy: Policy, start_step: int, ckpt: Path | None) -> None:
        """The policy as the checkpoint saved it (with the torch RNG), and the engine serving
        the same weights at version ``start_step``."""
        engine = self._engine
        # An engine with load_weights but no enable_lora cannot say: the interface's refusal.
        if self.cfg.optimiser.lora_rank:
            await getattr(engine, "enable_lora", functools.partial(WeightSink.enable_lora, engine))(policy.lora)
        if ckpt is not None:
            await anyio.to_thread.run_sync(policy.load, ckpt)
            Checkpoints.restore_rng(ckpt)
        if ckpt is not None or engine.weight_version != start_step:
            # The engine may serve other weights (a resumed run, an engine used before):
            # the base first, then the adapter, both at the checkpoint's version.
            await engine.load_weights(policy.base_tensors(), version=start_step)
            if policy.lora is not None:
                await engine.load_weights(policy.sync_tensors(), version=start_step)

    def _generation(self, checkpoints: Checkpoints, ckpt: Path | None, start_step: int) -> Generation:
        """Generation on the runtime's reactor, where the checkpoint left the task stream."""
        cfg = self.cfg
        stream = TaskStream(self._env, cfg.batch.groups_per_step, cfg.batch.seed)
        position, restored = checkpoints.restore_generation(ckpt, start_step, stream)
        return Generation(self.runtime.reactor, stream, self.programs, group_size=cfg.batch.group_size,
                          batch=cfg.batch.groups_per_step, max_staleness=cfg.staleness.limit, version=start_step,
                          position=position, restored=restored)

    async def _train(self, checkpoints: Checkpoints, start_step: int, ckpt: Path | None) -> dict[str, Any]:
        cfg, policy = self.cfg, self.policy
        assert policy is not None
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        log = RunLog(self.out, cfg, resume_step=start_step if ckpt is not None else None, rows=self.rows,
                     evals=self.evals, print_steps=self.print_steps, on_step=self.on_step)
        try:
            self.trackers = log.trackers.dirs
            generation = self._generation(checkpoints, ckpt, start_step)
            evaluator = Evaluator(cfg, self._engine, self._eval_env, self._sandbox, self.rollout, log,
                                  start_step=start_step)
            with StatusBar(self.progress, cfg.optimiser.steps, start_step) as bar:
                loop = StepLoop(cfg, policy, self._engine, generation, evaluator=evaluator, log=log,
                                checkpoints=checkpoints, bar=bar)
                summary = await loop.run(start_step)
                if self._judge is not None:
                    summary.update(self._judge.stats.summary())
                return summary
        finally:
            log.close()


def train(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Blocking entry point: ``agentenv.train.train(TrainConfig(...))``."""
    from .. import mainloop

    return mainloop.run(lambda: Trainer(cfg, **kwargs).run())


__all__ = ["TrainConfig", "Trainer", "latest_checkpoint", "train"]
