"""Generation on real parts: the bundled model on the embedded engine, real sandbox
processes, a retool-math task stream whose groups always have reward variance."""

from __future__ import annotations

import anyio
import pytest

from agentenv import inflight
from agentenv.config import RolloutConfig
from agentenv.reactor import Reactor
from agentenv.registry import make
from agentenv.sandboxes import default_sandbox
from agentenv.train.generation import STREAM_SEED_STRIDE, Generation, StreamPosition, TaskStream
from ..waiting import until
from .conftest import AlternatingReward


@pytest.fixture(scope="module")
def engine(own_engine):
    """This module moves its engine's version on: its own engine, not the session's."""
    return own_engine


ROLLOUT = RolloutConfig(max_new_tokens=48, concurrency=8)


def test_the_stream_is_seeded_by_chunk_and_repeatable():
    env = make("retool-math")
    stream = TaskStream(env, chunk=2, seed=3)
    ids = [stream.task(i).id for i in range(6)]
    expected = [t.id for c in range(3) for t in env.tasks(2, seed=3 * STREAM_SEED_STRIDE + c)]
    assert ids == expected and len(set(ids)) == 6
    assert stream.task(1).id == ids[1] and TaskStream(env, chunk=2, seed=3).task(4).id == ids[4]  # back and forth


def test_the_tasks_in_flight_at_a_checkpoint_come_before_the_cursors():
    position = StreamPosition(cursor=7, redo=[4, 6])
    assert [position.next_index() for _ in range(4)] == [4, 6, 7, 8] and position.cursor == 9


def accounted(gen: Generation, consumed: list[str]) -> None:
    """Every task started is exactly one of: consumed by a batch, in flight, in the buffer."""
    snap = gen.snapshot()
    index_of = {gen.stream.task(i).id: i for i in range(snap.next)}
    parts = [[index_of[t] for t in consumed], snap.in_flight, [i for i, _ in snap.buffered]]
    every = [i for part in parts for i in part]
    assert sorted(every) == list(range(snap.next)), parts
    assert [gen.stream.task(i).id for i, g in snap.buffered] == [g.task.id for _, g in snap.buffered]


class Held(AlternatingReward):
    """Rewards wait for ``release`` while it is set: the groups stay in flight until then."""

    release: anyio.Event | None = None

    async def reward(self, task, trajectory):
        if self.release is not None:
            await self.release.wait()
        return await super().reward(task, trajectory)


@pytest.fixture
async def parts(engine):
    env = Held()
    async with default_sandbox("local") as sandbox:
        yield engine, env, sandbox


def generation(parts, *, version: int = 0, restored=(), max_staleness: int = 0) -> Generation:
    engine, env, sandbox = parts
    programs = inflight.InFlight()
    return Generation(Reactor(engine, env, sandbox, ROLLOUT, journal=programs), TaskStream(env, 2, 0), programs,
                      group_size=2, batch=2, max_staleness=max_staleness, version=version, restored=restored)


async def sync(gen: Generation, version: int) -> None:
    """What the step loop does after a step: the engine serves ``version`` (its weights
    unchanged here), then generation admits work at it."""
    await gen.reactor.engine.load_weights({}, version=version)
    await gen.publish(version)


@pytest.mark.anyio
async def test_the_gate_admits_one_batch_per_version_and_a_drain_waits_for_the_groups_in_flight(parts):
    gen = generation(parts)
    consumed: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(gen.run, tg)
        await sync(gen, 0)
        batch = await gen.next_batch()
        assert len(batch) == 2 and all(len(g.trajectories) == 2 for g in batch)
        consumed += [g.task.id for g in batch]
        # max_staleness=0: nothing more starts at version 0.
        assert gen.position.cursor == 2 and gen.generating == 0 and len(gen.buffer) == 0
        accounted(gen, consumed)
        env = gen.reactor.env
        env.release = anyio.Event()
        await sync(gen, 1)
        await until(lambda: gen.generating == 2, "version 1's two groups started")
        accounted(gen, consumed)  # in flight
        drained = anyio.Event()

        async def drain() -> None:
            await gen.drain()
            drained.set()

        tg.start_soon(drain)
        await until(lambda: gen.draining, "the drain began")
        assert not drained.is_set() and gen.generating == 2  # it waits: the groups' rewards are held
        env.release.set()
        await drained.wait()
        assert gen.generating == 0 and len(gen.buffer) == 2 and gen.position.cursor == 4
        accounted(gen, consumed)  # buffered
        await gen.publish(1)
        assert not gen.draining
        batch = await gen.next_batch()
        consumed += [g.task.id for g in batch]
        accounted(gen, consumed)
        tg.cancel_scope.cancel()
    assert len(set(consumed)) == 4 and gen.buffer.dropped == 0
    assert gen.position.index == {}  # consumed groups leave the index


