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
import platform
import resource
import signal
import stat
import sys

try:
    from . import syscalls
except ImportError:  # in the fork server, which imports this module from its own directory
    import syscalls

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

# The sandbox's root is a fresh tmpfs holding the host's system directories (read-only) and
# nothing else: no other top-level entry exists there, so no hidden directory's name, mount or
# host path shows in its mountinfo. An allowlist, so a checkout under an unusual root (/check,
# /data, /scratch) is absent too. /dev, /proc, /sys and /tmp are its own (below).
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")
# Root-owned files under the system dirs that must read as empty even so.
HIDE_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")
# /sys is an empty tmpfs but for the CPU and memory-node topology (os.cpu_count, BLAS): no
# network interfaces, MACs or byte counters, no block or other devices. /sys/fs/cgroup is an
# empty directory: sessions join their cgroups through a handle the template opened before.
SYS_KEEP = ("/sys/devices/system/cpu", "/sys/devices/system/node")
SYS_DIRS = ("/sys/fs/cgroup",)
# The whole private /dev: character devices a Python notebook uses, made by the template
# (mknod) with the host's numbers: their inodes are not the host's, so a lock on /dev/null
# held by a session can never hold up the host.
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
STAGE = "/tmp"  # where the template builds the new root (covered in its own mount namespace)
MNT_DETACH = 2
# pivot_root's number per architecture (it has no libc wrapper).
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# Kernel interfaces under the (already read-only) /proc that leak host state: read as empty.
PROC_MASKS = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/kallsyms",
              "/proc/sysrq-trigger", "/proc/latency_stats")
# Those this kernel has, looked up once (the fork server imports this module before any
# session): a session's /proc is of the same kernel.
PROC_MASKS_PRESENT = tuple(p for p in PROC_MASKS if os.path.exists(p))

SIGPENDING = 1024  # queued signals per session (the host's default is ~1/16 of its memory pages)


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


# The kept paths under /tmp, fixed when the template builds its view (``enter_template_view``,
# from the host's tree, as ``_sources`` attaches them): each session forked from it puts them
# back inside its private /tmp without resolving them again.
_KEPT_UNDER_TMP: tuple[str, ...] | None = None


def _kept_under_tmp() -> tuple[str, ...]:
    """The kept paths (``_keep_paths``) that a session's private /tmp would cover."""
    if _KEPT_UNDER_TMP is not None:
        return _KEPT_UNDER_TMP
    return tuple(p for p in _keep_paths() if p.startswith("/tmp/"))


def _sources(keep: list[str]) -> dict[str, int | str]:
    """What the new root holds, taken from the host's tree before anything covers it: a
    detached copy of each mount to attach (an fd), or a system dir's symlink target.
    ``keep``: the kept paths (``_keep_paths``)."""
    out: dict[str, int | str] = {}
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            out[d] = os.readlink(d)
        elif os.path.isdir(d):
            out[d] = _clone_tree(d)
    kept = [d for d, src in out.items() if isinstance(src, int)]
    under = lambda p, d: p == d or p.startswith(d.rstrip("/") + "/")  # noqa: E731
    for k in keep:
        if not any(under(k, d) for d in kept):
            out[k] = _clone_tree(k)
    for d in SYS_KEEP:
        if os.path.isdir(d):
            out[d] = _clone_tree(d)
    return out


