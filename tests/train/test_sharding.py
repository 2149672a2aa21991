"""FSDP2 sharding helpers (``agentenv.train.sharding``) on two real gloo ranks (two spawned
processes, no Ray): each rank holds half of every parameter, a whole tensor is gathered and
set on every rank, gradients are summed over the ranks, and the optimiser state gathers whole
and installs back into the shards."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

WORLD = 2


class Tiny(torch.nn.Module):
    """Decoder-shaped (``model.layers``, then a head), as ``shard_model`` walks it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def inputs(rank: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6).mul(0.1 * (rank + 1)).sin()


def _rank(rank: int, init: str, out: str) -> None:
    import faulthandler

    import torch.distributed as dist

    from agentenv.train.sharding import (copy_full_, full, is_sharded, load_optimizer_state, local,
                                         optimizer_state, shard_model)

    faulthandler.enable()  # a rank that aborts in gloo's C++ shows where its Python was
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model, plain = Tiny(), Tiny()
        plain.load_state_dict(model.state_dict())
        shard_model(model)
        res: dict = {"sharded": all(is_sharded(p) for p in model.parameters()),
                     "rows": {n: [local(p).shape[0], p.shape[0]] for n, p in model.named_parameters()},
                     "whole": all(torch.equal(full(p), q) for p, q in zip(model.parameters(), plain.parameters()))}
        model(inputs(rank)).square().sum().backward()
        sum(plain(inputs(r)).square().sum() for r in range(WORLD)).backward()  # both ranks' data in one
        res["grads_summed"] = all(torch.allclose(full(p.grad), q.grad, atol=1e-6)
                                  for p, q in zip(model.parameters(), plain.parameters()))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)  # as a freshly built policy that loads a checkpoint has none
        state = optimizer_state(model, opt)  # whole on rank 0 (offloaded to CPU there), as a checkpoint saves it
        res["state_entries"] = len(state.get("state", {}))
        shared = [state]
        dist.broadcast_object_list(shared, src=0)  # every rank reads the one checkpoint file
        again = torch.optim.AdamW(model.parameters(), lr=0.1)
        load_optimizer_state(model, again, shared[0])
        back = optimizer_state(model, again)
        res["optimizer_round_trip"] = rank != 0 or all(
            torch.equal(back["state"][n][k], v) for n, s in state["state"].items() for k, v in s.items())
        value = torch.arange(18, dtype=torch.float32).reshape(3, 6)
        with torch.no_grad():
            copy_full_(model.head.weight, value)
        res["set_whole"] = torch.equal(full(model.head.weight), value)
        res["local_part"] = local(model.head.weight).tolist()
        Path(out, f"{rank}.json").write_text(json.dumps(res))
        dist.barrier()  # neither rank tears its gloo pairs down while the other's last collective is in flight
    finally:
        dist.destroy_process_group()
    # Every collective is done and the results are written. The interpreter's teardown is not
    # under test: with the model sharded, the group's gloo threads (gloo_tcp_loop,
    # pt_gloo_runloop) still run after destroy_process_group (FSDP still holds the group), so
    # they would be torn down with the interpreter, where gloo can abort the process. A
    # trainer rank ends by ``ray.kill``, without that teardown, as this one does.
    os._exit(0)


@pytest.mark.timeout(300)
def test_two_ranks_hold_halves_gather_wholes_and_sum_gradients(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for res in ranks:
        assert res["sharded"] and res["whole"] and res["grads_summed"] and res["optimizer_round_trip"]
        assert res["set_whole"]
    assert ranks[0]["state_entries"] == len(ranks[0]["rows"])  # Adam's state for every parameter
    for name, (part, whole) in ranks[0]["rows"].items():  # dim 0 split in order, the first rank's share rounded up
        assert part == math.ceil(whole / WORLD) and part + ranks[1]["rows"][name][0] == whole, name
    value = torch.arange(18, dtype=torch.float32).reshape(3, 6).tolist()
    assert ranks[0]["local_part"] == value[:2] and ranks[1]["local_part"] == value[2:]  # rows split in order
