"""The weight-update group: weights sent from the trainer into vLLM's workers by a collective
broadcast, not serialised and carried through the engine's RPC.

The trainer's end (rank 0) and every worker of one engine (ranks 1..N, one per
tensor-parallel rank) join a process group made for the purpose with vLLM's
``stateless_init_torch_distributed_process_group`` (it leaves ``torch.distributed``'s global
group alone, so a trainer rank that is also in its own data-parallel group can join): gloo on
CPU, NCCL where CUDA is present (the same code; :func:`backend` picks). vLLM's native weight
transfer (``WeightTransferConfig``) offers NCCL and CUDA IPC only, neither of which runs on a
CPU machine, hence this group of our own, as prime-rl and SkyRL build theirs.

One update is

1. the engine pauses (``mode="keep"``), as on the host path;
2. its workers are told the tensors' names, dtypes and shapes (:func:`metadata`, a small
   message carried by ``collective_rpc``) and start receiving;
3. the trainer broadcasts the tensors' bytes, packed into buckets of at most
   :data:`BUCKET_BYTES` (few collectives for a model of many small tensors, and a bounded extra
   copy on each side); both ends derive the same buckets from the metadata (:func:`buckets`);
4. each worker loads them in place (``vllm_worker.WeightSyncExtension``) exactly as a host
   update does, and the engine stamps the version and resumes.

A group that cannot be formed (no route to the trainer's address, workers without the
extension's methods, a timeout) leaves the engine on the host path, with one log line saying
why (the engines decide; this module forms the group and moves the bytes: :class:`Rendezvous`
and :class:`GroupSender` at the trainer's end, :func:`receive` in a worker).

The trainer's end is the process that holds the weights: this one, or another that sends them
itself while this one only coordinates (:class:`HeldWeights`: rank 0 of a Ray policy,
``train.rank_weights``).
"""

from __future__ import annotations

import logging
import socket
import threading
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Iterator, Literal

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: ``weight_sync`` settings: ``group`` (the group, or an error when it cannot be formed),
#: ``host`` (the serialised round trip), ``auto`` (the group where it can be formed, else host).
WeightSync = Literal["auto", "group", "host"]
WEIGHT_SYNC_MODES = ("auto", "group", "host")
#: The most bytes one broadcast carries (a larger tensor goes alone).
BUCKET_BYTES = 64 * 1024**2
#: How long forming the group, or one update's broadcast, may wait for its peers.
TIMEOUT_S = 120.0

Meta = list[tuple[str, str, list[int]]]  # (name, dtype without "torch.", shape) per tensor


def backend() -> str:
    """The group's backend: NCCL where CUDA is present, gloo otherwise."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def metadata(tensors: dict[str, torch.Tensor]) -> Meta:
    """What the receiving end needs to allocate the tensors, in the order they are sent."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]


def _nbytes(dtype: str, shape: list[int]) -> int:
    import torch

    n = 1
    for d in shape:
        n *= int(d)
    return n * getattr(torch, dtype).itemsize


