"""The local sandbox's sessions, and the pool that hands them out per setup code.

A :class:`LocalSession` is one program's interpreter: a worker process that keeps its state
between calls, started on first need and replaced when it dies (the next call's result then
says the state was lost). The :class:`_SessionPool` keeps at most ``max_workers`` sessions
live and, per setup code, sessions started ahead of need (prewarmed, prepared) that it hands
out at once.

Both reach workers only through :class:`Workers` (start one for a setup code; end, freeze
or thaw one), which the fork-server pool (``servers.py``) implements.
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import anyio
from anyio.abc import SocketAttribute, TaskGroup

from agentenv.errors import SandboxError

from ..base import ExecResult, Session
from .frames import FrameReader, send_all
from .handle import _Worker
from .protocol import ERROR_CAP, HEADER, MAX_REQUEST, VIOLATION, frame_cap

#: Session starts :meth:`_SessionPool.prepare` keeps in flight (two template servers fork
#: them; 8 at a time reach ~400 starts/s on 2 idle cores).
PREPARE_STARTS = 8
#: Earlier calls' numbers a session remembers: a frame carrying one is stale and dropped.
STALE_KEPT = 1024
#: Requests smaller than this go out with their header in one write (one pass through the
#: event loop); larger ones in two, uncopied.
JOIN_BELOW = 1 << 16


class Workers(Protocol):
    """Where sessions get their workers from, and give them back to."""

    async def spawn(self, setup_code: str | None) -> _Worker:
        """A new worker whose interpreter ran ``setup_code``."""

    def end(self, worker: _Worker) -> None:
        """Kill every process of ``worker`` and take back what it held."""

    def freeze(self, worker: _Worker) -> bool:
        """Stop everything ``worker`` runs until :meth:`thaw`; False if it could not be."""

    def thaw(self, worker: _Worker) -> bool:
        """Let ``worker`` run again; False if it could not be."""

    def cpu(self, worker: _Worker) -> tuple[float, float] | None:
        """The CPU seconds ``worker``'s session used and spent waiting for a CPU; None: unknown."""


@dataclass(frozen=True, slots=True)
class CallSettings:
    """How a session runs each call."""

    timeout: float = 5.0  # a call's wall-clock limit when the caller gives none
    kill_grace: float = 0.5  # after the interrupt at the deadline, how long the code has to stop
    max_output: int = 2000  # characters kept of stdout, stderr and the value, each

    @property
    def frame_cap(self) -> int:
        """The largest answer frame a worker may send (``protocol.frame_cap``)."""
        return frame_cap(self.max_output)


#: The most kill graces code interrupted at its deadline gets, on a machine too busy to run it.
GRACE_STRETCH = 4


def _clean(s: str | None, cap: int | None = None) -> str | None:
    # Lone surrogates (from undecodable bytes) would break UTF-8 JSONL later.
    if s is None:
        return None
    if cap is not None and len(s) > cap:
        s = s[:cap]
    return s if s.isascii() else s.encode("utf-8", "replace").decode("utf-8")


def _result(resp: dict, cap: int, elapsed: float, late: float | None) -> ExecResult:
    """A call's result from its worker's answer, every field capped and clean. ``late``: the
    call's timeout, when its deadline passed (a timeout, whatever the code made of the
    interrupt)."""
    fields = {k: resp.get(k) for k in ("stdout", "stderr", "value")}
    truncated = resp["truncated"] or any(v is not None and len(v) > cap + 3 for v in fields.values())
    status, error = resp["status"], _clean(resp.get("error"), ERROR_CAP)
    if late is not None:
        status, error, fields["value"] = "timeout", f"TimeoutError: execution exceeded {late:g}s", None
    return ExecResult(
        status=status,
        stdout=_clean(fields["stdout"], cap) or "",
        stderr=_clean(fields["stderr"], cap) or "",
        value=_clean(fields["value"], cap + 3),
        error=error,
        duration_s=elapsed,
        truncated=truncated,
    )


