"""What one local sandbox session may use: its resource limits, and how it is confined."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentenv.errors import ConfigError

#: The whole-number limits, each with its unit (the kernel takes each as an integer).
_WHOLE = {"memory_mb": "MiB", "cpu_s": "CPU seconds", "fsize_mb": "MiB", "nofile": "open files",
          "pids": "processes and threads", "tmp_mb": "MiB", "shm_mb": "MiB"}


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-session limits of a :class:`~agentenv.sandboxes.local.LocalSandbox`. The rlimits
    hold per process, the cgroup limits for the session as a whole (root included).

    Checked when made (``ConfigError`` naming the field): a value a session could not apply
    would make its confinement fail, which the pool must never take for a host without
    isolation."""

    memory_mb: int = 1024  # address space per process, and the session's cgroup memory
    cpu_s: int = 120  # CPU seconds per worker process (a session's lifetime budget)
    cpus: float = 0.0  # a hard CPU cap per session (cgroup cfs quota, in CPUs); 0: none, only an equal share
    fsize_mb: int = 64  # largest file it may write
    nofile: int = 256  # open files
    pids: int = 64  # processes and threads in the session (cgroup pids.max)
    tmp_mb: int = 128  # its private /tmp (a tmpfs: 0 would mean no size limit, so it is refused)
    shm_mb: int = 16  # its private /dev/shm
    seccomp: bool = True  # deny syscalls a session never needs (needs libseccomp)
    # Each live session runs as its own unprivileged uid (and gid) from ``uids`` uids starting at
    # ``uid`` (``uids.py``): per-user kernel quotas are then per session. The default range lies
    # between systemd's container and foreign uid ranges; no host user or container should use it.
    uid: int = 0x70000000
    uids: int = 65536
    background: bool = False  # let processes started by a call outlive it

    def __post_init__(self) -> None:
        for name, unit in _WHOLE.items():
            value = getattr(self, name)
            if not _whole(value) or value <= 0:
                raise ConfigError(f"Limits.{name} must be a positive whole number ({unit}), not {value!r}")
        cpus = self.cpus
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not (0 <= cpus < math.inf):
            raise ConfigError(f"Limits.cpus must be a number of CPUs >= 0 (0: no cap), not {cpus!r}")
        if not (_whole(self.uid) and _whole(self.uids) and self.uid > 0 and self.uids > 0
                and self.uid + self.uids <= 2**32 - 1):
            raise ConfigError(f"Limits.uid, Limits.uids: {self.uids!r} uids from {self.uid!r} is not a range of "
                              "unprivileged uids (uid > 0, uids > 0, uid + uids <= 2**32 - 1)")
        for name in ("seccomp", "background"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Limits.{name} must be True or False, not {getattr(self, name)!r}")
