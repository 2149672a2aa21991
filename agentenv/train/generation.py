"""Generation for the bundled trainer: the endless task stream, the generator task that runs
each admitted task's group in the reactor, and the batch queue the step loop takes from.

One :class:`Generation` owns everything the generator and the step loop share: the
:class:`~agentenv.train.buffer.StalenessGate` (what may start at the current weight version),
the :class:`~agentenv.train.buffer.RolloutBuffer` (complete groups waiting), the weight version
generation admits work at, whether a drain is in progress, and where the task stream stands
(:class:`StreamPosition`). These change only together under one condition variable, and no
change awaits between its parts, so a :meth:`Generation.snapshot` (a checkpoint's) finds every
started task exactly once: in flight or buffered, unless it was consumed or dropped as stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import anyio
import anyio.abc

from .. import inflight
from ..env import Task
from ..reactor import Group, Reactor
from .buffer import RolloutBuffer, StalenessGate
from .metrics import BusyClock

#: Chunk ``c`` of the task stream comes from seed ``seed * STREAM_SEED_STRIDE + c``.
STREAM_SEED_STRIDE = 1_000_003


class TaskStream:
    """Task ``i`` of an endless, seeded stream, drawn from ``env`` in chunks of ``chunk`` tasks,
    so a resumed run continues exactly where the checkpoint's consumed tasks end. Only the
    latest chunk is kept."""

    def __init__(self, env: Any, chunk: int, seed: int) -> None:
        self._env, self._chunk, self._seed = env, chunk, seed
        self._cached: tuple[int, list[Task]] | None = None  # (chunk number, its tasks)

    def task(self, i: int) -> Task:
        c, j = divmod(i, self._chunk)
        if self._cached is None or self._cached[0] != c:
            self._cached = (c, self._env.tasks(self._chunk, seed=self._seed * STREAM_SEED_STRIDE + c))
        return self._cached[1][j]


@dataclass
class StreamPosition:
    """Where the generator stands in the task stream (a checkpoint saves it)."""

    #: The next task index of the stream.
    cursor: int = 0
    #: Indices to generate (again) before the cursor's: the tasks in flight at a checkpoint.
    redo: list[int] = field(default_factory=list)
    #: Indices of the tasks whose group is being generated.
    in_flight: set[int] = field(default_factory=set)
    #: ``id(group)`` -> its task index, for the groups in the buffer.
    index: dict[int, int] = field(default_factory=dict)
    #: Task id -> its programs as a checkpoint saved them (continued, then forgotten).
    saved: dict[str, inflight.TaskSnapshot] = field(default_factory=dict)

    def next_index(self) -> int:
        if self.redo:
            return self.redo.pop(0)
        self.cursor += 1
        return self.cursor - 1


@dataclass
class GenerationState:
    """What generation had made of the task stream at one moment: the stream's next index,
    the tasks in flight (sorted), the buffered groups with their task indices (arrival order)
    and the in-flight tasks' programs (:meth:`agentenv.inflight.InFlight.snapshot`)."""

    next: int
    in_flight: list[int]
    buffered: list[tuple[int, Group]]
    programs: dict[str, inflight.TaskSnapshot]