@pytest.mark.anyio
async def test_restored_groups_that_are_too_stale_are_dropped_and_replaced(parts, groups):
    # The checkpoint's groups were sampled at version 0; at version 2 with max_staleness 1 they
    # are too old, so the first take drops them and lets two new groups start in their place.
    gen = generation(parts, version=2, max_staleness=1, restored=[(7, groups[0]), (8, groups[1])])
    await gen.reactor.engine.load_weights({}, version=2)
    assert [i for i, _ in gen.snapshot().buffered] == [7, 8]
    async with anyio.create_task_group() as tg:
        tg.start_soon(gen.run, tg)
        batch = await gen.next_batch()
        tg.cancel_scope.cancel()
    assert gen.buffer.dropped == 2 and not {g.task.id for g in batch} & {g.task.id for g in groups}
    assert all(v == 2 for g in batch for t in g.trajectories for v in t.weight_versions if v >= 0)
    assert all(i not in (7, 8) for i, _ in gen.snapshot().buffered)



class HoldOne(AlternatingReward):
    """The rewards of one task (``held``) wait for ``release``: its group stays in flight."""

    held: str | None = None
    release = None

    async def reward(self, task, trajectory):
        if task.id == self.held:
            await self.release.wait()
        return await super().reward(task, trajectory)


@pytest.mark.anyio
async def test_a_group_gone_stale_in_flight_is_cancelled_and_its_slot_goes_to_a_replacement(engine):
    # max_staleness 1: task 0's group, sampled at version 0, waits on its held rewards. At
    # version 1 it is still usable; at version 2 it no longer is, so it is cancelled then (not
    # generated to completion and dropped at a later take) and a replacement starts at once.
    env = HoldOne()
    env.release = anyio.Event()
    async with default_sandbox("local") as sandbox:
        gen = generation((engine, env, sandbox), max_staleness=1)
        env.held = gen.stream.task(0).id
        async with anyio.create_task_group() as tg:
            tg.start_soon(gen.run, tg)
            await sync(gen, 0)
            first = await gen.next_batch()
            await until(lambda: gen._programs.oldest_version(env.held) == 0, "task 0's group sampled at version 0")
            await sync(gen, 1)
            assert gen.cancelled == 0 and 0 in gen.position.in_flight  # one version old: still usable
            second = await gen.next_batch()
            # Only task 0's group is to go stale at version 2: any other group sampled at version
            # 0 (one a busy machine has not finished yet) completes first.
            await until(lambda: all(gen._programs.oldest_version(gen.stream.task(i).id) != 0
                                    for i in gen.position.in_flight if i != 0),
                        "every group but task 0's sampled at version 0 complete")
            await sync(gen, 2)
            assert gen.cancelled == 1 and gen.buffer.dropped == 1 and 0 not in gen.position.in_flight
            # Its rewards are still held: only the cancellation can end its task.
            await until(lambda: 0 not in gen._running, "the stale group's task ended")
            assert not env.release.is_set()
            assert env.held not in gen.reactor._ctx.prompt_cache  # the reactor keeps nothing of it
            # Admitted at version 2: two groups for its batch, and one in the cancelled one's place.
            await until(lambda: gen.position.cursor == 9, "the replacement admitted")
            third = await gen.next_batch()
            env.release.set()
            tg.cancel_scope.cancel()
    taken = {g.task.id for g in first + second + third}
    assert env.held not in taken and len(taken) == 6
    assert env.held not in {g.task.id for g in gen.buffer.groups}
