"""The bundled GRPO trainer: generation and training overlap through a bounded buffer.

Two tasks in one anyio task group share the engine, the reactor and a condition variable:

* the **generator** streams tasks; a new group starts only when the :class:`StalenessGate`
  admits it at the current weight version (so it will be consumed within ``max_staleness``
  versions); each group's G programs run in the reactor, rewards are scored as programs end
  (delayed, concurrent with other programs decoding), and the complete group enters the
  :class:`RolloutBuffer`;
* the **trainer** takes ``groups_per_step`` groups, recomputes logprobs on the exact sampled
  tokens, takes one optimiser step (token-level truncated IS against the behaviour logprobs),
  and pushes the new weights into the engine, which bumps its version *while generation
  continues*: programs in flight keep going and their later turns (vLLM: later tokens) carry
  the new version. ``partial="drain"`` instead waits for the programs in flight to finish
  before each sync.

``mode="sync"`` is the colocated baseline: the gate with ``max_staleness=0`` admits exactly
one batch per version, so generation, training and sync take turns.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import anyio
import torch

from .. import journal
from ..config import RolloutConfig
from ..env import Task
from ..errors import ConfigError, EngineError, RankDiedError, SandboxError
from ..reactor import Group, Reactor, prepare_sessions
from .batch import collate
from .buffer import RolloutBuffer, StalenessGate
from .config import TrainConfig
from .loss import LossConfig
from .metrics import BusyClock, MetricsLog, eval_line, staleness_summary, step_line
from .policy import LoraSpec, Policy, nbytes
from .tracking import Trackers, default_report_to


#: Held-out tasks come from this seed (minus the run's seed), far from the training stream's
#: seeds (seed * 1_000_003 + chunk), so a generated environment never trains on them.
EVAL_SEED = -7_777_777


def _task_stream(env: Any, cfg: TrainConfig) -> Callable[[int], Task]:
    """Task ``i`` of an endless, seeded stream (chunks of ``groups_per_step``), so a resumed
    run continues exactly where the checkpoint's consumed tasks end."""
    chunks: dict[int, list[Task]] = {}

    def task_at(i: int) -> Task:
        c, j = divmod(i, cfg.groups_per_step)
        if c not in chunks:
            chunks.clear()
            chunks[c] = env.tasks(cfg.groups_per_step, seed=cfg.seed * 1_000_003 + c)
        return chunks[c][j]

    return task_at


