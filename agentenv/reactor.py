"""The reactor: many programs at once on one engine, one sandbox backend, one environment.

Which program runs when is decided by the pure :class:`~agentenv.scheduler.Scheduler`: the
reactor tells it every event (a program was added, wants a turn, got its turn back, its sandbox
session is ready, it ended) and carries out each :class:`~agentenv.scheduler.Decision` at once:
an admitted program starts as a task in the calling ``rollouts``/``group`` task group, its
session is prepared ahead of its first tool call, a submitted turn goes to the engine, a paused
program's KV is released to the engine (``Engine.release``). Given the engine's costs (a
:class:`~agentenv.costs.CostModel`: by default measured from the turns the engine serves and
refitted as the run goes, :class:`~agentenv.costs.CostFit`) and the reactor's clock, the
scheduler also releases the KV of programs on their tools to programs that want the engine, when
a decode slot is worth more than the re-prefill. ``concurrency`` caps requests in
the engine (its decode slots), not programs: a program on a tool holds no slot, so while one
waits on its tool the others decode. When a program ends its reward is scored in a separate
task (delayed reward: slow or async rewards overlap with generation). When every sample of a
task is scored, the environment's optional ``group_reward`` runs and the whole GRPO
:class:`Group` is emitted.

Library use (what an external trainer imports)::

    async with Reactor(engine, env, sandbox, config) as reactor:
        async with reactor.rollouts(tasks, group_size=4) as results:
            async for item in results:          # Trajectory as each one is scored,
                ...                             # then Group when its task is complete

The results channel is bounded (backpressure: producers wait for the consumer). Leaving the
``rollouts`` block early cancels what is still running; every sandbox session is closed and
every engine request aborted on the way out.
"""

from __future__ import annotations

import gc
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Sequence

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .agent import AgentEnvironment
from .config import RolloutConfig
from .engines.base import Engine
from .env import Environment, Task, bind_tool_format
from .errors import ProgramEndedError, SandboxError
from .formats import get_format
from .program import ProgramContext, apply_reward, reward_failed, run_program, score_program, stop_token_ids
from .costs import CostFit, CostModel
from .scheduler import Scheduler, SchedulerConfig, SchedulingPolicy, State
from .stats import RunStats
from .tools import needs_sandbox
from .trajectory import Trajectory


#: The cyclic garbage collector's first threshold while programs run (Python's is 700). Programs
#: allocate containers by the million (token lists, request bodies, coroutines) and reference
#: counting frees nearly all of them, but at 700 the collector runs hundreds of times a run and
#: its older generations walk every live program's state: with a thousand programs the CPU per
#: token is 1.2-1.4x what it is at 50,000 (``bench/gateway.py`` prints both). Cycles then wait
#: for 50,000 allocations instead (a few MB). ``None`` leaves the collector as it is.
GC_THRESHOLD: int | None = 50_000
_gc_lock = threading.Lock()
_gc_open: list[Any] = [0, None]  # runs open in this process; the thresholds the first one found


