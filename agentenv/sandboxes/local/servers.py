"""The fork-server pool: where the local sandbox's session workers come from and go back to.

One base fork server (``forkserver.py``) imports the usual libraries once. For each setup
code, up to ``spawn_servers`` *templates* are forked from it, each of which ran the setup code
once, so that state is prepared once and shared copy-on-write; a session worker is a fork of
a template. Each worker gets cgroups and a uid of its own (``cgroups.py``, ``uids.py``) and is
held as a ``_Worker`` (``handle.py``); :meth:`_ForkServers.end` kills every process it has
and hands them back.

A base server that dies (killed from outside) is replaced by the next start that finds it
gone. Its templates and every session it forked die with it (each is killed with its parent,
by design), and ``on_lost`` tells the owner so at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Awaitable, Callable

import anyio
import anyio.abc
from anyio.abc import Process

from agentenv.errors import SandboxError

from .cgroups import _alive, _Cgroups
from .control import CONTROL_TIMEOUT, _Control, _ServerGone
from .handle import _Worker
from .limits import Limits
from .uids import _Uids

log = logging.getLogger(__name__)
FORKSERVER = Path(__file__).with_name("forkserver.py")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=8)
def _limits_dict(limits: Limits) -> dict:
    """``limits`` as a spawn request carries it; copy it before adding to it. Made once per
    value (``Limits`` is frozen), not per start: ``asdict`` walks every field recursively."""
    return asdict(limits)


async def _exits_soon(pid: int, within: float = 1.0) -> bool:
    """Whether ``pid`` is gone now or within ``within`` seconds."""
    with anyio.move_on_after(within):
        while _alive(pid):
            await anyio.sleep(0.02)
        return True
    return False


class _ForkServers:
    """The base fork server, its templates per setup code, and the workers forked from them
    (:meth:`spawn`, :meth:`end`, :meth:`freeze`, :meth:`thaw`: ``sessions.Workers``).

    The owner calls :meth:`start` once and sets :attr:`replace_dead` once the host's
    isolation is confirmed; from then on a start that finds its server dead replaces it and
    tries again (three tries). ``on_lost`` runs the moment a dead base server is dropped,
    before anything else can run: every session it forked is dead. :meth:`stop` refuses new
    servers from then on; :meth:`aclose` kills them."""

    def __init__(self, *, limits: Limits, isolate: bool, allow_unisolated: bool, max_output: int,
                 setup_timeout: float, spawn_servers: int, cgroups: _Cgroups, uids: _Uids, cgroup_root: Path,
                 on_lost: Callable[[], Awaitable[None]]) -> None:
        #: What each worker is started with. ``start`` turns seccomp off where the host has
        #: none (only with ``allow_unisolated``); :meth:`unisolate` turns isolation off.
        self.limits = limits
        self.isolate = isolate
        self.allow_unisolated = allow_unisolated
        self.max_output = max_output
        self.setup_timeout = setup_timeout
        self.spawn_servers = max(1, spawn_servers)
        self._cgroups, self._uids, self._cgroup_root = cgroups, uids, cgroup_root
        self._on_lost = on_lost
        self._proc: Process | None = None
        self._control: _Control | None = None
        self._templates: dict[str | None, list[_Control]] = {}
        self._making: dict[str | None, anyio.Lock] = {}  # one template made at a time per setup
        self._lock = anyio.Lock()  # one start or replacement of the base server at a time
        self._stopped = False
        #: Whether a start that finds its server dead replaces it and tries again. Off until
        #: the owner has checked the host's isolation: a crash then must not look like a host
        #: that runs (or cannot run) isolated sessions.
        self.replace_dead = False
        #: How many times a dead base server was replaced.
        self.restarts = 0
        #: Workers started so far.
        self.starts = 0
        #: Unisolated sessions' working directories are made under this one (made at the first
        #: such session), which closing removes with whatever a session left there: a session
        #: ended with its fork server gone was not reaped by it, so its directory is still there.
        self._workdirs: str | None = None

    @property
    def pid(self) -> int | None:
        """Host pid of the base fork server (its templates and sessions die with it); None
        before it starts and once it is closed."""
        return self._proc.pid if self._proc is not None else None

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` ran (the owner is closing, or the host refused at start)."""
        return self._stopped

    def stop(self) -> None:
        """Start no server and replace none from now on: a start that needs one fails."""
        self._stopped = True

    # -- the base server -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the base fork server unless one runs. Refuses (``SandboxError``) where the
        host lacks a part of the isolation asked for, unless ``allow_unisolated`` (then it
        warns, every time); a host without seccomp stops the pool."""
        async with self._lock:
            if self._control is not None:
                return
            if self._stopped:
                raise SandboxError("sandbox is closed")
            self._cgroups.reap_stale()
            v1 = [c for c in self._cgroups.missing if c != "freeze"]
            if self.isolate and v1:
                self._weaker(f"no writable cgroup v1 {'/'.join(v1)} hierarchy: the session process-count, "
                             "memory or CPU limit cannot be enforced")
            if self.isolate and "freeze" in self._cgroups.missing and not self.limits.background:
                self._weaker("no writable cgroup v2 hierarchy (cgroup.freeze): a session's threads and "
                             "processes cannot be stopped between calls")
            hello = await self._launch()
            if self.isolate and self.limits.seccomp and not hello.get("seccomp"):
                try:
                    self._weaker("libseccomp/pyseccomp is unavailable: no seccomp filter (user namespaces, "
                                 "the mount API, other socket families would be reachable)")
                except SandboxError:
                    await self.aclose()
                    raise
                self.limits = replace(self.limits, seccomp=False)

    async def _launch(self) -> dict:
        """Start the base server process; its hello message."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with anyio.CancelScope(shield=True):  # cancelled half way, the child is left unreaped; aclose reaps it
                self._proc = await anyio.open_process(
                    [sys.executable, "-I", str(FORKSERVER), str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], stdin=-3, stdout=-3, stderr=None, env=CLEAN_ENV, cwd="/",
                    start_new_session=True,
                )
        except OSError as exc:
            mine.close()
            raise SandboxError(f"cannot start the sandbox fork server: {exc}") from exc
        finally:
            theirs.close()
        try:
            mine.settimeout(120)
            hello = await anyio.to_thread.run_sync(mine.recv, 1 << 16)
            mine.settimeout(None)
            if not hello:
                raise SandboxError("the sandbox fork server exited at start")
        except BaseException:
            mine.close()
            raise
        self._control = _Control(mine)
        return json.loads(hello)

    def _weaker(self, what: str) -> None:
        """A kernel feature the isolation relies on is missing: refuse, unless the user opted
        into weaker isolation (then say so loudly, every time)."""
        if not self.allow_unisolated:
            raise SandboxError(f"sandbox isolation is incomplete on this host: {what}; pass allow_unisolated=True "
                               "(--sandbox-unisolated) to run with weaker isolation (NOT safe for untrusted code)")
        warnings.warn(f"agentenv: sandbox runs with WEAKER isolation: {what}", stacklevel=4)
        log.warning("sandbox runs with WEAKER isolation: %s", what)

    def unisolate(self) -> None:
        """Start workers without namespaces from now on (the host cannot isolate them and the
        user allowed that). Isolated templates serve isolated sessions only: they go."""
        self.isolate = False
        self._close_templates()

    def _close_templates(self) -> None:
        for servers in self._templates.values():
            for ctl in servers:
                ctl.close()
        self._templates = {}

    async def aclose(self) -> None:
        """Close every server's channel and kill the base server (its templates and sessions
        die with it)."""
        self.stop()
        with anyio.CancelScope(shield=True):
            self._close_templates()
            control, self._control = self._control, None
            if control is not None:
                control.close()
            proc, self._proc = self._proc, None
            if proc is not None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                await proc.aclose()
            workdirs, self._workdirs = self._workdirs, None
            if workdirs is not None:
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(workdirs, ignore_errors=True))

    # -- workers ---------------------------------------------------------------------------
    async def spawn(self, setup_code: str | None) -> _Worker:
        """Start a worker for ``setup_code`` from one of its templates."""
        for attempt in range(3):
            server, base = None, self._control
            try:
                with anyio.CancelScope(shield=True):  # a half-made worker must not leak
                    server = await self._server_for(setup_code)
                    worker = await self._spawn_from(server)
            except _ServerGone:
                if attempt == 2 or self._stopped or not self.replace_dead:
                    raise
                await self._replace(server, base, setup_code)
            else:
                self.starts += 1
                return worker
        raise AssertionError("unreachable")

    def end(self, worker: _Worker) -> None:
        """Kill every process of ``worker`` and take its cgroups and uid back."""
        worker.end(self._cgroups, self._uids)

    def freeze(self, worker: _Worker) -> bool:
        """Stop everything ``worker`` runs until :meth:`thaw`; False if it could not be."""
        return worker.freeze(self._cgroups)

    def thaw(self, worker: _Worker) -> bool:
        """Let ``worker`` run again after :meth:`freeze`; False if it could not be."""
        return worker.thaw(self._cgroups)

    def cpu(self, worker: _Worker) -> tuple[float, float] | None:
        """``worker``'s session's CPU seconds and seconds waiting for a CPU (None: unknown)."""
        return worker.cpu(self._cgroups)

    async def _spawn_from(self, server: _Control) -> _Worker:
        cgroups = await self._cgroups.acquire(self.limits)
        try:
            uid = await self._uids.acquire_soon() if self.isolate else None
        except BaseException:
            self._cgroups.release(cgroups)
            raise
        limits = dict(_limits_dict(self.limits))
        limits.update(uid=uid if uid is not None else -1, gid=uid if uid is not None else -1)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req = {"op": "spawn", "limits": limits, "isolate": self.isolate, "cgroups": cgroups,
               "max_output": self.max_output}
        if not self.isolate:
            if self._workdirs is None:
                self._workdirs = tempfile.mkdtemp(prefix="agentenv-sbx-")
            req["workdirs"] = self._workdirs
        fds: list[int] = []
        try:
            try:
                resp, fds = await server.request(req, [theirs.fileno()])
            finally:
                theirs.close()
            if "error" in resp or len(fds) != (1 if self.isolate else 2):
                raise SandboxError(f"cannot start a sandbox worker: {resp.get('error', 'no pidfd')}")
        except BaseException:
            mine.close()
            for fd in fds:
                os.close(fd)
            self._cgroups.release(cgroups)
            if uid is not None:  # a worker may have run as it and be exiting still: never reused
                self._uids.release(uid, None, reusable=False)
            raise
        stream = await anyio.abc.UNIXSocketStream.from_socket(mine)
        freezes = self.isolate and not self.limits.background and "freeze" in self._cgroups.bases
        return _Worker(stream, resp["pid"], fds[0], fds[1] if len(fds) > 1 else None, cgroups, uid, freezes)

    # -- templates -------------------------------------------------------------------------
    async def _server_for(self, setup_code: str | None) -> _Control:
        """A fork server for ``setup_code``: a template forked from the base server that ran
        the code once. Up to ``spawn_servers`` of them per setup, so session starts (fork,
        namespaces, mounts: milliseconds each, mostly in other processes) overlap instead of
        queueing behind one server."""
        if self._control is None:  # a dead server is being replaced
            await self.start()
        assert self._control is not None
        servers = self._templates.setdefault(setup_code, [])
        for ctl in servers:
            if not ctl.pending:
                return ctl
        making = self._making.setdefault(setup_code, anyio.Lock())
        # One template is made at a time. While one is being made, a start queues on a server
        # that exists rather than making yet another: a burst of starts for a new setup would
        # otherwise make one template per waiter, one after another.
        if len(servers) < self.spawn_servers and not (servers and making.locked()):
            async with making:
                servers = self._templates.setdefault(setup_code, [])  # may have been replaced
                free = next((ctl for ctl in servers if not ctl.pending), None)
                if free is not None:
                    return free
                if len(servers) < self.spawn_servers:
                    ctl = await self._make_template(setup_code)
                    servers.append(ctl)
                    return ctl
        return min(servers, key=lambda ctl: ctl.pending)  # its requests queue there, pipelined

    async def _make_template(self, setup_code: str | None) -> _Control:
        """Fork a template from the base server and run ``setup_code`` in it."""
        if self._control is None:  # the server died while this start waited
            await self.start()
        assert self._control is not None
        with anyio.fail_after(self.setup_timeout):
            resp, fds = await self._control.request(
                {
                    "op": "template",
                    "setup": setup_code or "",
                    "isolate": self.isolate,
                    "cgroup_root": str(self._cgroup_root),
                },
                timeout=self.setup_timeout + CONTROL_TIMEOUT,
            )  # the setup's own limit first
        if "error" in resp or not fds:
            raise SandboxError(f"environment setup code failed: {resp.get('error')}")
        return _Control(socket.socket(fileno=fds[0]))

    async def _replace(self, dead: _Control | None, base: _Control | None, setup_code: str | None) -> None:
        """A fork server is gone. A template that died alone is dropped (the next start makes
        a new one); if the base server died (its templates die with it), start a new one."""
        servers = self._templates.get(setup_code, [])
        if dead is not None and dead in servers:
            servers.remove(dead)
            dead.close()
        async with self._lock:
            proc, control = self._proc, self._control
            # ``dead is None``: the base server's own channel failed. A template's socket can
            # close (it dies with its parent) a moment before the base server's exit shows in
            # /proc, so a template's death waits briefly for the base server's. ``control is
            # not base``: another start already replaced the server this attempt used.
            if proc is not None and control is not None and control is base and (
                dead is None or await _exits_soon(proc.pid)
            ):
                log.warning("the sandbox fork server (pid %s) died; starting a new one", proc.pid)
                self.restarts += 1
                self._close_templates()
                self._control, self._proc = None, None
                control.close()
                await self._on_lost()
                with anyio.CancelScope(shield=True):
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
                    await proc.aclose()
        await self.start()
