"""A started session as the host holds it: its channel, a pidfd of each of its processes, its
cgroups and its uid. Everything the host does to the session's processes goes through here,
and never through a bare pid: a pid is freed when the process is reaped (by its fork server,
not the host) and the kernel may give it to any new process on the machine, while a pidfd
names one process for good (signalling it after it is gone fails with ESRCH)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from anyio.abc import SocketStream

from .cgroups import _Cgroups
from .uids import _Uids


def pidfd_signal(pidfd: int, sig: int) -> bool:
    """Signal the process ``pidfd`` holds; False if it has already exited."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


@dataclass(slots=True, eq=False)
class _Worker:
    stream: SocketStream
    pid: int  # for display and tests only: never signalled
    pidfd: int
    reaper_fd: int | None  # an unisolated session's reaper
    cgroups: list[str]
    uid: int | None  # an isolated session's own uid (``uids.py``)
    freezes: bool  # frozen between calls (isolated, no background processes allowed)
    frozen: bool = False

    def signal(self, sig: int) -> None:
        pidfd_signal(self.pidfd, sig)

    def end(self, cgroups: _Cgroups, uids: _Uids) -> None:
        """Kill every process of the session and hand its cgroups and uid back for reuse
        (each is reused only once nothing of this session is left in it)."""
        pidfd_signal(self.pidfd, signal.SIGKILL)  # isolated: pid 1, its namespace dies with it
        if self.reaper_fd is not None:  # unisolated: no pid namespace to take the rest along
            pidfd_signal(self.reaper_fd, signal.SIGKILL)
            os.close(self.reaper_fd)
            self.reaper_fd = None
        cgroups.end(self.cgroups)  # whatever is left in its cgroups, by the kernel's own list
        if self.uid is not None:
            uids.release(self.uid, self.pidfd)
        else:
            os.close(self.pidfd)
        self.pidfd = -1

    def cpu(self, cgroups: _Cgroups) -> tuple[float, float] | None:
        """The session's CPU seconds and seconds spent waiting for a CPU (None: unknown)."""
        return cgroups.cpu(self.cgroups) if self.cgroups else None

    def freeze(self, cgroups: _Cgroups) -> bool:
        """Between calls: nothing of the session runs (threads, timers, signal handlers,
        processes started after the call's sweep); False if it could not be frozen."""
        if not self.freezes or self.frozen:
            return True
        self.frozen = cgroups.freeze(self.cgroups)
        return self.frozen

    def thaw(self, cgroups: _Cgroups) -> bool:
        if not self.frozen:
            return True
        self.frozen = not cgroups.thaw(self.cgroups)
        return not self.frozen