@contextmanager
def collector_tuned() -> Iterator[None]:
    """:data:`GC_THRESHOLD` while any reactor run is open in this process (a higher first
    threshold is kept); the thresholds found before the first run once the last one ends."""
    with _gc_lock:
        if _gc_open[0] == 0:
            _gc_open[1] = gc.get_threshold()
            first, *older = _gc_open[1]
            if GC_THRESHOLD is not None and first < GC_THRESHOLD:
                gc.set_threshold(GC_THRESHOLD, *older)
        _gc_open[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_open[0] -= 1
            if _gc_open[0] == 0:
                gc.set_threshold(*_gc_open[1])


@dataclass(slots=True)
class Group:
    """The G trajectories of one task (a GRPO group), all scored. ``id`` (each trajectory's
    ``group_id``) is unique per group: the same task rolled out twice makes two groups."""

    task: Task
    trajectories: list[Trajectory] = field(default_factory=list)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = self.trajectories[0].group_id if self.trajectories else f"{self.task.id}#{uuid.uuid4().hex[:8]}"

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


class _Batch:
    """The programs one call (``rollouts`` or ``group``) added: it returns when all are done."""

    __slots__ = ("left", "finished")

    def __init__(self, total: int) -> None:
        self.left, self.finished = total, anyio.Event()

    def one_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.finished.set()


class _Slot:
    """The reactor's side of one program: what it runs, and the events it waits on."""

    __slots__ = ("pid", "key", "task", "index", "group", "pending", "send", "tg", "grant", "prepared",
                 "session", "session_error", "used_session", "batch", "started", "partial")

    def __init__(self, pid: int, task: Task, index: int, group: Group, pending: list[int],
                 send: MemoryObjectSendStream | None, tg: TaskGroup, batch: _Batch) -> None:
        self.pid, self.task, self.index, self.group, self.pending = pid, task, index, group, pending
        self.key = uuid.uuid4().hex[:16]  # the trajectory id and the engine request-id prefix
        self.send, self.tg, self.batch = send, tg, batch
        self.grant: anyio.Event | None = None
        self.prepared: anyio.Event | None = None  # set once its session started, or failed to (session_error)
        self.session: Any = None
        self.session_error: BaseException | None = None
        self.used_session = False
        self.started = False
        self.partial: Trajectory | None = None  # the program as of its last logged turn: resume from there


class _Hooks:
    """``ProgramHooks`` for one program: each event goes to the scheduler, whose decision the
    reactor carries out at once."""

    __slots__ = ("reactor", "slot", "tokens", "submitted")

    def __init__(self, reactor: "Reactor", slot: _Slot) -> None:
        self.reactor, self.slot, self.tokens = reactor, slot, 0
        self.submitted: tuple[float, float, int] | None = None  # the turn's start, for the cost fit

    async def before_turn(self, tokens: int, max_tokens: int) -> int:
        r, slot = self.reactor, self.slot
        self.tokens = tokens
        slot.grant = anyio.Event()
        r._sched.advance(time.monotonic())  # how long its tool took
        r._sched.want_turn(slot.pid, tokens, max_tokens)
        r._step()
        try:
            await slot.grant.wait()
        except BaseException:  # cancelled: the program ended, or its gateway client gave up on the call
            if slot.pid in r._sched.programs:
                r._sched.withdraw_turn(slot.pid)
                r._step()
            raise
        if slot.pid not in r._sched.programs:  # ended while this turn waited (a gateway request outlives it)
            raise ProgramEndedError(f"program {slot.pid} ended before its turn")
        r.stats.occupancy.requests_changed(+1)
        if r.cost_fit is not None:
            self.submitted = (time.perf_counter(), r.stats.occupancy.area(), r._prefilled)
        return r._sched.priority(slot.pid)

    def after_turn(self, tokens: int, prefilled: int = 0) -> None:
        r = self.reactor
        r._prefilled += prefilled
        if r.cost_fit is not None and self.submitted is not None:
            t0, area0, pre0 = self.submitted
            seconds = time.perf_counter() - t0
            in_flight = (r.stats.occupancy.area() - area0) / seconds if seconds > 0 else 1.0
            context = (self.tokens + tokens) / 2
            if r.cost_fit.add(seconds, tokens - self.tokens, in_flight, context, r._prefilled - pre0):
                r._sched.config.cost = r.cost_fit.model
        self.submitted = None
        r.stats.occupancy.requests_changed(-1)
        r.stats.occupancy.turn_sampled(tokens - self.tokens)
        r._sched.advance(time.monotonic())  # its tool starts now
        r._sched.turn_done(self.slot.pid, tokens)
        r._step()

    async def session(self) -> Any:
        r, slot = self.reactor, self.slot
        if slot.prepared is None:  # not prepared ahead (lookahead full): start it now
            r._sched.demand_session(slot.pid)
            r._start_prepare(slot)
        if not slot.prepared.is_set():
            r.stats.sessions.session_waits += 1
            t0 = time.perf_counter()
            await slot.prepared.wait()
            r.stats.sessions.session_wait_s += time.perf_counter() - t0
        if slot.session_error is not None:
            raise slot.session_error
        slot.used_session = True
        return slot.session


def _default_max_programs(config: RolloutConfig, sandbox: Any) -> int:
    """8 x concurrency (a program on a tool holds no slot, so many more programs than slots
    keep the engine fed), but no more than the sandbox can hold sessions for."""
    n = 8 * config.concurrency
    cap = getattr(sandbox, "max_workers", None) if sandbox is not None else None
    return min(n, cap) if cap else n


async def prepare_sessions(env: Environment, sandbox: Any, config: RolloutConfig | None = None,
                           programs: int | None = None, *, wait: bool = False) -> int:
    """Start in ``sandbox`` the sessions a run's first programs will take, ahead of the run:
    as many as a :class:`Reactor` with ``config`` admits at once, and at most ``programs``
    (the run's size). Call it before the engine loads (``agentenv rollout`` and the trainer
    do), so session starts overlap the model's loading instead of competing with the first
    turns for the CPU; the reactor then finds them ready. Returns how many it starts (0 for an
    environment without a Python tool, or a backend that cannot prepare ahead)."""
    if not needs_sandbox(env):
        return 0
    config = (config or RolloutConfig()).for_env(env)
    program_aware = SchedulingPolicy(config.scheduling) == SchedulingPolicy.PROGRAM
    at_once = config.max_programs or (_default_max_programs(config, sandbox) if program_aware else config.concurrency)
    n = at_once if programs is None else min(at_once, programs)
    return await sandbox.prepare(env.sandbox_setup(), n, wait=wait)


async def gateway(r: "Reactor") -> Any:
    """The OpenAI-compatible gateway an :class:`~agentenv.AgentEnvironment`'s programs on ``r``
    call (``agentenv.gateway``), started on first use on this event loop; closed with ``r``."""
    async with r._gateway_lock:
        if r._gateway is None:
            from .extras import require
            from .gateway.server import start_gateway

            require("openai", "starlette", "uvicorn", extra="agents", what="an AgentEnvironment")
            r._gateway = await start_gateway(r.engine.tokenizer)
        return r._gateway


async def _program(r: "Reactor", slot: _Slot) -> Trajectory:
    """Run ``slot``'s program: the reactor's turn loop, or an agent environment's agent with its
    calls through the gateway."""
    if isinstance(r.env, AgentEnvironment):
        from .gateway.program import run_agent_program

        return await run_agent_program(r._ctx, await gateway(r), slot.task, slot.group.id, slot.index,
                                       _Hooks(r, slot), program_id=slot.key, resume=slot.partial)
    return await run_program(r._ctx, slot.task, slot.group.id, slot.index, _Hooks(r, slot), program_id=slot.key,
                             resume=slot.partial)


def _scheduler(c: RolloutConfig, engine: Engine, cost_model: CostModel | None | str,
               default_max_programs: Callable[[], int]) -> tuple[Scheduler, CostFit | None]:
    """The reactor's scheduler for ``c`` on ``engine``, and the fit that measures the engine's
    costs for it (``cost_model="measured"``; a ``CostModel``: fixed costs; None: none, acting
    programs keep their KV)."""
    policy = SchedulingPolicy(c.scheduling)
    kv_bound = policy == SchedulingPolicy.PROGRAM and engine.kv_capacity_tokens is not None
    sched = Scheduler(SchedulerConfig(
        policy=policy,
        kv_capacity=engine.kv_capacity_tokens if policy == SchedulingPolicy.PROGRAM else None,
        block_size=engine.page_size,
        max_requests=c.concurrency,
        max_programs=(c.concurrency if policy == SchedulingPolicy.FIFO else c.max_programs or default_max_programs()),
        session_lookahead=c.session_lookahead,
        turn_reserve=c.max_tokens_per_turn, cost=cost_model if isinstance(cost_model, CostModel) else None,
    ))
    return sched, CostFit() if cost_model == "measured" and kv_bound else None


class Reactor:
    def __init__(
        self,
        engine: Engine,
        env: Environment,
        sandbox: object,
        config: RolloutConfig | None = None,
        *,
        buffer_size: int = 64,
        journal: Any = None, cost_model: CostModel | None | Literal["measured"] = "measured",
    ) -> None:
        self.engine, self.env, self.sandbox = engine, env, sandbox
        self.config = (config or RolloutConfig()).for_env(env)  # None limits: the env's
        self.buffer_size = buffer_size
        if env.tool_format is None:  # the model's own format (a CLI run has settled it already)
            bind_tool_format(env, engine.tokenizer)
        fmt = get_format(env.tool_format)
        tools = {t.name: t for t in env.tools()}
        self._ctx = ProgramContext(
            engine=engine,
            env=env,
            sandbox=sandbox,
            config=self.config,
            fmt=fmt,
            tools=tools,
            prompt_cache={},
            stop_token_ids=stop_token_ids(engine.tokenizer, fmt),
            journal=journal,
        )
        self._needs_session = needs_sandbox(env)
        self._setup = env.sandbox_setup() if self._needs_session else None
        self.stats = RunStats(block_size=engine.page_size, slots=self.config.concurrency)
        self._counted: set[str] = set()  # trajectories in ``stats`` whose group is not scored yet
        #: The engine's costs as measured so far (``cost_model="measured"``, the program policy
        #: on an engine that states its KV capacity): the scheduler is given each new fit.
        self._sched, self.cost_fit = _scheduler(self.config, engine, cost_model, self._default_max_programs)
        self._prefilled = 0  # prompt tokens the engine computed, every turn's so far
        self._slots: dict[int, _Slot] = {}
        self._spare: list[Any] = []  # prepared sessions no program used: clean, handed on
        self._next_pid = 0
        self._gateway: Any = None  # agentenv.gateway.Gateway, started by the first agent program
        self._gateway_lock = anyio.Lock()

    def _default_max_programs(self) -> int:
        return _default_max_programs(self.config, self.sandbox if self._needs_session else None)

    @property
    def scheduler(self) -> Scheduler:
        """The pure scheduler (read its counters; do not drive it)."""
        return self._sched

    async def __aenter__(self) -> "Reactor":
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            spare, self._spare = self._spare, []
            for s in spare:
                await s.aclose()
            gateway, self._gateway = self._gateway, None
            if gateway is not None:
                await gateway.aclose()

    # -- public API --------------------------------------------------------------------------
    @asynccontextmanager
    async def rollouts(
        self, tasks: Sequence[Task], group_size: int = 1, *, resume: Any = None
    ) -> AsyncIterator[MemoryObjectReceiveStream]:
        """Stream every trajectory as it is scored, and every group once complete. ``resume``
        (an ``agentenv.journal.LogState``): samples it lists as done are skipped, partial ones
        continue from their last logged turn."""
        send, receive = anyio.create_memory_object_stream[object](self.buffer_size)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._produce, list(tasks), group_size, send, resume)
            try:
                async with receive:
                    yield receive
            finally:
                tg.cancel_scope.cancel()

    async def collect(self, tasks: Sequence[Task], group_size: int = 1) -> list[Group]:
        """Run everything and return the groups in task order."""
        groups: dict[str, Group] = {}
        async with self.rollouts(tasks, group_size) as results:
            async for item in results:
                if isinstance(item, Group):
                    groups[item.task.id] = item
        return [groups[t.id] for t in tasks if t.id in groups]

    async def group(self, task: Task, group_size: int, *, resume: Any = None,
                    finished: Sequence[Trajectory] = ()) -> Group:
        """Run the ``group_size`` programs of one task (scheduled together with every other
        call's programs) and return the scored group. Trainers that stream tasks one group at
        a time (under their own admission control) use this. ``resume`` and ``finished``
        continue a group a checkpoint saved mid-way (see ``agentenv.inflight.restore``)."""
        group = Group(task, list(finished), id=resume.groups.get(task.id, "") if resume is not None else "")
        try:
            async with anyio.create_task_group() as tg:
                await self._run(tg, [task], group_size, None, {task.id: group}, resume)
        except BaseException:  # cancelled (a trainer drops a group gone stale) or failed: keep nothing of it
            self._ctx.prompt_cache.pop(task.id, None)
            self._counted.difference_update(t.id for t in group.trajectories)
            raise
        if finished and len(group.trajectories) == len(finished):  # nothing left to run: score the group
            await self._finish_group(group)
        return group

    # -- carrying out the scheduler's decisions ------------------------------------------------
    async def _produce(self, tasks: list[Task], group_size: int, send: MemoryObjectSendStream,
                       resume: Any = None) -> None:
        skip = resume.done if resume is not None else set()
        self.stats.start(len(tasks) * group_size - sum((t.id, i) in skip for t in tasks for i in range(group_size)))
        try:
            async with send, anyio.create_task_group() as tg:
                await self._run(tg, tasks, group_size, send, {}, resume)
        finally:
            self.stats.stop()

    async def _run(self, tg: TaskGroup, tasks: list[Task], group_size: int, send: MemoryObjectSendStream | None,
                   groups: dict[str, Group], resume: Any = None) -> None:
        """Add the programs to the scheduler; they start in ``tg`` when admitted. Returns when
        all of them are done."""
        skip = resume.done if resume is not None else set()
        partial = resume.partial if resume is not None else {}
        todo = [(t, [i for i in range(group_size) if (t.id, i) not in skip]) for t in tasks]
        batch = _Batch(sum(len(samples) for _, samples in todo))
        added: list[int] = []
        with collector_tuned():  # the whole run, its programs' tasks included
            try:
                for task, samples in todo:
                    if not samples:
                        continue
                    # Not kept here: a finished group is referenced only until it is sent, so a long
                    # run's memory does not grow with the programs it has finished.
                    group = groups.get(task.id) or Group(
                        task, list(resume.finished.get(task.id, ())) if resume else [],
                        id=resume.groups.get(task.id, "") if resume else "")
                    pending = [len(samples)]
                    for i in samples:
                        pid = self._next_pid
                        self._next_pid += 1
                        slot = _Slot(pid, task, i, group, pending, send, tg, batch)
                        slot.partial = partial.get((task.id, i))
                        if slot.partial is not None:
                            slot.key = slot.partial.id
                            tokens = slot.partial.num_tokens
                        else:
                            tokens = len(self._ctx.prompt_ids(task))
                        self._slots[pid] = slot
                        self._sched.add(pid, tokens, group=task.id, needs_session=self._needs_session)
                        added.append(pid)
                if batch.left == 0:
                    return
                self._step()
                await batch.finished.wait()
            finally:
                # Cancelled (or failed) before every program ran: withdraw the queued ones, and
                # finish the admitted ones whose coroutine never got to start.
                for pid in added:
                    slot = self._slots.get(pid)
                    if slot is None or slot.started or pid not in self._sched.programs:
                        continue
                    if self._sched.state(pid) == State.QUEUED:
                        self._sched.cancel(pid)
                    else:
                        self._sched.finish(pid)
                        self._sched.forget(pid)
                    del self._slots[pid]
                    if slot.session is not None:
                        slot.used_session = True  # not handed on: close it
                        await self._release_session(slot)

    def _step(self) -> None:
        """Ask the scheduler, then carry out its decision (never blocks)."""
        self._sched.advance(time.monotonic())  # how long programs have been on their tools
        d = self._sched.schedule()
        if not d:
            return
        self.stats.sessions.pauses += len(d.paused)
        self.stats.sessions.restores += len(d.restored)
        for pid in d.paused:
            self.engine.release(self._slots[pid].key)
        for pid in d.prepare:
            self._start_prepare(self._slots[pid])
        for pid in d.admit:
            slot = self._slots[pid]
            slot.tg.start_soon(self._one, slot)
        for pid in d.submit:
            grant = self._slots[pid].grant
            if grant is not None:
                grant.set()

    def _start_prepare(self, slot: _Slot) -> None:
        slot.prepared = anyio.Event()
        if self._spare:
            slot.session = self._spare.pop()
            self._sched.session_ready(slot.pid)
            slot.prepared.set()
            return
        slot.tg.start_soon(self._prepare, slot)

    async def _prepare(self, slot: _Slot) -> None:
        try:
            t0 = time.perf_counter()
            slot.session = await self.sandbox.session(self._setup)
            self.stats.sessions.session_started(time.perf_counter() - t0)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # noqa: BLE001 - the program meets it at its first tool call
            slot.session_error = exc if isinstance(exc, SandboxError) else SandboxError(f"{type(exc).__name__}: {exc}")
        finally:
            assert slot.prepared is not None
            slot.prepared.set()
        if self._sched.programs.get(slot.pid) is None or self._sched.state(slot.pid) == State.DONE:
            await self._release_session(slot)  # the program ended before its session was ready
        else:
            self._sched.session_ready(slot.pid)
            self._step()

    async def _release_session(self, slot: _Slot) -> None:
        session, slot.session = slot.session, None
        if session is None:
            return
        if not slot.used_session and not self._sched.done:
            self._spare.append(session)  # no code ran in it: as good as new
            return
        with anyio.CancelScope(shield=True):
            await session.aclose()

    async def _one(self, slot: _Slot) -> None:
        send = slot.send  # owned by the call that added the program (it closes it)
        if self._slots.get(slot.pid) is not slot:
            return  # withdrawn before it got to start (its run was cancelled)
        slot.started = True
        self.stats.program_started()
        try:
            traj = await _program(self, slot)
        finally:
            self._sched.finish(slot.pid)
            self.engine.release(slot.key)
            if slot.prepared is not None and slot.prepared.is_set():
                await self._release_session(slot)
            self._step()
            self._sched.forget(slot.pid)
            self._slots.pop(slot.pid, None)
        # The program no longer occupies the engine; the (possibly slow) reward runs now.
        await score_program(self.env, slot.task, traj, self.config.reward_timeout)
        self.stats.add(traj)
        self._counted.add(traj.id)
        if self._ctx.journal is not None:
            self._ctx.journal.finished(traj)
        group = slot.group
        group.trajectories.append(traj)
        if send is not None:
            await send.send(traj)
        slot.pending[0] -= 1
        if slot.pending[0] == 0:
            self._ctx.prompt_cache.pop(slot.task.id, None)  # memory stays bounded by what is in flight
            await self._finish_group(group)
            if send is not None:
                await send.send(group)
        slot.batch.one_done()

    async def _finish_group(self, group: Group) -> None:
        group.trajectories.sort(key=lambda t: t.sample_index)
        scored = [t for t in group.trajectories if t.reward is not None]
        counted = [t for t in scored if t.id in self._counted]  # not those a snapshot brought back
        self._counted.difference_update(t.id for t in group.trajectories)
        if not scored:
            return
        for t in counted:  # the run's stats count the rewards the group ends with
            self.stats.outcomes.count_reward(t, -1)
        for t in scored:  # a group reward is computed from the per-sample ones, also when a group runs again
            per_sample = t.metadata.get("sample_reward")
            if per_sample is not None:
                t.reward, t.reward_components = per_sample["reward"], dict(per_sample["components"])
        try:
            with anyio.fail_after(self.config.reward_timeout):
                values = await self.env.group_reward(group.task, scored)
            if values is not None:
                if len(values) != len(scored):
                    raise ValueError(f"group_reward returned {len(values)} values for {len(scored)} samples")
                for t, v in zip(scored, values):
                    t.metadata["sample_reward"] = {"reward": t.reward, "components": dict(t.reward_components)}
                    apply_reward(t, v)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # noqa: BLE001
            for t in scored:
                reward_failed(t, exc)
        finally:
            for t in counted:
                self.stats.outcomes.count_reward(t)
