"""Where a rollout run's results go (:class:`RunWriter`): the JSONL output, a line per
trajectory written whole, and the event log's ``done`` and ``held`` records, so that
``--resume`` knows what is finished. The same for a run in this process and one on Ray.

* A trajectory is written as soon as its program finishes, unless the environment rewards
  whole groups (``group_reward``): then a group's lines are written together once it is
  scored, so that every line carries the reward the trainer would see.
* What the engine failed on for good (``error:engine``: restarts or reconnects exhausted) is
  not a result: it is not written, and its log records stay, so ``--resume`` continues it.
  With a group reward, the group's other samples are held in the log (``held`` records keep
  them whole, not to be run again), so that the group is scored whole on resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .errors import AgentEnvError

if TYPE_CHECKING:
    from .journal import Journal
    from .reactor import Group
    from .trajectory import Trajectory

Key = tuple[str, int]  # (task id, sample index)


def has_group_reward(env: Any) -> bool:
    """Whether ``env`` rewards whole groups: :meth:`agentenv.env.Environment.has_group_reward`,
    which this name is kept for (deprecated)."""
    from .env import Environment

    return Environment.has_group_reward(env)


class RunWriter:
    """Takes a run's finished programs and complete groups (:meth:`take`) and writes them.

    ``in_out``: the samples whose lines ``out`` holds already (a resumed run's); ``already``:
    those finished before this run (``in_out`` and the samples held in the log), which the
    progress count leaves out. ``append``: continue ``out`` rather than replace it."""

    def __init__(self, out: Path, log: Journal, *, by_group: bool, in_out: Iterable[Key] = (),
                 already: Iterable[Key] = (), append: bool = False) -> None:
        self.out, self.log, self.by_group = out, log, by_group
        self.in_out, self.already = set(in_out), set(already) | set(in_out)
        self.written = 0
        self.held_back: list[Trajectory] = []  # the engine failed on them: not written, --resume continues them
        self.waiting: list[Trajectory] = []  # finished samples held in the log with such a group
        self.reward_errors: list[str | None] = []
        self._seen: set[Key] = set()
        self._append = append
        self._file: Any = None

    def __enter__(self) -> "RunWriter":
        # Unbuffered: each line goes to the OS as it is written, so closing the file has
        # nothing left to write (and cannot fail after a write error was reported).
        self._file = open(self.out, "ab" if self._append else "wb", buffering=0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def take(self, item: Trajectory | Group) -> int:
        """A finished program (a :class:`~agentenv.trajectory.Trajectory`) or a complete group
        (a :class:`~agentenv.reactor.Group`, whose programs may or may not have come before it
        one by one); returns how many programs finished that were not finished before."""
        from .trajectory import Trajectory

        if isinstance(item, Trajectory):
            return self._program(item)
        fresh = sum(self._program(t) for t in item.trajectories)
        if self.by_group:
            self._group(item.trajectories)
        return fresh

    def _program(self, t: Trajectory) -> int:
        key = (t.task_id, t.sample_index)
        if key in self._seen:
            return 0
        self._seen.add(key)
        if t.finish_reason == "error:engine":
            self.held_back.append(t)
        elif not self.by_group and key not in self.in_out:
            self._write(t)
        return int(key not in self.already)

    def _group(self, trajectories: list[Trajectory]) -> None:
        new = [t for t in trajectories if (t.task_id, t.sample_index) not in self.in_out]
        ok = [t for t in new if t.finish_reason != "error:engine"]
        if len(ok) < len(new):  # scored whole on resume, with these held in the log
            for t in ok:
                self.log.held(t)
                self.waiting.append(t)
            return
        for t in ok:
            self._write(t)

    def _write(self, t: Trajectory) -> None:
        """One trajectory as one JSONL line, written whole, then its ``done`` record; a write
        error is one clear line (a line cut short by it is dropped by --resume)."""
        if t.finish_reason == "error:reward":
            self.reward_errors.append(t.error)
        data = memoryview((json.dumps(t.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))
        try:
            while data:
                data = data[self._file.write(data):]  # a raw write may take fewer bytes than given
        except OSError as exc:
            raise AgentEnvError(f"cannot write {self.out}: {exc.strerror or exc}; the lines before this one are "
                                "intact (--resume continues)") from None
        self.in_out.add((t.task_id, t.sample_index))
        self.log.done(t)
        self.written += 1


__all__ = ["RunWriter", "has_group_reward"]
