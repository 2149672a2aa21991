"""The fork server: a warm template process that forks isolated sessions.

Run as ``python -I forkserver.py FD`` with FD one end of a SOCK_SEQPACKET control socket.
It imports the usual libraries once (math, numpy, sympy where installed), so a new session
costs a fork, not an interpreter start. Each request on the control socket is one JSON
message, possibly carrying file descriptors (SCM_RIGHTS):

  {"op": "spawn", "limits": {...}, "isolate": bool, "cgroups": [...], "max_output": int}
      + [session socket]
      -> {"pid": <worker host pid>, "reaper": <reaper host pid>}
  {"op": "template", "setup": "<code>"}
      -> {"ok": true} + [control socket of a new fork server whose namespace ran <code>]

A spawned session is two processes. The *reaper* (A) joins the session's cgroups, unshares
mount/net/ipc/uts/pid namespaces and builds the session's filesystem view
(``isolation.enter_namespaces``: host system dirs read-only, everything else hidden, a private
``/dev``, private tmpfs ``/tmp`` and ``/dev/shm``), forks the *worker* (B), pid 1 of the new
pid namespace (killing it kills everything the code started), drops its own capabilities
and waits. The worker mounts a fresh read-only ``/proc``, applies rlimits, becomes an
unprivileged uid with no capabilities, loads the seccomp filter and serves calls
(``worker.serve``) on the session socket; after each call it kills every other process in
its namespace (unless the limits allow background processes). If it cannot confine itself
it never runs code: it answers the host's first call with a ``VIOLATION`` frame saying why.
Without ``isolate`` only the rlimits, cgroups and a private working directory apply (the
caller must have opted in, loudly).
"""

from __future__ import annotations

import json
import os
import select
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
from isolation import PR_SET_PDEATHSIG, libc  # noqa: E402
from protocol import HEADER, VIOLATION  # noqa: E402

try:  # compiled once here; each session only loads it
    SECCOMP_BPF = isolation.compile_seccomp()
except Exception:  # noqa: BLE001 - reported to the host, which refuses unless opted out
    SECCOMP_BPF = None

for _mod in ("math", "json", "re", "itertools", "functools", "collections", "fractions", "decimal",
             "statistics", "random", "numpy", "sympy"):
    try:
        __import__(_mod)
    except Exception:  # noqa: BLE001 - optional warm imports
        pass


def _end_background() -> None:
    """After a call, in the worker (pid 1 of its namespace): kill every other process in the
    namespace, wherever it hid (setsid, double fork), and reap them. Every process there
    descends from the worker and orphans are re-parented to it, so no child means nothing
    else runs: the common case costs one syscall."""
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            pass  # children running
    except ChildProcessError:
        return
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass  # ESRCH: the only child was a zombie, now reaped
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _worker(sock: socket.socket, limits: dict, isolate: bool, workdir: str, ns: dict) -> None:
    try:
        after_call = _confine(sock, limits, isolate, workdir)
    except BaseException as exc:  # noqa: BLE001 - a session that cannot be confined never runs code
        why = json.dumps({"violation": f"the session could not be confined: {type(exc).__name__}: {exc}"[:1000]})
        try:
            sock.recv(HEADER.size)  # the first call
            sock.sendall(HEADER.pack(len(why), VIOLATION) + why.encode())
        except OSError:
            pass
        os._exit(1)
    worker.serve(sock.makefile("rb", buffering=0), sock.makefile("wb", buffering=0), ns, after_call)
    os._exit(0)


def _confine(sock: socket.socket, limits: dict, isolate: bool, workdir: str):
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setsid()  # its own process group: kill(0, ...) from user code reaches nothing outside
    if isolate:
        isolation.mount_proc()
        libc.sethostname(b"sandbox", 7)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                       "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    keep = sock.fileno()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, 65536)
    isolation.apply_rlimits(limits)
    if not isolate:
        return None
    # The uid change clears the parent-death signal until drop_privileges sets it again: a
    # reaper that died in between is not noticed, but the host kills every session it closes.
    isolation.drop_privileges(limits["uid"], limits["gid"])
    if limits.get("seccomp"):
        if SECCOMP_BPF is None:
            raise OSError("the seccomp filter is unavailable (pyseccomp/libseccomp missing)")
        isolation.apply_seccomp(SECCOMP_BPF)
    return None if limits.get("background") or os.getpid() != 1 else _end_background


