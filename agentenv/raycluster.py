"""What every Ray actor of agentenv shares: connecting to the cluster, and the actor options.

Kept below ``cluster`` (rollout workers), ``engines.actors`` (engine actors) and
``train.distributed`` (trainer ranks), which all use it. Ray is optional
(``pip install agentenv[ray]``)."""

from __future__ import annotations

import os
from typing import Any


def ray_module() -> Any:
    """The ``ray`` module (:class:`~agentenv.errors.MissingExtraError` without it)."""
    from .extras import require

    require("ray", extra="ray", what="--cluster ray")
    import ray

    return ray


def connect(address: str | None = None) -> tuple[Any, bool]:
    """Ray, connected: to the cluster at ``address`` or ``RAY_ADDRESS``, or (with neither) to a
    local one started now, which the caller shuts down when it is done (the second value).

    Start a local cluster from the main thread: Ray ties its processes' lives to the thread
    that started them (PR_SET_PDEATHSIG), so one started from a worker thread dies when that
    thread ends (anyio's idle worker threads end after 10 s)."""
    ray = ray_module()
    if ray.is_initialized():
        return ray, False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return ray, False
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    return ray, True


def actor_options(options: dict[str, Any] | None, **defaults: Any) -> dict[str, Any]:
    """``ray.remote(...).options(...)`` for one of our actors: ``defaults`` under the caller's
    ``options``, with ``OMP_WAIT_POLICY=PASSIVE`` in its environment unless the caller sets it.

    Ray sets OMP_NUM_THREADS to an actor's CPUs; OpenMP then spin-waits between torch calls,
    burning the CPU that sandboxes and other actors on the node need (measured: +30-50 % wall
    on a CPU-bound tool workload)."""
    merged = {**defaults, **(options or {})}
    runtime_env = dict(merged.get("runtime_env") or {})
    runtime_env["env_vars"] = {"OMP_WAIT_POLICY": "PASSIVE", **(runtime_env.get("env_vars") or {})}
    merged["runtime_env"] = runtime_env
    return merged


def cpu_share(ray: Any, actors: int) -> float | None:
    """Each actor's CPUs when ``actors`` actors of one CPU each would not fit on a one-node
    cluster (a local one has as many CPUs as the machine, and an actor that does not fit would
    wait forever); None when they fit, or the cluster has several nodes (it may be scaling).
    Ray keeps 4 decimals: rounded down, so that they fit."""
    cpus = ray.cluster_resources().get("CPU", 0)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return None if actors <= cpus or nodes > 1 else int(cpus / actors * 1e4) / 1e4


def died_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a call to an actor raises when the actor died or is restarting."""
    ray = ray_module()
    return tuple(e for e in (getattr(ray.exceptions, "RayActorError", None),
                             getattr(ray.exceptions, "ActorUnavailableError", None)) if e is not None)
