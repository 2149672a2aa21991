"""A distinct uid (and gid) for every live session, machine-wide.

The kernel keeps several quotas per user, not per process: inotify instances and watches,
file descriptors in flight on unix sockets, POSIX message queue bytes (``RLIMIT_MSGQUEUE``),
pipe buffer pages, pending signals, processes (``RLIMIT_NPROC``). Sessions that shared one
uid shared them all, so one session could exhaust them for every other session on the machine.
Here each live session runs as its own uid from a range no host user uses (as nsjail and
Android's app uids do), so those quotas are its own, and the per-process rlimits that exist
for them (``isolation.apply_session_rlimits``) bound it further.

A uid is owned machine-wide by the pool that holds a byte-range lock on it: byte ``uid``
of one lock file, locked with ``lockf`` by the pool's process and released by the
kernel when that process dies, so a crashed pool leaks nothing. Two pools in one process are
kept apart by a process-wide registry (POSIX locks belong to the process, not to a pool).

A uid is handed out again only once its last session's worker has been *reaped*: that
worker is pid 1 of the session's pid namespace, and the kernel reaps the namespace's other
processes before it lets pid 1 exit, so nothing of the old session still runs as (or is
counted against) the uid. The host checks this through the worker's pidfd (a reaped process
makes ``pidfd_send_signal`` fail with ESRCH; a zombie does not), never by its pid.
"""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import threading
from collections import deque

import anyio

from agentenv.errors import SandboxError

LOCK_DIRS = ("/run", tempfile.gettempdir())
LOCK_NAME = "agentenv-sandbox-uids.lock"

_registry_lock = threading.Lock()
_held: set[int] = set()  # uids some pool of this process owns
_lock_fd: int | None = None  # this process's handle on the lock file (never closed: see lockf)


def _lock_file() -> int:
    """This process's descriptor of the machine-wide lock file. Opened once and kept: closing
    any descriptor of a file drops every POSIX lock the process holds on it."""
    global _lock_fd
    if _lock_fd is None:
        for d in LOCK_DIRS:
            try:
                _lock_fd = os.open(os.path.join(d, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                break
            except OSError:
                continue
        else:
            raise SandboxError(f"cannot open a uid lock file in any of {LOCK_DIRS}")
    return _lock_fd


def _reaped(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM cannot happen as root; anything else: assume it is not gone
        return False
    return False


class _Uids:
    """The uids of one pool: ``acquire`` one per session start, ``release`` it with the
    session worker's pidfd at its end. Released uids are reused oldest first, once reaped;
    until then a new uid is locked from the range."""

    def __init__(self, first: int, count: int) -> None:
        if first <= 0 or count <= 0 or first + count > 2**32 - 1:
            raise SandboxError(f"bad sandbox uid range: {count} uids from {first}")
        self.first, self.count = first, count
        self.mine: set[int] = set()  # locked by this pool
        self.free: deque[tuple[int, int | None]] = deque()  # released: (uid, pidfd of its last worker)
        self._next = 0  # where the search for an unlocked uid resumes

    def acquire(self) -> int:
        """A uid no live session on this machine runs as."""
        while self.free:
            uid, pidfd = self.free[0]
            if pidfd is not None and not _reaped(pidfd):
                break  # still exiting; those behind it were released later
            self.free.popleft()
            if pidfd is not None:
                os.close(pidfd)
            return uid
        return self._lock_new()

    async def acquire_soon(self, within: float = 5.0) -> int:
        """``acquire``, or, when the range is used up while a released uid's worker is still
        exiting (milliseconds), that uid once it is reaped."""
        try:
            return self.acquire()  # the common case: no timer set up for it
        except SandboxError:
            if not self.free:
                raise
        with anyio.move_on_after(within):
            while True:
                await anyio.sleep(0.005)
                try:
                    return self.acquire()
                except SandboxError:
                    if not self.free:
                        raise
        return self.acquire()

    def _lock_new(self) -> int:
        fd = _lock_file()
        with _registry_lock:
            for i in range(self.count):
                off = (self._next + i) % self.count
                uid = self.first + off
                if uid in _held:
                    continue
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid, os.SEEK_SET)
                except OSError:
                    continue  # another process's pool owns it
                _held.add(uid)
                self.mine.add(uid)
                self._next = off + 1
                return uid
        raise SandboxError(f"every sandbox uid ({self.count} from {self.first}) is in use on this machine")

    def release(self, uid: int, pidfd: int | None, *, reusable: bool = True) -> None:
        """The session that ran as ``uid`` is over: reusable once the worker ``pidfd`` holds
        is reaped (this takes ``pidfd`` over). ``reusable=False``: a worker that may have run
        is not known (a start that failed half-way): the uid stays locked until the pool
        closes, never reused by this pool."""
        if reusable:
            self.free.append((uid, pidfd))
        elif pidfd is not None:
            os.close(pidfd)

    def close(self) -> None:
        """The pool is closed: give back every released uid whose last worker is reaped. One
        still exiting, lost or still handed out stays locked for this process's lifetime
        rather than be shared."""
        give = []
        for uid, pidfd in self.free:
            if pidfd is None or _reaped(pidfd):
                give.append(uid)
            if pidfd is not None:
                os.close(pidfd)
        self.free.clear()
        fd = _lock_file()
        with _registry_lock:
            for uid in give:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_UN, 1, uid, os.SEEK_SET)
                except OSError:
                    continue
                _held.discard(uid)
                self.mine.discard(uid)