def _spawn(sock: socket.socket, req: dict, ns: dict) -> tuple[int, int]:
    limits, isolate, cgroups = req["limits"], bool(req["isolate"]), req.get("cgroups", [])
    r, w = os.pipe()
    reaper = os.fork()
    if reaper == 0:
        try:
            os.close(r)
            os.setsid()
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            for cg in cgroups:
                with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
            if isolate:
                isolation.enter_namespaces(limits["tmp_mb"], limits["shm_mb"])
                workdir = "/tmp"
            else:
                workdir = tempfile.mkdtemp(prefix="agentenv-sbx-")
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _worker(sock, limits, isolate, workdir, ns)
            os.write(w, struct.pack(">i", pid))  # the fork server is free; the worker confines itself
            os.close(w)
            sock.close()
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            if isolate:  # the reaper only waits: it needs no privilege. It takes the worker's
                # uid: its parent-death SIGKILL to the worker is a signal from it, and a process
                # without CAP_KILL may signal only its own uid (as root it could not, and the
                # worker outlived a dead fork server).
                isolation.drop_privileges(limits["uid"], limits["gid"])
            while True:
                try:
                    os.waitpid(pid, 0)
                    break
                except InterruptedError:
                    continue
                except ChildProcessError:
                    break
            if not isolate:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
        except BaseException as exc:  # noqa: BLE001 - report and die
            try:
                msg = f"{type(exc).__name__}: {exc}".encode()[:1000]
                os.write(w, struct.pack(">i", -len(msg)) + msg)
            except OSError:
                pass
        os._exit(0)
    os.close(w)
    head = os.read(r, 4)
    n = struct.unpack(">i", head)[0] if len(head) == 4 else -1
    if n < 0:
        msg = os.read(r, -n).decode(errors="replace") if n < -1 else "sandbox worker failed to start"
        os.close(r)
        raise OSError(msg)
    os.close(r)
    return n, reaper


def _template(req: dict, ns: dict) -> socket.socket:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        mine.close()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        child_ns = dict(ns)
        try:
            exec(compile(req["setup"], "<setup>", "exec"), child_ns)
        except BaseException as exc:  # noqa: BLE001
            theirs.send(json.dumps({"error": f"setup failed: {type(exc).__name__}: {exc}"}).encode())
            os._exit(1)
        theirs.send(json.dumps({"ok": True}).encode())
        serve_control(theirs, child_ns)
        os._exit(0)
    theirs.close()
    return mine


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve_control(ctrl: socket.socket, ns: dict) -> None:
    while True:
        _reap()
        ready, _, _ = select.select([ctrl], [], [], 0.5)
        if not ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 1 << 20, 4)
        except OSError:
            return
        if not msg:
            return
        req = json.loads(msg)
        try:
            if req["op"] == "spawn":
                sock = socket.socket(fileno=fds[0])
                pid, reaper = _spawn(sock, req, ns)
                sock.close()
                ctrl.send(json.dumps({"pid": pid, "reaper": reaper}).encode())
            elif req["op"] == "template":
                tctrl = _template(req, ns)
                first = tctrl.recv(1 << 16)
                socket.send_fds(ctrl, [first], [tctrl.fileno()])
                tctrl.close()
            else:
                ctrl.send(json.dumps({"error": f"unknown op {req['op']!r}"}).encode())
        except Exception as exc:  # noqa: BLE001 - the server keeps serving
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            ctrl.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())


def main() -> None:
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    ctrl.send(json.dumps({"ok": True, "pid": os.getpid(), "seccomp": SECCOMP_BPF is not None}).encode())
    serve_control(ctrl, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
