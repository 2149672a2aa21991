"""``agentenv.train.rank_weights``: weights that rank 0 of a Ray policy holds and sends into an
engine itself. What the driver's handle answers without fetching, a closed sender, and (slow)
a real two-rank Ray policy whose rank 0 forms a group with a worker and broadcasts its
weights."""

from __future__ import annotations

import anyio
import pytest
import torch

from agentenv.engines.weight_group import join, leave, receive
from agentenv.train.rank_weights import RankSender, RankWeights

pytestmark = pytest.mark.anyio

META = [("lm_head.weight", "float32", [8, 4]), ("norm.weight", "bfloat16", [4])]


def test_the_driver_knows_the_staged_weights_from_their_metadata_alone():
    # No policy to fetch from: anything read here comes from the metadata, nothing is fetched.
    weights = RankWeights(None, META, None)
    assert weights.keys() == ["lm_head.weight", "norm.weight"]
    assert weights.nbytes == 8 * 4 * 4 + 4 * 2
    assert weights.holder == "rank 0 of the Ray trainer" and weights.origin is None


async def test_a_closed_sender_refuses_an_update_and_closes_once():
    sender = RankSender(None, None, world=2, backend_name="gloo", pid=1)
    sender.close()  # no actor: nothing to leave, no error
    with pytest.raises(RuntimeError, match="rank 0's weight-update group is closed"):
        await sender.update(RankWeights(None, META, None), lambda meta: anyio.sleep(0))
    assert sender.sent_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True], ids=["whole", "fsdp"])
async def test_rank_zero_of_a_ray_policy_sends_its_weights_itself(ray_cluster, model_dir, shard):
    """A two-rank Ray policy stages its weights with rank 0 (sharded: both ranks gather them);
    rank 0 forms a group with a worker (a thread of this process here; a first try whose worker
    fails is given up) and broadcasts them: the worker receives exactly what ``sync_tensors``
    fetches, and rank 0's process reports the bytes."""
    from agentenv.train.distributed import RayPolicy

    policy = await anyio.to_thread.run_sync(lambda: RayPolicy(model_dir, ranks=2, seed=0, shard=shard,
                                                              logprob_chunk=0 if shard else 512))
    peer: list = []
    try:
        weights = await anyio.to_thread.run_sync(policy.sync_weights)

        async def ask_join(host: str, port: int, world: int, backend_name: str) -> None:
            peer.append(await anyio.to_thread.run_sync(
                lambda: join(host, port, 1, world, backend_name=backend_name, timeout_s=60)))

        async def refuse(host: str, port: int, world: int, backend_name: str) -> None:
            raise RuntimeError("the workers could not join")

        with pytest.raises(RuntimeError, match="could not join"):
            await weights.form_group(1, refuse)
        sender = await weights.form_group(1, ask_join)
        got = await sender.update(weights, lambda meta: anyio.to_thread.run_sync(lambda: dict(receive(peer[0], meta))))
        expected = await anyio.to_thread.run_sync(policy.sync_tensors)
        assert list(got) == list(expected) and all(torch.equal(got[n], t) for n, t in expected.items())
        assert sender.sent_bytes == weights.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
        assert sender.pid == policy.pids[0]
        sender.close()
    finally:
        for group in peer:
            leave(group)
        await anyio.to_thread.run_sync(policy.close)
