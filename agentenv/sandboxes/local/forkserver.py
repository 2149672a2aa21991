"""The fork server: a warm template process that forks isolated sessions.

Run as ``python -I forkserver.py FD`` with FD one end of a SOCK_SEQPACKET control socket.
It imports the usual libraries once (math, numpy, sympy where installed), so a new session
costs a fork, not an interpreter start. Each request on the control socket is one JSON
message, possibly carrying file descriptors (SCM_RIGHTS):

  {"op": "spawn", "limits": {...}, "isolate": bool, "cgroups": [...], "max_output": int}
      + [session socket]
      -> {"pid": <worker host pid>, "reaper": <reaper host pid, or null>}
  {"op": "template", "setup": "<code>", "isolate": bool, "cgroup_root": "<path>"}
      -> {"ok": true} + [control socket of a new fork server whose namespace ran <code>]

Isolated sessions start from an *isolated template*: a fork server that ran the environment's
setup code and then moved into a mount namespace holding the session's filesystem view
(``isolation.enter_template_view``: host system dirs read-only, everything else hidden, a
private ``/dev``), built once; it also empties its capability bounding set and locks its
securebits (``isolation.lock_capabilities``) and sets the sessions' environment variables,
once for all its sessions. A session is one fork of it, straight into a new pid namespace
(pid 1 there: killing it kills everything the code started). The worker joins its cgroups,
takes its own mount/net/ipc/uts namespaces with a private ``/tmp`` and ``/dev/shm``
(``isolation.enter_session``), mounts a fresh read-only ``/proc``, applies rlimits, becomes
an unprivileged uid with no capabilities, loads the seccomp filter and serves calls
(``worker.serve``) on the session socket; after each call it kills every other process in its
namespace (unless the limits allow background processes). If it cannot confine itself it
never runs code: it answers the host's first call with a ``VIOLATION`` frame saying why.
The template reaps its sessions; the parent-death signal ends them if it dies.

Without ``isolate`` a session is two processes: a *reaper* that joins the session's cgroups
and forks the *worker* into a private working directory, which the fork server removes when
it reaps the reaper; only the rlimits, cgroups and that directory apply (the caller must have
opted in, loudly).

Templates compact their memory before serving (``gc.freeze`` and transparent huge pages where
the kernel has ``MADV_COLLAPSE``): a fork copies far fewer page-table entries.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS thread pools: they break after fork
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import isolation  # noqa: E402
import worker  # noqa: E402
from isolation import PR_SET_NAME, PR_SET_PDEATHSIG, libc  # noqa: E402
from protocol import HEADER, VIOLATION  # noqa: E402

try:  # compiled once here; each session only loads it
    SECCOMP_BPF = isolation.compile_seccomp()
except Exception:  # noqa: BLE001 - reported to the host, which refuses unless opted out
    SECCOMP_BPF = None

# Set in an isolated template (``_isolate_template``): this process's own pid namespace and the
# host's cgroup v1 root, both opened before the template left the host's mount namespace.
ISOLATED = False
PIDNS_FD: int | None = None
CGROUP_ROOT: tuple[str, int] | None = None
MADV_COLLAPSE = 25

for _mod in ("math", "json", "re", "itertools", "functools", "collections", "fractions", "decimal",
             "statistics", "random", "numpy", "sympy"):
    try:
        __import__(_mod)
    except Exception:  # noqa: BLE001 - optional warm imports
        pass


def _end_background(_waitpid=os.waitpid, _kill=os.kill, _nohang=os.WNOHANG, _sigkill=signal.SIGKILL,
                    _getrlimit=resource.getrlimit, _setrlimit=resource.setrlimit,
                    _nproc=resource.RLIMIT_NPROC) -> None:
    """After a call, in the worker (pid 1 of its namespace): kill every other process in the
    namespace, wherever it hid (setsid, double fork), and reap them. Every process there
    descends from the worker and orphans are re-parented to it, so no child means nothing
    else runs: the common case costs one syscall. The syscalls are the ones captured when
    this module loaded: user code that replaces ``os.kill``, ``os.waitpid`` or their flags
    does not reach them.

    While it kills, this process starts no process or thread: the session's uid is its own
    (``uids.py``), and a soft ``RLIMIT_NPROC`` of 0 fails its every fork and clone (the killed
    processes cannot fork either: a fatal signal is pending). A thread of the code forking all
    the while would otherwise replace each child reaped, and on a busy machine the sweep could
    go on until the call's deadline. The hard limit stays, and the soft one is set back after;
    code that raises it again meanwhile only holds its own answer, to the call's deadline (the
    session is then killed)."""
    try:
        if _waitpid(-1, _nohang) == (0, 0):
            pass  # children running
    except ChildProcessError:
        return
    soft, hard = _getrlimit(_nproc)
    _setrlimit(_nproc, (0, hard))
    try:
        while True:
            try:
                _kill(-1, _sigkill)
            except OSError:
                pass  # ESRCH: the only child was a zombie, now reaped
            try:
                _waitpid(-1, 0)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
    finally:
        try:
            _setrlimit(_nproc, (soft, hard))
        except (OSError, ValueError):
            pass  # a thread of the code lowered the hard limit meanwhile: its lower limits stand


def _worker(sock: socket.socket, limits: dict, isolate: bool, workdir: str, ns: dict,
            cgroups: list[str] | None = None, parent_fd: int | None = None) -> None:
    try:
        after_call = _confine(sock, limits, isolate, workdir, cgroups, parent_fd)
    except BaseException as exc:  # noqa: BLE001 - a session that cannot be confined never runs code
        why = json.dumps({"violation": f"the session could not be confined: {type(exc).__name__}: {exc}"[:1000]})
        try:
            sock.recv(HEADER.size)  # the first call
            sock.sendall(HEADER.pack(len(why), VIOLATION) + why.encode())
        except OSError:
            pass
        os._exit(1)
    try:
        worker.serve(sock.makefile("rb", buffering=0), sock.makefile("wb", buffering=0), ns, after_call)
    finally:
        os._exit(0)  # never back into the fork server's loop


def _join_cgroups(cgroups: list[str]) -> None:
    """Move this process into its session's cgroups, through the host's cgroup mount (the
    template's own view of it is read-only)."""
    if not cgroups:
        return
    if CGROUP_ROOT is None:
        raise OSError("the template has no handle on the host's cgroup hierarchy")
    root, fd = CGROUP_ROOT
    for cg in cgroups:
        rel = os.path.relpath(cg, root)
        if rel.startswith(".."):
            raise OSError(f"cgroup {cg} is outside {root}")
        procs = os.open(os.path.join(rel, "cgroup.procs"), os.O_WRONLY, dir_fd=fd)
        try:
            os.write(procs, b"0")  # "0": the writing process
        finally:
            os.close(procs)


def _yield_on_wake() -> None:
    """Run the session under ``SCHED_BATCH``: same CPU share as any process, but a session
    woken up (by its call, its thaw, its freeze) never preempts the process that woke it. That
    process is the host's event loop, which serves every session and the engine; a worker
    taking its CPU the moment it wakes stalls the loop once or more per call. A woken session
    runs at once on an idle CPU, else when the waker blocks or at the next scheduler tick. A
    scheduling hint, not a protection: code that sets its policy back only has the host
    preempted again, as before."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError):  # not on this kernel, or a runtime that refuses it
        pass


def _confine(sock: socket.socket, limits: dict, isolate: bool, workdir: str, cgroups: list[str] | None,
             parent_fd: int | None = None):
    """Confine this new session process. ``parent_fd``: a pidfd of the process that forked it
    (an isolated session, pid 1 of its namespace, cannot ask for its parent's pid)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _name(b"sbx-session")
    os.setsid()  # its own process group: kill(0, ...) from user code reaches nothing outside
    if isolate:
        if not ISOLATED or os.getpid() != 1:
            raise OSError("an isolated session must start from an isolated template, as pid 1")
        _join_cgroups(cgroups or [])
        isolation.enter_session(limits["tmp_mb"], limits["shm_mb"])
        isolation.mount_proc()
        libc.sethostname(b"sandbox", 7)
    os.chdir(workdir)
    if not isolate:  # the rest of the environment is the template's (``_session_environment``)
        os.environ.update({"HOME": workdir, "TMPDIR": workdir})
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    start = 3
    for keep in sorted({sock.fileno(), parent_fd if parent_fd is not None else sock.fileno()}):
        os.closerange(start, keep)
        start = keep + 1
    os.closerange(start, 65536)
    isolation.apply_rlimits(limits)
    if not isolate:
        _yield_on_wake()
        return None
    if limits["uid"] <= 0 or limits["gid"] <= 0:
        raise OSError("an isolated session needs its own unprivileged uid and gid")
    isolation.apply_session_rlimits(limits)
    # The uid change clears the parent-death signal until drop_privileges sets it again, and a
    # parent that died before it was first set sent none: once it is set for good, a parent
    # already gone is looked for (its pidfd is readable) and this session ends itself.
    isolation.drop_privileges(limits["uid"], limits["gid"])
    if parent_fd is not None:
        parent_gone = bool(select.select([parent_fd], [], [], 0)[0])
        os.close(parent_fd)
        if parent_gone:
            os._exit(1)
    _yield_on_wake()  # only now: its start-up above is never put off to a scheduler tick
    if limits.get("seccomp"):
        if SECCOMP_BPF is None:
            raise OSError("the seccomp filter is unavailable (pyseccomp/libseccomp missing)")
        isolation.apply_seccomp(SECCOMP_BPF)
    return None if limits.get("background") or os.getpid() != 1 else _end_background


def _spawn(sock: socket.socket, req: dict, ns: dict) -> tuple[int, int | None, list[int], str | None]:
    """Fork a session; returns its worker's pid, its reaper's (unisolated), a pidfd of each
    and the working directory this server removes once the session is gone (unisolated). A
    pidfd is opened here, by the parent, before ``_reap`` can free the pid: the host signals
    only through it, so a pid the kernel has reused can never be hit."""
    if req["isolate"]:
        return _spawn_isolated(sock, req, ns)
    return _spawn_unisolated(sock, req, ns)


def _spawn_isolated(sock: socket.socket, req: dict, ns: dict) -> tuple[int, None, list[int], None]:
    """One fork, into a new pid namespace; the worker isolates itself (``_confine``)."""
    if not ISOLATED or PIDNS_FD is None:
        raise OSError("isolated sessions start from an isolated template")
    me = os.pidfd_open(os.getpid())  # the session's check that its parent outlived its start
    isolation.enter_pid_namespace()
    try:
        pid = os.fork()
    except BaseException:
        os.close(me)
        isolation.leave_pid_namespace(PIDNS_FD)
        raise
    if pid == 0:
        _worker(sock, req["limits"], True, "/tmp", ns, req.get("cgroups", []), me)
    os.close(me)
    try:
        isolation.leave_pid_namespace(PIDNS_FD)
    except OSError:  # later children would land in this session's namespace: give up instead
        os.kill(pid, signal.SIGKILL)  # our own child, not reaped yet: the pid is still its
        os._exit(1)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        os.kill(pid, signal.SIGKILL)
        raise
    return pid, None, [pidfd], None


def _spawn_unisolated(sock: socket.socket, req: dict, ns: dict) -> tuple[int, int, list[int], str]:
    """A reaper and its worker, in a working directory made here under the pool's (``workdirs``):
    the host ends a session by killing its reaper, which can then remove nothing, so this server
    removes the directory when it reaps the reaper (``_Children``)."""
    limits, cgroups = req["limits"], req.get("cgroups", [])
    os.makedirs(req["workdirs"], 0o700, exist_ok=True)  # a session may have removed it
    workdir = tempfile.mkdtemp(prefix="session-", dir=req["workdirs"])
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        reaper = os.fork()
    except BaseException:
        r.close()
        w.close()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    if reaper == 0:
        _reaper(r, w, sock, limits, cgroups, ns, workdir)
    w.close()
    try:
        reaper_fd = os.pidfd_open(reaper)  # our child, not reaped yet
        msg, fds, _, _ = socket.recv_fds(r, 1024, 1)
    finally:
        r.close()
    n = struct.unpack(">i", msg[:4])[0] if len(msg) >= 4 else -1
    if n < 0 or not fds:
        for fd in fds:
            os.close(fd)
        os.close(reaper_fd)
        shutil.rmtree(workdir, ignore_errors=True)
        raise OSError(msg[4:].decode(errors="replace") or "sandbox worker failed to start")
    return n, reaper, [fds[0], reaper_fd], workdir


def _reaper(r: socket.socket, w: socket.socket, sock: socket.socket, limits: dict, cgroups: list[str],
            ns: dict, workdir: str) -> None:
    """An unisolated session's first process: joins its cgroups, forks the worker (in
    ``workdir``), hands the fork server a pidfd of it (opened before this process could reap
    it) and waits for the worker to exit."""
    try:
        r.close()
        os.setsid()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for cg in cgroups:
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        pid = os.fork()
        if pid == 0:
            w.close()
            _worker(sock, limits, False, workdir, ns)
        pidfd = os.pidfd_open(pid)
        socket.send_fds(w, [struct.pack(">i", pid)], [pidfd])  # the fork server is free
        os.close(pidfd)
        w.close()
        sock.close()
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                break
    except BaseException as exc:  # noqa: BLE001 - report and die
        try:
            w.sendall(struct.pack(">i", -1) + f"{type(exc).__name__}: {exc}".encode()[:1000])
        except OSError:
            pass
    os._exit(0)


def _isolate_template(cgroup_root: str | None) -> None:
    """Make this template an isolated one: remember what sessions need from the host, then
    move into the sessions' filesystem view (built once here, copied by each session)."""
    global ISOLATED, PIDNS_FD, CGROUP_ROOT
    PIDNS_FD = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    if cgroup_root and os.path.isdir(cgroup_root):
        CGROUP_ROOT = (cgroup_root, os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    isolation.enter_template_view()
    isolation.lock_capabilities()
    ISOLATED = True


def _session_environment() -> None:
    """Once, in a template after the setup code: the environment its sessions start with
    (nothing of the host's). Clearing it here rather than in each session saves the session
    a third of a millisecond."""
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                       "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})


def _compact() -> None:
    """Cheaper forks: objects alive now are never scanned by a session's garbage collector
    (no copy-on-write of their pages), and the heap is collapsed into transparent huge pages
    where the kernel can (one page-table entry per 2 MiB to copy, not 512). Best effort."""
    gc.freeze()
    huge = 1 << 21
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return
    for line in maps:
        parts = line.split()
        if len(parts) < 5 or parts[1][:2] != "rw" or parts[1][3] != "p":
            continue
        if len(parts) > 5 and parts[5] != "[heap]":
            continue  # file-backed or special: shared with the host, nothing to gain
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        lo, hi = (lo + huge - 1) & ~(huge - 1), hi & ~(huge - 1)
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE)  # errors ignored


def _template(req: dict, ns: dict, ctrl: socket.socket, children: _Children) -> tuple[socket.socket, int]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        # The child never returns into its parent's loop, and never speaks on its parent's
        # control channel (an error there would read as the parent's answer to the host).
        try:
            mine.close()
            ctrl.close()
            children.close()
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # it died before the signal was set: none will come
                os._exit(1)
            _name(b"sbx-template")
            child_ns = dict(ns)
            try:
                exec(compile(req["setup"], "<setup>", "exec"), child_ns)
            except BaseException as exc:  # noqa: BLE001
                theirs.send(json.dumps({"error": f"setup failed: {type(exc).__name__}: {exc}"}).encode())
                os._exit(1)
            if req.get("isolate"):
                try:
                    _isolate_template(req.get("cgroup_root"))
                except BaseException as exc:  # noqa: BLE001 - no isolated template, no isolated session
                    theirs.send(json.dumps({"error": f"cannot isolate the template: {type(exc).__name__}: {exc}"}
                                           ).encode())
                    os._exit(1)
            _session_environment()
            _compact()
            theirs.send(json.dumps({"ok": True}).encode())
            serve_control(theirs, child_ns)
        except BaseException:  # noqa: BLE001 - e.g. the parent died mid-way (EPIPE): just end
            pass
        os._exit(0)
    theirs.close()
    return mine, pid


def _died(pid: int) -> str:
    """How a child that closed its end of the channel ended (it is exiting: waited for)."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "it exited"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = " (out of memory?)" if sig == signal.SIGKILL else ""
        return f"it was killed by {signal.Signals(sig).name}{why}"
    return f"it exited with status {os.WEXITSTATUS(status)}"


def _name(name: bytes) -> None:
    """The process's name as ``ps`` and ``top`` show it."""
    libc.prctl(PR_SET_NAME, name, 0, 0, 0)


class _Children:
    """A fork server's sessions, reaped the moment each exits: a pidfd of each is watched with
    the control socket (epoll), so a dead session's pid, cgroups and uid are free for reuse at
    once, not at the server's next request."""

    def __init__(self, ctrl: socket.socket) -> None:
        self.poll = select.epoll()
        self.poll.register(ctrl.fileno(), select.EPOLLIN)
        self.pidfds: dict[int, int] = {}  # pidfd -> pid
        self.workdirs: dict[int, str] = {}  # pidfd -> the directory to remove when it exits

    def watch(self, pidfd: int, pid: int, workdir: str | None = None) -> None:
        self.pidfds[pidfd] = pid
        if workdir is not None:
            self.workdirs[pidfd] = workdir
        self.poll.register(pidfd, select.EPOLLIN)

    def wait(self) -> None:
        """Until the control socket is readable, reaping every session that exits meanwhile."""
        while True:
            _reap()  # children not watched: templates that died
            request = False
            for fd, _ in self.poll.poll():
                pid = self.pidfds.pop(fd, None)
                if pid is None:
                    request = True
                    continue
                self.poll.unregister(fd)
                os.close(fd)
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                workdir = self.workdirs.pop(fd, None)
                if workdir is not None:
                    shutil.rmtree(workdir, ignore_errors=True)
            if request:
                return

    def close(self) -> None:
        """In a forked child (a new template): none of this is its own."""
        for fd in self.pidfds:
            os.close(fd)
        self.pidfds.clear()
        self.workdirs.clear()
        self.poll.close()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve_control(ctrl: socket.socket, ns: dict) -> None:
    children = _Children(ctrl)
    while True:
        children.wait()
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, 4)
        except OSError:
            return
        if not msg:
            return
        req = json.loads(msg)
        try:
            if req["op"] == "spawn":
                # The socket object owns the session socket's fd from here (closed once, here:
                # a second close, when it is collected, could hit the next request's socket).
                sock = socket.socket(fileno=fds.pop(0))
                try:
                    pid, reaper, pidfds, workdir = _spawn(sock, req, ns)
                finally:
                    sock.close()
                try:
                    socket.send_fds(ctrl, [json.dumps({"pid": pid, "reaper": reaper}).encode()], pidfds)
                finally:
                    children.watch(pidfds.pop(), reaper or pid, workdir)  # the last: this server's own child
                    for fd in pidfds:
                        os.close(fd)
            elif req["op"] == "template":
                tctrl, tpid = _template(req, ns, ctrl, children)
                first = tctrl.recv(1 << 16)
                if first:
                    socket.send_fds(ctrl, [first], [tctrl.fileno()])
                else:  # it died before it was ready (e.g. the setup code called os._exit)
                    ctrl.send(json.dumps({"error": f"the setup process died before it was ready: "
                                                   f"{_died(tpid)}"}).encode())
                tctrl.close()
            else:
                ctrl.send(json.dumps({"error": f"unknown op {req['op']!r}"}).encode())
        except Exception as exc:  # noqa: BLE001 - the server keeps serving
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                ctrl.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            except OSError:  # the host is gone (its end of the channel closed): no one to answer
                return


def main() -> None:
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name(b"sbx-forkserver")
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    ctrl.send(json.dumps({"ok": True, "pid": os.getpid(), "seccomp": SECCOMP_BPF is not None}).encode())
    serve_control(ctrl, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
