"""The framework-neutral producer on the real embedded engine and sandbox pool."""

from __future__ import annotations

import anyio
import pytest
import torch

from agentenv import Reactor, RolloutConfig, RolloutProducer
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.sandboxes.local import LocalSandbox

from ..waiting import until
from .test_trainer import AlternatingReward

pytestmark = pytest.mark.anyio


async def test_batches_are_exact_groups_with_backpressure_and_bounded_staleness(model_dir):
    env = AlternatingReward()
    tasks = env.tasks(12, seed=5)
    async with EmbeddedEngine(model_dir, seed=0) as eng, LocalSandbox() as sb:
        reactor = Reactor(eng, env, sb, RolloutConfig(max_new_tokens=64, concurrency=8))
        async with RolloutProducer(reactor, tasks, group_size=2, groups_per_batch=2, max_staleness=0) as producer:
            groups = await producer.next_groups()
            batch = await producer.next_batch()
            # The generator runs ahead only as far as the bound allows: once every group it
            # started has finished, it has had every chance to start more, and has not.
            bound = (producer.batches + 0 + 1) * 2
            await until(lambda: producer.started >= bound and producer._running == 0,
                        "the generator filled its bound and its groups finished")
            assert producer.started == bound
            # Row by row, the batch is the trajectories exactly as sampled.
            assert batch.size == 4 and len(groups) == 2
            for g in groups:
                assert len(g.trajectories) == 2 and {t.task_id for t in g.trajectories} == {g.task.id}
            # One weight update: groups sampled at version 0 are now too stale (max_staleness 0).
            await eng.load_weights({n: p.detach().clone() for n, p in eng.model.named_parameters()})
            fresh = await producer.next_batch()
            sampled = fresh.versions[fresh.mask.bool()]
            assert sampled.numel() > 0 and bool((sampled == 1).all()), "a stale token was handed out"
            handed = [g.task.id for g in groups] + [None] * 4  # batch and fresh: 2 groups each
            while (more := await producer.next_groups()) is not None:  # a finite task list ends
                handed += [g.task.id for g in more]
        assert len(handed) + producer.dropped == 12, (len(handed), producer.dropped)
        ids = [h for h in handed if h is not None]
        assert len(ids) == len(set(ids))
    # Masks and advantages: per group, advantages are normalised (sum 0); the mask covers only
    # sampled tokens, which carry their behaviour logprob.
    adv = batch.advantages.view(2, 2)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(2), atol=1e-5)
    assert bool((batch.behaviour_logprobs[batch.versions < 0] == 0).all())
    assert bool((batch.versions[batch.mask.bool()] == 0).all())


async def test_closing_right_after_a_batch_is_taken_is_clean(model_dir):
    # Taking a batch wakes the generator (a new group may start); closing before it runs must
    # not let it start that group on a task group that is already gone.
    env = AlternatingReward()
    async with EmbeddedEngine(model_dir, seed=0) as eng, LocalSandbox() as sb:
        reactor = Reactor(eng, env, sb, RolloutConfig(max_new_tokens=16, concurrency=4))
        for _ in range(3):
            producer = RolloutProducer(reactor, env.tasks(50, seed=1), group_size=2, groups_per_batch=1,
                                       max_staleness=0)
            await producer.__aenter__()
            groups = await producer.next_groups()
            await producer.aclose()  # no checkpoint between taking the batch and closing
            assert groups is not None and len(groups) == 1
            assert producer.started >= 1


@pytest.mark.slow
def test_the_minimal_pytorch_loop_example_trains_and_syncs(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "examples/producer_loop.py", "--steps", "2"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "1"], ["step", "2"]]
    assert "-> engine v1" in lines[0] and "-> engine v2" in lines[1]
    assert lines[-1] == "producer_steps: 2"
