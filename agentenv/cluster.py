"""Rollouts on a Ray cluster: rollout workers are Ray actors, each with its own reactor, engine
and local sandbox pool on its node; the driver keeps the global queue of groups.

    async with RayRollouts("retool-math", workers=2, config=RolloutConfig()) as cluster:
        async for traj in cluster.rollouts(env.tasks(64), group_size=4):
            ...   # the same Trajectory objects a one-machine run yields

``env`` is an id or spec string, or an :class:`~agentenv.env.Environment` instance (the workers
then make its class, imported with the driver's ``sys.path``, and give it the instance's id;
when the class's module is one file of the user's own, its text goes with the spec, so a
worker on a node without that file makes the class all the same: ``registry.portable_spec``).
Optional (``pip install agentenv[ray]``). The cluster is the one at ``address`` or
``RAY_ADDRESS``; with neither, a local one is started for the run and shut down after.

* **Placement.** A group goes to the live worker with the fewest groups in flight, up to
  ``groups_per_worker`` each (by default enough to fill its reactor's decode slots), so a
  worker whose programs are slow (long tool calls, a busy node) is given less.
* **Streaming.** Trajectories come back a group at a time, as each group completes (rewards
  and ``group_reward`` applied on the worker), in the same format as a local run.
* **Faults.** A worker that dies (node lost, process killed) is replaced by a new actor; the
  groups it had in flight continue on the live workers from their latest snapshot: every
  ``snapshot_interval`` seconds the driver asks each worker for its in-flight programs as of
  their last completed turn (the same in-memory log a trainer checkpoint saves; the worker
  sends only the turns and finished programs the driver lacks, merged into what it holds), so the
  programs resume there (the notebook rebuilt by replaying their logged tool calls) and the
  group's finished programs are kept; a group with no snapshot yet runs again from the start.
  Only complete groups are ever yielded, so nothing is lost and nothing appears twice.

Engines: with ``engines=N``, N engine actors (``engines.actors``: ``embedded``, ``vllm`` with
``engine_options={"num_gpus": 1}``, or ``openai`` clients of ``base_urls``) serve every
worker; each worker routes its programs over all of them by KV room (each actor reports the KV
held by every worker's programs), its scheduler keeping its working set within 1/``workers``
of their total KV; an engine actor that dies is restarted and its requests go to the others.
With ``engines=0``, each worker opens its own engine in its process (``embedded``: a copy of
the model per worker; ``vllm``: give each worker a GPU with ``worker_options={"num_gpus": 1}``;
``openai``: every worker a client of the same servers).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import deque
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable, Sequence

from .config import RolloutConfig
from .env import Environment, Task
from .errors import ConfigError, EngineError, describe
from .journal import holding, merge_snapshot
from .raycluster import actor_options, connect, cpu_share, died_errors
from .raycluster import ray_module as _ray
from .trajectory import Trajectory


class RolloutWorker:
    """The Ray actor (wrapped by ``ray.remote`` at start): one reactor, engine and sandbox pool,
    open for the actor's life in a task that owns them, serving ``group`` calls concurrently."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from .journal import InFlight

        self.spec = spec
        self.reactor: Any = None
        self.log = InFlight()  # every program's state at its last completed turn
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: str | None = None

    async def start(self) -> int:
        self._ready, self._stop = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._hold())
        await self._ready.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        return os.getpid()

    async def _hold(self) -> None:
        from .engines import open_engine
        from .reactor import Reactor
        from .registry import make_portable
        from .sandboxes import default_sandbox

        s = self.spec
        try:
            sys.path.extend(p for p in s.get("sys_path", ()) if p not in sys.path)
            env = make_portable(s["env"], **s["env_args"])
            if s.get("env_id"):
                env.id = s["env_id"]
            config = RolloutConfig(**s["config"])
            if s.get("engine_actors"):  # the driver's engine actors, shared by every worker
                from .engines.actors import RayEngine

                engine = await RayEngine.connect(s["engine_actors"], s["model"], share=1 / s["workers"])
            else:
                engine = await open_engine(s["engine"], s["model"], temperature=config.temperature,
                                           top_p=config.top_p, seed=s["seed"], base_urls=s["base_urls"],
                                           **s["engine_kwargs"])
            async with engine, default_sandbox(s["sandbox"]) as sandbox, \
                    Reactor(engine, env, sandbox, config, journal=self.log) as reactor:
                self.reactor = reactor
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the driver by start() and group()
            self._error = describe(exc)
        finally:
            self.reactor = None
            self._ready.set()

    async def group(self, task: dict[str, Any], group_size: int, saved: dict[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
        """Run one group; ``saved`` (a :meth:`snapshot` entry from a worker that died) continues
        its programs from their last completed turn and keeps its finished ones."""
        from .journal import restore

        if self.reactor is None:
            raise RuntimeError(self._error or "the rollout worker is not running")
        resume, finished = restore(saved) if saved else (None, ())
        for t in finished:  # in this worker's snapshots too, should it die in turn
            self.log.finished(t)
        try:
            group = await self.reactor.group(Task(**task), group_size, resume=resume, finished=finished)
        finally:
            self.log.forget(task["id"])
        return [t.to_dict() for t in group.trajectories]

    async def snapshot(self, task_ids: list[str], have: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The tasks' programs as of their last completed turn (see ``journal.InFlight``); with
        ``have`` (what the driver holds), only what it lacks."""
        return self.log.snapshot(set(task_ids), have)

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await self._task


class RayRollouts:
    """Rollout workers on a Ray cluster behind one async iterator (see the module doc)."""

    def __init__(self, env: "str | Environment", *, workers: int = 2, env_args: dict[str, Any] | None = None,
                 engine: str = "embedded", model: str | None = None, engine_kwargs: dict[str, Any] | None = None,
                 base_urls: Sequence[str] | None = None, sandbox: str = "local", config: RolloutConfig | None = None,
                 seed: int = 0, groups_per_worker: int | None = None, address: str | None = None,
                 worker_options: dict[str, Any] | None = None, snapshot_interval: float | None = 1.0,
                 engines: int = 0, engine_options: dict[str, Any] | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        if model is None:
            from .models import default_model

            model = str(default_model())
        self.config = config or RolloutConfig()
        from .registry import portable_spec

        # An instance: the workers make its class, under its id; a user's one-file module goes
        # with it, for workers on nodes without the file. The workers' sys.path is extended
        # with this one's, so what this process imports, a worker on this machine does too.
        env, env_id = ({"env": env, "source": None}, None) if isinstance(env, str) else (portable_spec(env), env.id)
        self.spec = {"env": env, "env_id": env_id, "sys_path": list(sys.path), "env_args": dict(env_args or {}),
                     "engine": engine, "model": str(model), "engine_kwargs": dict(engine_kwargs or {}),
                     "base_urls": list(base_urls or []) or None, "sandbox": sandbox, "config": asdict(self.config),
                     "seed": seed, "workers": workers}
        if engines < 0:
            raise ConfigError(f"engines must be >= 0, got {engines}")
        self.engines_wanted = engines
        self.engine_options = dict(engine_options or {})
        self.engine_actors: list[Any] = []
        self.workers_wanted = workers
        self.groups_per_worker = groups_per_worker
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.worker_options = actor_options(worker_options, num_cpus=1)  # OpenMP waits passively
        self._cpus_given = "num_cpus" in (worker_options or {}) or "num_cpus" in (engine_options or {})
        self.workers: list[Any] = []
        self.pids: list[int] = []
        self.replaced = 0  # workers that died and were replaced
        self.rerun = 0  # groups run again because their worker died
        self.continued = 0  # ... of which continued from a snapshot, not from the start
        self.snapshot_interval = snapshot_interval
        self.snapshots: dict[str, dict[str, Any]] = {}  # task id -> its group's latest snapshot
        self.placed: dict[str, Any] = {}  # task id -> the worker actor running its group now
        self._started_ray = False
        self._actor_cls: Any = None

    async def __aenter__(self) -> "RayRollouts":
        ray, self._started_ray = connect(self.address)
        each = cpu_share(ray, self.workers_wanted + self.engines_wanted)
        if not self._cpus_given and each:  # one node without the CPUs for them: share its CPUs
            self.worker_options["num_cpus"] = each
            self.engine_options["num_cpus"] = each
        self._actor_cls = ray.remote(RolloutWorker).options(**self.worker_options)
        try:
            if self.engines_wanted:
                from .engines.actors import start_actors

                s, c = self.spec, self.config
                self.engine_actors = start_actors(s["engine"], s["model"], replicas=self.engines_wanted,
                                                  options=self.engine_options, temperature=c.temperature,
                                                  top_p=c.top_p, seed=s["seed"], base_urls=s["base_urls"],
                                                  **s["engine_kwargs"])
                self.spec["engine_actors"] = self.engine_actors
            await asyncio.gather(*(self._add_worker() for _ in range(self.workers_wanted)))
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _add_worker(self, index: int | None = None) -> None:
        actor = self._actor_cls.remote(self.spec)
        try:
            pid = await actor.start.remote()
        except Exception as exc:  # noqa: BLE001 - the worker could not open its engine/sandbox
            _ray().kill(actor)
            hint = ("; the environment's own module travels with the workers, but what it imports must be "
                    "installed on every node (or shipped with worker_options={'runtime_env': ...})"
                    if "EnvNotFoundError" in str(exc) else "")
            raise EngineError(f"a rollout worker failed to start: {exc}{hint}") from exc
        if index is None:
            self.workers.append(actor)
            self.pids.append(pid)
        else:
            self.workers[index], self.pids[index] = actor, pid

    async def aclose(self) -> None:
        ray = _ray()
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                await asyncio.wait_for(w.stop.remote(), 10)
            except Exception:  # noqa: BLE001 - a dead or stuck worker is killed below anyway
                pass
            ray.kill(w)
        if self.engine_actors:
            from .engines.actors import stop_actors

            actors, self.engine_actors = self.engine_actors, []
            await stop_actors(actors)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def _per_worker(self, group_size: int) -> int:
        if self.groups_per_worker:
            return self.groups_per_worker
        return max(1, -(-self.config.concurrency // max(1, group_size)))

    async def rollouts(self, tasks: Sequence[Task], group_size: int, *, saved: dict[str, dict[str, Any]] | None = None,
                       on_snapshot: Callable[[str, dict[str, Any]], None] | None = None) -> AsyncIterator[Trajectory]:
        """Run ``group_size`` programs of every task on the workers; yield each trajectory when
        its group is complete. Cancelling the iteration leaves the workers running nothing of it.

        ``saved`` (task id -> snapshot, see ``journal.snapshot_of``) continues groups a run
        left unfinished; ``on_snapshot(task_id, snapshot)`` sees every snapshot taken (the CLI
        logs them, so ``--resume`` continues the programs). A group given its finished
        trajectories yields them again with the rest."""
        ray = _ray()
        self.snapshots.update(saved or {})
        queue = deque(tasks)
        per_worker = self._per_worker(group_size)
        inflight: dict[asyncio.Future, tuple[int, Any, Task]] = {}  # future -> (worker index, actor, task)
        load = [0] * len(self.workers)

        refs: dict[asyncio.Future, Any] = {}
        died = died_errors()

        def call(actor: Any, task: Task, saved: dict[str, Any] | None) -> asyncio.Future:
            ref = actor.group.remote(asdict(task), group_size, saved)

            async def wait() -> list[dict[str, Any]]:
                return await ref

            fut = asyncio.ensure_future(wait())
            refs[fut] = ref
            return fut

        async def poll() -> None:
            """Keep each in-flight group's latest snapshot (its programs at their last completed
            turn), so a group whose worker dies continues from there."""
            while True:
                await asyncio.sleep(self.snapshot_interval)
                by_actor: dict[Any, list[str]] = {}
                for _, actor, task in list(inflight.values()):
                    by_actor.setdefault(actor, []).append(task.id)
                # Each worker sends only what the driver lacks (``journal.InFlight.snapshot``):
                # new turns and newly finished programs, not every program's whole prefix.
                have = {a: {tid: holding(self.snapshots.get(tid)) for tid in ids} for a, ids in by_actor.items()}
                replies = await asyncio.gather(*(a.snapshot.remote(ids, have[a]) for a, ids in by_actor.items()),
                                               return_exceptions=True)
                running = {task.id for _, _, task in inflight.values()}
                for reply in replies:
                    if isinstance(reply, dict):
                        for tid, part in reply.items():
                            if tid in running:
                                snap = self.snapshots[tid] = merge_snapshot(self.snapshots.get(tid), part)
                                if on_snapshot is not None:
                                    on_snapshot(tid, snap)

        poller = asyncio.ensure_future(poll()) if self.snapshot_interval else None
        try:
            while queue or inflight:
                while queue:
                    free = [i for i in range(len(self.workers)) if load[i] < per_worker]
                    if not free:
                        break
                    i = min(free, key=lambda j: load[j])
                    task = queue.popleft()
                    fut = call(self.workers[i], task, self.snapshots.get(task.id))
                    inflight[fut] = (i, self.workers[i], task)
                    self.placed[task.id] = self.workers[i]
                    load[i] += 1
                done, _ = await asyncio.wait([*inflight, *([poller] if poller else [])],
                                             return_when=asyncio.FIRST_COMPLETED)
                if poller in done:
                    poller.result()  # it ends only by failing (on_snapshot raised): raise that here
                for fut in done - {poller}:
                    i, actor, task = inflight.pop(fut)
                    refs.pop(fut, None)
                    if actor is self.workers[i]:
                        load[i] -= 1
                    try:
                        dicts = fut.result()
                    except died:
                        self.rerun += 1
                        self.continued += task.id in self.snapshots
                        queue.appendleft(task)  # again, elsewhere: from its snapshot, or whole
                        if actor is self.workers[i]:  # the first of its failures: replace it
                            self.replaced += 1
                            load[i] = 0
                            await self._add_worker(i)
                        continue
                    self.snapshots.pop(task.id, None)
                    self.placed.pop(task.id, None)
                    for d in dicts:
                        yield Trajectory.from_dict(d)
        finally:  # stop what is still running on the workers (their reactors cancel its programs)
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
            for fut in inflight:
                try:
                    ray.cancel(refs[fut])
                except Exception:  # noqa: BLE001 - its worker may be gone
                    pass
                fut.cancel()
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)


__all__ = ["RayRollouts", "RolloutWorker", "connect"]
