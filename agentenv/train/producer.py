"""A framework-neutral rollout producer: complete GRPO groups as ready-to-train batches.

For trainers that are not the bundled one (a home-grown PyTorch loop, a prime-rl-style
trainer): the producer runs programs in a :class:`~agentenv.reactor.Reactor` in the
background and hands out :class:`~agentenv.train.batch.Batch` objects (input ids exactly as
sampled, loss mask, behaviour logprobs, weight versions, group-normalised advantages)::

    async with RolloutProducer(reactor, env.tasks(1000), group_size=4, groups_per_batch=8,
                               max_staleness=1) as producer:
        async for batch in producer:        # waits until 8 complete groups are ready
            loss = ...                      # your forward/backward/step
            await engine.load_weights(model.state_dict())   # bumps the engine's version

* **Backpressure.** At most ``(batches taken + max_staleness + 1) x groups_per_batch`` groups
  are started (AReaL's admission rule), so generation never runs further ahead than the
  trainer can use; with ``max_staleness=None`` the bound is ``buffer_batches`` batches ahead.
* **Bounded staleness.** A group whose oldest sampled token is more than ``max_staleness``
  weight versions behind the engine's current version when a batch is taken is dropped
  (counted in ``dropped``) and a replacement task starts. Versions are the engine's
  ``weight_version``: bump it with ``engine.load_weights`` after each optimiser step.
* Leaving the ``async with`` cancels what is still running; every sandbox session is closed.
"""

from __future__ import annotations

import itertools
from typing import AsyncIterator, Callable, Iterable

import anyio

from ..env import Task
from ..reactor import Group, Reactor
from .batch import Batch, collate
from .buffer import RolloutBuffer, StalenessGate


class RolloutProducer:
    def __init__(self, reactor: Reactor, tasks: Iterable[Task] | Callable[[int], Task], *, group_size: int,
                 groups_per_batch: int, max_staleness: int | None = None, buffer_batches: int = 2,
                 pad_id: int | None = None, scale_advantages: bool = True) -> None:
        if group_size < 2:
            raise ValueError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        if groups_per_batch < 1 or buffer_batches < 1 or (max_staleness is not None and max_staleness < 0):
            raise ValueError("groups_per_batch and buffer_batches must be >= 1, max_staleness >= 0 or None")
        self.reactor, self.group_size, self.groups_per_batch = reactor, group_size, groups_per_batch
        self._tasks = (tasks if callable(tasks) else None), (None if callable(tasks) else iter(tasks))
        ahead = buffer_batches - 1 if max_staleness is None else max_staleness
        self.max_staleness = max_staleness
        self._gate = StalenessGate(batch=groups_per_batch, max_staleness=ahead)
        # The buffer's own staleness check uses engine versions; None: never drop.
        self._buffer = RolloutBuffer(capacity=(ahead + 1) * groups_per_batch,
                                     max_staleness=10**9 if max_staleness is None else max_staleness)
        tok = reactor.engine.tokenizer
        self.pad_id = pad_id if pad_id is not None else (tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.scale_advantages = scale_advantages
        self.batches = 0  # batches handed out
        self._cond = anyio.Condition()
        self._tg: anyio.abc.TaskGroup | None = None
        self._exhausted = False
        self._running = 0
        self._error: BaseException | None = None

    @property
    def dropped(self) -> int:
        """Groups dropped because they were too stale when a batch was taken."""
        return self._buffer.dropped

    @property
    def started(self) -> int:
        """Groups started so far (consumed, buffered or running)."""
        return self._gate.started

    def _next_task(self, index: int) -> Task | None:
        fn, it = self._tasks
        if fn is not None:
            return fn(index)
        return next(it, None)  # type: ignore[arg-type]

    async def __aenter__(self) -> "RolloutProducer":
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._generate)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    async def _generate(self) -> None:
        # Held here: aclose() clears self._tg before this task sees its cancellation.
        tg = self._tg
        assert tg is not None
        for index in itertools.count():
            async with self._cond:
                while not self._gate.can_start(self.batches):
                    await self._cond.wait()
                task = self._next_task(index)
                if task is None:
                    self._exhausted = True
                    self._cond.notify_all()
                    return
                self._gate.start(self.batches)
                self._running += 1
            tg.start_soon(self._one, task)

    async def _one(self, task: Task) -> None:
        try:
            group = await self.reactor.group(task, self.group_size)
        except Exception as exc:  # noqa: BLE001 - surfaced to the consumer
            group, self._error = None, exc
        async with self._cond:
            self._running -= 1
            if group is not None:
                self._buffer.put(group)
            self._cond.notify_all()

    async def next_batch(self) -> Batch | None:
        """The next ``groups_per_batch`` complete groups, collated; None once a finite task
        list is used up (a last, smaller batch is returned first)."""
        groups = await self.next_groups()
        return None if groups is None else collate(groups, pad_id=self.pad_id, scale_advantages=self.scale_advantages)

    async def next_groups(self) -> list[Group] | None:
        """Like :meth:`next_batch`, as :class:`Group` objects (trajectories with everything)."""
        if self._tg is None:
            raise RuntimeError("use the producer as 'async with RolloutProducer(...) as producer'")
        n = self.groups_per_batch
        async with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                before = self._buffer.dropped
                groups = self._buffer.take(n, self.reactor.engine.weight_version)
                if self._buffer.dropped > before:  # stale: let replacements start
                    self._gate.started -= self._buffer.dropped - before
                    self._cond.notify_all()
                if groups is None and self._exhausted and self._running == 0:
                    groups = self._buffer.take(max(1, len(self._buffer)), self.reactor.engine.weight_version) \
                        if len(self._buffer) else None
                    if groups is None:
                        return None
                if groups is not None:
                    self.batches += 1
                    self._cond.notify_all()
                    return groups
                await self._cond.wait()

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Batch]:
        while (batch := await self.next_batch()) is not None:
            yield batch


__all__ = ["RolloutProducer"]
