"""The trainer's policy as a group of Ray actors (data parallel), behind the :class:`Policy`
interface the trainer already uses:

    policy = RayPolicy(model_dir, ranks=2, lr=2e-5)
    stats = policy.train_step(batch)   # each rank takes its share of the rows; one step on all
    tensors = policy.sync_tensors()    # rank 0's weights, through the object store
    weights = policy.sync_weights()    # the same, left with rank 0 (it sends them over a group)
    policy.close()

Each rank is a Ray actor holding a whole copy of the policy and its optimiser; the ranks form
one ``torch.distributed`` process group: NCCL when they train on CUDA (each rank asks Ray for
one GPU and makes it its device), gloo on CPUs (``agentenv.train.device.rank_device`` decides,
on the driver, from the ``device`` asked for and the cluster's GPUs). A step splits the batch's rows into
contiguous shares. Each rank weighs its loss by the whole batch's trained tokens (or rows), the
gradients and statistics are summed in one all-reduce, and every rank clips and steps the same
gradient, so the ranks' weights stay identical and equal one process's step on the whole batch
(:meth:`Policy.train_step`). Rank 0 broadcasts its starting weights, so the ranks start equal
whatever their seeds.

Weights reach the engine from rank 0 (LoRA: the adapter only): an engine that takes them over a
weight-update group gets them broadcast by rank 0 itself, the driver only coordinating
(:meth:`RayPolicy.sync_weights`, ``rank_weights``); otherwise through the object store (host
copies, from whichever device rank 0 trains on) and the driver, which loads them into its
engine. Checkpoints are written by rank 0 into ``out_dir``, so that must be storage rank 0's
node can write (on a local cluster, the driver's own disk; across machines, a shared
filesystem, as verl also requires).

With ``shard=True`` the ranks shard the parameters, gradients and optimiser state (FSDP2,
``agentenv.train.sharding``) instead of each holding all of them: the same step, 1/N of the
memory per rank; weight sync and checkpoints gather the whole tensors on every rank.

A rank that dies raises :class:`~agentenv.errors.RankDiedError`; the trainer then stops every
rank and starts new ones from its last checkpoint (``TrainConfig.cluster.rank_restarts`` times).
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, RankDiedError
from ..models.lora import LoraSpec
from .batch import Batch
from .config import OptimiserOptions
from .packing import micro_plan
from .policy import optimiser_options

if TYPE_CHECKING:
    from .rank_weights import RankWeights

_OPTIMISER_FIELDS = frozenset(f.name for f in fields(OptimiserOptions))


class TrainerRank:
    """The Ray actor (wrapped by ``ray.remote`` at start): one rank of the process group."""

    def __init__(self, rank: int, world: int, policy_kwargs: dict[str, Any], seed: int) -> None:
        self.rank, self.world = rank, world
        self.policy_kwargs, self.seed = policy_kwargs, seed
        self.policy: Any = None
        self._rendezvous: Any = None  # rank 0: a weight-update group being formed (``engines.weight_group``)
        self._weight_sender: Any = None  # rank 0: the formed group's sending end
        self._listen: Any = None  # rank 0, between address() and setup(): the rendezvous' socket

    def address(self) -> str:
        """The address of the group's rendezvous (asked of rank 0): a port on this node that
        this rank binds now and holds until :meth:`setup` serves the rendezvous on it, so no
        other process can take it in between."""
        import ray

        from ..engines.weight_group import listen

        ip = ray.util.get_node_ip_address()
        self._listen = listen(ip)
        return f"{ip}:{self._listen.getsockname()[1]}"

    def setup(self, address: str, timeout_s: float) -> int:
        import socket

        import torch.distributed as dist

        from .device import process_group_backend, resolve_device, use_device
        from .policy import Policy

        device = resolve_device(self.policy_kwargs["optimiser"].device)
        use_device(device)  # before the group: NCCL binds each rank to its current device
        host, port = address.rsplit(":", 1)
        timeout = timedelta(seconds=timeout_s)
        listening = self._listen
        if listening is None:
            store = dist.TCPStore(host, int(port), self.world, is_master=False, timeout=timeout)
        else:  # the store serves on the socket address() bound (it owns the descriptor now)
            self._listen, fd = None, listening.detach()
            try:
                store = dist.TCPStore(host, int(port), self.world, is_master=True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=fd)
            except BaseException:
                socket.close(fd)
                raise
        dist.init_process_group(process_group_backend(device.type), store=store, rank=self.rank,
                                world_size=self.world, timeout=timeout)
        torch.manual_seed(self.seed)
        self.policy = Policy(**self.policy_kwargs)  # it takes rank 0's weights (a broadcast), then shards
        return os.getpid()

    def train_step(self, batch: Batch, totals: tuple[float, int], micro_steps: int | None = None) -> dict[str, float]:
        return self.policy.train_step(batch, totals, micro_steps)

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        """Rank 0's tensors as host copies (sharded: every rank takes part in gathering them;
        the others return none)."""
        tensors = self.policy.sync_tensors()
        return {n: t.to("cpu", copy=True) for n, t in tensors.items()} if self.rank == 0 else {}

    def stage_tensors(self) -> tuple[Any, dict[str, torch.Tensor]]:
        """:meth:`sync_tensors` in two returns: their metadata, and the host copies, which the
        driver leaves in the object store (``rank_weights.RankWeights``)."""
        from ..engines.weight_group import metadata

        tensors = self.sync_tensors()
        return metadata(tensors), tensors

    def weight_group_open(self, workers: int, timeout_s: float) -> tuple[str, int, int, str]:
        """Rank 0: listen for a weight-update group with ``workers`` peers on this node's
        address (as the cluster reaches it) and join it as rank 0, in a thread; answers what
        the peers join with (host, port, world size, backend). A group this rank was in is left."""
        import ray

        from ..engines.weight_group import Rendezvous

        self.weight_group_close()
        self._rendezvous = Rendezvous(ray.util.get_node_ip_address(), workers, timeout_s)
        return self._rendezvous.address

    def weight_group_joined(self) -> int:
        """Rank 0: block until the group is formed (raises why it was not); this process's id."""
        rendezvous, self._rendezvous = self._rendezvous, None
        try:
            self._weight_sender = rendezvous.wait()
        finally:
            rendezvous.cancel()  # a join that failed: its socket closed (after success: nothing)
        return os.getpid()

    def weight_group_send(self, tensors: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast ``tensors`` (its staged copies, read from the object store) to the
        group's other ranks; the bytes sent."""
        if self._weight_sender is None:
            raise RuntimeError("rank 0 is in no weight-update group")
        return self._weight_sender.broadcast(tensors)

    def weight_group_close(self) -> None:
        """Give up a group being formed and leave a formed one (idempotent)."""
        rendezvous, self._rendezvous = self._rendezvous, None
        sender, self._weight_sender = self._weight_sender, None
        if rendezvous is not None:
            rendezvous.cancel()
        if sender is not None:
            sender.close()

    def base_tensors(self) -> dict[str, torch.Tensor]:
        tensors = self.policy.base_tensors()
        return {n: t.to("cpu", copy=True) for n, t in tensors.items()} if self.rank == 0 else {}

    def full_bytes(self) -> int:
        return self.policy.full_bytes

    def held_numel(self) -> tuple[int, int]:
        """(parameter elements this rank holds, the whole model's): 1/N of it when sharded."""
        from .sharding import local

        params = list(self.policy.model.parameters())
        return sum(local(p).numel() for p in params), sum(p.numel() for p in params)

    def save(self, path: str) -> None:
        self.policy.save(Path(path), write=self.rank == 0)

    def load(self, path: str) -> None:
        self.policy.load(Path(path))

    def close(self) -> None:
        import torch.distributed as dist

        self.weight_group_close()
        if dist.is_initialized():
            dist.destroy_process_group()


def shares(rows: int, ranks: int) -> list[slice]:
    """Contiguous, near-equal shares of ``rows`` (the first ``rows % ranks`` one longer)."""
    if rows < ranks:
        raise ConfigError(f"a batch of {rows} trajectories cannot be split over {ranks} trainer ranks; "
                          "use more groups per step or fewer ranks")
    base, extra = divmod(rows, ranks)
    out, start = [], 0
    for r in range(ranks):
        end = start + base + (r < extra)
        out.append(slice(start, end))
        start = end
    return out


class RayPolicy:
    """:class:`~agentenv.train.policy.Policy`'s interface over ``ranks`` Ray actors (see the
    module doc). Methods block (the trainer calls them from a worker thread)."""

    def __init__(self, model_dir: str | Path, *, ranks: int = 2, seed: int = 0, address: str | None = None,
                 rank_options: dict[str, Any] | None = None, setup_timeout_s: float = 300.0,
                 **policy_kwargs: Any) -> None:
        from ..raycluster import actor_options, connect
        from .device import rank_device

        if ranks < 1:
            raise ConfigError(f"trainer ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        settings = {k: policy_kwargs.pop(k) for k in list(policy_kwargs) if k in _OPTIMISER_FIELDS}
        opt = optimiser_options(policy_kwargs.pop("optimiser", None), settings)
        self.lora = policy_kwargs.get("lora") or (LoraSpec(rank=opt.lora_rank, alpha=opt.lora_alpha)
                                                  if opt.lora_rank else None)
        self.sharded = bool(policy_kwargs.get("shard")) and ranks > 1
        self.micro_batch, self.micro_batch_tokens, self.pack = opt.micro_batch, opt.micro_batch_tokens, opt.pack
        self._ray, self._started_ray = connect(address)
        ray = self._ray
        self.actors: list[Any] = []
        try:  # every rank on one GPU of its own, or all on CPUs
            self.device = rank_device(opt.device, ray.cluster_resources().get("GPU", 0), ranks)
        except BaseException:
            self.close()
            raise
        gpus = {"num_gpus": 1} if self.device == "cuda" else {}
        cls = ray.remote(TrainerRank).options(**actor_options(rank_options, num_cpus=1, **gpus))
        kwargs = {"model_dir": str(model_dir), **policy_kwargs, "optimiser": replace(opt, device=self.device)}
        self.actors = [cls.remote(r, ranks, kwargs, seed) for r in range(ranks)]
        try:
            address = self._get(self.actors[0].address.remote())
            self.pids = self._get([a.setup.remote(address, setup_timeout_s) for a in self.actors])
            self.full_bytes = self._get(self.actors[0].full_bytes.remote())
        except BaseException:
            self.close()
            raise

    def _get(self, refs: Any) -> Any:
        """The ranks' answers. A rank that died raises :class:`RankDiedError`, even when a
        survivor fails first (its collective lost a peer) or is left waiting in one."""
        ray = self._ray
        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        order = list(pending)
        failure: BaseException | None = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=None if failure is None else 5.0)
            if not ready:  # a survivor stuck in a collective with the failed rank
                break
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise RankDiedError(f"a trainer rank died: {exc}; the process group is gone") from exc
            except ray.exceptions.RayTaskError as exc:
                failure = failure or exc  # wait a little: was it a peer's death?
        if failure is not None:
            raise failure.as_instanceof_cause() from None  # type: ignore[attr-defined]
        values = ray.get(order)
        return values[0] if single else values

    def train_step(self, batch: Batch) -> dict[str, float]:
        totals = (float(batch.mask.sum()), batch.size)
        parts = shares(batch.size, self.ranks)
        lengths = batch.lengths
        micro_steps = max(len(micro_plan(lengths[s], self.micro_batch, self.micro_batch_tokens, self.pack))
                          for s in parts)  # the same on every rank
        stats = self._get([a.train_step.remote(batch.rows(s), totals, micro_steps)
                           for a, s in zip(self.actors, parts)])
        return stats[0]  # the same on every rank: the statistics were summed over them

    def _from_rank0(self, method: str, *args: Any) -> Any:
        """Rank 0's answer; sharded, every rank must take part (the whole tensors are gathered)."""
        actors = self.actors if self.sharded else self.actors[:1]
        return self._get([getattr(a, method).remote(*args) for a in actors])[0]

    def sync_tensors(self) -> dict[str, torch.Tensor]:
        return self._from_rank0("sync_tensors")

    def sync_weights(self) -> RankWeights:
        """What :meth:`sync_tensors` gives, left with rank 0: staged in the object store, only
        their metadata fetched. An engine that takes weights over a weight-update group gets
        them from rank 0 itself; one on the host path fetches them (``rank_weights``)."""
        from .rank_weights import RankWeights

        actors = self.actors if self.sharded else self.actors[:1]  # sharded: every rank gathers
        staged = [a.stage_tensors.options(num_returns=2).remote() for a in actors]
        meta = self._get([m for m, _ in staged])[0]
        return RankWeights(self, meta, staged[0][1])

    def base_tensors(self) -> dict[str, torch.Tensor]:
        return self._from_rank0("base_tensors")

    def save(self, path: Path) -> None:
        self._from_rank0("save", str(path))

    def load(self, path: Path) -> None:
        self._get([a.load.remote(str(path)) for a in self.actors])

    def close(self) -> None:
        ray = self._ray
        actors, self.actors = self.actors, []
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead or stuck rank is killed below anyway
                pass
            ray.kill(a)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


__all__ = ["RayPolicy", "TrainerRank", "shares"]
