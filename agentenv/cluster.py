"""Rollouts on a Ray cluster: rollout workers are Ray actors, each with its own reactor, engine
and local sandbox pool on its node; the driver keeps the global queue of groups.

    async with RayRollouts("retool-math", workers=2, config=RolloutConfig()) as cluster:
        async with cluster.rollouts(env.tasks(64), group_size=4) as groups:
            async for group in groups:
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
  (``prepare_sessions``), then the engine, as a one-machine run does. A worker's runtime is
  held open by one long call, :meth:`RolloutWorker.serve`, which the driver owns: ``stop``
  ends it, and the driver waits for it (10 s at most) before ending the actor.
* **Concurrency.** ``rollouts`` is an async context manager, as a reactor's is: every remote
  call it makes is awaited by a task of its task group (groups, snapshot polls), and leaving
  it (done, failed or cancelled) cancels those still running, on the workers too.
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

import contextlib
import math
import os
import sys
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .config import RolloutConfig, SandboxOptions
from .engines.spec import EngineSpec
from .env import Environment, Task
from .errors import ConfigError, EngineError, describe
from .inflight import TaskSnapshot, holding, merge_snapshot, read_snapshot
from .raycluster import actor_options, connect, cpu_share, died_errors
from .raycluster import ray_module as _ray
from .reactor import Group
from .trajectory import Trajectory

#: Seconds a worker has to close its runtime once told to stop, before its actor is killed.
STOP_S = 10.0
#: Seconds a worker has to answer a snapshot poll; a later reply is not waited for (the
#: snapshot held stays as it was, and the next poll asks for the same again).
SNAPSHOT_REPLY_S = 30.0


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
    open for as long as its :meth:`serve` call runs, serving ``group`` calls concurrently.

    Everything here runs on the actor's event loop, each remote call in its own asyncio task
    (Ray's): the runtime's task groups belong to the ``serve`` call's task, which enters and
    leaves them, and ``start``, ``group``, ``snapshot`` and ``stop`` only wait on events or
    use the reactor it holds open."""

    def __init__(self, spec: WorkerSpec) -> None:
        from .inflight import InFlight

        self.spec = spec
        self.reactor: Any = None
        self.in_flight = InFlight()  # every program's state at its last completed turn
        self.prepared = 0  # sandbox sessions started while the engine loaded
        # Made by the first call to need them: anyio's events are made on a running loop,
        # which Ray's async actors do not run ``__init__`` on. ``serve`` and ``start`` may run
        # in either order.
        self._ready: anyio.Event | None = None
        self._stop: anyio.Event | None = None
        self._error: str | None = None

    def _events(self) -> tuple[anyio.Event, anyio.Event]:
        if self._ready is None or self._stop is None:
            self._ready, self._stop = anyio.Event(), anyio.Event()
        return self._ready, self._stop

    async def serve(self) -> None:
        """Open the environment and runtime and hold them open until :meth:`stop`. What fails
        is kept for :meth:`start` and :meth:`group` to raise, not raised here: the driver
        waits for this call's end only to know it ended."""
        from .runtime import open_runtime

        ready, stop = self._events()
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
                ready.set()
                await stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the driver by start() and group()
            self._error = describe(exc)
        finally:
            self.reactor = None
            ready.set()

    async def start(self) -> dict[str, int]:
        """Wait until :meth:`serve` has opened everything: this worker's pid and the sandbox
        sessions it prepared."""
        ready, _ = self._events()
        await ready.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        return {"pid": os.getpid(), "prepared": self.prepared}

    def _engine_source(self) -> Any:
        """The worker's own engine (its spec), or the driver's engine actors, shared by every worker."""
        s = self.spec
        if not s.engine_actors:
            return s.engine
        from .engines.actors import RayEngine

        return lambda: RayEngine.connect(s.engine_actors, s.engine.model, share=1 / s.workers)

    async def group(self, task: dict[str, Any], group_size: int, saved: dict[str, Any] | None = None
                    ) -> list[dict[str, Any]]:
        """Run one group; ``saved`` (a snapshot's saved form, of the group on a worker that died
        or in a log) continues its programs from their last completed turn and keeps its
        finished ones."""
        from .inflight import restore

        if self.reactor is None:
            raise RuntimeError(self._error or "the rollout worker is not running")
        snap = read_snapshot(saved) if saved else None
        resume, finished = restore(snap) if snap else (None, ())
        if snap:  # in this worker's snapshots too, should it die in turn: finished programs, agents' calls
            self.in_flight.restored(snap)
        for t in finished:
            self.in_flight.finished(t)
        try:
            group = await self.reactor.group(Task(**task), group_size, resume=resume, finished=finished)
        finally:
            self.in_flight.forget(task["id"])
        return [t.to_dict() for t in group.trajectories]

    async def snapshot(self, task_ids: list[str], have: dict[str, dict[str, Any]] | None = None
                       ) -> dict[str, dict[str, Any]]:
        """The tasks' programs as of their last completed turn (see ``inflight.InFlight``), in
        their saved form (versioned: the driver reads it with ``inflight.read_snapshot``); with
        ``have`` (what the driver holds), only what it lacks."""
        return {tid: s.to_dict() for tid, s in self.in_flight.snapshot(set(task_ids), have).items()}

    async def stop(self) -> None:
        """End :meth:`serve`: it closes the runtime and returns."""
        self._events()[1].set()