class Generation:
    """The generator and the batch queue it fills.

    ``run`` (the generator task) starts a task's group only when the staleness gate admits it
    at :attr:`version`, so every group is consumed within ``max_staleness`` versions; each
    group's programs run in ``reactor`` and the complete group enters :attr:`buffer`.
    ``next_batch`` hands the step loop ``batch`` groups usable at :attr:`version`; ``publish``
    moves :attr:`version` on after a weight sync. ``restored`` groups (a checkpoint's buffer)
    enter the buffer first; those too stale for ``version`` are dropped at the first take. A
    group in flight that goes stale is cancelled when the version that makes it so is published
    (:meth:`publish`), and a replacement admitted."""

    def __init__(self, reactor: Reactor, stream: TaskStream, programs: inflight.InFlight, *, group_size: int,
                 batch: int, max_staleness: int, version: int, position: StreamPosition | None = None,
                 restored: Sequence[tuple[int, Group]] = ()) -> None:
        self.reactor, self.stream, self.group_size = reactor, stream, group_size
        self.position = position if position is not None else StreamPosition()
        #: The weight version the engine serves, at which work is admitted and batches taken.
        self.version = version
        #: While True (``partial="drain"``, before a sync) no group starts.
        self.draining = False
        #: Seconds the step loop spent waiting in :meth:`next_batch`.
        self.wait_s = 0.0
        #: Time during which at least one group was generating; ``clock.active`` counts them.
        self.clock = BusyClock()
        self.batch = batch
        self._programs = programs
        self._gate = StalenessGate(batch=batch, max_staleness=max_staleness, started=version * batch + len(restored))
        #: The complete groups waiting; read it, change it only through this object.
        self.buffer = RolloutBuffer(capacity=max((max_staleness + 1) * batch, len(restored)),
                                    max_staleness=max_staleness)
        self._cond = anyio.Condition()
        #: Task index -> (task id, cancel scope) of each group being generated.
        self._running: dict[int, tuple[str, anyio.CancelScope]] = {}
        #: Groups cancelled in flight: stale before they were complete (counted in ``buffer.dropped``).
        self.cancelled = 0
        for index, group in restored:
            self.position.index[id(group)] = index
            self.buffer.put(group)

    @property
    def generating(self) -> int:
        """Groups being generated now."""
        return self.clock.active

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """The generator task: each admitted task's group runs in ``tg`` (so a failure cancels
        the run); it never returns."""
        while True:
            async with self._cond:
                while self.draining or not self._gate.can_start(self.version):
                    await self._cond.wait()
                self._gate.start(self.version)
                index = self.position.next_index()
                self.position.in_flight.add(index)
            tg.start_soon(self._group, index)

    async def _group(self, index: int) -> None:
        task = self.stream.task(index)
        saved = self.position.saved.pop(task.id, None)  # in flight at the checkpoint: continue it
        resume, finished = inflight.restore(saved) if saved is not None else (None, ())
        if saved is not None:  # agents' calls so far stay in the next checkpoint's snapshot
            self._programs.restored(saved)
        scope = anyio.CancelScope()
        self._running[index] = (task.id, scope)
        self.clock.enter()
        try:
            with scope:
                group = await self.reactor.group(task, self.group_size, resume=resume, finished=finished)
        finally:
            self.clock.exit()
            self._running.pop(index, None)
        self._programs.forget(task.id)
        async with self._cond:
            self.position.in_flight.discard(index)
            if not scope.cancel_called:  # else :meth:`_cancel_stale` dropped it (even if it completed since)
                self.position.index[id(group)] = index
                self.buffer.put(group)
            self._cond.notify_all()

    async def next_batch(self) -> list[Group]:
        """The next ``batch`` complete groups usable at :attr:`version`, oldest weights first;
        waits until there are enough. Each stale group dropped lets a replacement start."""
        waited = time.perf_counter()
        async with self._cond:
            while True:
                before = self.buffer.dropped
                groups = self.buffer.take(self.batch, self.version)
                if self.buffer.dropped > before:
                    self._gate.started -= self.buffer.dropped - before
                    self._cond.notify_all()
                if groups is not None:
                    break
                await self._cond.wait()
            # Consumed and dropped groups leave the index; the buffer's remain.
            self.position.index = {id(g): self.position.index[id(g)] for g in self.buffer.groups}
        self.wait_s += time.perf_counter() - waited
        return groups

    async def drain(self) -> None:
        """Stop admitting groups and wait until none is generating (until :meth:`publish`)."""
        async with self._cond:
            self.draining = True
            while self.clock.active:
                await self._cond.wait()

    async def publish(self, version: int) -> None:
        """The engine serves ``version`` now: admit work at it, and end a drain."""
        async with self._cond:
            self.version, self.draining = version, False
            self._cancel_stale()
            self._cond.notify_all()

    def _cancel_stale(self) -> None:
        """Cancel each group in flight that can no longer be used at :attr:`version`: one of
        its tokens is older than ``max_staleness`` versions (the buffer would drop it when
        complete). Its admission slot goes to a replacement now, and the engine stops decoding
        for it, rather than when it would have completed."""
        for index, (task_id, scope) in list(self._running.items()):
            oldest = self._programs.oldest_version(task_id)
            if scope.cancel_called or oldest is None or self.version - oldest <= self.buffer.max_staleness:
                continue
            scope.cancel()
            self._gate.started -= 1
            self.buffer.dropped += 1
            self.cancelled += 1
            self.position.in_flight.discard(index)

    def snapshot(self) -> GenerationState:
        """Where generation stands now (between two awaits, so consistent)."""
        in_flight = sorted(self.position.in_flight)
        return GenerationState(next=self.position.cursor, in_flight=in_flight,
                               buffered=[(self.position.index[id(g)], g) for g in self.buffer.groups],
                               programs=self._programs.snapshot({self.stream.task(i).id for i in in_flight}))


__all__ = ["Generation", "GenerationState", "StreamPosition", "TaskStream"]
