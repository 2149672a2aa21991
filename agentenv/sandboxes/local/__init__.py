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
come back as ``state_lost`` at their next call. Where the namespace primitives are missing, ``LocalSandbox`` refuses to start
unless ``allow_unisolated=True``, which logs a loud warning and keeps only the rlimits,
cgroups and private working directory.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import anyio
from anyio.abc import Process, TaskGroup

from agentenv.errors import SandboxError

from ..base import ExecResult, Sandbox, Session
from .cgroups import _alive, _Cgroups
from .control import _Control, _ServerGone
from .frames import read_frame
from .handle import _Worker
from .protocol import ERROR_CAP, HEADER, MAX_REQUEST, VIOLATION, frame_cap
from .uids import _Uids

log = logging.getLogger(__name__)
FORKSERVER = Path(__file__).with_name("forkserver.py")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CGROUP_V1 = Path("/sys/fs/cgroup")
#: Session starts :meth:`LocalSandbox.prepare` keeps in flight (two template servers fork
#: them; 8 at a time reach ~400 starts/s on 2 idle cores).
PREPARE_STARTS = 8


@dataclass(frozen=True, slots=True)
class Limits:
    memory_mb: int = 1024  # address space per process, and the session's cgroup memory
    cpu_s: int = 120  # CPU seconds per worker process (a session's lifetime budget)
    cpus: float = 0.0  # a hard CPU cap per session (cgroup cfs quota, in CPUs); 0: none, only an equal share
    fsize_mb: int = 64  # largest file it may write
    nofile: int = 256  # open files
    pids: int = 64  # processes and threads in the session (cgroup pids.max)
    tmp_mb: int = 128  # its private /tmp
    shm_mb: int = 16  # its private /dev/shm
    seccomp: bool = True  # deny syscalls a session never needs (needs libseccomp)
    # Each live session runs as its own unprivileged uid (and gid) from ``uids`` uids starting at
    # ``uid`` (``uids.py``): per-user kernel quotas are then per session. The default range lies
    # between systemd's container and foreign uid ranges; no host user or container should use it.
    uid: int = 0x70000000
    uids: int = 65536
    background: bool = False  # let processes started by a call outlive it


def _clean(s: str | None, cap: int | None = None) -> str | None:
    # Lone surrogates (from undecodable bytes) would break UTF-8 JSONL later.
    if s is None:
        return None
    if cap is not None and len(s) > cap:
        s = s[:cap]
    return s.encode("utf-8", "replace").decode("utf-8")


async def _exits_soon(pid: int, within: float = 1.0) -> bool:
    """Whether ``pid`` is gone now or within ``within`` seconds."""
    with anyio.move_on_after(within):
        while _alive(pid):
            await anyio.sleep(0.02)
        return True
    return False


