"""The embedded engine's sleep mode (:meth:`EmbeddedEngine.sleep <agentenv.engines.embedded.EmbeddedEngine.sleep>`):
what it frees and how it comes back.

Asleep, the continuous-batching manager's generation thread is stopped (the requests in
flight finish first) and its batch processor, which owns the paged KV cache and the prefix
cache's blocks, is dropped, so the cache's tensors are freed. Then, by level:

* level 1: the weights move to host memory, and back to their device on waking. On CPU they
  are in host memory already, so only the KV cache is freed;
* level 2: every parameter's storage is released (its shape and dtype kept). Waking allocates
  them again, uninitialised, and requests wait until ``load_weights`` has filled every one of
  them.

Waking creates a new batch processor (an empty KV cache, every block free) and starts the
generation thread again. Pure torch and transformers calls, run in a worker thread by the
engine.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

#: The levels the embedded engine implements (vLLM's meaning).
SLEEP_LEVELS = (1, 2)


@dataclass
class Slumber:
    """One sleep of the engine: its level, where the weights live awake, and (level 2) the
    parameters whose storage was released, with their shapes."""

    level: int
    device: torch.device
    released: list[tuple[torch.nn.Parameter, torch.Size]] = field(default_factory=list)


def _empty_device_cache(device: torch.device) -> None:
    """Give a device's cached blocks back to the device (torch keeps freed CUDA memory in its
    caching allocator). Freed host memory goes back to the system without this (the KV cache is
    one large allocation, which the C allocator returns when freed)."""
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "empty_cache"):
        gc.collect()
        module.empty_cache()


def fall_asleep(mgr: Any, model: torch.nn.Module, level: int) -> Slumber:
    """Stop ``mgr``'s generation thread (requests in flight finish), drop its KV cache, and
    offload (level 1) or release (level 2) ``model``'s weights."""
    device = next(model.parameters()).device
    mgr.stop(block=True)
    mgr.batch_processor = None  # stop() drops it too; said here because the cache must go
    slumber = Slumber(level, device)
    if level == 1:
        if device.type != "cpu":
            model.to("cpu")
    else:
        with torch.no_grad():
            for p in model.parameters():  # tied parameters come once
                slumber.released.append((p, p.shape))
                p.data = torch.empty(0, dtype=p.dtype, device=device)
    _empty_device_cache(device)
    return slumber


def wake(mgr: Any, model: torch.nn.Module, slumber: Slumber) -> set[int]:
    """Bring back what :func:`fall_asleep` freed and create a new, empty KV cache (the
    generation thread is not started here). Returns the ids of the parameters that hold no
    weights yet (level 2's), which ``load_weights`` must fill before the engine generates."""
    if slumber.level == 1 and slumber.device.type != "cpu":
        model.to(slumber.device)
    missing: set[int] = set()
    with torch.no_grad():
        for p, shape in slumber.released:
            p.data = torch.empty(shape, dtype=p.dtype, device=slumber.device)
            missing.add(id(p))
    # The manager gives back the attention implementation it switched to when it stops.
    mgr.switch_to_cb_friendly_attn(model, mgr.continuous_batching_config.auto_switch_to_flash)
    mgr.batch_processor = mgr._create_batch_processor()
    return missing


def kv_cache_bytes(mgr: Any) -> int:
    """Bytes held by the KV cache's tensors (0 while the engine sleeps)."""
    bp = mgr.batch_processor
    if bp is None:
        return 0
    t = bp.cache.cache_tensor  # one byte tensor holds every layer's keys and values
    return t.numel() * t.element_size()


__all__ = ["SLEEP_LEVELS", "Slumber", "fall_asleep", "kv_cache_bytes", "wake"]