class LocalSession(Session):
    """One program's isolated interpreter in a :class:`~agentenv.sandboxes.local.LocalSandbox`.

    Calls run one at a time. A worker that dies or is killed (a crash, a call past its
    deadline that ignores the interrupt, a malformed answer) is replaced at the next call,
    whose result says the state was lost. Between calls an isolated session is frozen:
    nothing of it runs. ``on_close`` runs once, when the session is closed."""

    def __init__(self, workers: Workers, settings: CallSettings, setup_code: str | None,
                 on_close: Callable[[LocalSession], None] | None = None) -> None:
        self._workers = workers
        self._settings = settings
        self._setup = setup_code
        self._on_close = on_close
        self._worker: _Worker | None = None
        # Held for a call's whole round trip, and for a start. A free lock is taken without a
        # pass through the event loop (the call yields at its first wait on the worker anyway).
        self._lock = anyio.Lock(fast_acquire=True)
        self._closed = False
        self._started_once = False
        self._reader: FrameReader | None = None  # the worker's answers
        self._raw: socket.socket | None = None  # the worker's channel, for a write that must not wait
        self._past: deque[int] = deque(maxlen=STALE_KEPT)  # this worker's calls so far

    @property
    def pid(self) -> int | None:
        """Host pid of the worker process (pid 1 of its namespace), for display: the pool
        itself only ever signals it through a pidfd."""
        return self._worker.pid if self._worker is not None else None

    @property
    def uid(self) -> int | None:
        """The uid the session's code runs as (its own among live sessions); None unisolated."""
        return self._worker.uid if self._worker is not None else None

    @property
    def busy(self) -> bool:
        """Whether a call (or a start) is under way."""
        return self._lock.locked()

    @property
    def _cgroups(self) -> list[str]:
        return self._worker.cgroups if self._worker is not None else []

    async def start(self) -> None:
        """Start the worker now unless it runs, so that the first call finds it ready (a pool
        does this before it hands a session out). The first call then reports no lost state."""
        if self._closed:
            raise SandboxError("session is closed")
        async with self._lock:
            if self._worker is None:
                await self._begin()
            self._started_once = True

    async def run(self, code: str, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("session is closed")
        timeout = self._settings.timeout if timeout is None else timeout
        async with self._lock:
            restarted = False
            if self._worker is None:
                restarted = True
                await self._begin()
            try:
                res = await self._call(code, timeout)
            except BaseException:
                with anyio.CancelScope(shield=True):  # cancelled mid-call: state unknown, drop it
                    await self._kill()
                raise
            res.state_lost = res.state_lost or (restarted and self._started_once)
            self._started_once = True
            return res

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._kill()
        if self._on_close is not None:
            self._on_close(self)

    async def _begin(self) -> None:
        """Start a worker for the session. One that arrives after the session was closed
        (while it started) is ended at once: nothing holds it any more."""
        w = await self._workers.spawn(self._setup)
        if self._closed:
            self._workers.end(w)
            with anyio.CancelScope(shield=True):
                await w.stream.aclose()
            raise SandboxError("session is closed")
        self._worker, self._reader = w, FrameReader(w.stream)
        self._raw = w.stream.extra(SocketAttribute.raw_socket)
        self._past.clear()

    async def _read_frame(self, seq: int, just_sent: bool = False) -> dict | str:
        if self._reader is None:  # closed meanwhile
            return "eof"
        return await self._reader.read(seq, self._settings.frame_cap, self._past, just_sent)

    async def _after_interrupt(self, seq: int) -> dict | str | None:
        """The answer of code interrupted at its deadline; None if it did not stop within the
        kill grace. A grace the session spent mostly waiting for a CPU it did not get (a machine
        too busy to run it: little CPU used, much time runnable) gave the code no chance to
        unwind, so another follows, up to ``GRACE_STRETCH`` graces in all. A session that used
        the CPU (its own processes included) or slept is not waiting for the machine."""
        grace = self._settings.kill_grace
        before = self._cpu()
        for _ in range(GRACE_STRETCH):
            with anyio.move_on_after(grace):
                return await self._read_frame(seq)
            after = self._cpu()
            if before is None or after is None:
                return None
            used, waited = after[0] - before[0], after[1] - before[1]
            if used >= grace / 4 or waited < grace / 2:
                return None
            before = after
        return None

    def _cpu(self) -> tuple[float, float] | None:
        return self._workers.cpu(self._worker) if self._worker is not None else None

    async def _kill(self) -> None:
        """End the worker. Bounded: signals and cgroup writes, then closing the socket (no
        wait on the session for anything)."""
        w, reader = self._worker, self._reader
        self._worker, self._reader, self._raw = None, None, None
        if w is None:
            return
        self._workers.end(w)
        with anyio.CancelScope(shield=True):
            await (reader.aclose() if reader is not None else w.stream.aclose())  # wakes a read under way

    async def _send(self, w: _Worker, seq: int, payload: bytes) -> str | None:
        """Write the worker the call and thaw it; why the call cannot be made, or None. The
        caller bounds this with the call's deadline: a session that does not read its socket
        blocks the write once the request outgrows the socket buffer.

        A frozen worker sleeps in the freezer, not on its socket: what of the request its
        socket buffer takes goes out first, in one non-blocking write, and the thaw then
        finds it there (the worker wakes once, not once for the thaw and again for the data).
        The rest, if any, is written once it runs; it reads nothing before the thaw."""
        header = HEADER.pack(len(payload), seq)
        data = header + payload if len(payload) < JOIN_BELOW else None
        sock, sent = self._raw, 0
        if sock is None:
            return "eof"
        if data is not None and w.frozen:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                return "eof"
        if not self._workers.thaw(w):
            return "the session could not be thawed"
        try:
            if data is not None:
                if sent < len(data):
                    await send_all(sock, data[sent:])
            else:  # not joined: no copy of a large request
                await send_all(sock, header)
                await send_all(sock, payload)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return "eof"
        return None

    def _timed_out(self, timeout: float, start: float, why: str) -> ExecResult:
        return ExecResult("timeout", error=f"TimeoutError: execution exceeded {timeout:g}s and {why}",
                          duration_s=time.perf_counter() - start, state_lost=True)

    async def _call(self, code: str, timeout: float) -> ExecResult:
        w = self._worker
        assert w is not None
        start = time.perf_counter()  # the deadline counts from here, serialising included
        cap = self._settings.max_output
        payload = json.dumps({"code": code, "max_output": cap}).encode()
        if len(payload) > MAX_REQUEST:
            return ExecResult("error", error=f"SandboxError: code of {len(payload)} bytes exceeds the "
                              f"{MAX_REQUEST}-byte request limit")
        # A fresh random number per call: code cannot answer a call before it was sent, and a
        # forged answer never matches a later call. Frames of this worker's earlier calls are
        # stale: dropped when found (``FrameReader.read``).
        seq = secrets.randbelow(VIOLATION)
        self._past.append(seq)
        late, sent = False, False
        resp: dict | str | None = None
        with anyio.move_on_after(timeout - (time.perf_counter() - start)):  # bounds the write and the read
            resp = await self._send(w, seq, payload)
            if resp is None:
                sent = True
                resp = await self._read_frame(seq, just_sent=True)
        if resp is None and not sent:  # it did not take the request in time: nothing ran
            await self._kill()
            return self._timed_out(timeout, start, "the session did not read the call; it was killed")
        if resp is None:  # deadline: interrupt the code, give it a moment to unwind
            late = True
            if self._worker is not None:  # not closed meanwhile (its pidfd is closed then)
                self._worker.signal(signal.SIGINT)
            resp = await self._after_interrupt(seq)
            if not isinstance(resp, dict):
                await self._kill()
                return self._timed_out(timeout, start, "was killed")
        elapsed = time.perf_counter() - start
        if resp == "eof":
            await self._kill()
            return ExecResult("crashed", error="the interpreter process died (crash, exit or a resource limit)",
                              duration_s=elapsed, state_lost=True)
        if isinstance(resp, str):
            await self._kill()
            return ExecResult("error", error=f"SandboxError: {resp}; the session was killed and will be replaced",
                              duration_s=elapsed, state_lost=True)
        if not self._workers.freeze(w):  # it could run between calls: not kept
            await self._kill()
        return _result(resp, cap, elapsed, timeout if late else None)


class _SessionPool:
    """The live sessions of one sandbox: at most ``max_workers`` at once, and per setup code
    the sessions started ahead of need (``prewarm`` of them, and those :meth:`prepare` asks
    for), handed out first.

    Background starts (prewarm, :meth:`prepare` without ``wait``) run in :attr:`background`
    when the owner sets it; with none, only :meth:`prepare` with ``wait`` starts ahead."""

    def __init__(self, workers: Workers, settings: CallSettings, *, max_workers: int, prewarm: int) -> None:
        self._workers = workers
        self._settings = settings
        self.max_workers = max_workers
        self.prewarm = prewarm
        #: Where background starts run; None: not in the background.
        self.background: TaskGroup | None = None
        self._slots = anyio.Semaphore(max_workers)
        self._live: set[LocalSession] = set()
        self._ready: dict[str | None, list[LocalSession]] = {}
        self._filling: dict[str | None, int] = {}
        self._owed: dict[str | None, int] = {}  # sessions prepare() still has to start
        self._changed = anyio.Event()  # a slot was freed or a ready session added
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        """Host pids of every live session's worker (handed out or ready)."""
        return [s.pid for s in self._live if s.pid is not None]

    @property
    def ready_pids(self) -> list[int]:
        """Host pids of the sessions started ahead that nobody holds yet."""
        return [s.pid for group in self._ready.values() for s in group if s.pid is not None]

    @property
    def busy_pids(self) -> list[int]:
        """Host pids of the workers in the middle of a call (or a start)."""
        return [s.pid for s in self._live if s.pid is not None and s.busy]

    async def take(self, setup_code: str | None) -> LocalSession:
        """A started session for ``setup_code``: a ready one, else a new one once a slot is
        free (a ready session of another setup gives its slot up)."""
        while True:
            ready = self._ready.get(setup_code)
            if ready:
                s = ready.pop()
                break
            try:
                self._slots.acquire_nowait()  # at most max_workers sessions at once
            except anyio.WouldBlock:
                # Full. A prewarmed session for another setup gives its slot up; otherwise
                # wait until a slot is freed or a ready session of ours appears (a waiter
                # parked on the semaphore alone would miss the latter: a deadlock when the
                # pool's own prewarm holds the last slots).
                other = next((r for k, r in self._ready.items() if r and k != setup_code), None)
                if other:
                    await other.pop().aclose()
                    continue
                if self._changed.is_set():
                    self._changed = anyio.Event()
                await self._changed.wait()
                continue
            s = self._new(setup_code)
            try:
                await s.start()
            except BaseException:
                self._forget(s)
                raise
            break
        if self.background is not None and self.prewarm:
            self.background.start_soon(self.refill, setup_code)
        return s

    def _new(self, setup_code: str | None) -> LocalSession:
        """A session in a slot already taken, not started yet."""
        s = LocalSession(self._workers, self._settings, setup_code, on_close=self._forget)
        self._live.add(s)
        return s

    def _forget(self, s: LocalSession) -> None:
        """``s`` is closed (or never started): its slot is free."""
        if s in self._live:
            self._live.discard(s)
            self._slots.release()
            self._changed.set()

    async def refill(self, setup_code: str | None) -> None:
        """Start sessions for ``setup_code`` until ``prewarm`` of them are ready."""
        ready = self._ready.setdefault(setup_code, [])
        # Concurrent refills (one per session taken) count each other's starts in progress,
        # so the pool holds ``prewarm`` ready sessions, not one batch per refill.
        while len(ready) + self._filling.get(setup_code, 0) < self.prewarm and not self._closed:
            if not await self._start_ready(setup_code):
                return

    async def _start_ready(self, setup_code: str | None) -> bool:
        """Start one session into the ready list; False when the pool is full or it failed
        (a failing setup then fails the ``take()`` that needs it, with its error)."""
        try:
            self._slots.acquire_nowait()  # only into free capacity
        except anyio.WouldBlock:
            return False
        s = self._new(setup_code)
        self._filling[setup_code] = self._filling.get(setup_code, 0) + 1
        try:
            await s.start()
        except SandboxError:
            self._forget(s)
            return False
        finally:
            self._filling[setup_code] -= 1
        self._ready.setdefault(setup_code, []).append(s)
        self._changed.set()  # a take() waiting for capacity may take this one
        return True

    async def prepare(self, setup_code: str | None, n: int, *, wait: bool) -> int:
        """Start ``n`` sessions for ``setup_code`` ahead of need, at most into the free
        capacity, ``PREPARE_STARTS`` at a time: in :attr:`background` unless ``wait`` (or
        there is none), which returns once they started. Returns how many it starts (with
        ``wait``: how many started; a setup that fails stops it)."""
        n = max(0, min(n, self._slots.value - sum(self._owed.values())))
        if n == 0:
            return 0
        self._owed[setup_code] = self._owed.get(setup_code, 0) + n
        if wait or self.background is None:
            started = [0]
            async with anyio.create_task_group() as tg:
                for _ in range(min(n, PREPARE_STARTS)):
                    tg.start_soon(self._pay_owed, setup_code, started)
            return started[0]
        for _ in range(min(n, PREPARE_STARTS)):
            self.background.start_soon(self._pay_owed, setup_code, [0])
        return n

    async def _pay_owed(self, setup_code: str | None, started: list[int]) -> None:
        try:
            while self._owed.get(setup_code, 0) > 0 and not self._closed:
                self._owed[setup_code] -= 1
                if await self._start_ready(setup_code):
                    started[0] += 1
                else:
                    self._owed[setup_code] = 0  # full, or the setup fails: stop preparing
        finally:
            if not self._owed.get(setup_code, 1):
                self._owed.pop(setup_code, None)

    async def drop_ready(self) -> None:
        """The sessions started ahead are dead (their fork server died): close them. They
        leave the ready lists before this first awaits, so none is handed out any more."""
        ready, self._ready = self._ready, {}
        for group in ready.values():
            for s in group:
                await s.aclose()

    async def aclose(self) -> None:
        """Close every live session (handed out or ready); start none from now on."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for s in list(self._live):
                await s.aclose()
