"""The fork server: a warm template process that forks isolated session workers.

Run as ``python -I forkserver.py FD`` with FD one end of a SOCK_SEQPACKET control socket.
It imports the usual libraries once (math, numpy, sympy where installed), so a new session
costs a fork, not an interpreter start. Each request on the control socket is one JSON
message, possibly carrying file descriptors (SCM_RIGHTS):

  {"op": "spawn", "limits": {...}, "isolate": bool}  + [session socket]
      -> {"pid": <worker host pid>, "reaper": <reaper pid>} (the worker leads its own process group)
  {"op": "template", "setup": "<code>"}
      -> {"ok": true} + [control socket of a new fork server whose namespace ran <code>]

A spawned session is two processes. The *reaper* (A) joins the session's cgroups, unshares
mount/net/ipc/uts/pid namespaces, makes the whole mount tree read-only (mount_setattr,
recursive), mounts a private size-capped tmpfs on /tmp, then forks the *worker* (B), which is
pid 1 of the new pid namespace: killing it kills everything the code started. The worker
mounts a fresh /proc, applies rlimits, drops every capability (bounding set, capset,
securebits so that exec cannot regain them, no_new_privs) and serves the session protocol
(``worker.serve``) on its socket. Without ``isolate`` only the rlimits, cgroups and the
private working directory apply (the caller must have opted in, loudly).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
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

import worker  # noqa: E402

for _mod in ("math", "json", "re", "itertools", "functools", "collections", "fractions", "decimal",
             "statistics", "random", "numpy", "sympy"):
    try:
        __import__(_mod)
    except Exception:  # noqa: BLE001 - optional warm imports
        pass

try:
    import pyseccomp
except Exception:  # noqa: BLE001 - optional: libseccomp may be missing
    pyseccomp = None

# Syscalls a session never needs that widen the kernel surface (user namespaces, tracing,
# module and keyring calls, io_uring, bpf, ...): they fail with EPERM under seccomp.
SECCOMP_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "kexec_load", "kexec_file_load", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl",
)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 8192, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_CAPSET, SYS_MOUNT_SETATTR = 126, 442  # x86_64
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
# NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE, each with its lock bit, and KEEP_CAPS_LOCKED.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


# The sandbox sees the host's system directories (read-only) and nothing else: every other
# top-level directory gets an empty tmpfs and every other top-level file reads as empty. An
# allowlist, so a checkout under an unusual root (/check, /data, /scratch) is hidden too.
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/dev", "/proc", "/sys")
# Files under the system dirs it must not read even as uid 0 without capabilities (root-owned,
# so owner permissions would allow it).
HIDE_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")


def _hidden_entries() -> tuple[list[str], list[str]]:
    """Top-level directories and files outside SYSTEM_DIRS (symlinks resolve into kept ones)."""
    dirs, files = [], []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if path in SYSTEM_DIRS or os.path.islink(path):
            continue
        if os.path.isdir(path):
            dirs.append(path)
        elif os.path.isfile(path):
            files.append(path)
    return dirs, files


def _keep_paths() -> list[str]:
    """The Python installation: visible (read-only) even where it lives under a hidden dir."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    real = sorted({os.path.realpath(p) for p in paths})
    # Drop paths inside another kept path.
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr),
                        ctypes.sizeof(attr)), f"mount_setattr({path})")


def enter_namespaces(tmp_mb: int) -> None:
    """In the reaper: new namespaces; a read-only view of the host with private dirs hidden;
    the Python installation kept; a private writable tmpfs at /tmp."""
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hidden, hidden_files = _hidden_entries()
    if "/tmp" not in hidden:
        hidden.append("/tmp")
    under = lambda p, d: p == d or p.startswith(d.rstrip("/") + "/")  # noqa: E731
    keeps = [k for k in _keep_paths() if any(under(k, h) for h in hidden)]
    stage = "/dev/shm"
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=700")
    for i, k in enumerate(keeps):
        os.mkdir(f"{stage}/k{i}")
        _mount(k, f"{stage}/k{i}", None, MS_BIND | MS_REC)
    for h in hidden:
        size = f"{tmp_mb}m" if h == "/tmp" else "1m"
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={'1777' if h == '/tmp' else '755'}")
    for f in HIDE_FILES + tuple(hidden_files):
        if os.path.isfile(f):
            _mount("/dev/null", f, None, MS_BIND)
    for i, k in enumerate(keeps):
        os.makedirs(k, exist_ok=True)
        _mount(f"{stage}/k{i}", k, None, MS_MOVE)
    _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
    _setattr("/tmp", 0, 0, MOUNT_ATTR_RDONLY)  # only /tmp itself is writable


def drop_privileges() -> None:
    """No capabilities now or after any exec; no setuid gains."""
    _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective/permitted/inheritable, two words each: all zero
    _check(libc.syscall(SYS_CAPSET, header, data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def apply_seccomp() -> None:
    import errno

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in SECCOMP_DENY:
        try:
            f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
        except Exception:  # noqa: BLE001 - a syscall this kernel/arch does not have
            pass
    f.load()


def apply_rlimits(limits: dict) -> None:
    mb = 1024 * 1024
    for res, value in (
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_FSIZE, limits["fsize_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))


def _worker(sock: socket.socket, limits: dict, isolate: bool, workdir: str, ns: dict) -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setsid()  # its own process group: kill(0, ...) from user code reaches nothing outside
    if isolate:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
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
    apply_rlimits(limits)
    if isolate:
        drop_privileges()
        if limits.get("seccomp") and pyseccomp is not None:
            apply_seccomp()
    worker.serve(sock.makefile("rb", buffering=0), sock.makefile("wb", buffering=0), ns)
    os._exit(0)


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
                enter_namespaces(limits["tmp_mb"])
                workdir = "/tmp"
            else:
                workdir = tempfile.mkdtemp(prefix="agentenv-sbx-")
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _worker(sock, limits, isolate, workdir, ns)
            os.write(w, struct.pack(">i", pid))
            os.close(w)
            sock.close()
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            os.waitpid(pid, 0)
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
    ctrl.send(json.dumps({"ok": True, "pid": os.getpid(), "seccomp": pyseccomp is not None}).encode())
    serve_control(ctrl, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