async def _ended(serving: Any) -> None:
    """Wait (:data:`STOP_S` at most) for a worker's ``serve`` call to end, however it ended: a
    ref never fetched that holds an error (the actor died) is reported by Ray as unhandled."""
    if serving is None:
        return
    with anyio.move_on_after(STOP_S), contextlib.suppress(Exception):
        await serving


def _sole(group: BaseExceptionGroup) -> BaseException:
    """The one exception a task group's failure holds, however nested (the group itself when
    it holds several): a caller sees the error raised, as it would without a task group."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(reversed(exc.exceptions))
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


class _Rollouts:
    """What :meth:`RayRollouts.rollouts` returns: ``async with`` it for the stream of groups.
    ``async for`` over it directly, as before it was a context, still works, deprecated: the
    rollout is then left when the loop ends (or when the generator is closed)."""

    def __init__(self, cm: contextlib.AbstractAsyncContextManager) -> None:
        self._cm = cm

    async def __aenter__(self) -> MemoryObjectReceiveStream[Group]:
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._cm.__aexit__(*exc)

    def __aiter__(self) -> AsyncIterator[Group]:
        warnings.warn("`async for g in cluster.rollouts(...)` is deprecated: write `async with "
                      "cluster.rollouts(...) as groups: async for g in groups`", DeprecationWarning, stacklevel=2)
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Group]:
        async with self._cm as groups:
            async for group in groups:
                yield group


class RayRollouts:
    """Rollout workers on a Ray cluster behind one stream of groups (see the module doc).

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
        self.snapshots: dict[str, TaskSnapshot] = {}  # task id -> its group's latest snapshot
        self.placed: dict[str, Any] = {}  # task id -> the worker actor running its group now
        self._serving: dict[Any, Any] = {}  # worker actor -> its serve() call's ref
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
            await self._add_workers(self.workers_wanted)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _add_workers(self, n: int) -> None:
        """Start ``n`` workers together; every one is started (or failed) before the first
        failure is raised, so :meth:`aclose` ends them all."""
        errors: list[Exception] = []

        async def add() -> None:
            try:
                await self._add_worker()
            except Exception as exc:  # noqa: BLE001 - raised below, once all have started or failed
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(add)
        if errors:
            raise errors[0]

    async def _add_worker(self, index: int | None = None) -> None:
        actor = self._actor_cls.remote(self.spec)
        self._serving[actor] = actor.serve.remote()  # holds the worker's runtime open until stop()
        try:
            started = await actor.start.remote()
        except BaseException as exc:  # cancelled too: an actor no one holds must not live on
            with anyio.CancelScope(shield=True):
                await _ended(self._serving.pop(actor))
                _ray().kill(actor)
            if not isinstance(exc, Exception):
                raise
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

    async def _replace_worker(self, index: int) -> None:
        """A new worker in the place of worker ``index``, which died."""
        self.replaced += 1
        old = self.workers[index]
        _ray().kill(old)  # gone, or unreachable for now: either way its place is taken
        await _ended(self._serving.pop(old, None))
        await self._add_worker(index)

    async def aclose(self) -> None:
        """Stop every worker (each closes its runtime, :data:`STOP_S` at most, then its actor
        ends) and the engine actors, and shut down a cluster started for this; cancelling it
        does not cut that short."""
        with anyio.CancelScope(shield=True):
            serving, self._serving = self._serving, {}
            # Every actor started, a worker's or one still starting (in ``_serving`` only).
            workers = list(dict.fromkeys([*self.workers, *serving]))
            self.workers = []
            async with anyio.create_task_group() as tg:
                for w in workers:
                    tg.start_soon(self._stop_worker, w, serving.get(w))
            if self.engine_actors:
                from .engines.actors import stop_actors

                actors, self.engine_actors = self.engine_actors, []
                await stop_actors(actors)
            ray = _ray()
            if self._started_ray and ray.is_initialized():
                ray.shutdown()
                self._started_ray = False

    @staticmethod
    async def _stop_worker(actor: Any, serving: Any) -> None:
        """Tell the worker to stop and wait for its ``serve`` call to end (its runtime closed),
        :data:`STOP_S` at most; then end the actor, stuck or not."""
        with anyio.move_on_after(STOP_S):
            for ref in (actor.stop.remote(), serving):
                if ref is not None:
                    with contextlib.suppress(Exception):  # a dead worker: killed below anyway
                        await ref
        _ray().kill(actor)

    def _per_worker(self, group_size: int) -> int:
        if self.groups_per_worker:
            return self.groups_per_worker
        return max(1, -(-self.config.concurrency // max(1, group_size)))

    def rollouts(self, tasks: Sequence[Task], group_size: int, *, saved: dict[str, TaskSnapshot] | None = None,
                 on_snapshot: Callable[[str, TaskSnapshot], None] | None = None) -> "_Rollouts":
        """Run ``group_size`` programs of every task on the workers: ``async with`` it for a
        stream of the groups, each as it is complete, ending when every group has come. Leaving
        the block (done, failed or cancelled) leaves the workers running nothing of it.
        (``async for`` over it directly, its former use, still works, deprecated.)

        ``saved`` (task id -> snapshot, see ``inflight.snapshot_of``) continues groups a run
        left unfinished; ``on_snapshot(task_id, snapshot)`` sees every snapshot taken (the CLI
        logs them, so ``--resume`` continues the programs). A group given its finished
        trajectories yields them again with the rest. An error (a worker's that is not its
        death, a replacement that failed to start, ``on_snapshot``'s) is raised as it is."""
        return _Rollouts(self._rollouts(tasks, group_size, saved, on_snapshot))

    @contextlib.asynccontextmanager
    async def _rollouts(self, tasks: Sequence[Task], group_size: int, saved: dict[str, Any] | None,
                        on_snapshot: Callable[[str, TaskSnapshot], None] | None
                        ) -> AsyncIterator[MemoryObjectReceiveStream[Group]]:
        # A snapshot in its saved form (a dict, as code written before they were typed passes) is read.
        self.snapshots.update({k: v if isinstance(v, TaskSnapshot) else read_snapshot(v)
                               for k, v in (saved or {}).items()})
        d = _Dispatch(self, list(tasks), group_size, on_snapshot)
        # Groups wait here while the caller handles one: up to one per slot on the workers.
        send, receive = anyio.create_memory_object_stream[Group](len(self.workers) * d.per_worker)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(d.run, send)
                try:
                    with receive:
                        yield receive
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            sole = _sole(group)
            if sole is group:
                raise
            raise sole from sole.__cause__  # as raised where it was, its cause kept


@dataclass(eq=False)
class _Call:
    """One group's call on a worker: the worker's index and actor, the task and the call's ref."""

    index: int
    actor: Any
    task: Task
    ref: Any = field(repr=False)


class _Dispatch:
    """One :meth:`RayRollouts.rollouts` call: the queue of groups, each worker's load, the calls
    in flight, and the snapshots of their programs. :meth:`run` places groups and settles the
    calls' outcomes; each call is awaited by its own task (:meth:`_await`), which cancels it on
    its worker if the dispatch is cancelled; :meth:`poll` keeps the snapshots."""

    def __init__(self, owner: RayRollouts, tasks: list[Task], group_size: int,
                 on_snapshot: Callable[[str, TaskSnapshot], None] | None) -> None:
        self.owner = owner
        self.queue = deque(tasks)
        self.group_size = group_size
        self.per_worker = owner._per_worker(group_size)
        self.on_snapshot = on_snapshot
        self.calls: set[_Call] = set()
        self.load = [0] * len(owner.workers)
        self.died = died_errors()

    async def run(self, out: MemoryObjectSendStream[Group]) -> None:
        """Place groups on the workers until every one is complete, each sent to ``out`` as
        it is. The calls' outcomes come back on a stream without a bound: one per call, and
        the calls are as many as the workers' slots (and a dead worker's, until settled)."""
        done_send, done = anyio.create_memory_object_stream[tuple[_Call, Any]](math.inf)
        with done_send, done:
            async with out, anyio.create_task_group() as tg:
                if self.owner.snapshot_interval:
                    tg.start_soon(self.poll)
                while self.queue or self.calls:
                    self.fill(tg, done_send)
                    call, outcome = await done.receive()
                    group = await self.settle(call, outcome)
                    if group is not None:
                        await out.send(group)
                tg.cancel_scope.cancel()  # the poller: nothing is left to snapshot

    def fill(self, tg: TaskGroup, done: MemoryObjectSendStream[tuple[_Call, Any]]) -> None:
        """Place queued groups on the least loaded workers that have room."""
        o = self.owner
        while self.queue:
            free = [i for i in range(len(o.workers)) if self.load[i] < self.per_worker]
            if not free:
                return
            i = min(free, key=lambda j: self.load[j])
            task = self.queue.popleft()
            snap = o.snapshots.get(task.id)
            ref = o.workers[i].group.remote(asdict(task), self.group_size, snap.to_dict() if snap else None)
            call = _Call(i, o.workers[i], task, ref)
            self.calls.add(call)
            o.placed[task.id] = o.workers[i]
            self.load[i] += 1
            tg.start_soon(self._await, call, done)

    async def _await(self, call: _Call, done: MemoryObjectSendStream[tuple[_Call, Any]]) -> None:
        """The call's outcome (its trajectories' dicts, or what it raised) to ``done``; the call
        cancelled on its worker (its reactor cancels the group's programs) if this is."""
        try:
            outcome = await call.ref
        except anyio.get_cancelled_exc_class():
            with contextlib.suppress(Exception):  # its worker may be gone
                _ray().cancel(call.ref)
            raise
        except Exception as exc:  # noqa: BLE001 - settled (raised, or the group run again) by run()
            outcome = exc
        done.send_nowait((call, outcome))

    async def settle(self, call: _Call, outcome: Any) -> Group | None:
        """A finished call: its group, or (its worker died) None, the group queued again to
        continue from its snapshot on a live worker, and the worker replaced. Any other error
        of the call is raised."""
        o, i, task = self.owner, call.index, call.task
        self.calls.discard(call)
        if call.actor is o.workers[i]:
            self.load[i] -= 1
        if isinstance(outcome, self.died):
            o.rerun += 1
            o.continued += task.id in o.snapshots
            self.queue.appendleft(task)  # again, elsewhere: from its snapshot, or whole
            if call.actor is o.workers[i]:  # the first of its failures: replace it
                self.load[i] = 0
                await o._replace_worker(i)
            return None
        if isinstance(outcome, BaseException):
            raise outcome
        o.snapshots.pop(task.id, None)
        o.placed.pop(task.id, None)
        return Group(task, [Trajectory.from_dict(d) for d in outcome])

    async def poll(self) -> None:
        """Keep each in-flight group's latest snapshot (its programs at their last completed
        turn), so a group whose worker dies continues from there. Runs until cancelled."""
        o = self.owner
        while True:
            await anyio.sleep(o.snapshot_interval or 1.0)
            by_actor: dict[Any, list[str]] = {}
            for call in list(self.calls):
                by_actor.setdefault(call.actor, []).append(call.task.id)
            # Each worker sends only what the driver lacks (``inflight.InFlight.snapshot``):
            # new turns and newly finished programs, not every program's whole prefix.
            replies: list[dict[str, Any]] = []
            async with anyio.create_task_group() as tg:
                for actor, ids in by_actor.items():
                    have = {tid: holding(o.snapshots.get(tid)) for tid in ids}
                    tg.start_soon(self._ask, actor, ids, have, replies)
            running = {call.task.id for call in self.calls}
            for reply in replies:
                for tid, part in reply.items():
                    if tid in running:
                        snap = o.snapshots[tid] = merge_snapshot(o.snapshots.get(tid), read_snapshot(part))
                        if self.on_snapshot is not None:
                            self.on_snapshot(tid, snap)

    @staticmethod
    async def _ask(actor: Any, ids: list[str], have: dict[str, Any], replies: list[dict[str, Any]]) -> None:
        """One worker's snapshot reply into ``replies``; none from a worker that is dead or
        does not answer within :data:`SNAPSHOT_REPLY_S`."""
        with anyio.move_on_after(SNAPSHOT_REPLY_S):
            try:
                replies.append(await actor.snapshot.remote(ids, have))
            except Exception:  # noqa: BLE001 - a dead worker: its groups are settled by run()
                pass


__all__ = ["RayRollouts", "RolloutWorker", "WorkerSpec", "connect"]
