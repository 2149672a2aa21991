"""Rollouts on a Ray cluster: rollout workers are Ray actors, each with its own reactor, engine
and local sandbox pool on its node; the driver keeps the global queue of groups.

    async with RayRollouts("retool-math", workers=2, config=RolloutConfig()) as cluster:
        async for group in cluster.rollouts(env.tasks(64), group_size=4):
            ...   # the same Group objects a one-machine run yields, each complete

``env`` is an id or spec string, or an :class:`~agentenv.env.Environment` instance (the workers
then make its class, imported with the driver's ``sys.path``, and give it the instance's id;
when the class's module is one file of the user's own, its text goes with the spec, so a
worker on a node without that file makes the class all the same: ``registry.portable_spec``).
Optional (``pip install agentenv[ray]``). The cluster is the one at ``address`` or
``RAY_ADDRESS``; with neither, a local one is started for the run and shut down after.

* **Placement.** A group goes to the live worker with the fewest groups in flight, up to
  ``groups_per_worker`` each (by default enough to fill its reactor's decode slots), so a
  worker whose programs are slow (long tool calls, a busy node) is given less.
* **Streaming.** Groups come back as each completes (rewards and ``group_reward`` applied on
  the worker), as :class:`~agentenv.reactor.Group` objects, as a local run's reactor yields them.
* **Workers** open their sandbox first and start the sessions their first programs will take
  (``prepare_sessions``), then the engine, as a one-machine run does.
* **Faults.** A worker that dies (node lost, process killed) is replaced by a new actor; the
  groups it had in flight continue on the live workers from their latest snapshot: every
  ``snapshot_interval`` seconds the driver asks each worker for its in-flight programs as of
  their last completed turn (the same in-memory log a trainer checkpoint saves; the worker
  sends only the turns and finished programs the driver lacks, merged into what it holds), so the
  programs resume there (the notebook rebuilt by replaying their logged tool calls) and the
  group's finished programs are kept; a group with no snapshot yet runs again from the start.
  An agent program's snapshot is its answered gateway calls: it runs again from its start,
  answered from them while its requests match (``agentenv.gateway.program``).
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
import contextlib
import os
import sys
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, AsyncIterator, Callable, Sequence

from .config import RolloutConfig, SandboxOptions
from .engines.spec import EngineSpec
from .env import Environment, Task
from .errors import ConfigError, EngineError, describe
from .inflight import holding, merge_snapshot
from .raycluster import actor_options, connect, cpu_share, died_errors
from .raycluster import ray_module as _ray
from .reactor import Group
from .trajectory import Trajectory


@dataclass(frozen=True)
class WorkerSpec:
    """What a rollout worker opens: its environment (``registry.portable_spec`` form, or an id),
    its engine (or the driver's engine actors), its sandbox and the reactor's config."""

    env: dict[str, Any]
    env_id: str | None
    env_args: dict[str, Any]
    engine: EngineSpec
    sandbox: SandboxOptions | str  # its kind, or the kind with limits
    config: RolloutConfig
    workers: int  # how many share the engine actors: each keeps to 1/workers of their KV
    sys_path: list[str]
    engine_actors: list[Any] | None = None

    def make_env(self) -> Environment:
        from .registry import make_portable

        sys.path.extend(p for p in self.sys_path if p not in sys.path)
        env = make_portable(self.env, **self.env_args)
        if self.env_id:
            env.id = self.env_id
        return env


class RolloutWorker:
    """The Ray actor (wrapped by ``ray.remote`` at start): one reactor, engine and sandbox pool,
    open for the actor's life in a task that owns them, serving ``group`` calls concurrently."""

    def __init__(self, spec: WorkerSpec) -> None:
        from .inflight import InFlight

        self.spec = spec
        self.reactor: Any = None
        self.in_flight = InFlight()  # every program's state at its last completed turn
        self.prepared = 0  # sandbox sessions started while the engine loaded
        self._ready: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: str | None = None

    async def start(self) -> dict[str, int]:
        """Open everything; this worker's pid and the sandbox sessions it prepared."""
        self._ready, self._stop = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._hold())
        await self._ready.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        return {"pid": os.getpid(), "prepared": self.prepared}

    async def _hold(self) -> None:
        from .runtime import open_runtime

        s = self.spec
        try:
            env = s.make_env()
            async with contextlib.AsyncExitStack() as stack:
                stack.push_async_callback(env.aclose)
                # A local run's runtime, in this actor: its first groups fill its decode slots
                # (``concurrency``), so that many sessions start while the engine loads.
                runtime = await stack.enter_async_context(open_runtime(
                    env, self._engine_source(), s.sandbox, s.config, programs=s.config.concurrency,
                    journal=self.in_flight))
                self.prepared, self.reactor = runtime.prepared, runtime.reactor
                self._ready.set()
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the driver by start() and group()
            self._error = describe(exc)
        finally:
            self.reactor = None
            self._ready.set()

    def _engine_source(self) -> Any:
        """The worker's own engine (its spec), or the driver's engine actors, shared by every worker."""
        s = self.spec
        if not s.engine_actors:
            return s.engine
        from .engines.actors import RayEngine

        return lambda: RayEngine.connect(s.engine_actors, s.engine.model, share=1 / s.workers)

    async def group(self, task: dict[str, Any], group_size: int, saved: dict[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
        """Run one group; ``saved`` (a :meth:`snapshot` entry from a worker that died) continues
        its programs from their last completed turn and keeps its finished ones."""
        from .inflight import restore

        if self.reactor is None:
            raise RuntimeError(self._error or "the rollout worker is not running")
        resume, finished = restore(saved) if saved else (None, ())
        if saved:  # in this worker's snapshots too, should it die in turn: finished programs, agents' calls
            self.in_flight.restored(saved)
        for t in finished:
            self.in_flight.finished(t)
        try:
            group = await self.reactor.group(Task(**task), group_size, resume=resume, finished=finished)
        finally:
            self.in_flight.forget(task["id"])
        return [t.to_dict() for t in group.trajectories]

    async def snapshot(self, task_ids: list[str], have: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The tasks' programs as of their last completed turn (see ``inflight.InFlight``); with
        ``have`` (what the driver holds), only what it lacks."""
        return self.in_flight.snapshot(set(task_ids), have)

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await self._task


class RayRollouts:
    """Rollout workers on a Ray cluster behind one async iterator of groups (see the module doc).

    ``engine`` is an engine name (with ``model``, ``engine_kwargs``, ``base_urls``, ``seed``
    and the config's sampling settings) or an :class:`~agentenv.engines.spec.EngineSpec`."""

    def __init__(self, env: "str | Environment", *, workers: int = 2, env_args: dict[str, Any] | None = None,
                 engine: str | EngineSpec = "embedded", model: str | None = None,
                 engine_kwargs: dict[str, Any] | None = None, base_urls: Sequence[str] | None = None,
                 sandbox: SandboxOptions | str = "local", config: RolloutConfig | None = None, seed: int = 0,
                 groups_per_worker: int | None = None, address: str | None = None,
                 worker_options: dict[str, Any] | None = None, snapshot_interval: float | None = 1.0,
                 engines: int = 0, engine_options: dict[str, Any] | None = None) -> None:
        from .registry import portable_spec

        if workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        if engines < 0:
            raise ConfigError(f"engines must be >= 0, got {engines}")
        self.config = config or RolloutConfig()
        if isinstance(engine, str):
            if model is None:
                from .models import default_model

                model = str(default_model())
            engine = EngineSpec.sampling_as(self.config, engine, model, kwargs=engine_kwargs, base_urls=base_urls,
                                            seed=seed)
        # An instance: the workers make its class, under its id; a user's one-file module goes
        # with it, for workers on nodes without the file. The workers' sys.path is extended
        # with this one's, so what this process imports, a worker on this machine does too.
        env_spec, env_id = (
            ({"env": env, "source": None}, None) if isinstance(env, str) else (portable_spec(env), env.id)
        )
        self.spec = WorkerSpec(env_spec, env_id, dict(env_args or {}), engine, sandbox, self.config, workers,
                               list(sys.path))
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
        self.prepared = 0  # sandbox sessions the workers started while their engines loaded
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

                self.engine_actors = start_actors(self.spec.engine, replicas=self.engines_wanted,
                                                  options=self.engine_options)
                self.spec = replace(self.spec, engine_actors=self.engine_actors)
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
            started = await actor.start.remote()
        except Exception as exc:  # noqa: BLE001 - the worker could not open its engine/sandbox
            _ray().kill(actor)
            hint = ("; the environment's own module travels with the workers, but what it imports must be "
                    "installed on every node (or shipped with worker_options={'runtime_env': ...})"
                    if "EnvNotFoundError" in str(exc) else "")
            raise EngineError(f"a rollout worker failed to start: {exc}{hint}") from exc
        self.prepared += started["prepared"]
        if index is None:
            self.workers.append(actor)
            self.pids.append(started["pid"])
        else:
            self.workers[index], self.pids[index] = actor, started["pid"]

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
                       on_snapshot: Callable[[str, dict[str, Any]], None] | None = None) -> AsyncIterator[Group]:
        """Run ``group_size`` programs of every task on the workers; yield each group when it is
        complete. Cancelling the iteration leaves the workers running nothing of it.

        ``saved`` (task id -> snapshot, see ``inflight.snapshot_of``) continues groups a run
        left unfinished; ``on_snapshot(task_id, snapshot)`` sees every snapshot taken (the CLI
        logs them, so ``--resume`` continues the programs). A group given its finished
        trajectories yields them again with the rest."""
        self.snapshots.update(saved or {})
        d = _Dispatch(self, list(tasks), group_size, on_snapshot)
        poller = asyncio.ensure_future(d.poll()) if self.snapshot_interval else None
        try:
            while d.queue or d.inflight:
                d.fill()
                done, _ = await asyncio.wait([*d.inflight, *([poller] if poller else [])],
                                             return_when=asyncio.FIRST_COMPLETED)
                if poller in done:
                    poller.result()  # it ends only by failing (on_snapshot raised): raise that here
                for fut in done - {poller}:
                    group = await d.settle(fut)
                    if group is not None:
                        yield group
        finally:  # stop what is still running on the workers (their reactors cancel its programs)
            if poller is not None:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
            await d.cancel()


class _Dispatch:
    """One :meth:`RayRollouts.rollouts` call: the queue of groups, each worker's load, the calls
    in flight, and the snapshots of their programs."""

    def __init__(self, owner: RayRollouts, tasks: list[Task], group_size: int,
                 on_snapshot: Callable[[str, dict[str, Any]], None] | None) -> None:
        self.owner = owner
        self.queue = deque(tasks)
        self.group_size = group_size
        self.per_worker = owner._per_worker(group_size)
        self.on_snapshot = on_snapshot
        self.inflight: dict[asyncio.Future, tuple[int, Any, Task]] = {}  # future -> (worker index, actor, task)
        self.refs: dict[asyncio.Future, Any] = {}
        self.load = [0] * len(owner.workers)
        self.died = died_errors()

    def fill(self) -> None:
        """Place queued groups on the least loaded workers that have room."""
        o = self.owner
        while self.queue:
            free = [i for i in range(len(o.workers)) if self.load[i] < self.per_worker]
            if not free:
                return
            i = min(free, key=lambda j: self.load[j])
            task = self.queue.popleft()
            ref = o.workers[i].group.remote(asdict(task), self.group_size, o.snapshots.get(task.id))

            async def wait(ref: Any = ref) -> list[dict[str, Any]]:
                return await ref

            fut = asyncio.ensure_future(wait())
            self.refs[fut] = ref
            self.inflight[fut] = (i, o.workers[i], task)
            o.placed[task.id] = o.workers[i]
            self.load[i] += 1

    async def settle(self, fut: asyncio.Future) -> Group | None:
        """A finished call: its group, or (its worker died) None, the group queued again to
        continue from its snapshot on a live worker, and the worker replaced."""
        o = self.owner
        i, actor, task = self.inflight.pop(fut)
        self.refs.pop(fut, None)
        if actor is o.workers[i]:
            self.load[i] -= 1
        try:
            dicts = fut.result()
        except self.died:
            o.rerun += 1
            o.continued += task.id in o.snapshots
            self.queue.appendleft(task)  # again, elsewhere: from its snapshot, or whole
            if actor is o.workers[i]:  # the first of its failures: replace it
                o.replaced += 1
                self.load[i] = 0
                await o._add_worker(i)
            return None
        o.snapshots.pop(task.id, None)
        o.placed.pop(task.id, None)
        return Group(task, [Trajectory.from_dict(d) for d in dicts])

    async def poll(self) -> None:
        """Keep each in-flight group's latest snapshot (its programs at their last completed
        turn), so a group whose worker dies continues from there."""
        o = self.owner
        while True:
            await asyncio.sleep(o.snapshot_interval or 1.0)
            by_actor: dict[Any, list[str]] = {}
            for _, actor, task in list(self.inflight.values()):
                by_actor.setdefault(actor, []).append(task.id)
            # Each worker sends only what the driver lacks (``inflight.InFlight.snapshot``):
            # new turns and newly finished programs, not every program's whole prefix.
            have = {a: {tid: holding(o.snapshots.get(tid)) for tid in ids} for a, ids in by_actor.items()}
            replies = await asyncio.gather(*(a.snapshot.remote(ids, have[a]) for a, ids in by_actor.items()),
                                           return_exceptions=True)
            running = {task.id for _, _, task in self.inflight.values()}
            for reply in replies:
                if isinstance(reply, dict):
                    for tid, part in reply.items():
                        if tid in running:
                            snap = o.snapshots[tid] = merge_snapshot(o.snapshots.get(tid), part)
                            if self.on_snapshot is not None:
                                self.on_snapshot(tid, snap)

    async def cancel(self) -> None:
        """Cancel the calls still in flight (the workers' reactors cancel their programs)."""
        ray = _ray()
        for fut in self.inflight:
            try:
                ray.cancel(self.refs[fut])
            except Exception:  # noqa: BLE001 - its worker may be gone
                pass
            fut.cancel()
        if self.inflight:
            await asyncio.gather(*self.inflight, return_exceptions=True)


__all__ = ["RayRollouts", "RolloutWorker", "WorkerSpec", "connect"]
