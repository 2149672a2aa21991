"""The local sandbox: a pool of isolated, persistent Python workers forked from a warm template.

One fork server per :class:`LocalSandbox` imports the usual libraries once; each program
session is a fork of it (or of a *template* fork server that already ran the environment's
setup code, so that state is prepared once and shared copy-on-write). Each session worker:

* lives in its own mount, network, pid, ipc and uts namespaces: no network (only a down
  loopback), the whole filesystem read-only, a private size-capped tmpfs as ``/tmp`` and its
  working directory, a fresh ``/proc`` that shows only its own processes;
* runs with no capabilities (bounding set emptied, securebits locked, no_new_privs), so it
  cannot remount, escape or regain privileges even as uid 0, and cannot see or signal the
  parent or sibling sessions (separate pid namespaces);
* has rlimits on address space, CPU time, file size and open files, and cgroup limits on
  process count and memory (cgroup v1 ``pids``/``memory``), which hold for root too;
* gets a clean environment (no parent variables, so no secrets);
* dies with its parent, and takes every process it started with it (it is pid 1 of its pid
  namespace).

A call's wall-clock timeout interrupts the code (SIGINT); code that does not stop is killed
and its worker replaced, and the result says the session state was lost. A crash is reported
the same way. A fork server that dies (killed from outside) is replaced at the next session
start; the sessions it had forked die with it (each is killed with its parent, by design) and
come back as ``state_lost`` at their next call. Where the namespace primitives are missing,
``LocalSandbox`` refuses to start unless ``allow_unisolated=True``, which logs a loud warning
and keeps only the rlimits, cgroups and private working directory.

The pool has two halves with a small interface between them: the fork-server pool
(``servers.py``: the base server, templates per setup code, starting and ending workers) and
the session pool (``sessions.py``: sessions, capacity, prewarmed and prepared sessions per
setup code), which reaches workers only through ``sessions.Workers``. ``LocalSandbox`` owns
both, the per-session cgroups and uids, and the isolation check at start.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from agentenv.errors import SandboxError

from ..base import Sandbox
from .cgroups import _Cgroups
from .control import _ServerGone
from .limits import Limits
from .servers import _ForkServers
from .sessions import PREPARE_STARTS, CallSettings, LocalSession, _SessionPool
from .uids import _Uids

__all__ = ["CGROUP_V1", "PREPARE_STARTS", "Limits", "LocalSandbox", "LocalSession"]

log = logging.getLogger(__name__)
CGROUP_V1 = Path("/sys/fs/cgroup")


class LocalSandbox(Sandbox):
    """A pool of isolated session workers. Use as ``async with`` to get prewarming.

    ``limits``: what each session may use. ``default_timeout``: a call's wall-clock limit
    when the caller gives none; ``kill_grace``: how long code interrupted at its deadline has
    to stop before it is killed; ``max_output``: characters kept of a call's stdout, stderr
    and value each. ``prewarm``: sessions per setup code kept started ahead of need (inside
    ``async with``); ``max_workers``: live sessions at most. ``isolate``: namespaces, an
    unprivileged uid, no capabilities, seccomp; where the host cannot provide them the pool
    refuses to start unless ``allow_unisolated``. ``setup_timeout``: how long an environment's
    setup code may run; ``spawn_servers``: template servers per setup code."""

    def __init__(
        self,
        *,
        limits: Limits = Limits(),
        default_timeout: float = 5.0,
        max_output: int = 2000,
        kill_grace: float = 0.5,
        prewarm: int = 4,
        max_workers: int = 256,
        isolate: bool = True,
        allow_unisolated: bool = False,
        setup_timeout: float = 120.0,
        spawn_servers: int = 2,
    ) -> None:
        self._settings = CallSettings(timeout=default_timeout, kill_grace=kill_grace, max_output=max_output)
        self._cgroups = _Cgroups(CGROUP_V1)
        self._uids = _Uids(limits.uid, limits.uids)
        self._servers = _ForkServers(
            limits=limits, isolate=isolate, allow_unisolated=allow_unisolated, max_output=max_output,
            setup_timeout=setup_timeout, spawn_servers=spawn_servers, cgroups=self._cgroups, uids=self._uids,
            cgroup_root=CGROUP_V1, on_lost=self._server_lost,
        )
        self._pool = _SessionPool(self._servers, self._settings, max_workers=max_workers, prewarm=prewarm)
        self._start_lock = anyio.Lock()  # one start (and isolation check) at a time
        self._checked = False  # the isolation check passed (or fell back to unisolated, as allowed)
        self._tg: TaskGroup | None = None
        self._closed = False

    # -- settings (as constructed; ``isolate`` and ``limits`` as the host allowed) ---------
    @property
    def limits(self) -> Limits:
        """Each session's limits (``seccomp`` off where the host has none, if allowed)."""
        return self._servers.limits

    @property
    def isolate(self) -> bool:
        """Whether sessions are isolated (False where the host cannot, if allowed)."""
        return self._servers.isolate

    @property
    def allow_unisolated(self) -> bool:
        return self._servers.allow_unisolated

    @property
    def default_timeout(self) -> float:
        return self._settings.timeout

    @property
    def kill_grace(self) -> float:
        return self._settings.kill_grace

    @property
    def max_output(self) -> int:
        return self._settings.max_output

    @property
    def prewarm(self) -> int:
        return self._pool.prewarm

    @property
    def max_workers(self) -> int:
        return self._pool.max_workers

    @property
    def setup_timeout(self) -> float:
        return self._servers.setup_timeout

    @property
    def spawn_servers(self) -> int:
        return self._servers.spawn_servers

    @property
    def restarts(self) -> int:
        """How many times a dead fork server was replaced."""
        return self._servers.restarts

    @property
    def starts(self) -> int:
        """Session workers started so far (prepared, prewarmed and on demand)."""
        return self._servers.starts

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> "LocalSandbox":
        try:
            await self.start()
        except BaseException:  # cancelled or refused while starting: no fork server left behind
            await self.aclose()
            raise
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._pool.background = self._tg
        if self.prewarm:
            self._tg.start_soon(self._pool.refill, None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._tg is not None:
            self._pool.background = None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        await self.aclose()

    async def start(self) -> None:
        """Start the fork server and, the first time, check that a session is as isolated as
        asked. No session is handed out before the check has passed."""
        async with self._start_lock:
            if self._closed:
                raise SandboxError("sandbox is closed")
            try:
                await self._servers.start()
            except SandboxError:
                if self._servers.stopped:  # the host refused after the server started
                    await self.aclose()
                raise
            if not self._checked:
                await self._probe()
                self._checked = True
                self._servers.replace_dead = True

    async def _probe(self) -> None:
        """Refuse to run weaker than asked: a first isolated session must really be isolated
        (its own pid namespace, an unprivileged uid)."""
        check = "import os\n(os.getpid(), [p for p in os.listdir('/proc') if p.isdigit()], os.getuid(), os.getgid())"
        problem = None
        try:
            s = await self._pool.take(None)
        except _ServerGone as exc:  # a crash, not a host without isolation: never a reason to run weaker
            await self.aclose()
            raise SandboxError(f"the sandbox fork server died during its first session start (the isolation "
                               f"check); nothing else is wrong with the host that we know of: {exc}") from exc
        except SandboxError as exc:
            if not self.isolate:
                raise
            problem = str(exc)
        else:
            if self.isolate:
                r = await s.run(check, timeout=10)
                if s.uid is None or r.value != f"(1, ['1'], {s.uid}, {s.uid})":
                    problem = f"isolation check failed: {r.render()[:300]}"
            await s.aclose()
        if problem is None:
            return
        if not self.allow_unisolated:
            await self.aclose()
            raise SandboxError(f"sandbox isolation is not available on this host ({problem}); pass "
                               "allow_unisolated=True (--sandbox-unisolated on the command line) to run without "
                               "namespaces (NOT safe for untrusted code)")
        warnings.warn(f"agentenv: sandbox isolation unavailable ({problem}); running UNISOLATED", stacklevel=2)
        log.warning("sandbox isolation unavailable (%s); running UNISOLATED", problem)
        self._servers.unisolate()
        await (await self._pool.take(None)).aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._servers.stop()  # a start that finds its server dead from now on fails
        with anyio.CancelScope(shield=True):
            await self._pool.aclose()
            await self._servers.aclose()
            await anyio.to_thread.run_sync(self._cgroups.drain)  # ended sessions' dirs back in ``free``
            for _ in range(20):  # workers exit within milliseconds of SIGKILL
                if await anyio.to_thread.run_sync(self._cgroups.remove_all):
                    break
                await anyio.sleep(0.05)
            self._cgroups.remove_roots()
            self._uids.close()

    async def _server_lost(self) -> None:
        # The fork server died: the sessions started ahead died with it. They leave the
        # ready lists before the first await here, so none is handed out.
        await self._pool.drop_ready()

    # -- sessions --------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Host pids of every live session's worker."""
        return self._pool.worker_pids

    @property
    def ready_pids(self) -> list[int]:
        """Host pids of the sessions started ahead (prewarmed, prepared) that no caller holds
        yet. Only pids: a ready session must reach its caller untouched."""
        return self._pool.ready_pids

    @property
    def busy_pids(self) -> list[int]:
        """Host pids of the workers in the middle of a call (or being started)."""
        return self._pool.busy_pids

    @property
    def server_pid(self) -> int | None:
        """Host pid of the base fork server (its templates and sessions die with it)."""
        return self._servers.pid

    async def session(self, setup_code: str | None = None) -> LocalSession:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if not self._checked:
            await self.start()
        return await self._pool.take(setup_code)

    async def prepare(self, setup_code: str | None = None, n: int = 1, *, wait: bool = False) -> int:
        """Start ``n`` sessions for ``setup_code`` ahead of need: :meth:`session` hands them out
        at once. ``agentenv rollout`` and the trainer call it before their engine loads, so the
        starts overlap the model's loading instead of the first turns. At most the free
        capacity (``max_workers``); ``PREPARE_STARTS`` at a time, in the pool's background
        (``async with``) unless ``wait`` (or the pool was not entered), which returns once they
        started. Each prepared session is an idle, fully isolated worker (~3 MB); unused ones
        close with the pool. Returns how many it starts (with ``wait``: how many started; a
        setup that fails stops it, and the ``session()`` that needs one raises its error)."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        if not self._checked:
            await self.start()
        return await self._pool.prepare(setup_code, n, wait=wait)
