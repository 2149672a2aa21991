"""Isolation primitives for a sandbox session: namespaces and mounts, a private ``/dev`` and a
read-only ``/proc``, privilege dropping to an unprivileged uid, seccomp, rlimits.

Used inside the fork server's children (``forkserver.py``); nothing here talks to the host.
Each function either succeeds or raises ``OSError``: a session that cannot be isolated as asked
is not started. What each step guards against is in the threat model (docs/sandboxes.md).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import sys

try:
    import pyseccomp
except Exception:  # noqa: BLE001 - optional: libseccomp may be missing; the host refuses then
    pyseccomp = None

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP = 0x00000080, 0x00020000, 0x02000000
CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER = 0x04000000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
NAMESPACE_FLAGS = (CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC,
                   CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 0x4
# The new mount API's numbers are the same on every architecture.
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NAME, PR_CAPBSET_READ, PR_CAPBSET_DROP = 1, 4, 15, 23, 24
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 22, 2, 28, 38
# NOROOT, NO_SETUID_FIXUP, NO_CAP_AMBIENT_RAISE, each with its lock bit, and KEEP_CAPS_LOCKED.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

# The sandbox sees the host's system directories (read-only) and nothing else: every other
# top-level directory gets an empty tmpfs and every other top-level file reads as empty. An
# allowlist, so a checkout under an unusual root (/check, /data, /scratch) is hidden too.
# /dev and /proc are replaced (a private device tree, a fresh read-only proc).
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/dev", "/proc", "/sys")
# Root-owned files under the system dirs that must read as empty even so.
HIDE_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")
CGROUP_FS = "/sys/fs/cgroup"
# The whole private /dev: character devices a Python notebook uses, bound from the host's.
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
# Kernel interfaces under the (already read-only) /proc that leak host state: read as empty.
PROC_MASKS = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/kallsyms",
              "/proc/sysrq-trigger", "/proc/latency_stats")

# Syscalls a session never needs that widen the kernel surface. EPERM under seccomp.
SECCOMP_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "userfaultfd",
    # File activity watches: the host's system dirs are shared with sessions by inode
    # (read-only), so a watch would report the host's own accesses to them as they happen.
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    # Linux AIO: its event slots are a machine-wide quota (fs.aio-max-nr) of the host's.
    "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "iopl", "ioperm", "lookup_dcookie", "uselib", "personality",
)
# fcntl commands denied: F_NOTIFY (dnotify: a signal on any access to a watched host
# directory, inotify's predecessor) and F_SETLEASE (a lease on a shared host inode would
# hold up host processes opening it; only its owner may take one, but no session needs it).
FCNTL_DENY = (1026, 1024)
SIGPENDING = 1024  # queued signals per session (the host's default is ~1/16 of its memory pages)
# Socket families a session may create: AF_UNIX, AF_INET, AF_INET6 (in an empty network
# namespace). Everything else (AF_VSOCK, AF_NETLINK, AF_PACKET, ...) fails with EAFNOSUPPORT.
ALLOWED_FAMILIES = (1, 2, 10)


def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    _check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr),
                        ctypes.sizeof(attr)), f"mount_setattr({path})")


def _clone_tree(path: str) -> int:
    """A detached copy of the mount at ``path`` (with its submounts), to attach elsewhere later
    even after ``path`` itself has been covered."""
    fd = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE)
    _check(fd, f"open_tree({path})")
    return fd


def _attach(fd: int, target: str) -> None:
    _check(libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount({target})")
    os.close(fd)


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
    """What stays visible (read-only) even where it lives under a hidden dir: the Python
    installation (its prefixes, which hold the stdlib and site-packages) and agentenv's own
    package directory. Not every ``sys.path`` entry: an editable install, pytest or the
    current directory put a checkout's root there, and the whole checkout (its tests, its
    data, a ``.env``) must not become readable to the code a session runs."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, package}
    real = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    # Drop paths inside another kept path.
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def enter_template_view() -> None:
    """Run once in an isolated template fork server (as root, after the environment's setup
    code): a new mount namespace with the session's filesystem view, read-only throughout: the
    host's system dirs, everything else hidden behind empty tmpfs or empty files, the Python
    installation kept, a private minimal /dev, an empty /sys/fs/cgroup. Each session forked from the template copies
    this view (``enter_session``) instead of building it again."""
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    hidden, hidden_files = _hidden_entries()
    if "/tmp" not in hidden:
        hidden.append("/tmp")
    under = lambda p, d: p == d or p.startswith(d.rstrip("/") + "/")  # noqa: E731
    keeps = {k: _clone_tree(k) for k in _keep_paths() if any(under(k, h) for h in hidden + ["/dev"])}
    devices = {d: _clone_tree(f"/dev/{d}") for d in DEVICES if os.path.exists(f"/dev/{d}")}
    # The host's /dev (kvm, loop-control, kmsg, fuse, userfaultfd, ...) is replaced outright.
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
    for name, fd in devices.items():
        open(f"/dev/{name}", "w").close()
        _attach(fd, f"/dev/{name}")
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    for h in hidden:  # /tmp too: each session mounts its own over it
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for f in HIDE_FILES + tuple(hidden_files):
        if os.path.isfile(f):
            _mount("/dev/null", f, None, MS_BIND)
    for k, fd in keeps.items():
        os.makedirs(k, exist_ok=True)
        _attach(fd, k)
    # The host's cgroup tree names every cgroup on the machine and lists the pids in each (host
    # processes', other sessions'), with their memory and CPU use: an empty directory instead.
    # Sessions join their own cgroups through a handle the template opened before this.
    if os.path.isdir(CGROUP_FS):
        _mount("tmpfs", CGROUP_FS, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)