def _private_dev(dev: str) -> None:
    """``dev``: a tmpfs of device nodes made here with the host's device numbers, the
    ``/proc/self/fd`` links and a mount point for the session's ``/dev/shm``. Not ``nodev``
    (its nodes must open); no other node can appear: the view is read-only and no session
    has CAP_MKNOD."""
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        host = f"/dev/{name}"
        if os.path.exists(host) and stat.S_ISCHR(os.stat(host).st_mode):
            os.mknod(f"{dev}/{name}", stat.S_IFCHR | 0o666, os.stat(host).st_rdev)
            os.chmod(f"{dev}/{name}", 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")


def _unescape(field: str) -> str:
    """A mountinfo path field (spaces, tabs, newlines and backslashes octal-escaped)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _drop_file_binds(root: str) -> None:
    """Detach the single files bound into the new root's system dirs from elsewhere (a
    container's /etc/hosts, /etc/resolv.conf, /etc/hostname): mountinfo would name their host
    source paths. The file underneath shows instead."""
    with open("/proc/self/mountinfo") as f:
        lines = [line.split() for line in f]
    for fields in reversed(lines):  # submounts of submounts first
        source_root, point = _unescape(fields[3]), _unescape(fields[4])
        inside = point[len(root):] if point.startswith(root + "/") else None
        if inside is None or not any(inside.startswith(d + "/") for d in SYSTEM_DIRS):
            continue
        if source_root not in ("/", inside) and os.path.isfile(point):
            libc.umount2(point.encode(), MNT_DETACH)  # best effort: what stays is still read-only


def _pivot(root: str) -> None:
    """Make ``root`` this mount namespace's root and detach the old one entirely."""
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root's number on {platform.machine()} is unknown")
    os.chdir(root)
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount2(old root)")
    os.chdir("/")


def enter_template_view() -> None:
    """Run once in an isolated template fork server (as root, after the environment's setup
    code): a new mount namespace whose root is a fresh tmpfs holding the session's view,
    read-only throughout: the host's system dirs, the Python installation, a private minimal
    /dev, a /sys with only the CPU topology, an empty /sys/fs/cgroup; nothing else of the
    host's exists there, and the host's own root is detached. Each session forked from the
    template copies this view (``enter_session``) instead of building it again."""
    global _KEPT_UNDER_TMP
    _check(libc.unshare(CLONE_NEWNS), "unshare")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    keep = _keep_paths()
    _KEPT_UNDER_TMP = tuple(p for p in keep if p.startswith("/tmp/"))
    sources = _sources(keep)
    root = STAGE
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    for d in ("/dev", "/sys", "/proc", "/tmp"):
        os.mkdir(root + d, 0o755)
    _private_dev(root + "/dev")
    # The template's own /proc (it reads its memory map later); each session mounts a fresh
    # one over it. Detaching this one in each session instead would cost the session an RCU
    # grace period (milliseconds on a busy machine).
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", root + "/sys", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=755")
    for d in SYS_DIRS:
        os.makedirs(root + d, 0o555)
    for path in sorted(sources):  # parents before what lies under them
        src = sources[path]
        if isinstance(src, str):
            os.symlink(src, root + path)
            continue
        os.makedirs(root + path, 0o755, exist_ok=True)
        _attach(src, root + path)
    _drop_file_binds(root)
    for f in HIDE_FILES:
        if os.path.isfile(root + f):
            _mount(root + "/dev/null", root + f, None, MS_BIND)
    _pivot(root)
    _setattr("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)


def enter_session(tmp_mb: int, shm_mb: int) -> None:
    """In a session's pid 1, forked from an isolated template (``enter_template_view``) into
    its own pid namespace, still root, after joining its cgroups: its own mount, network, IPC,
    UTS and cgroup namespaces (a copy of the template's read-only view: mounts made here are
    seen by no other session; its cgroups read as the root, with no host pid or session
    number in their names), and the only writable places, a fresh private tmpfs at /tmp and
    at /dev/shm."""
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP), "unshare")
    # The Python installation may live under /tmp (a virtualenv in a temporary checkout): its
    # read-only view is taken before the private /tmp covers it and put back inside, read-only.
    kept = [(path, _clone_tree(path)) for path in _kept_under_tmp()]
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_mb}m,mode=1777")
    for path, fd in kept:
        os.makedirs(path, 0o755, exist_ok=True)
        _attach(fd, path)
        _setattr(path, AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
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
    the files that leak host state read as empty. It covers the template's own /proc, which
    nothing in the session can reach."""
    _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in PROC_MASKS_PRESENT:
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


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompFilters:
    """Compiled filters with the structures the kernel reads built once, in the fork server:
    a session only hands each to ``prctl`` (no allocation, no copy, fewer pages touched)."""

    def __init__(self, programs: tuple[bytes, ...]) -> None:
        self.programs = programs
        self._buffers, self.fprogs = [], []
        for bpf in programs:
            if not bpf or len(bpf) % 8:
                raise OSError(errno.EINVAL, "empty or malformed seccomp program")
            buf = ctypes.create_string_buffer(bpf, len(bpf))
            self._buffers.append(buf)
            self.fprogs.append(ctypes.byref(_SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))))


def compile_seccomp() -> SeccompFilters:
    """The session's seccomp filters (``syscalls.compile_filters``: the allow-list, then the
    argument filter); the fork server compiles them once and each session only loads them."""
    return SeccompFilters(syscalls.compile_filters())


def apply_seccomp(filters: SeccompFilters) -> None:
    """Load the filters from ``compile_seccomp``, in order, on this (single-threaded)
    process; needs no_new_privs (``drop_privileges`` sets it). Inherited by every process it
    starts."""
    for fprog in filters.fprogs:
        _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0), "seccomp")


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
