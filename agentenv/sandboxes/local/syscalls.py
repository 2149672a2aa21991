"""The session's system-call policy: an allow-list, and a filter for dangerous arguments.

Two seccomp filters, both loaded in every isolated session (``isolation.apply_seccomp``):

* the *allow-list* (``ALLOWED``: each call with the reason a session needs it) fails the
  calls in ``DENIED`` with EPERM (named so that their error is the clear one; the tests check
  none of them is allowed) and every other call with ENOSYS, so a syscall the kernel adds
  later, or a newer variant of a denied one (``quotactl_fd``, ``open_tree_attr``, ``*_fd``,
  ``*_attr``, ``*2``, ``*at2``), is denied without anyone naming it, and libc falls back where
  it can (``clone3`` to ``clone``);
* the *argument filter* (``arg_rules``) fails the dangerous arguments of allowed calls:
  namespace flags of ``clone``, socket families, peer credentials and pidfds of a socket's
  peer, advice that drops shared page cache, reads that do not wait, file watches and leases.

Two programs because libseccomp cannot hold both in one: a call's unconditional rule
overrides its conditional ones. Neither program runs for an allowed call without an argument
rule: the kernel answers those from its per-filter cache. Loading costs a session about
0.4 us per instruction, so the allow-list is a plain chain (it only runs for calls it denies)
and the argument filter a tree (fcntl and madvise run it).
"""

from __future__ import annotations

import errno
import os

try:
    import pyseccomp
except Exception:  # noqa: BLE001 - optional: libseccomp may be missing; the host refuses then
    pyseccomp = None

_GROUPS: dict[str, str] = {
    "descriptors: open, read, write, seek, copy and close files (host files are read-only)":
        "read write open openat openat2 creat close close_range lseek pread64 pwrite64 readv writev preadv "
        "pwritev preadv2 pwritev2 sendfile copy_file_range splice tee vmsplice dup dup2 dup3 fcntl ioctl "
        "readahead fadvise64 fallocate ftruncate truncate fsync fdatasync sync_file_range",
    "file metadata and directories (only the session's tmpfs is writable)":
        "stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2 getdents getdents64 getcwd "
        "chdir fchdir rename renameat renameat2 mkdir mkdirat rmdir link linkat unlink unlinkat symlink symlinkat "
        "readlink readlinkat chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat umask utime utimes "
        "utimensat futimesat mknod mknodat",
    "extended attributes (shutil.copy2 copies them; writable only on the session's tmpfs)":
        "getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr setxattr lsetxattr fsetxattr removexattr "
        "lremovexattr fremovexattr",
    "its own memory (RLIMIT_MEMLOCK is 0; advice that drops shared pages is denied by argument)":
        "mmap mprotect munmap brk mremap msync madvise mlock mlock2 munlock mlockall munlockall memfd_create "
        "membarrier pkey_mprotect pkey_alloc pkey_free mbind get_mempolicy set_mempolicy map_shadow_stack",
    "threads and their synchronisation":
        "futex futex_waitv futex_wake futex_wait futex_requeue set_robust_list get_robust_list set_tid_address "
        "rseq arch_prctl restart_syscall",
    "processes inside its own pid namespace (clone's namespace flags denied by argument)":
        "clone fork vfork execve execveat exit exit_group wait4 waitid kill tkill tgkill getpid getppid gettid "
        "getpgid setpgid getpgrp setsid getsid pidfd_open pidfd_send_signal prctl",
    "restricting itself further (a filter or ruleset can only take away)":
        "seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self",
    "signals": "rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigqueueinfo "
               "rt_sigsuspend rt_tgsigqueueinfo sigaltstack pause signalfd signalfd4",
    "clocks, sleeps and timers (setting a clock is denied)":
        "nanosleep clock_nanosleep gettimeofday time clock_gettime clock_getres getitimer setitimer alarm "
        "timer_create timer_settime timer_gettime timer_getoverrun timer_delete timerfd_create timerfd_settime "
        "timerfd_gettime",
    "waiting on descriptors, pipes and event counters":
        "poll ppoll select pselect6 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2 "
        "eventfd eventfd2 pipe pipe2",
    "sockets in an empty network namespace (families and peer credentials denied by argument)":
        "socket socketpair connect accept accept4 bind listen getsockname getpeername sendto recvfrom sendmsg "
        "recvmsg sendmmsg recvmmsg shutdown setsockopt getsockopt",
    "SysV and POSIX IPC in its own IPC namespace (RLIMIT_MSGQUEUE 0: no POSIX queue bytes)":
        "shmget shmat shmctl shmdt semget semop semtimedop semctl msgget msgsnd msgrcv msgctl mq_open mq_unlink "
        "mq_timedsend mq_timedreceive mq_notify mq_getsetattr",
    "its own ids, limits and scheduling (no capabilities: it can only read or lower them)":
        "getuid geteuid getgid getegid getresuid getresgid getgroups setuid setgid setreuid setregid setresuid "
        "setresgid setgroups setfsuid setfsgid capget capset getrlimit setrlimit prlimit64 getrusage times "
        "getpriority setpriority sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_setparam "
        "sched_getscheduler sched_setscheduler sched_get_priority_max sched_get_priority_min "
        "sched_rr_get_interval sched_getattr sched_setattr getcpu ioprio_get ioprio_set",
    "what a notebook reads about the system and randomness": "uname sysinfo getrandom",
}
#: Every call a session may make, with the reason it needs it.
ALLOWED: dict[str, str] = {name: reason for reason, names in _GROUPS.items() for name in names.split()}