@dataclass
class _GenState:
    """The generator's place in the task stream (saved with each checkpoint)."""

    cursor: int = 0  # the next task index of the stream
    redo: list[int] = field(default_factory=list)  # indices to generate (again) before the cursor's
    in_flight: set[int] = field(default_factory=set)
    index: dict[int, int] = field(default_factory=dict)  # id(group) -> its task index
    saved: dict[str, Any] = field(default_factory=dict)  # task id -> its programs at the checkpoint

    def next_index(self) -> int:
        if self.redo:
            return self.redo.pop(0)
        self.cursor += 1
        return self.cursor - 1


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted((out_dir / "checkpoints").glob("step-*"))
    done = [c for c in ckpts if (c / "state.json").exists()]  # state.json is written last
    return done[-1] if done else None


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
        self.out = Path(cfg.out_dir)
        self.rows: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []  # held-out evaluations (eval.jsonl)
        self.trackers: dict[str, Path] = {}  # tracker -> its directory
        self.policy: Policy | None = None

    # -- setup -------------------------------------------------------------------------------
    async def _open(self, stack: AsyncExitStack, sampling_seed: int) -> None:
        from agentenv.sandboxes import default_sandbox

        from ..checker import check_env
        from ..engines import open_engine
        from ..engines.embedded import check_model_dir
        from ..models import default_model
        from ..registry import make

        cfg = self.cfg
        model = Path(cfg.model) if cfg.model else default_model()
        check_model_dir(model)
        self.model_dir = model
        if self._env is None:
            self._env = make(cfg.env, **cfg.env_kwargs)
            stack.push_async_callback(self._env.aclose)
        self._eval_env = self._env
        if cfg.eval_every and cfg.eval_env_kwargs:
            self._eval_env = make(cfg.env, **{**cfg.env_kwargs, **cfg.eval_env_kwargs})
            stack.push_async_callback(self._eval_env.aclose)
        if self._sandbox is None:
            self._sandbox = await stack.enter_async_context(default_sandbox(cfg.sandbox))
        # The first steps' sessions start while the model loads (see ``prepare_sessions``).
        await prepare_sessions(self._env, self._sandbox, RolloutConfig(concurrency=cfg.concurrency,
                                                                       scheduling=cfg.scheduling),
                               cfg.groups_per_step * cfg.group_size * (cfg.staleness + 1))
        if self._engine is None:
            # A resumed run samples a new stream (seed + step), not the first run's again.
            if cfg.engines:  # engine actors on the cluster; weights reach them through the object store
                from ..engines.actors import RayEngine

                cpus = {"num_cpus": self._actor_cpus} if self._actor_cpus else None
                self._engine = await RayEngine.start(cfg.engine, str(model), replicas=cfg.engines, options=cpus,
                                                     temperature=cfg.temperature, seed=sampling_seed,
                                                     base_urls=cfg.base_urls, **cfg.engine_kwargs)
            else:
                self._engine = await open_engine(cfg.engine, str(model), temperature=cfg.temperature,
                                                 seed=sampling_seed, base_urls=cfg.base_urls, **cfg.engine_kwargs)
            stack.push_async_callback(self._engine.aclose)
        check_env(self._env, tokenizer=self._engine.tokenizer)

    def _policy(self) -> Policy:
        """The policy in this process, or (``cluster="ray"``) data-parallel over Ray actors."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        lora = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha) if cfg.lora_rank else None
        loss = LossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, is_cap=cfg.is_cap, aggregation=cfg.aggregation,
                          kl_coef=cfg.kl_coef)
        kwargs = dict(lr=cfg.lr, max_grad_norm=cfg.max_grad_norm, temperature=cfg.temperature, lora=lora,
                      micro_batch=cfg.micro_batch, micro_batch_tokens=cfg.micro_batch_tokens, loss=loss)
        if cfg.cluster == "ray":
            from .distributed import RayPolicy

            return RayPolicy(self.model_dir, ranks=cfg.trainer_ranks, seed=cfg.seed, shard=cfg.fsdp,  # type: ignore[return-value]
                             rank_options={"num_cpus": self._actor_cpus} if self._actor_cpus else None, **kwargs)
        return Policy(self.model_dir, **kwargs)

    def _resume_state(self) -> tuple[int, Path | None]:
        if not self.cfg.resume:
            return 0, None
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            raise ConfigError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
        state = json.loads((ckpt / "state.json").read_text())
        saved = state["config"]
        for key in TrainConfig.RESUME_KEYS:
            if saved.get(key) != asdict(self.cfg)[key]:
                raise ConfigError(f"--resume: {key} was {saved.get(key)!r} in {ckpt}, now {asdict(self.cfg)[key]!r}")
        return int(state["step"]), ckpt

    def _checkpoint(self, policy: Policy, step: int, tasks: dict[str, Any] | None = None,
                    buffered: list[tuple[int, Group]] = ()) -> Path:
        """The policy and optimiser, and what generation had made of the task stream: the
        complete groups waiting in the buffer (saved whole, with their weight versions), the
        tasks in flight (generated again on resume), and the stream's next position."""
        path = self.out / "checkpoints" / f"step-{step:06d}"
        policy.save(path)
        with open(path / "buffer.jsonl", "w", encoding="utf-8") as f:
            for index, group in buffered:
                f.write(json.dumps({"index": index, "trajectories": [t.to_dict() for t in group.trajectories]}) + "\n")
        state = {"step": step, "version": step, "task_cursor": step * self.cfg.groups_per_step,
                 "config": asdict(self.cfg), "torch_rng": torch.get_rng_state().tolist()}
        if tasks is not None:
            state["tasks"] = tasks
        (path / "state.json").write_text(json.dumps(state))  # last: marks the checkpoint complete
        return path

    def _restore_generation(self, ckpt: Path | None, start_step: int, task_at: Callable[[int], Task]
                            ) -> tuple["_GenState", list[tuple[int, Group]]]:
        """Where generation stands after a checkpoint: the buffered groups it saved, the tasks
        to generate again first (those in flight at the checkpoint), then the stream onward."""
        from ..trajectory import Trajectory

        gen = _GenState(cursor=start_step * self.cfg.groups_per_step)
        state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else {}
        if "tasks" not in state:  # a fresh run, or a checkpoint from before buffers were saved
            return gen, []
        gen.cursor, gen.redo = state["tasks"]["next"], list(state["tasks"]["in_flight"])
        gen.saved = dict(state["tasks"].get("programs", {}))
        restored = []
        buf = ckpt / "buffer.jsonl"
        for line in (buf.read_text().splitlines() if buf.exists() else []):
            d = json.loads(line)
            restored.append((d["index"], Group(task_at(d["index"]), [Trajectory.from_dict(t) for t in d["trajectories"]])))
        return gen, restored

    # -- the run -----------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Train ``steps`` steps. On a Ray cluster, a trainer rank that dies stops the attempt:
        everything the run opened is closed, and a new attempt resumes from the last checkpoint
        (or starts over when there is none), at most ``rank_restarts`` times."""
        while True:
            try:
                return await self._run_once()
            except RankDiedError as exc:
                if self.restarts >= self.cfg.rank_restarts:
                    raise
                self.restarts += 1
                ckpt = latest_checkpoint(self.out)
                self.cfg = replace(self.cfg, resume=ckpt is not None)
                self._engine, self._env, self._sandbox = (x if given else None for x, given in
                                                          zip((self._engine, self._env, self._sandbox), self._given))
                print(f"agentenv train: {exc}; starting the trainer ranks again ({self.restarts}/"
                      f"{self.cfg.rank_restarts}) from {ckpt.name if ckpt else 'the start'}", flush=True)

    async def _run_once(self) -> dict[str, Any]:
        start_step, ckpt = self._resume_state()
        if start_step >= self.cfg.steps:
            raise ConfigError(f"the checkpoint is at step {start_step}; ask for --steps > {start_step}")
        async with AsyncExitStack() as stack:
            if self.cfg.cluster == "ray":
                from ..raycluster import connect, cpu_share

                # Here, not in a worker thread: a local cluster's processes die with the thread that started them.
                ray, started = connect()
                if started:
                    stack.callback(ray.shutdown)
                # Trainer ranks and engine actors share one node's CPUs when they need more (else some would wait forever).
                self._actor_cpus = cpu_share(ray, self.cfg.trainer_ranks + self.cfg.engines)
            await self._open(stack, sampling_seed=self.cfg.seed + start_step)
            self.policy = await anyio.to_thread.run_sync(self._policy)
            stack.callback(self.policy.close)
            return await self._train(start_step, ckpt)

    async def _train(self, start_step: int, ckpt: Path | None) -> dict[str, Any]:
        cfg, engine = self.cfg, self._engine
        policy = self.policy
        assert policy is not None
        if cfg.lora_rank:
            await engine.enable_lora(policy.lora)
        if ckpt is not None:
            await anyio.to_thread.run_sync(policy.load, ckpt)
            torch.set_rng_state(torch.tensor(json.loads((ckpt / "state.json").read_text())["torch_rng"],
                                             dtype=torch.uint8))
        if ckpt is not None or engine.weight_version != start_step:
            # The engine may serve other weights (a resumed run, an engine used before):
            # the base first, then the adapter, both at the checkpoint's version.
            await engine.load_weights(policy.base_tensors(), version=start_step)
            if policy.lora is not None:
                await engine.load_weights(policy.sync_tensors(), version=start_step)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(asdict(self.cfg), indent=1))
        kept = start_step if ckpt is not None else None
        log = MetricsLog(self.out / "metrics.jsonl", resume_step=kept)
        eval_log = MetricsLog(self.out / "eval.jsonl", resume_step=kept) if cfg.eval_every else None
        try:
            trackers = Trackers(default_report_to() if cfg.report_to is None else cfg.report_to, self.out,
                                asdict(cfg), resume=ckpt is not None)
        except BaseException:
            log.close()
            raise
        self.trackers = trackers.dirs

        rollout = RolloutConfig(
            max_turns=cfg.max_turns or self._env.max_turns, max_new_tokens=cfg.max_new_tokens,
            concurrency=cfg.concurrency, scheduling=cfg.scheduling,
            tool_timeout=cfg.tool_timeout or self._env.tool_timeout, temperature=cfg.temperature)
        tracker = journal.InFlight()  # in-flight programs, for the checkpoints
        reactor = Reactor(engine, self._env, self._sandbox, rollout, journal=tracker)
        b, s = cfg.groups_per_step, cfg.staleness
        task_at = _task_stream(self._env, cfg)
        gen, restored = self._restore_generation(ckpt, start_step, task_at)
        gate = StalenessGate(batch=b, max_staleness=s, started=start_step * b + len(restored))
        buffer = RolloutBuffer(capacity=max((s + 1) * b, len(restored)), max_staleness=s)
        for index, group in restored:  # too stale for this version: dropped at the first take
            gen.index[id(group)] = index
            buffer.put(group)
        cond = anyio.Condition()
        gen_clock = BusyClock()
        st = {"version": start_step, "draining": False, "trainer_wait_s": 0.0}
        pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        t0 = time.perf_counter()

        async def run_group(index: int) -> None:
            task = task_at(index)
            saved = gen.saved.pop(task.id, None)  # in flight at the checkpoint: continue it
            resume, finished = journal.restore(saved) if saved is not None else (None, ())
            gen_clock.enter()
            try:
                group = await reactor.group(task, cfg.group_size, resume=resume, finished=finished)
            finally:
                gen_clock.exit()
            tracker.forget(task.id)
            async with cond:
                gen.in_flight.discard(index)
                gen.index[id(group)] = index
                buffer.put(group)
                cond.notify_all()

        async def generator(tg: anyio.abc.TaskGroup) -> None:
            while True:
                async with cond:
                    while st["draining"] or not gate.can_start(st["version"]):
                        await cond.wait()
                    gate.start(st["version"])
                    index = gen.next_index()
                    gen.in_flight.add(index)
                tg.start_soon(run_group, index)

        async def next_batch() -> list[Group]:
            waited = time.perf_counter()
            async with cond:
                while True:
                    before = buffer.dropped
                    groups = buffer.take(b, st["version"])
                    if buffer.dropped > before:  # stale stragglers: let replacements start
                        gate.started -= buffer.dropped - before
                        cond.notify_all()
                    if groups is not None:
                        break
                    await cond.wait()
            st["trainer_wait_s"] += time.perf_counter() - waited
            return groups

        # The evaluation before the first step is the baseline the others are compared with: the
        # first weight sync waits for it, so it sees only the starting weights.
        baseline = anyio.Event()
        if not (cfg.eval_every and start_step == 0):
            baseline.set()

        async def evaluate(step: int) -> None:
            """Held-out tasks with the weights of the moment (a sync during it shows in ``versions``;
            the first sync waits for the baseline), on a reactor of its own: its programs are not
            the checkpoint's in-flight work. If it fails, the task group is cancelled, and with
            it a sync waiting for the baseline."""
            from ..evaluation import report

            env = self._eval_env
            version, t_eval = engine.weight_version, time.perf_counter()
            async with Reactor(engine, env, self._sandbox, rollout) as r:
                groups = await r.collect(env.tasks(cfg.eval_tasks, seed=EVAL_SEED - cfg.seed), cfg.eval_k)
            if step == 0:
                baseline.set()
            trajs = [t for g in groups for t in g.trajectories]
            rep = report(trajs)
            versions = [v for t in trajs for seg in t.segments if seg.kind == "model" for v in seg.weight_versions]
            row = {"step": step, "version": version, "versions": [min(versions), max(versions)] if versions else None,
                   "eval_s": round(time.perf_counter() - t_eval, 2), "tasks": rep["tasks"], "samples": rep["samples"],
                   **{f"pass@{k}": v for k, v in rep["pass@k"].items()}, "mean_reward": rep["mean_reward"],
                   **{f"mean_{k}": v for k, v in rep["components"].items()},
                   "finish_reasons": rep["finish_reasons"]}
            assert eval_log is not None
            eval_log.write(row)
            trackers.log(row, step, prefix="eval")
            self.evals.append(row)
            if self.print_steps:
                print(eval_line(row), flush=True)

        last = {"t0": t0, "t": t0, "tokens": 0, "gen_busy": 0.0, "wait": 0.0}
        bar, bar_task = _status_bar(self.progress, cfg.steps, start_step)

        async def status() -> None:
            while True:
                bar.update(bar_task, info=f"v{st['version']}  buffer {len(buffer)}/{b} groups  "
                           f"{gen_clock.active} groups generating  {reactor.stats.sampled_tokens} tokens sampled")
                await anyio.sleep(0.5)
        summary: dict[str, Any] = {}
        bar.start()
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(generator, tg)
                    if self.progress:
                        tg.start_soon(status)
                    if cfg.eval_every and start_step == 0:
                        tg.start_soon(evaluate, 0)  # the starting model, for comparison
                    for step in range(start_step + 1, cfg.steps + 1):
                        stale_before = Counter(buffer.staleness)
                        groups = await next_batch()
                        _check_batch(groups, step)
                        batch = collate(groups, pad_id=pad)
                        t_train = time.perf_counter()
                        stats = await anyio.to_thread.run_sync(policy.train_step, batch)
                        train_s = time.perf_counter() - t_train
                        if cfg.partial == "drain":
                            async with cond:
                                st["draining"] = True
                                while gen_clock.active:
                                    await cond.wait()
                        await baseline.wait()
                        in_flight = gen_clock.active  # groups that continue across this update
                        t_sync = time.perf_counter()
                        tensors = policy.sync_tensors()
                        await engine.load_weights(tensors, version=step)
                        sync_s = time.perf_counter() - t_sync
                        async with cond:
                            st["version"], st["draining"] = step, False
                            cond.notify_all()
                        row = self._row(step, groups, batch, stats, train_s, sync_s, nbytes(tensors), policy,
                                        buffer.staleness - stale_before, buffer.dropped, reactor, gen_clock, st, last)
                        row["groups_in_flight_at_sync"] = in_flight
                        log.write(row)
                        trackers.log(row, step)
                        self.rows.append(row)
                        bar.advance(bar_task)
                        if self.print_steps:
                            print(step_line(row, cfg.steps), flush=True)
                        if self.on_step is not None:
                            self.on_step(row)
                        gen.index = {id(g): gen.index[id(g)] for g in buffer.groups}  # consumed/dropped: gone
                        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                            tasks = {"next": gen.cursor, "in_flight": sorted(gen.in_flight),
                                     "buffered": len(gen.index),
                                     "programs": tracker.snapshot({task_at(i).id for i in gen.in_flight})}
                            buffered = [(gen.index[id(g)], g) for g in buffer.groups]
                            await anyio.to_thread.run_sync(self._checkpoint, policy, step, tasks, buffered)
                        if cfg.eval_every and step < cfg.steps and step % cfg.eval_every == 0:
                            tg.start_soon(evaluate, step)
                    if cfg.eval_every:
                        await evaluate(cfg.steps)  # the final weights; evaluations still running are dropped
                    tg.cancel_scope.cancel()  # groups started for later steps are not needed
            except BaseExceptionGroup as eg:  # one failure inside the task group: raise it as is
                leaves = _leaves(eg)
                if len(leaves) == 1:
                    raise leaves[0] from None
                raise
            wall = time.perf_counter() - t0
            summary = {
                "steps": cfg.steps, "start_step": start_step, "mode": cfg.mode, "wall_s": round(wall, 2),
                "gen_idle_frac": round(max(0.0, 1 - gen_clock.busy_s / wall), 4),
                "trainer_idle_frac": round(st["trainer_wait_s"] / wall, 4),
                "staleness": staleness_summary(buffer.staleness)[0], "dropped_groups": buffer.dropped,
                "first_reward": self.rows[0]["reward_mean"] if self.rows else None,
                "last_reward": self.rows[-1]["reward_mean"] if self.rows else None,
                "checkpoint": str(latest_checkpoint(self.out)),
            }
            if self.evals:
                first, final = self.evals[0], self.evals[-1]
                summary["eval"] = {"first_step": first["step"], "first_pass@1": first["pass@1"],
                                   "last_step": final["step"], "last_pass@1": final["pass@1"]}
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        finally:
            bar.stop()
            log.close()
            if eval_log is not None:
                eval_log.close()
            trackers.close()
        return summary

    def _row(self, step: int, groups: list[Group], batch: Any, stats: dict, train_s: float, sync_s: float,
             sync_bytes: int, policy: Policy, stale: Counter, dropped: int, reactor: Reactor,
             gen_clock: BusyClock, st: dict, last: dict) -> dict[str, Any]:
        now = time.perf_counter()
        dt = max(now - last["t"], 1e-9)
        tokens = reactor.stats.sampled_tokens
        gen_busy, wait = gen_clock.busy_s, st["trainer_wait_s"]
        rewards = [r for r in batch.rewards if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else float("nan")
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else float("nan")
        hist, stale_mean = staleness_summary(stale)
        flat = [g.rewards for g in groups]
        row = {
            "step": step, "version": step, "time_s": round(now - last["t0"], 3),
            "reward_mean": mean, "reward_std": std, "groups": len(groups), "trajectories": batch.size,
            "reward_failures": sum(r is None for r in batch.rewards),
            "zero_variance_groups": sum(1 for rs in flat if len({r for r in rs if r is not None}) <= 1),
            "trained_tokens": batch.trained_tokens, **{k: round(v, 6) for k, v in stats.items()},
            "staleness": hist, "staleness_mean": round(stale_mean, 4), "dropped_groups": dropped,
            "gen_tokens_per_s": round((tokens - last["tokens"]) / dt, 1),
            "gen_idle_frac": round(min(1.0, max(0.0, 1 - (gen_busy - last["gen_busy"]) / dt)), 4),
            "trainer_idle_frac": round(min(1.0, max(0.0, (wait - last["wait"]) / dt)), 4),
            "train_s": round(train_s, 4), "sync_s": round(sync_s, 4), "sync_bytes": sync_bytes,
            "full_sync_bytes": policy.full_bytes, "step_s": round(dt, 3),
            "task_ids": [g.task.id for g in groups],
        }
        last.update(t=now, tokens=tokens, gen_busy=gen_busy, wait=wait)
        return row


def _leaves(eg: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out += _leaves(e) if isinstance(e, BaseExceptionGroup) else [e]
    return out


def _check_batch(groups: list[Group], step: int) -> None:
    """Failures are data, but a batch in which *every* program failed in the engine or the
    sandbox means the run cannot learn anything: stop with the first error."""
    trajs = [t for g in groups for t in g.trajectories]
    infra = [t for t in trajs if t.finish_reason in ("error:engine", "error:sandbox")]
    if trajs and len(infra) == len(trajs):
        where = infra[0].finish_reason.split(":")[1]
        err = EngineError if where == "engine" else SandboxError
        raise err(f"every program of step {step} failed in the {where}: {infra[0].error}")


def _status_bar(enabled: bool, total: int, done: int) -> tuple[Any, Any]:
    """A rich progress bar on stderr (steps, plus what the generator is doing); a no-op when
    disabled. Step lines go to stdout either way."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"), console=Console(stderr=True), disable=not enabled)
    return bar, bar.add_task("train", total=total, completed=done, info="starting")


def train(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Blocking entry point: ``agentenv.train.train(TrainConfig(...))``."""
    return anyio.run(lambda: Trainer(cfg, **kwargs).run())


__all__ = ["TrainConfig", "Trainer", "latest_checkpoint", "train"]