def buckets(meta: Meta, limit: int | None = None) -> list[list[int]]:
    """The tensors' indices grouped, in order, into buckets of at most ``limit`` bytes
    (None: :data:`BUCKET_BYTES`, read at the call, so both ends of a group agree on it)."""
    limit = BUCKET_BYTES if limit is None else limit
    out: list[list[int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(meta):
        n = _nbytes(dtype, shape)
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def local_address(peer: str) -> str:
    """This machine's address as ``peer`` reaches it (loopback for a local peer)."""
    if peer in ("localhost", "127.0.0.1", "::1", ""):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # no packet is sent: this only picks the outgoing interface
        return str(s.getsockname()[0])


def listen(host: str) -> socket.socket:
    """A socket bound on ``host`` for the group's rendezvous (raises ``OSError`` when ``host``
    is not an address of this machine)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def join(host: str, port: int, rank: int, world: int, *, backend_name: str, listen_socket: socket.socket | None = None,
         timeout_s: float = TIMEOUT_S, cancelled: threading.Event | None = None) -> Any:
    """Join the group at ``host:port`` as ``rank`` of ``world`` (blocks until all have
    joined); rank 0 passes the socket :func:`listen` bound, on which the rendezvous runs, and
    may pass ``cancelled``: setting it makes rank 0's wait for the others end promptly with
    :class:`JoinCancelled` (the rendezvous' store is then gone, its socket closed).

    vLLM's ``stateless_init_torch_distributed_process_group`` in steps (it leaves
    ``torch.distributed``'s global group alone), so that rank 0's wait can be cancelled: rank 0's
    store waits for nobody; each other rank counts itself in (:data:`JOINED_KEY`) once its store
    is connected, and rank 0 makes the backend's group only once all are in, when it forms at once."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=timeout_s)
    if listen_socket is None:
        store = TCPStore(host, port, world, is_master=False, timeout=timeout, multi_tenant=True)
        store.add(JOINED_KEY, 1)
        return _group(store, host, port, rank, world, backend_name, timeout)
    cancelled = cancelled or threading.Event()
    if cancelled.is_set():
        raise JoinCancelled("the group was given up before its rendezvous began")
    fd = listen_socket.detach()
    try:
        store = TCPStore(host, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise
    try:
        _wait_for_ranks(store, world, cancelled, f"{host}:{port}", timeout_s)
        return _group(store, host, port, 0, world, backend_name, timeout)
    except BaseException as exc:
        # The store's server stops, closing the socket, now: not whenever the traceback is let go of.
        traceback.clear_frames(exc.__traceback__)
        store = None  # noqa: F841
        raise


class JoinCancelled(RuntimeError):
    """Rank 0 stopped waiting for the group's other ranks (its caller gave up on the group)."""


#: The rendezvous store's key that counts the ranks other than 0 connected to it.
JOINED_KEY = "agentenv/joined"
#: How often rank 0, waiting for the other ranks at the rendezvous, looks whether it was cancelled.
POLL_S = 0.02


def _wait_for_ranks(store: Any, world: int, cancelled: threading.Event, where: str, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while int(store.add(JOINED_KEY, 0)) < world - 1:
        if cancelled.wait(POLL_S):
            raise JoinCancelled(f"the group at {where} was given up before its other ranks joined")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the group's other ranks did not join at {where} in {timeout_s:.0f} s")


def _group(store: Any, host: str, port: int, rank: int, world: int, backend_name: str, timeout: timedelta) -> Any:
    """The backend's process group over the rendezvous ``store`` (as vLLM makes it)."""
    from torch.distributed import PrefixStore
    from vllm.distributed.utils import init_gloo_process_group
    from vllm.utils.network_utils import get_tcp_uri

    prefixed = PrefixStore(get_tcp_uri(host, port), store)
    if backend_name == "gloo":
        return init_gloo_process_group(prefix_store=prefixed, group_rank=rank, group_size=world, timeout=timeout)
    from vllm.platforms import current_platform

    return current_platform.stateless_init_device_torch_dist_pg(
        backend=backend_name, prefix_store=prefixed, group_rank=rank, group_size=world, timeout=timeout)


def leave(group: Any) -> None:
    """Tear the group down on this end (a peer that is gone makes no difference)."""
    try:
        group.shutdown()
    except Exception:  # noqa: BLE001 - a group whose peers died has nothing left to shut
        pass


def _broadcast(group: Any, buf: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([buf], opts).wait()


#: Each tensor starts at a multiple of this many bytes in its bucket (a view of the bytes as
#: any dtype must be aligned to its element size).
ALIGN = 16


def _layout(meta: Meta, bucket: list[int]) -> tuple[list[int], list[int], int]:
    """Where each tensor of ``bucket`` lies in its bytes: offsets, sizes, and the bucket's length."""
    offsets, sizes, end = [], [], 0
    for i in bucket:
        n = _nbytes(meta[i][1], meta[i][2])
        offsets.append(end)
        sizes.append(n)
        end += -(-n // ALIGN) * ALIGN
    return offsets, sizes, end


def send(group: Any, tensors: dict[str, torch.Tensor], device: Any = "cpu") -> int:
    """Broadcast ``tensors`` (in :func:`metadata`'s order) from rank 0; answers the tensors'
    bytes sent. Blocks until every peer has received them."""
    import torch

    items, meta = list(tensors.values()), metadata(tensors)
    sent = 0
    for bucket in buckets(meta):
        offsets, sizes, total = _layout(meta, bucket)
        if len(bucket) == 1 and sizes[0] == total:  # one tensor, already aligned: sent as it lies
            buf = items[bucket[0]].detach().to(device).contiguous().view(-1).view(torch.uint8)
        else:
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            for i, offset, n in zip(bucket, offsets, sizes):
                buf[offset:offset + n] = items[i].detach().to(device).contiguous().view(-1).view(torch.uint8)
        _broadcast(group, buf)
        sent += sum(sizes)
    return sent


def receive(group: Any, meta: Meta, device: Any = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors rank 0 broadcasts, bucket by bucket, as ``(name, tensor)`` pairs viewing the
    received bytes (a bucket's tensors are yielded once it has arrived)."""
    import torch

    for bucket in buckets(meta):
        offsets, sizes, total = _layout(meta, bucket)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        _broadcast(group, buf)
        for i, offset, n in zip(bucket, offsets, sizes):
            name, dtype, shape = meta[i]
            yield name, buf[offset:offset + n].view(getattr(torch, dtype)).view(shape)


def root_error(failure: BaseExceptionGroup) -> BaseException:
    """The error to raise for a task group's failure: the first that is not a consequence of
    another (a cancelled wait, a join given up), else the exception group itself."""
    import anyio

    def leaves(exc: BaseException) -> Iterator[BaseException]:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                yield from leaves(inner)
        else:
            yield exc

    consequences = (JoinCancelled, anyio.get_cancelled_exc_class())
    return next((e for e in leaves(failure) if not isinstance(e, consequences)), failure)


class Rendezvous:
    """Rank 0's end of a group being formed, in a thread of its own: it listens at ``host``
    (an address of this machine the workers reach) and joins as rank 0 while the ``workers``
    peers are asked to join at :attr:`address`. :meth:`wait` gives the formed group's
    :class:`GroupSender`; :meth:`cancel` gives up, and the join ends at once, its socket closed.
    Synchronous: :meth:`GroupSender.form` drives it from an event loop, a trainer rank (a Ray
    actor, ``train.distributed``) from its calls."""

    def __init__(self, host: str, workers: int, timeout_s: float = TIMEOUT_S) -> None:
        self.backend, self.world, self.timeout_s = backend(), workers + 1, timeout_s
        self._sock = listen(host)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._cancelled = threading.Event()
        self._out: list[Any] = []  # the group, or why there is none
        self._thread = threading.Thread(target=self._join, name="agentenv-weight-group-join", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int, int, str]:
        """What the workers join with (``ask_join``'s arguments): host, port, world size, backend."""
        return self.host, self.port, self.world, self.backend

    def _join(self) -> None:
        try:
            self._out.append(join(self.host, self.port, 0, self.world, backend_name=self.backend,
                                  listen_socket=self._sock, timeout_s=self.timeout_s, cancelled=self._cancelled))
        except BaseException as exc:  # noqa: BLE001 - raised by wait()
            self._out.append(exc)

    def wait(self) -> "GroupSender":
        """Block until the group is formed (or its join failed: raised) and answer its sender."""
        self._thread.join()
        if isinstance(self._out[0], BaseException):
            raise self._out[0]
        return GroupSender(self._out[0], self.world, self.backend)

    def cancel(self) -> None:
        """Give up on the group (idempotent; nothing once :meth:`wait` answered): the join ends
        within :data:`POLL_S` and the socket is closed."""
        self._cancelled.set()
        self._thread.join()
        self._sock.close()  # the store took it over (and closed it with itself), unless the join never began


class GroupSender:
    """The trainer's end (rank 0) of one engine's weight-update group. ``form`` makes it;
    ``update`` sends one set of tensors while the engine's workers receive them.

    A weight-update group's sender, whichever process it sends from, offers ``origin`` (None:
    this process; else the :attr:`HeldWeights.origin` it sends for), ``world``, ``backend``,
    ``sent_bytes``, ``update(weights, ask_receive)`` and ``close()``: :class:`GroupLink` uses any."""

    #: Where the weights it sends are held: here.
    origin: Any = None

    def __init__(self, group: Any, world: int, backend_name: str) -> None:
        self.group, self.world, self.backend = group, world, backend_name
        #: Bytes sent over the group so far.
        self.sent_bytes = 0
        # A group is never left under a broadcast of this end's: ``close`` during one hands the
        # group to the broadcasting thread (``_orphan``), which leaves it once its broadcast returns.
        self._mutex = threading.Lock()
        self._sending = False
        self._orphan: Any = None

    @classmethod
    async def form(cls, host: str, workers: int, ask_join: Callable[[str, int, int, str], Awaitable[Any]], *,
                   timeout_s: float = TIMEOUT_S) -> "GroupSender":
        """Form the group at ``host`` (an address of this machine the workers can reach) with
        ``workers`` peers: ``ask_join(host, port, world, backend)`` asks the engine's workers to
        join (ranks 1..workers) while this end joins as rank 0 (a :class:`Rendezvous`). Raises
        when any of it fails or ``timeout_s`` passes; then this end's join has ended and its
        socket is closed."""
        import anyio

        rendezvous = Rendezvous(host, workers, timeout_s)
        formed: list[GroupSender] = []

        async def wait() -> None:
            formed.append(await anyio.to_thread.run_sync(rendezvous.wait, abandon_on_cancel=True))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)  # a join that fails here ends the workers' wait below
                with anyio.fail_after(timeout_s):
                    await ask_join(*rendezvous.address)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(rendezvous.cancel)
            if isinstance(exc, BaseExceptionGroup):
                raise root_error(exc) from None
            raise
        return formed[0]

    async def update(self, tensors: dict[str, torch.Tensor], ask_receive: Callable[[Meta], Awaitable[Any]]) -> Any:
        """Send ``tensors``; ``ask_receive(meta)`` makes the workers receive and load them and
        returns their answer, which this returns. A failure on either side closes the group
        (a later update cannot trust it) and raises at once; a broadcast still in flight then
        runs on in its thread until the peers take it or the group's timeout ends it, and that
        thread leaves the group."""
        import anyio

        sent: list[int] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: anyio.to_thread.run_sync(lambda: sent.append(self.broadcast(tensors)),
                                                               abandon_on_cancel=True))
                answer = await ask_receive(metadata(tensors))
        except BaseException as exc:
            self.close()
            if isinstance(exc, BaseExceptionGroup):
                raise root_error(exc) from None
            raise
        return answer

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> int:
        """:func:`send` ``tensors`` over the group (blocks; the workers must be receiving them)
        and count them in :attr:`sent_bytes`; answers the bytes sent. A :meth:`close` meanwhile
        is carried out here once the broadcast returns."""
        with self._mutex:
            group = self.group
            if group is None:
                raise RuntimeError("the weight-update group was closed before its broadcast began")
            self._sending = True
        try:
            sent = send(group, tensors, "cuda" if self.backend == "nccl" else "cpu")
            self.sent_bytes += sent
            return sent
        finally:
            with self._mutex:
                self._sending = False
                orphan, self._orphan = self._orphan, None
            if orphan is not None:
                leave(orphan)

    def close(self) -> None:
        """Leave the group (idempotent): at once, or, while a broadcast of this end's is in
        flight, in its thread when it returns."""
        with self._mutex:
            group, self.group = self.group, None
            if group is not None and self._sending:
                group, self._orphan = None, group
        if group is not None:
            leave(group)


class HeldWeights:
    """Weights another process holds (a trainer's rank 0, ``train.distributed``): that process
    sends them over a weight-update group itself, and this one only coordinates; the host path
    fetches them (:meth:`tensors`). Passed to ``Engine.load_weights`` like a dict, it is also an
    iterable of ``(name, tensor)`` pairs (fetched), so every engine takes it.

    Subclasses give :attr:`meta`, :attr:`origin`, :meth:`tensors` and :meth:`form_group`."""

    #: The tensors' names, dtypes and shapes, in the order they are sent (:func:`metadata`).
    meta: Meta
    #: Who holds them: a sender :meth:`form_group` made serves every later update of the same origin.
    origin: Any
    #: The holder, in words (for log lines).
    holder = "their holder"

    def tensors(self) -> dict[str, torch.Tensor]:
        """Host copies of the tensors, fetched from their holder (once)."""
        raise NotImplementedError

    async def form_group(self, workers: int, ask_join: Callable[[str, int, int, str], Awaitable[Any]]) -> Any:
        """Form a weight-update group of the holder (rank 0) and ``workers`` peers, as
        :meth:`GroupSender.form` does here; answers a sender with the same surface."""
        raise NotImplementedError

    def keys(self) -> list[str]:
        return [name for name, _, _ in self.meta]

    def items(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.tensors().items()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.items())

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (from :attr:`meta`: nothing is fetched)."""
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.meta)


def kept(weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | HeldWeights) -> dict[str, Any]:
    """An update kept by an engine client for a restarted engine (which serves its checkpoint
    and must be sent every update again): host copies of the tensors by name; held weights as
    their handle, one per name, fetched only if needed (:func:`fetched`)."""
    if isinstance(weights, HeldWeights):
        return dict.fromkeys(weights.keys(), weights)
    items = weights.items() if isinstance(weights, dict) else weights
    return {n: t.detach().to("cpu", copy=True).contiguous() for n, t in items}


def fetched(weights: dict[str, Any] | HeldWeights) -> dict[str, torch.Tensor]:
    """The tensors by name, those held elsewhere (held weights, or :func:`kept`'s handles)
    fetched from their holder: what the host path sends."""
    if isinstance(weights, HeldWeights):
        return weights.tensors()
    return {n: t.tensors()[n] if isinstance(t, HeldWeights) else t for n, t in weights.items()}


def weight_bytes(weights: dict[str, torch.Tensor] | HeldWeights) -> int:
    """The bytes of a weight update, held or here."""
    if isinstance(weights, HeldWeights):
        return weights.nbytes
    return sum(t.numel() * t.element_size() for t in weights.values())


class GroupLink:
    """An engine client's choice between the group and the host path (``mode``, a
    :data:`WeightSync`), and its group once formed. ``auto``: a group that cannot be formed,
    or an update over it that fails, puts the engine on the host path for good, with one log
    line saying why; ``group``: either is kept as :attr:`failure`, which :meth:`check` raises
    (outside whatever task group the engine made the call in)."""

    def __init__(self, mode: str = "auto", *, name: str = "vllm", host: str = "127.0.0.1") -> None:
        if mode not in WEIGHT_SYNC_MODES:
            from ..errors import ConfigError

            raise ConfigError(f"weight_sync must be auto, group or host, got {mode!r}")
        self.mode, self.name = mode, name
        #: The address of this machine the engine's workers reach the group's rendezvous at.
        self.host = host
        self.sender: GroupSender | None = None
        #: Why the host path is used (None while the group is, or may yet be, formed).
        self.host_reason: str | None = "weight_sync=host" if mode == "host" else None
        #: ``group``: why the group could not be formed or used (raised by :meth:`check`).
        self.failure: Exception | None = None

    @property
    def on(self) -> bool:
        """Whether updates go over a formed group."""
        return self.sender is not None

    async def ready(self, workers: Callable[[], Awaitable[int]],
                    ask_join: Callable[[str, int, int, str], Awaitable[Any]],
                    weights: dict[str, torch.Tensor] | HeldWeights | None = None) -> bool:
        """Whether this update (``weights``) goes over the group: formed now if it is not yet
        (``workers()`` counts the engine's workers; ``ask_join`` as :meth:`GroupSender.form`
        takes it). :class:`HeldWeights` are sent by their holder: the group is formed with it
        (and formed again when the weights come from elsewhere than the formed group's sender)."""
        origin = weights.origin if isinstance(weights, HeldWeights) else None
        if self.sender is not None and self.sender.origin is not origin:
            self.drop()
        if self.sender is not None:
            return True
        if self.host_reason is not None or self.failure is not None:
            return False
        try:
            if isinstance(weights, HeldWeights):
                self.sender = await weights.form_group(await workers(), ask_join)
            else:
                self.sender = await GroupSender.form(self.host, await workers(), ask_join)
        except Exception as exc:  # noqa: BLE001 - reported, and the host path taken (auto)
            where = f"at {self.host}" if origin is None else f"with {weights.holder}"
            self._failed(f"the weight-update group could not be formed {where}: {type(exc).__name__}: {exc}", exc)
            return False
        log.info("%s: weights go over a weight-update group (%s, %d ranks, sent by %s)", self.name,
                 self.sender.backend, self.sender.world, "this process" if origin is None else weights.holder)
        return True

    async def update(self, weights: dict[str, torch.Tensor] | HeldWeights,
                     ask_receive: Callable[[Meta], Awaitable[Any]]) -> Any:
        """Send ``weights`` over the formed group (from where :meth:`ready` formed it); the
        workers' answer, or None when the update failed (auto: the caller takes the host path
        for it)."""
        assert self.sender is not None
        try:
            return await self.sender.update(weights, ask_receive)
        except Exception as exc:  # noqa: BLE001 - reported, and the host path taken (auto)
            self.sender = None
            self._failed(f"an update over the weight-update group failed: {type(exc).__name__}: {exc}", exc)
            return None

    def _failed(self, reason: str, exc: BaseException) -> None:
        if self.mode == "group":
            from ..errors import EngineError

            self.failure = EngineError(f"{self.name}: {reason} (weight_sync=group)")
            self.failure.__cause__ = exc
            return
        self.host_reason = reason
        log.warning("%s: weights go through the host (serialised): %s", self.name, reason)

    def check(self) -> None:
        """``group``: raise the failure to form or use the group, if there was one (it is
        cleared: the next update tries to form the group again)."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def drop(self) -> None:
        """The engine's workers were replaced (a restart): the group is left, and formed again
        with the new ones at the next update."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def close(self) -> None:
        self.drop()


__all__ = [
    "BUCKET_BYTES",
    "GroupLink",
    "GroupSender",
    "HeldWeights",
    "JoinCancelled",
    "Meta",
    "Rendezvous",
    "TIMEOUT_S",
    "WEIGHT_SYNC_MODES",
    "WeightSync",
    "backend",
    "buckets",
    "fetched",
    "join",
    "kept",
    "leave",
    "listen",
    "local_address",
    "metadata",
    "receive",
    "root_error",
    "send",
    "weight_bytes",
]