#: Calls failed with EPERM by name. Everything not in ``ALLOWED`` fails anyway (ENOSYS); these
#: are the ones a hostile session reaches for, given the clearer error.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "userfaultfd",
    # File activity watches: the system dirs are the host's inodes; a watch would report the
    # host's own accesses to them as they happen.
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    # Linux AIO: its event slots are a machine-wide quota (fs.aio-max-nr) of the host's.
    "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "iopl", "ioperm", "lookup_dcookie", "uselib", "personality",
    # Locks and page cache on shared host inodes: a flock on a readable host file (/etc/passwd,
    # /usr/bin/env) would hold up the host and sibling sessions; mincore, cachestat and
    # process_madvise would show or drop pages others read.
    "flock", "mincore", "cachestat", "process_madvise", "process_mrelease", "remap_file_pages",
    "migrate_pages", "move_pages", "memfd_secret",
)

# Socket families a session may create: AF_UNIX, AF_INET, AF_INET6 (in an empty network
# namespace). Everything else (AF_VSOCK, AF_NETLINK, AF_PACKET, ...) fails with EAFNOSUPPORT.
ALLOWED_FAMILIES = (1, 2, 10)
# fcntl commands denied: F_NOTIFY (dnotify: a signal on any access to a watched host
# directory, inotify's predecessor) and F_SETLEASE (a lease on a shared host inode would
# hold up host processes opening it).
FCNTL_DENY = (1026, 1024)
SOL_SOCKET = 1
# The peer's credentials, security label, groups and a pidfd of it: the session socket's peer
# is the host's pool process (uid 0), so none of it may be read, now or with each message.
PEER_GETSOCKOPT = {17: "SO_PEERCRED", 31: "SO_PEERSEC", 59: "SO_PEERGROUPS", 77: "SO_PEERPIDFD"}
PEER_SETSOCKOPT = {16: "SO_PASSCRED", 34: "SO_PASSSEC", 76: "SO_PASSPIDFD"}
# madvise advice a session may give its own memory. The rest is denied: MADV_REMOVE (9),
# MADV_MERGEABLE (12: KSM would merge pages across sessions, a timing channel), MADV_COLD
# (20) and MADV_PAGEOUT (21: they drop file pages others read), MADV_COLLAPSE (25: rebuilds
# a shared file's page cache), the poisoning ones (100, 101), and any advice added later.
# MADV_DONTNEED (4) only unmaps: a file's pages stay in the page cache.
MADV_ALLOWED = (0, 1, 2, 3, 4, 8, 10, 11, 13, 14, 15, 16, 17, 18, 19, 22, 23, 24, 102, 103)
MADV_TOP = 104  # every advice above the last allowed one is denied (high bits included)
# posix_fadvise: NORMAL, RANDOM, SEQUENTIAL, WILLNEED; DONTNEED (4) and NOREUSE (5) would
# drop pages of a shared host file from the page cache.
FADVISE_MAX = 3
RWF_NOWAIT = 0x8  # preadv2/pwritev2: a read that fails unless cached shows what others read
# The kernel reads an ``int`` argument from the low 32 bits of its register, while a filter
# sees all 64: an equality on an int argument compares the low half only, or a caller setting
# a high bit (fcntl(fd, 1 << 32 | F_NOTIFY)) would pass the filter and still reach the call.
# Ranges (GT, GE) need no mask: any high bit makes the value large, which they deny.
LOW32 = 0xFFFFFFFF
NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000)


