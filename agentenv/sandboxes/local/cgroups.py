"""Per-session cgroup v1 directories for the local sandbox (made, reused and removed by the
host; each session joins its own from inside, see ``forkserver._join_cgroups``)."""

from __future__ import annotations

import os
import secrets
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import psutil

from agentenv.errors import SandboxError

if TYPE_CHECKING:
    from .limits import Limits


def _alive(pid: int) -> bool:
    """Running (a zombie, killed but not yet reaped, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class _Cgroups:
    """Per-session cgroup directories: v1 ``pids`` and ``memory`` and v2 (``freeze``) under a parent unique to this
    pool (``agentenv-<pid>-<random>``, so two pools in one process never share a limit), and
    ``cpu`` directly at the hierarchy's root (``agentenv-<pid>-<random>.s<n>``), so that each
    session competes for CPU as one entity beside the host's own processes, whatever number
    of processes it starts. Directories left by a dead process are reaped at start.

    A closed session's directories are reused, with the same limits, once no process is left
    in them (``pids.current`` is 0: not even a zombie): making and removing cgroups takes the
    kernel's global cgroup lock, and under load a ``mkdir`` there blocked for hundreds of
    milliseconds. New directories are made in a worker thread, never on the event loop."""

    CONTROLLERS = ("pids", "memory", "cpu")
    # The cgroup v2 hierarchy beside them (a hybrid host mounts it here) gives every cgroup
    # ``cgroup.freeze`` and ``cgroup.kill`` without any controller. Its freezer, unlike v1's,
    # lets SIGKILL through: a session frozen between calls still dies with its parent.
    UNIFIED = ("unified", ".")

    def __init__(self, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.name = f"agentenv-{os.getpid()}-{secrets.token_hex(4)}"
        self.bases = {}
        for ctl in self.CONTROLLERS:
            base = root / ctl
            if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
                self.bases[ctl] = base
        for sub in self.UNIFIED:
            base = root / sub
            if (base / "cgroup.controllers").exists() and os.access(base, os.W_OK):
                self.bases["freeze"] = base
                break
        self.n = 0
        self.free: deque[list[str]] = deque()  # released sets, oldest first
        self.broken: list[list[str]] = []
        self._states: dict[str, int] = {}  # v2 dir -> its open cgroup.freeze
        self._kills: dict[str, int] = {}  # v2 dir -> its open cgroup.kill (where the kernel has one)
        # Ended sessions' cgroup writes (``end``), one after another, off the event loop.
        self._teardown = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentenv-cgroups")

    @property
    def missing(self) -> list[str]:
        return [ctl for ctl in (*self.CONTROLLERS, "freeze") if ctl not in self.bases]

    def create(self, limits: Limits, n: int) -> list[str]:
        """New directories, numbered ``n`` (in a worker thread: touches nothing shared)."""
        dirs = []
        for ctl, base in self.bases.items():
            d = base / f"{self.name}.s{n}" if ctl == "cpu" else base / self.name / f"s{n}"
            try:
                d.mkdir(parents=True)  # never exist_ok: a name in use is someone else's limit
                dirs.append(str(d))
                if ctl == "pids":
                    (d / "pids.max").write_text(str(limits.pids))
                elif ctl == "memory":
                    (d / "memory.limit_in_bytes").write_text(str(limits.memory_mb * 1024 * 1024))
                elif ctl == "freeze":
                    self._states[str(d)] = os.open(d / "cgroup.freeze", os.O_WRONLY | os.O_CLOEXEC)
                    self._open_kill(str(d))
                elif limits.cpus > 0:
                    period = int((d / "cpu.cfs_period_us").read_text())
                    (d / "cpu.cfs_quota_us").write_text(str(max(1000, int(limits.cpus * period))))
            except OSError as exc:
                self.remove(dirs)
                raise SandboxError(f"cannot set up cgroup {d}: {exc}") from exc
        return dirs

    async def acquire(self, limits: Limits) -> list[str]:
        """Directories for a new session: the oldest released set once it is empty, else new."""
        while self.free:
            busy = self._busy(self.free[0])
            if busy:
                break  # still exiting; the sets behind it were released later
            dirs = self.free.popleft()
            if busy is False:
                return dirs
            self.broken.append(dirs)  # unreadable: removed at close
        self.n += 1
        return await anyio.to_thread.run_sync(self.create, limits, self.n)

    def release(self, dirs: list[str]) -> None:
        """A session is over (its processes killed, perhaps not gone yet): reuse its dirs,
        thawed (a session started in them must not start frozen)."""
        if dirs:
            self.thaw(dirs)
            self.free.append(dirs)

    def end(self, dirs: list[str]) -> None:
        """A session is over and its worker killed: SIGKILL whatever is left in ``dirs``
        (``kill``) and take them back for reuse (``release``), on this pool's teardown thread.
        Each of those writes waits for the kernel's global cgroup lock, which every session
        start (joining its cgroups) and end takes; under a steady stream of starts and ends
        (a rollout) they waited milliseconds at a time, stalling the event loop that serves
        the engine. ``dirs`` are reused only once both are done. After ``drain`` (the pool is
        closing) they run at once, here."""
        if not dirs:
            return

        def work() -> None:
            self.kill(dirs)
            self.release(dirs)  # thawed: a frozen process dies of SIGKILL all the same

        try:
            self._teardown.submit(work)
        except RuntimeError:  # drained: the pool is closing
            work()

    def drain(self) -> None:
        """Wait until every ``end`` handed to the teardown thread is done (blocking: call it
        from a worker thread) and stop the thread; later ends run where they are called."""
        self._teardown.shutdown(wait=True)

    def _freezer(self, dirs: list[str]) -> int | None:
        return next((self._states[d] for d in dirs if d in self._states), None)

    def freeze(self, dirs: list[str]) -> bool:
        """Stop every process and thread in the session (it runs nothing until ``thaw``);
        False if it has no freezer or the write failed."""
        return self._set_frozen(dirs, b"1")

    def thaw(self, dirs: list[str]) -> bool:
        return self._set_frozen(dirs, b"0")

    def _set_frozen(self, dirs: list[str], state: bytes) -> bool:
        fd = self._freezer(dirs)
        if fd is None:
            return False
        try:
            os.write(fd, state)
        except OSError:
            return False
        return True

    def cpu(self, dirs: list[str]) -> tuple[float, float] | None:
        """The session's CPU seconds so far and its seconds with a task runnable but waiting
        for a CPU (the v2 cgroup's ``cpu.stat`` usage and ``cpu.pressure`` "some" total), or
        None where they cannot be read."""
        ours = self._under("freeze", dirs)
        if not ours:
            return None
        try:
            with open(os.path.join(ours[0], "cpu.stat")) as f:
                used = int(f.readline().split()[1])  # usage_usec
            with open(os.path.join(ours[0], "cpu.pressure")) as f:
                waited = int(f.readline().rsplit("total=", 1)[1])
        except (OSError, IndexError, ValueError):
            return None
        return used / 1e6, waited / 1e6

    def _under(self, ctl: str, dirs: list[str]) -> list[str]:
        """Those of ``dirs`` in the ``ctl`` hierarchy. Each was made as ``base / name`` (``create``),
        so a string prefix says it, without parsing paths at every session start."""
        base = self.bases.get(ctl)
        if base is None:
            return []
        prefix = str(base).rstrip("/") + "/"
        return [d for d in dirs if d.startswith(prefix)]

    def _busy(self, dirs: list[str]) -> bool | None:
        """Whether a process is left in ``dirs``; None if they cannot be read. Every session
        process is in all of them, so the pids dir alone says (zombies included), where there
        is one."""
        ours = self._under("pids", dirs)
        for d, name in ([(ours[0], "pids.current")] if ours else [(d, "cgroup.procs") for d in dirs]):
            try:
                with open(os.path.join(d, name)) as f:
                    if f.read().strip() not in ("", "0"):
                        return True
            except OSError:
                return None
        return False

    def _open_kill(self, d: str) -> None:
        """Open ``d``'s ``cgroup.kill`` once, with its ``cgroup.freeze``: a session's end then
        writes it without a path lookup (none on a kernel before 5.14: ``kill`` says False)."""
        try:
            self._kills[d] = os.open(os.path.join(d, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            pass

    def kill(self, dirs: list[str]) -> bool:
        """SIGKILL every process in the session's cgroup at once (``cgroup.kill``: the kernel
        walks the cgroup's members; no pid is read, so none can have been reused); False if
        the session has no such cgroup or the write failed."""
        fd = next((self._kills[d] for d in dirs if d in self._kills), None)
        if fd is None:
            return False
        try:
            os.write(fd, b"1")
        except OSError:
            return False
        return True

    def remove(self, dirs: list[str]) -> bool:
        ok = True
        for d in dirs:
            for fd in (self._states.pop(d, None), self._kills.pop(d, None)):
                if fd is not None:
                    os.close(fd)
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok

    def remove_all(self) -> bool:
        """At the pool's close (its sessions killed): remove every set. False while a process
        is still leaving one (try again shortly)."""
        left = [d for dirs in (*self.free, *self.broken) for d in dirs if not self.remove([d])]
        self.free.clear()
        self.broken = [left] if left else []
        return not left

    def remove_roots(self) -> None:
        for ctl, base in self.bases.items():
            if ctl != "cpu":
                self.remove([str(base / self.name)])

    def reap_stale(self) -> int:
        """Remove ``agentenv-<pid>-*`` directories whose process is gone (a crashed pool's;
        its workers died with it). Returns how many were removed."""
        removed = 0
        for base in self.bases.values():
            for d in base.glob("agentenv-*"):
                try:
                    pid = int(d.name.split("-")[1].split(".")[0])
                except (IndexError, ValueError):
                    continue
                if pid == os.getpid() or _alive(pid):
                    continue
                try:  # another pool on this host may be reaping the same directory right now
                    subs = [str(s) for s in d.iterdir() if s.is_dir()] if d.is_dir() else []
                except FileNotFoundError:
                    continue
                if self.remove(subs + [str(d)]):
                    removed += 1
        return removed
