"""How the policy computes on its device: the precision, the autocast context, the process
group's backend, and which device a Ray trainer rank takes.

The CPU (what CI runs) and a CUDA GPU go through the same code; these functions are where the
two differ, each a plain decision that tests check for both inputs. The lines that only run on
CUDA are listed in docs/architecture.md ("GPU-only lines").
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager

from ..devices import DEVICE_NAMES, resolve_device
from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

#: ``auto``: bf16 autocast on a CUDA device that supports bf16, fp32 elsewhere; ``fp32``;
#: ``bf16``: autocast with float32 master weights and optimiser state (on CPU too, if asked).
PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device: "torch.device") -> str:
    """``"fp32"`` or ``"bf16"``: what ``precision`` means on ``device``."""
    import torch

    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be auto, fp32 or bf16, got {precision!r}")
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def autocast(device: "torch.device", precision: str) -> ContextManager:
    """The forward's context: bf16 autocast on ``device`` (matrix products in bfloat16, the
    weights they read stay float32), or nothing for fp32."""
    import torch

    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def process_group_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend for ranks that train on ``device_type``: NCCL between
    CUDA devices, gloo between CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device: str, cluster_gpus: float, ranks: int) -> str:
    """The device each of ``ranks`` Ray trainer ranks trains on, decided on the driver: ``"cuda"``
    (each rank asks Ray for one GPU, the only one it then sees) or ``"cpu"``. ``auto`` takes GPUs
    when the cluster has one for every rank; naming CUDA on a cluster with too few is a
    :class:`~agentenv.errors.ConfigError`."""
    if device == "cpu":
        return "cpu"
    if device == "auto":
        return "cuda" if cluster_gpus >= ranks else "cpu"
    if not device.startswith("cuda"):
        raise ConfigError(f"device must be {DEVICE_NAMES}, got {device!r}")
    if cluster_gpus < ranks:
        raise ConfigError(f"device={device!r} with {ranks} trainer ranks needs {ranks} GPUs in the Ray cluster, "
                          f"which has {cluster_gpus:g}; use device='cpu', device='auto' (GPUs only where every rank "
                          "gets one) or fewer --trainer-ranks")
    return "cuda"


def use_device(device: "torch.device") -> None:
    """Make ``device`` this process's current CUDA device (NCCL and FSDP2 place their buffers
    there); nothing on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)


def device_mesh(device: "torch.device"):
    """A one-dimensional mesh over the process group's ranks on ``device``'s type, for FSDP2
    (its default mesh takes the machine's accelerator, also for ranks that train on the CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


__all__ = ["PRECISIONS", "autocast", "device_mesh", "process_group_backend", "rank_device", "resolve_device",
           "resolve_precision", "use_device"]