def _blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) as aligned power-of-two blocks, each (mask, value): x is in the block when
    x & mask == value (one seccomp comparison each; a rule compares each argument once)."""
    out = []
    while lo < hi:
        size = lo & -lo if lo else 1 << 64
        while size > hi - lo:
            size >>= 1
        out.append(((~(size - 1)) & ((1 << 64) - 1), lo))
        lo += size
    return out


def _denied_ranges(allowed: tuple[int, ...], top: int) -> list[tuple[int, int]]:
    """The complement of ``allowed`` in [0, top), as [lo, hi) ranges."""
    out, lo = [], 0
    for v in sorted(allowed) + [top]:
        if v > lo:
            out.append((lo, v))
        lo = v + 1
    return out


def arg_rules() -> list[tuple[int, str, list]]:
    """The argument filter's rules: (errno, call, [(arg, op, datum[, value])...]), as
    libseccomp reads them (MASKED_EQ: arg & datum == value)."""
    rules: list[tuple[int, str, list]] = []
    for flag in NAMESPACE_FLAGS:
        rules.append((errno.EPERM, "clone", [(0, "MASKED_EQ", flag, flag)]))
    for cmd in FCNTL_DENY:
        rules.append((errno.EPERM, "fcntl", [(1, "MASKED_EQ", LOW32, cmd)]))
    for call in ("socket", "socketpair"):
        for family in range(max(ALLOWED_FAMILIES)):
            if family not in ALLOWED_FAMILIES:
                rules.append((errno.EAFNOSUPPORT, call, [(0, "EQ", family)]))
        rules.append((errno.EAFNOSUPPORT, call, [(0, "GT", max(ALLOWED_FAMILIES))]))
    for call, names in (("getsockopt", PEER_GETSOCKOPT), ("setsockopt", PEER_SETSOCKOPT)):
        for opt in names:
            rules.append((errno.EPERM, call, [(1, "MASKED_EQ", LOW32, SOL_SOCKET), (2, "MASKED_EQ", LOW32, opt)]))
    for lo, hi in _denied_ranges(MADV_ALLOWED, MADV_TOP):
        for mask, value in _blocks(lo, hi):
            rules.append((errno.EPERM, "madvise", [(2, "MASKED_EQ", mask, value)]))
    rules.append((errno.EPERM, "madvise", [(2, "GE", MADV_TOP)]))
    rules.append((errno.EPERM, "fadvise64", [(3, "GT", FADVISE_MAX)]))
    for call in ("preadv2", "pwritev2"):
        rules.append((errno.EPERM, call, [(5, "MASKED_EQ", RWF_NOWAIT, RWF_NOWAIT)]))
    return rules


def _export(f) -> bytes:
    fd = os.memfd_create("seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            f.export_bpf(out)
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


def _known(name: str) -> bool:
    try:
        pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
    except Exception:  # noqa: BLE001 - not a call of this architecture (or this libseccomp)
        return False
    return True


def compile_filters() -> tuple[bytes, bytes]:
    """The allow-list and the argument filter as classic BPF programs, in the order to load
    them (libseccomp compiles them: milliseconds, so the fork server does it once)."""
    if pyseccomp is None:
        raise OSError(errno.ENOSYS, "pyseccomp/libseccomp is not available")
    allow = pyseccomp.SyscallFilter(pyseccomp.ERRNO(errno.ENOSYS))
    allow.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)
    for name in ALLOWED:
        if _known(name):
            allow.add_rule(pyseccomp.ALLOW, name)
    for name in DENIED:
        if _known(name):
            allow.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    args = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    args.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)  # a binary tree of calls, not a chain
    for err, call, conditions in arg_rules():
        args.add_rule(pyseccomp.ERRNO(err), call,
                      *(pyseccomp.Arg(c[0], getattr(pyseccomp, c[1]), *c[2:]) for c in conditions))
    return _export(allow), _export(args)
