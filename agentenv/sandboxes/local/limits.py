"""What one local sandbox session may use: its resource limits, and how it is confined."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-session limits of a :class:`~agentenv.sandboxes.local.LocalSandbox`. The rlimits
    hold per process, the cgroup limits for the session as a whole (root included)."""

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