def enter_session(tmp_mb: int, shm_mb: int) -> None:
    """In a session's pid 1, forked from an isolated template (``enter_template_view``) into
    its own pid namespace, still root: its own mount, network, IPC and UTS namespaces (a copy
    of the template's read-only view: mounts made here are seen by no other session), and the
    only writable places, a fresh private tmpfs at /tmp and at /dev/shm."""
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={shm_mb}m,mode=1777")


def enter_pid_namespace() -> None:
    """The calling process's next child is pid 1 of a new pid namespace."""
    _check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")


def leave_pid_namespace(own_ns_fd: int) -> None:
    """Undo ``enter_pid_namespace`` for later children (an fd of this process's own
    ``/proc/self/ns/pid``), so the next session gets a fresh pid namespace of its own."""
    _check(libc.setns(own_ns_fd, CLONE_NEWPID), "setns(CLONE_NEWPID)")


def mount_proc() -> None:
    """In the session's pid 1: a fresh, read-only /proc that shows only the session's processes;
    /proc/sys, sysrq-trigger and every other kernel knob under it are therefore read-only, and
    the files that leak host state read as empty."""
    _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in PROC_MASKS:
        if os.path.exists(path):
            _mount("/dev/null", path, None, MS_BIND)


def lock_capabilities() -> None:
    """Once, in an isolated template (which keeps its effective capabilities: it still mounts
    and forks into namespaces): an empty capability bounding set (no exec can ever grant a
    capability again) and locked securebits (no root privilege at exec, no capability
    fixups at uid changes). Every session forked from it inherits both, so a session
    (``drop_privileges``) does not pay the 40-odd system calls each time."""
    _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability
    if libc.prctl(PR_CAPBSET_READ, 0, 0, 0, 0) != 0:
        raise OSError("the capability bounding set could not be emptied")


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` (an unprivileged user: root-owned files and kernel knobs are not
    writable even where a mount is) with no capabilities now or after any exec (the bounding
    set and securebits come from the template, ``lock_capabilities``), no setuid gains, and
    the parent-death signal set again (a uid change clears it)."""
    if uid >= 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective/permitted/inheritable, two words each: all zero
    _check(libc.capset(header, data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if uid >= 0:  # the uid change made it non-dumpable: its own /proc/self would be root's
        _check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")


def compile_seccomp() -> bytes:
    """The session's seccomp filter as classic BPF (libseccomp compiles it; milliseconds, so
    the fork server does it once and each session only loads it). It denies the kernel
    surface a session never needs: the calls in SECCOMP_DENY, clone() with any namespace flag
    (no new user namespace, hence no regained capabilities), clone3 (whose flags a filter
    cannot read: ENOSYS, so libc falls back to clone), and sockets outside ALLOWED_FAMILIES."""
    if pyseccomp is None:
        raise OSError(errno.ENOSYS, "pyseccomp/libseccomp is not available")
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    eperm = pyseccomp.ERRNO(errno.EPERM)
    for name in SECCOMP_DENY:
        try:
            f.add_rule(eperm, name)
        except Exception:  # noqa: BLE001 - a syscall this kernel/arch does not have
            pass
    for flag in NAMESPACE_FLAGS:
        f.add_rule(eperm, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    f.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    for cmd in FCNTL_DENY:
        f.add_rule(eperm, "fcntl", pyseccomp.Arg(1, pyseccomp.EQ, cmd))
    nofamily = pyseccomp.ERRNO(errno.EAFNOSUPPORT)
    for call in ("socket", "socketpair"):
        for family in range(max(ALLOWED_FAMILIES)):
            if family not in ALLOWED_FAMILIES:
                f.add_rule(nofamily, call, pyseccomp.Arg(0, pyseccomp.EQ, family))
        f.add_rule(nofamily, call, pyseccomp.Arg(0, pyseccomp.GT, max(ALLOWED_FAMILIES)))
    fd = os.memfd_create("seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            f.export_bpf(out)
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def apply_seccomp(bpf: bytes) -> None:
    """Load a filter from ``compile_seccomp`` on this (single-threaded) process; needs
    no_new_privs (``drop_privileges`` sets it). Inherited by every process it starts."""
    if not bpf or len(bpf) % 8:
        raise OSError(errno.EINVAL, "empty or malformed seccomp program")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def apply_session_rlimits(limits: dict) -> None:
    """The per-user quotas that have an rlimit, for an isolated session (whose uid is its own,
    ``uids.py``, so a per-user count is a per-session count): processes and threads
    (``RLIMIT_NPROC``, beside the pids cgroup), POSIX message queue bytes (none: no session
    needs one), pending signals, locked memory (none)."""
    for res, value in (
        (resource.RLIMIT_NPROC, limits["pids"]),
        (resource.RLIMIT_MSGQUEUE, 0),
        (resource.RLIMIT_SIGPENDING, SIGPENDING),
        (resource.RLIMIT_MEMLOCK, 0),
    ):
        resource.setrlimit(res, (value, value))


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
