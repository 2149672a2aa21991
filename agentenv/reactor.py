"""The reactor: many programs at once on one engine, one sandbox backend, one environment.

Each program is a task in one anyio task group, admitted by a capacity limiter
(``concurrency``), so while one waits on its tool the others decode. When a program ends its
slot is freed at once and its reward is scored in a separate task (delayed reward: slow or
async rewards overlap with generation). When every sample of a task is scored, the
environment's optional ``group_reward`` runs and the whole GRPO :class:`Group` is emitted.

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

import math
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .config import RolloutConfig
from .engines.base import Engine
from .env import Environment, Task
from .formats import get_format
from .program import ProgramContext, run_program, stop_token_ids
from .stats import RunStats
from .errors import TrajectoryError
from .trajectory import Trajectory


@dataclass(slots=True)
class Group:
    """The G trajectories of one task (a GRPO group), all scored."""

    task: Task
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


def _apply_reward(traj: Trajectory, value: float | dict[str, float]) -> None:
    if isinstance(value, dict):
        comps = {k: float(v) for k, v in value.items()}
        traj.reward = comps.pop("reward") if "reward" in comps else float(sum(comps.values()))
        traj.reward_components = comps
    else:
        traj.reward = float(value)
    if traj.reward is not None and not math.isfinite(traj.reward):
        raise ValueError(f"reward is not a finite number: {traj.reward}")


def _reward_failed(traj: Trajectory, exc: BaseException) -> None:
    traj.metadata["program_finish_reason"] = traj.finish_reason
    traj.finish_reason = "error:reward"
    traj.reward = None
    traj.error = f"reward: {type(exc).__name__}: {exc}"


class Reactor:
    def __init__(
        self,
        engine: Engine,
        env: Environment,
        sandbox: object,
        config: RolloutConfig | None = None,
        *,
        buffer_size: int = 64,
    ) -> None:
        self.engine, self.env, self.sandbox = engine, env, sandbox
        self.config = config or RolloutConfig()
        self.buffer_size = buffer_size
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
        )
        self.stats = RunStats(block_size=getattr(engine, "page_size", 1))
        self._limiter = anyio.CapacityLimiter(self.config.concurrency)

    async def __aenter__(self) -> "Reactor":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass  # the reactor owns no resources; engine/sandbox/env belong to the caller

    @asynccontextmanager
    async def rollouts(
        self, tasks: Sequence[Task], group_size: int = 1
    ) -> AsyncIterator[MemoryObjectReceiveStream]:
        send, receive = anyio.create_memory_object_stream[object](self.buffer_size)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._produce, list(tasks), group_size, send)
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

    async def group(self, task: Task, group_size: int) -> Group:
        """Run the ``group_size`` programs of one task (sharing the reactor's concurrency
        limit with every other call) and return the scored group. Trainers that stream tasks
        one group at a time (under their own admission control) use this."""
        group = Group(task)
        pending = [group_size]
        async with anyio.create_task_group() as tg:
            for i in range(group_size):
                tg.start_soon(self._one, task, f"{task.id}#g", i, group, pending, None)
        return group

    async def _produce(self, tasks: list[Task], group_size: int, send: MemoryObjectSendStream) -> None:
        self.stats.start(len(tasks) * group_size)
        async with send, anyio.create_task_group() as tg:
            for task in tasks:
                group = Group(task)
                pending = [group_size]
                for i in range(group_size):
                    tg.start_soon(self._one, task, f"{task.id}#g", i, group, pending, send.clone())
        self.stats.stop()

    async def _one(
        self,
        task: Task,
        group_id: str,
        index: int,
        group: Group,
        pending: list[int],
        send: MemoryObjectSendStream | None,
    ) -> None:
        async with send if send is not None else nullcontext():
            async with self._limiter:
                self.stats.program_started()
                traj = await run_program(self._ctx, task, group_id, index)
            # The slot is free again; the (possibly slow) reward runs outside it.
            try:
                with anyio.fail_after(self.config.reward_timeout):
                    _apply_reward(traj, await self.env.reward(task, traj))
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # noqa: BLE001 - recorded on the trajectory
                _reward_failed(traj, exc)
            try:
                traj.validate()
            except TrajectoryError as exc:  # an engine returned inconsistent data: keep it, flagged
                traj.finish_reason, traj.error = "error:trajectory", str(exc)
            self.stats.add(traj)
            group.trajectories.append(traj)
            if send is not None:
                await send.send(traj)
            pending[0] -= 1
            if pending[0] == 0:
                await self._finish_group(group)
                if send is not None:
                    await send.send(group)

    async def _finish_group(self, group: Group) -> None:
        group.trajectories.sort(key=lambda t: t.sample_index)
        scored = [t for t in group.trajectories if t.reward is not None]
        if not scored:
            return
        try:
            with anyio.fail_after(self.config.reward_timeout):
                values = await self.env.group_reward(group.task, scored)
            if values is not None:
                if len(values) != len(scored):
                    raise ValueError(f"group_reward returned {len(values)} values for {len(scored)} samples")
                for t, v in zip(scored, values):
                    _apply_reward(t, v)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # noqa: BLE001
            for t in scored:
                _reward_failed(t, exc)
