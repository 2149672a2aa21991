"""Sharded data parallelism for the policy (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each rank keeps a 1/N shard of every parameter, gradient and optimiser state; a forward
all-gathers a decoder layer's parameters just before it runs, a backward reduce-scatters its
gradients. :class:`~agentenv.train.policy.Policy` shards itself when built with ``shard=True``
inside a process group (``agentenv.train.distributed`` builds it so on each Ray rank), over a
mesh on the ranks' device. The same code runs on gloo (CPU: what the tests here check) and
NCCL (GPUs).

Two rules every rank follows, since these are collective operations:
* every rank runs the same number of forward/backward passes in a step (a rank with fewer
  micro-batches runs zero-weighted ones; see ``Policy.train_step``'s ``micro_steps``);
* gathering full tensors (weight sync, checkpoints) is called on every rank; rank 0 uses them.
"""

from __future__ import annotations

from typing import Any

import torch


def shard_model(model: torch.nn.Module, mesh: Any = None) -> None:
    """Shard each decoder layer as its own unit, then the rest (embeddings, norm, head) at the
    root, over ``mesh`` (a ``DeviceMesh`` on the ranks' device type, from
    ``agentenv.train.device.device_mesh``; None: FSDP2's default, the machine's accelerator).
    Gradients are *summed* over the ranks (the loss is already weighted by the whole batch),
    not averaged."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in model.modules():  # each unit reduces its own gradients: set every one
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def is_sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather when sharded: call it on every rank)."""
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (the tensor itself when not sharded)."""
    return t.to_local() if is_sharded(t) else t


def copy_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a (possibly sharded) parameter from the whole tensor: each rank keeps its shard."""
    if is_sharded(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
        param.to_local().copy_(value.to_local())
    else:
        param.copy_(value)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's whole state, keyed by parameter name (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Install a whole state from :func:`optimizer_state` (each rank keeps its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