class LocalSession(Session):
    def __init__(self, sandbox: "LocalSandbox", setup_code: str | None) -> None:
        self._sandbox = sandbox
        self._setup = setup_code
        self._worker: _Worker | None = None
        self._lock = anyio.Lock()
        self._closed = False
        self._started_once = False
        self._seq = 0

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
    def _cgroups(self) -> list[str]:
        return self._worker.cgroups if self._worker is not None else []

    async def _start(self) -> None:
        self._worker = await self._sandbox._spawn(self._setup)
        self._sandbox.starts += 1

    async def _read_frame(self, seq: int) -> dict | str:
        assert self._worker is not None
        return await read_frame(self._worker.stream, seq, self._sandbox._frame_cap)

    def _signal(self, sig: int) -> None:
        if self._worker is not None:
            self._worker.signal(sig)

    async def _kill(self) -> None:
        w, self._worker = self._worker, None
        if w is None:
            return
        w.end(self._sandbox._cgroups, self._sandbox._uids)
        with anyio.CancelScope(shield=True):
            await w.stream.aclose()

    async def _call(self, code: str, timeout: float) -> ExecResult:
        w = self._worker
        assert w is not None
        # A fresh random number per call: code cannot answer a call before it was sent, and a
        # stale or forged answer waiting in the stream never matches the next call.
        self._seq = secrets.randbelow(VIOLATION)
        payload = json.dumps({"code": code, "max_output": self._sandbox.max_output}).encode()
        if len(payload) > MAX_REQUEST:
            return ExecResult("error", error=f"SandboxError: code of {len(payload)} bytes exceeds the "
                              f"{MAX_REQUEST}-byte request limit")
        start = time.perf_counter()
        late = False
        resp: dict | str | None = None
        if not w.thaw(self._sandbox._cgroups):
            resp = "the session could not be thawed"
        else:
            try:
                await w.stream.send(HEADER.pack(len(payload), self._seq) + payload)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                resp = "eof"
        if resp is None:
            with anyio.move_on_after(timeout):
                resp = await self._read_frame(self._seq)
            if resp is None:  # deadline: interrupt the code, give it a moment to unwind
                late = True
                self._signal(signal.SIGINT)
                with anyio.move_on_after(self._sandbox.kill_grace):
                    resp = await self._read_frame(self._seq)
                if not isinstance(resp, dict):
                    await self._kill()
                    return ExecResult("timeout", error=f"TimeoutError: execution exceeded {timeout:g}s and was "
                                      "killed", duration_s=time.perf_counter() - start, state_lost=True)
        elapsed = time.perf_counter() - start
        if resp == "eof":
            await self._kill()
            return ExecResult("crashed", error="the interpreter process died (crash, exit or a resource limit)",
                              duration_s=elapsed, state_lost=True)
        if isinstance(resp, str):
            await self._kill()
            return ExecResult("error", error=f"SandboxError: {resp}; the session was killed and will be replaced",
                              duration_s=elapsed, state_lost=True)
        if not w.freeze(self._sandbox._cgroups):  # it could run between calls: not kept
            await self._kill()
        cap = self._sandbox.max_output
        fields = {k: resp.get(k) for k in ("stdout", "stderr", "value")}
        truncated = resp["truncated"] or any(v is not None and len(v) > cap + 3 for v in fields.values())
        status, error = resp["status"], _clean(resp.get("error"), ERROR_CAP)
        if late:  # the deadline passed: a timeout, whatever the code made of the interrupt
            status, error, fields["value"] = "timeout", f"TimeoutError: execution exceeded {timeout:g}s", None
        return ExecResult(
            status=status,
            stdout=_clean(fields["stdout"], cap) or "",
            stderr=_clean(fields["stderr"], cap) or "",
            value=_clean(fields["value"], cap + 3),
            error=error,
            duration_s=elapsed,
            truncated=truncated,
        )

    async def run(self, code: str, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("session is closed")
        timeout = self._sandbox.default_timeout if timeout is None else timeout
        async with self._lock:
            restarted = False
            if self._worker is None:
                restarted = True
                await self._start()
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
        if self in self._sandbox._sessions:
            self._sandbox._sessions.discard(self)
            self._sandbox._free_slot()


class LocalSandbox(Sandbox):
    """A pool of isolated session workers. Use as ``async with`` to get prewarming."""

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
        self.limits = limits
        self.default_timeout = default_timeout
        self.max_output = max_output
        self.kill_grace = kill_grace
        self.prewarm = prewarm
        self.max_workers = max_workers
        self._slots = anyio.Semaphore(max_workers)
        self.setup_timeout = setup_timeout
        self.spawn_servers = max(1, spawn_servers)
        self.isolate = isolate
        self.allow_unisolated = allow_unisolated
        self._proc: Process | None = None
        self._control: _Control | None = None
        self._templates: dict[str | None, list[_Control]] = {}
        self._making: dict[str | None, anyio.Lock] = {}  # one template made at a time per setup
        self._sessions: set[LocalSession] = set()
        self._ready: dict[str | None, list[LocalSession]] = {}
        self._filling: dict[str | None, int] = {}
        self._owed: dict[str | None, int] = {}  # sessions prepare() still has to start
        self._changed = anyio.Event()  # a slot was freed or a ready session added
        self._cgroups = _Cgroups(CGROUP_V1)
        self._uids = _Uids(limits.uid, limits.uids)
        self._frame_cap = frame_cap(max_output)
        self._start_lock = anyio.Lock()
        self._tg: TaskGroup | None = None
        self._closed = False
        #: How many times a dead fork server was replaced.
        self.restarts = 0
        #: Session workers started so far (prepared, prewarmed and on demand).
        self.starts = 0
        self._probing = False  # start() holds the start lock while it checks isolation

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> "LocalSandbox":
        await self.start()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.prewarm:
            self._tg.start_soon(self._refill, None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        await self.aclose()

    async def start(self) -> None:
        async with self._start_lock:
            if self._control is not None:
                return
            if self._closed:
                raise SandboxError("sandbox is closed")
            self._cgroups.reap_stale()
            v1 = [c for c in self._cgroups.missing if c != "freeze"]
            if self.isolate and v1:
                self._weaker(f"no writable cgroup v1 {'/'.join(v1)} hierarchy: the session process-count, "
                             "memory or CPU limit cannot be enforced")
            if self.isolate and "freeze" in self._cgroups.missing and not self.limits.background:
                self._weaker("no writable cgroup v2 hierarchy (cgroup.freeze): a session's threads and "
                             "processes cannot be stopped between calls")
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._proc = await anyio.open_process(
                    [sys.executable, "-I", str(FORKSERVER), str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], stdin=-3, stdout=-3, stderr=None, env=CLEAN_ENV, cwd="/",
                    start_new_session=True,
                )
            except OSError as exc:
                raise SandboxError(f"cannot start the sandbox fork server: {exc}") from exc
            finally:
                theirs.close()
            mine.settimeout(120)
            hello = await anyio.to_thread.run_sync(mine.recv, 1 << 16)
            mine.settimeout(None)
            if not hello:
                raise SandboxError("the sandbox fork server exited at start")
            self._control = _Control(mine)
            if self.isolate and self.limits.seccomp and not json.loads(hello).get("seccomp"):
                try:
                    self._weaker("libseccomp/pyseccomp is unavailable: no seccomp filter (user namespaces, "
                                 "the mount API, other socket families would be reachable)")
                except SandboxError:
                    await self.aclose()
                    raise
                self.limits = replace(self.limits, seccomp=False)
            if not self.restarts:  # a replacement server runs on the host the probe checked
                self._probing = True
                try:
                    await self._probe()
                finally:
                    self._probing = False

    def _weaker(self, what: str) -> None:
        """A kernel feature the isolation relies on is missing: refuse, unless the user opted
        into weaker isolation (then say so loudly, every time)."""
        if not self.allow_unisolated:
            raise SandboxError(f"sandbox isolation is incomplete on this host: {what}; pass "
                               "allow_unisolated=True to run with weaker isolation (NOT safe for untrusted code)")
        warnings.warn(f"agentenv: sandbox runs with WEAKER isolation: {what}", stacklevel=3)
        log.warning("sandbox runs with WEAKER isolation: %s", what)

    async def _probe(self) -> None:
        """Refuse to run weaker than asked: a first isolated session must really be isolated
        (its own pid namespace, an unprivileged uid)."""
        check = "import os\n(os.getpid(), [p for p in os.listdir('/proc') if p.isdigit()], os.getuid(), os.getgid())"
        problem = None
        try:
            s = await self.session()
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
                               "allow_unisolated=True to run without namespaces (NOT safe for untrusted code)")
        warnings.warn(f"agentenv: sandbox isolation unavailable ({problem}); running UNISOLATED", stacklevel=2)
        log.warning("sandbox isolation unavailable (%s); running UNISOLATED", problem)
        self.isolate = False
        for servers in self._templates.values():  # isolated templates serve isolated sessions only
            for ctl in servers:
                ctl.close()
        self._templates = {}
        await (await self.session()).aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for s in list(self._sessions):
                await s.aclose()
            for servers in self._templates.values():
                for ctl in servers:
                    ctl.close()
            if self._control is not None:
                self._control.close()
            if self._proc is not None:
                try:
                    self._proc.kill()
                except ProcessLookupError:
                    pass
                await self._proc.aclose()
            for _ in range(20):  # workers exit within milliseconds of SIGKILL
                if await anyio.to_thread.run_sync(self._cgroups.remove_all):
                    break
                await anyio.sleep(0.05)
            self._cgroups.remove_roots()
            self._uids.close()

    # -- sessions --------------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        return [s.pid for s in self._sessions if s.pid is not None]

    @property
    def server_pid(self) -> int | None:
        """Host pid of the base fork server (its templates and sessions die with it)."""
        return self._proc.pid if self._proc is not None else None

    async def session(self, setup_code: str | None = None) -> LocalSession:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if self._control is None:
            await self.start()
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
            s = LocalSession(self, setup_code)
            self._sessions.add(s)
            try:
                async with s._lock:
                    await s._start()
                    s._started_once = True
            except BaseException:
                self._sessions.discard(s)
                self._free_slot()
                raise
            break
        if self._tg is not None and self.prewarm:
            self._tg.start_soon(self._refill, setup_code)
        return s

    def _free_slot(self) -> None:
        self._slots.release()
        self._changed.set()

    async def _refill(self, setup_code: str | None) -> None:
        ready = self._ready.setdefault(setup_code, [])
        # Concurrent refills (one per session taken) count each other's starts in progress,
        # so the pool holds ``prewarm`` ready sessions, not one batch per refill.
        while len(ready) + self._filling.get(setup_code, 0) < self.prewarm and not self._closed:
            if not await self._start_ready(setup_code):
                return

    async def _start_ready(self, setup_code: str | None) -> bool:
        """Start one session into the ready list; False when the pool is full or it failed
        (a failing setup then fails the ``session()`` call that needs it, with its error)."""
        try:
            self._slots.acquire_nowait()  # only into free capacity
        except anyio.WouldBlock:
            return False
        s = LocalSession(self, setup_code)
        self._sessions.add(s)
        self._filling[setup_code] = self._filling.get(setup_code, 0) + 1
        try:
            await s._start()
        except SandboxError:
            self._sessions.discard(s)
            self._free_slot()
            return False
        finally:
            self._filling[setup_code] -= 1
        s._started_once = True
        self._ready.setdefault(setup_code, []).append(s)
        self._changed.set()  # a session() waiting for capacity may take this one
        return True

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
        if self._control is None:
            await self.start()
        n = max(0, min(n, self._slots.value - sum(self._owed.values())))
        if n == 0:
            return 0
        self._owed[setup_code] = self._owed.get(setup_code, 0) + n
        if wait or self._tg is None:
            started = [0]
            async with anyio.create_task_group() as tg:
                for _ in range(min(n, PREPARE_STARTS)):
                    tg.start_soon(self._pay_owed, setup_code, started)
            return started[0]
        for _ in range(min(n, PREPARE_STARTS)):
            self._tg.start_soon(self._pay_owed, setup_code, [0])
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
        # that exists rather than making yet another: a burst of starts for a new setup once
        # made one template per waiter (254 for 256 starts, 15 starts/s).
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
                {"op": "template", "setup": setup_code or "", "isolate": self.isolate, "cgroup_root": str(CGROUP_V1)}
            )
        if "error" in resp or not fds:
            raise SandboxError(f"environment setup code failed: {resp.get('error')}")
        return _Control(socket.socket(fileno=fds[0]))

    async def _spawn(self, setup_code: str | None) -> _Worker:
        for attempt in range(3):
            server, base = None, self._control
            try:
                with anyio.CancelScope(shield=True):  # a half-made worker must not leak
                    server = await self._server_for(setup_code)
                    return await self._spawn_from(server)
            except _ServerGone:
                if attempt == 2 or self._closed or self._probing:  # replacing takes start()'s lock
                    raise
                await self._replace_server(server, base, setup_code)
        raise AssertionError("unreachable")

    async def _spawn_from(self, server: _Control) -> _Worker:
        cgroups = await self._cgroups.acquire(self.limits)
        try:
            uid = await self._uids.acquire_soon() if self.isolate else None
        except BaseException:
            self._cgroups.release(cgroups)
            raise
        limits = asdict(self.limits)
        limits.update(uid=uid if uid is not None else -1, gid=uid if uid is not None else -1)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req = {"op": "spawn", "limits": limits, "isolate": self.isolate, "cgroups": cgroups,
               "max_output": self.max_output}
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

    async def _replace_server(self, dead: _Control | None, base: _Control | None, setup_code: str | None) -> None:
        """A fork server is gone. A template that died alone is dropped (the next start makes
        a new one); if the base server died (its templates die with it), start a new one."""
        servers = self._templates.get(setup_code, [])
        if dead is not None and dead in servers:
            servers.remove(dead)
            dead.close()
        async with self._start_lock:
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
                for group in self._templates.values():
                    for ctl in group:
                        ctl.close()
                self._templates, self._control, self._proc = {}, None, None
                control.close()
                ready, self._ready = self._ready, {}  # prewarmed sessions died with it
                for group in ready.values():
                    for s in group:
                        await s.aclose()
                with anyio.CancelScope(shield=True):
                    try:
                        proc.kill()
                    except ProcessLookupError:
                        pass
                    await proc.aclose()
        await self.start()

