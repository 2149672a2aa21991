"""Weights that rank 0 of a Ray policy (``train.distributed``) sends into an engine itself.

After a step, the ranks stage the weights (sharded: every rank takes part in gathering the whole
tensors) and rank 0 leaves its host copies in the object store; the driver gets their metadata
only (:class:`RankWeights`). An engine whose weights go over a weight-update group
(``engines/weight_group.py``) forms it with rank 0, which joins as the group's rank 0 on its own
node's address and broadcasts the staged tensors straight to the engine's workers; the driver
coordinates (pause, metadata through ``collective_rpc``, version stamping) and sends nothing
(:class:`RankSender`). An engine on the host path fetches the staged tensors, as before.

    weights = policy.sync_weights()            # a RankWeights: staged, not fetched
    await engine.load_weights(weights, version=step)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from ..engines.weight_group import TIMEOUT_S, HeldWeights, Meta, root_error

if TYPE_CHECKING:
    import torch


class RayPolicy(Protocol):
    """What these weights use of ``train.distributed.RayPolicy`` (which imports this module):
    its rank actors, rank 0 first, and the call that waits for a rank's answer."""

    actors: list[Any]

    def _get(self, ref: Any) -> Any: ...


async def _answer(policy: RayPolicy, ref: Any) -> Any:
    """A rank's answer, waited for in a thread (a rank that died raises ``RankDiedError``)."""
    import anyio

    return await anyio.to_thread.run_sync(policy._get, ref, abandon_on_cancel=True)


class RankWeights(HeldWeights):
    """Rank 0's weights after a step, staged in the object store (``ref``), with their
    metadata: rank 0 sends them over a weight-update group itself; :meth:`tensors` fetches
    them for the host path (once)."""

    holder = "rank 0 of the Ray trainer"

    def __init__(self, policy: RayPolicy, meta: Meta, ref: Any) -> None:
        #: The policy whose rank 0 holds them (a sender formed with it serves its later updates).
        self.origin = policy
        self.meta, self.ref = meta, ref
        self._fetched: dict[str, torch.Tensor] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._fetched is None:
            self._fetched = self.origin._get(self.ref)
        return self._fetched

    async def form_group(self, workers: int, ask_join: Callable[[str, int, int, str], Awaitable[Any]]) -> RankSender:
        return await RankSender.form(self.origin, workers, ask_join)


class RankSender:
    """Rank 0's end of an engine's weight-update group, driven from the driver: the group and
    its broadcasts live in the rank-0 actor, and these calls are Ray calls on it
    (:class:`~agentenv.engines.weight_group.GroupSender`'s surface, for ``GroupLink``)."""

    def __init__(self, policy: RayPolicy, actor: Any, world: int, backend_name: str, pid: int) -> None:
        self.origin, self._actor = policy, actor
        self.world, self.backend = world, backend_name
        #: The rank-0 actor's process id: where the bytes are sent from.
        self.pid = pid
        #: Bytes rank 0 sent over the group so far (as it reports them).
        self.sent_bytes = 0

    @classmethod
    async def form(cls, policy: RayPolicy, workers: int, ask_join: Callable[[str, int, int, str], Awaitable[Any]], *,
                   timeout_s: float = TIMEOUT_S) -> RankSender:
        """Form the group of rank 0 and ``workers`` peers: rank 0 listens on its node's address
        and joins in a thread of its own (``Rendezvous``) while ``ask_join(host, port, world,
        backend)`` asks the engine's workers to join. Raises when any of it fails or
        ``timeout_s`` passes; rank 0's join is then given up (it ends at once)."""
        import anyio

        actor = policy.actors[0]
        host, port, world, backend_name = await _answer(policy, actor.weight_group_open.remote(workers, timeout_s))
        try:
            with anyio.fail_after(timeout_s):
                await ask_join(host, port, world, backend_name)
                pid = await _answer(policy, actor.weight_group_joined.remote())
        except BaseException:
            actor.weight_group_close.remote()
            raise
        return cls(policy, actor, world, backend_name, pid)

    async def update(self, weights: RankWeights, ask_receive: Callable[[Meta], Awaitable[Any]]) -> Any:
        """Rank 0 broadcasts the staged ``weights`` while ``ask_receive(meta)`` makes the
        workers receive and load them; their answer. A failure on either side closes the group
        and raises."""
        import anyio

        if self._actor is None:
            raise RuntimeError("rank 0's weight-update group is closed")
        sent: list[int] = []
        ref = self._actor.weight_group_send.remote(weights.ref)

        async def broadcast() -> None:
            sent.append(await _answer(self.origin, ref))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(broadcast)
                answer = await ask_receive(weights.meta)
        except BaseException as exc:
            self.close()
            if isinstance(exc, BaseExceptionGroup):
                raise root_error(exc) from None
            raise
        self.sent_bytes += sent[0]
        return answer

    def close(self) -> None:
        """Rank 0 leaves the group (idempotent). Its calls run one at a time, so it does so
        after a broadcast still in flight there returns: never under it."""
        actor, self._actor = self._actor, None
        if actor is not None:
            try:
                actor.weight_group_close.remote()
            except Exception:  # noqa: BLE001 - a rank that is gone took its group with it
                pass


__all__ = ["RankSender", "RankWeights"]
