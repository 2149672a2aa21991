"""Programs in flight, held in memory: what a trainer checkpoint saves of its unfinished
groups, and what Ray rollout workers send the driver of theirs.

:class:`InFlight` is the in-memory counterpart of the on-disk event log
(:class:`agentenv.journal.Journal`): both are a :class:`~agentenv.journal.ProgramLog`, told of
every program's start, turns and end. A *snapshot* (:class:`TaskSnapshot`) is the state of one
task's unfinished group: per program (:class:`ProgramSnapshot`) its start record's fields and
every turn so far, plus the group's finished trajectories. :func:`restore` turns one back into
the state a reactor resumes from; :func:`snapshot_of` builds one from a log's state;
:func:`log_snapshot` writes one into a log, so a driver's log holds what its workers had done.

Saved form (version ``SNAPSHOT_VERSION``; a checkpoint's ``state.json`` holds one per task in
flight, and a Ray worker and its driver send them so), :meth:`TaskSnapshot.to_dict`::

  {"v": 2, "agentenv": "0.1.0",                  the format's version, and the writer's
   "partial": [{"k": key, "task": id, "sample": i, "group": gid, "prompt": [ids],
                "segments": [...], "tools": [...], "stats": [...],     as a log's turn records
                "calls": [...], "calls_tag": tag}, ...],               an agent program's only
   "finished": [trajectory dicts]}

:func:`read_snapshot` is the one reader of that form: a snapshot without ``"v"`` (written
before snapshots had a version) is version 1, read through :func:`upgrade`; a version this
agentenv does not know is refused, naming it and the agentenv that wrote it.

A *delta* (:meth:`InFlight.snapshot` given what its caller holds) is the same record with
``"delta": true``, ``"finished_ids"`` (every finished trajectory's id; ``"finished"`` holds
those the caller lacks), and per program ``"base"`` (the segments, tool calls and stats the
caller holds, which the entry's follow) and ``"calls_base"``; a program the caller holds has
no ``"prompt"``. :func:`merge_snapshot` turns it back into the whole snapshot.

An agent program (``agentenv.gateway``) completes no turns while it runs: what it has done is
its answered gateway calls (the journal's ``call`` records). Its entry carries them as
``calls`` (``{"d", "role", "g"}`` each, in order) with ``calls_tag``, which names the attempt
they belong to (an agent whose replay mismatched starts again: a new tag, no calls); restored,
they are the trajectory's ``metadata["gateway_log"]``, from which the agent is replayed.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import AgentEnvError
from .journal import Call, Journal, LogState, Start, Turn, extent
from .trajectory import Segment, ToolCall, Trajectory, TurnStats

#: The saved form's version. 1: the unversioned dicts written before it had one (the same
#: fields, ``group`` optional); 2: ``"v"`` and the writer's ``"agentenv"`` version named.
SNAPSHOT_VERSION = 2


@functools.cache
def _agentenv_version() -> str:
    """This agentenv's version, as installed (a checkout not installed: ``"unknown"``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentenv")
    except PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class ProgramSnapshot:
    """One unfinished program of a :class:`TaskSnapshot`: its start record's fields and its
    turns so far, as the log's ``turn`` records hold them (``segments``, ``tool_calls`` and
    ``stats`` as their dicts: a copy, taken when the snapshot was). ``prompt_ids`` is None in
    a delta for a program its holder has; ``base`` and ``calls_base`` are set in a delta only."""

    key: str
    task_id: str
    sample_index: int
    group_id: str
    prompt_ids: list[int] | None
    segments: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    stats: list[dict[str, Any]]
    #: An agent program's answered gateway calls (``{"d", "role", "g"}`` each), and the tag of
    #: the attempt they belong to: set for an agent program only (a delta's ``calls`` may be
    #: empty: none new).
    calls: list[dict[str, Any]] = field(default_factory=list)
    calls_tag: str | None = None
    #: A delta's: the (segments, tool calls, stats) its holder has, which these follow.
    base: tuple[int, int, int] | None = None
    #: A delta's: the calls its holder has of the same attempt, which these follow.
    calls_base: int | None = None

    @classmethod
    def of(cls, t: Trajectory, group: str, start: Sequence[int] = (0, 0, 0),
           end: Sequence[int] | None = None) -> "ProgramSnapshot":
        """``t``'s segments, tool calls and stats from ``start`` to ``end`` (its whole extent
        by default), without its prompt (set by the caller when the holder lacks it)."""
        end = extent(t) if end is None else end
        return cls(t.id, t.task_id, t.sample_index, group, None,
                   [x.to_dict() for x in t.segments[start[0]:end[0]]],
                   [x.to_dict() for x in t.tool_calls[start[1]:end[1]]],
                   [x.to_dict() for x in t.turns[start[2]:end[2]]])

    def start_record(self) -> Start:
        """The log's ``start`` record of this program (a whole snapshot's entry has its prompt)."""
        assert self.prompt_ids is not None, "a delta's entry for a program its holder has"
        return Start(self.key, self.task_id, self.sample_index, self.group_id, self.prompt_ids)

    def trajectory(self) -> Trajectory:
        """The trajectory this entry holds (its environment's id is not in a snapshot: empty);
        an agent program's calls as its ``metadata["gateway_log"]``, replayed from
        (``agentenv.gateway.program``)."""
        t = self.start_record().trajectory()
        t.segments = [Segment(**x) for x in self.segments]
        t.tool_calls = [ToolCall(**x) for x in self.tool_calls]
        t.turns = [TurnStats(**x) for x in self.stats]
        if self.calls:
            t.metadata["gateway_log"] = list(self.calls)
        return t

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"k": self.key, "task": self.task_id, "sample": self.sample_index, "group": self.group_id}
        if self.prompt_ids is not None:
            d["prompt"] = self.prompt_ids
        d.update(segments=self.segments, tools=self.tool_calls, stats=self.stats)
        if self.calls_tag is not None:
            d.update(calls=self.calls, calls_tag=self.calls_tag)
        if self.base is not None:
            d["base"] = list(self.base)
        if self.calls_base is not None:
            d["calls_base"] = self.calls_base
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProgramSnapshot":
        """An entry of this version's saved form (:func:`read_snapshot` reads any version)."""
        base = d.get("base")
        return cls(d["k"], d["task"], d["sample"], d["group"], d.get("prompt"), d["segments"], d["tools"],
                   d["stats"], list(d.get("calls") or []), d.get("calls_tag"),
                   None if base is None else (base[0], base[1], base[2]), d.get("calls_base"))


@dataclass(slots=True)
class TaskSnapshot:
    """One task's unfinished group: its running programs (``partial``) and its finished
    trajectories (as their dicts). A delta (``finished_ids`` set: every finished trajectory's
    id) holds only what its holder lacked; see the module doc."""

    partial: list[ProgramSnapshot] = field(default_factory=list)
    finished: list[dict[str, Any]] = field(default_factory=list)
    finished_ids: list[str] | None = None

    @property
    def delta(self) -> bool:
        return self.finished_ids is not None

    def to_dict(self) -> dict[str, Any]:
        """The saved form (JSON-ready), its version and writer named."""
        d: dict[str, Any] = {"v": SNAPSHOT_VERSION, "agentenv": _agentenv_version(),
                             "partial": [p.to_dict() for p in self.partial], "finished": self.finished}
        if self.finished_ids is not None:
            d.update(delta=True, finished_ids=self.finished_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TaskSnapshot":
        """A saved form of any version this agentenv reads (:func:`read_snapshot`)."""
        return read_snapshot(d)


def upgrade(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` (a snapshot's saved form) as this version's: the one place an older snapshot is
    read. Version 1 (no ``"v"``, as checkpoints before versions hold): its entries' ``group``
    could be absent or null (no group id: ``""``). A version this agentenv does not know is
    refused, naming it and the agentenv that wrote it."""
    version = d.get("v", 1)
    if version == SNAPSHOT_VERSION:
        return d
    if version == 1:
        partial = [{**p, "group": p.get("group") or ""} for p in d.get("partial", [])]
        return {**d, "v": SNAPSHOT_VERSION, "partial": partial}
    raise AgentEnvError(
        f"in-flight snapshot version {version!r} is not one this agentenv ({_agentenv_version()}) reads "
        f"(1 to {SNAPSHOT_VERSION}): agentenv {d.get('agentenv', 'newer than this')} wrote it; "
        "read it (resume the run) with that version or a later one")


def read_snapshot(d: dict[str, Any]) -> TaskSnapshot:
    """The one reader of a snapshot's saved form, whatever its version (:func:`upgrade`): a
    checkpoint's, a Ray worker's reply, a driver's snapshot sent to a worker."""
    d = upgrade(d)
    return TaskSnapshot([ProgramSnapshot.from_dict(p) for p in d.get("partial", [])], list(d.get("finished", [])),
                        list(d["finished_ids"]) if d.get("delta") else None)


class InFlight:
    """The in-memory counterpart of :class:`Journal` for the trainer: it keeps a reference to
    every running program's trajectory and how far it was complete at its last logged turn, and
    the finished (scored) trajectories of groups not yet complete, so a checkpoint can save
    exactly the in-flight work (:meth:`snapshot`) and a resumed run continue it."""

    def __init__(self) -> None:
        self._live: dict[str, dict[str, tuple[Trajectory, tuple[int, int, int]]]] = {}  # task -> key -> ...
        self._finished: dict[str, list[Trajectory]] = {}
        self._calls: dict[str, tuple[str, list[dict[str, Any]]]] = {}  # agent program -> (attempt tag, calls)

    def start(self, traj: Trajectory) -> None:
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, (0, 0, 0))
        self._calls.pop(traj.id, None)  # a new attempt: an earlier one's calls are not replayed

    def call(self, key: str, n: int, digest: str, role: str, generation: dict[str, Any]) -> None:
        """An agent program's gateway call ``n`` was answered (replayed calls are not told: a
        resumed program's log is :meth:`restored` first, so ``n`` follows on from it)."""
        _, log = self._calls.setdefault(key, (secrets.token_hex(6), []))
        if n == len(log):
            log.append({"d": digest, "role": role, "g": generation})

    def restored(self, snapshot: TaskSnapshot) -> None:
        """A task's programs resume from ``snapshot``: their agents' calls so far are held again,
        under the same tag, so the next snapshot still carries them (a second loss replays too)."""
        for p in snapshot.partial:
            if p.calls and p.calls_tag is not None:
                self._calls[p.key] = (p.calls_tag, list(p.calls))

    def resumed(self, traj: Trajectory) -> None:
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, extent(traj))

    def turn(self, traj: Trajectory, mark: list[int]) -> None:
        mark[:] = extent(traj)
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, extent(traj))

    def finished(self, traj: Trajectory) -> None:
        self._live.get(traj.task_id, {}).pop(traj.id, None)
        self._calls.pop(traj.id, None)
        self._finished.setdefault(traj.task_id, []).append(traj)

    def oldest_version(self, task_id: str) -> int | None:
        """The oldest weight version among the task's sampled tokens (its running programs'
        trajectories as they stand and its finished ones); None before any. A program's
        versions only grow, so tokens sampled later cannot lower it."""
        trajs = [t for t, _ in self._live.get(task_id, {}).values()] + self._finished.get(task_id, [])
        versions = [s.weight_versions[0] for t in trajs for s in t.segments
                    if s.kind == "model" and s.weight_versions]
        return min(versions) if versions else None

    def forget(self, task_id: str) -> None:
        """The task's group is complete (it went to the buffer)."""
        for key in self._live.pop(task_id, {}):
            self._calls.pop(key, None)
        self._finished.pop(task_id, None)

    def snapshot(self, task_ids: set[str], have: dict[str, dict[str, Any]] | None = None) -> dict[str, TaskSnapshot]:
        """For each task with work in flight, its programs' logged prefixes and its finished
        trajectories.

        ``have`` (task id -> :func:`holding` of the snapshot the caller keeps): only what the
        caller lacks, a *delta* (each program's segments, tool calls and stats past what it
        holds; finished trajectories it does not hold, with the ids of all of them), which
        :func:`merge_snapshot` turns back into the whole snapshot. A Ray driver polls its
        workers so: the same state, without sending every program's whole prefix each time."""
        out: dict[str, TaskSnapshot] = {}
        for tid in task_ids:
            held = None if have is None else have.get(tid, {"partial": {}, "finished": []})
            partial = []
            for t, m in self._live.get(tid, {}).values():
                base = None if held is None else held["partial"].get(t.id)
                start = base if base is not None and all(b <= x for b, x in zip(base, m)) else (0, 0, 0)
                entry = ProgramSnapshot.of(t, t.group_id, start, m)
                if base is None:  # new to the caller
                    entry.prompt_ids = t.prompt_ids
                if held is not None:
                    entry.base = (start[0], start[1], start[2])
                self._add_calls(entry, None if held is None else held.get("calls", {}).get(t.id, [None, 0]))
                partial.append(entry)
            finished = self._finished.get(tid, [])
            if not (partial or finished):
                continue
            if held is None:
                out[tid] = TaskSnapshot(partial, [t.to_dict() for t in finished])
            else:
                known = set(held["finished"])
                out[tid] = TaskSnapshot(partial, [t.to_dict() for t in finished if t.id not in known],
                                        [t.id for t in finished])
        return out

    def _add_calls(self, entry: ProgramSnapshot, held: Sequence[Any] | None) -> None:
        """An agent program's calls into its snapshot entry: all of them, or (``held``: the tag
        and count the caller holds) those past what it holds of the same attempt."""
        tag, log = self._calls.get(entry.key, (None, []))
        if not log:
            return  # not an agent program, or one before its first answered call
        base = held[1] if held is not None and held[0] == tag and held[1] <= len(log) else 0
        entry.calls, entry.calls_tag = log[base:], tag
        if held is not None:
            entry.calls_base = base


def holding(snapshot: TaskSnapshot | None) -> dict[str, Any]:
    """What one task's snapshot (whole, as :meth:`InFlight.snapshot` or :func:`merge_snapshot`
    gives it) holds: each program's (segments, tool calls, stats) counts, its agent calls' tag
    and count, and the finished trajectories' ids. The ``have`` entry for
    :meth:`InFlight.snapshot` (JSON-ready: it travels to a Ray worker)."""
    if not snapshot:
        return {"partial": {}, "finished": []}
    return {"partial": {p.key: (len(p.segments), len(p.tool_calls), len(p.stats)) for p in snapshot.partial},
            "calls": {p.key: [p.calls_tag, len(p.calls)] for p in snapshot.partial if p.calls},
            "finished": [d["id"] for d in snapshot.finished]}


def merge_snapshot(held: TaskSnapshot | None, reply: TaskSnapshot) -> TaskSnapshot:
    """The whole snapshot of one task from the one held before and a worker's reply to a
    poll with ``have=holding(held)`` (a whole snapshot is returned as it is). Programs the
    reply does not list any more (finished, or gone) are dropped, as a whole snapshot would."""
    if reply.finished_ids is None:
        return reply
    before = {p.key: p for p in (held.partial if held is not None else [])}
    partial = []
    for e in reply.partial:
        old = before.get(e.key)
        seg, tools, stats = e.base or (0, 0, 0)
        p = ProgramSnapshot(e.key, e.task_id, e.sample_index, e.group_id,
                            e.prompt_ids if e.prompt_ids is not None else old.prompt_ids if old else None,
                            (old.segments[:seg] if old else []) + e.segments,
                            (old.tool_calls[:tools] if old else []) + e.tool_calls,
                            (old.stats[:stats] if old else []) + e.stats)
        if e.calls_tag is not None:  # an agent's calls: those held of the same attempt, then the new ones
            p.calls = (old.calls if old else [])[: e.calls_base or 0] + e.calls
            p.calls_tag = e.calls_tag
        partial.append(p)
    finished = {d["id"]: d for d in (held.finished if held is not None else [])}
    finished.update((d["id"], d) for d in reply.finished)
    return TaskSnapshot(partial, [finished[i] for i in reply.finished_ids])


def log_snapshot(log: Journal, snapshot: TaskSnapshot, written: dict[str, tuple[Any, ...]]) -> None:
    """Append to ``log`` what one task's whole snapshot adds to it: a ``start`` record for a
    program it has not seen, a ``turn`` record with the segments, tool calls and stats logged
    since, a ``call`` record for each agent call logged since (``written`` remembers how far
    each program's records go: segments, tool calls, stats, the calls' tag and count). A Ray
    rollout driver logs its workers' snapshots so, so a ``--resume`` continues their programs
    (an agent's calls replayed from the log)."""
    for p in snapshot.partial:
        n = (len(p.segments), len(p.tool_calls), len(p.stats))
        seen = written.get(p.key)
        # New to the log, or an agent that started again with calls of the old attempt logged:
        # a start record (a later start of the same program wins, its calls logged afresh).
        if seen is None or (seen[3] != p.calls_tag and seen[4]):
            log.write(p.start_record())
            seen = (0, 0, 0, p.calls_tag, 0)
        if n[0] > seen[0]:
            log.write(Turn.from_json({"k": p.key, "turn": n[2], "segments": p.segments[seen[0]:],
                                      "tools": p.tool_calls[seen[1]:], "stats": p.stats[seen[2]:]}))
            seen = (*n, *seen[3:])
        for i in range(seen[4], len(p.calls)):
            c = p.calls[i]
            log.write(Call(p.key, i, c["d"], c["role"], c["g"]))
        written[p.key] = (*seen[:3], p.calls_tag, max(seen[4], len(p.calls)))


def snapshot_of(state: LogState, task_id: str, finished: list[dict[str, Any]]) -> TaskSnapshot:
    """The snapshot of one task from a loaded log (its partial programs) and its trajectories
    already in the output (``finished``, as dicts)."""
    group = state.groups.get(task_id, "")
    partial = []
    for (tid, _), t in sorted(state.partial.items()):
        if tid == task_id:
            entry = ProgramSnapshot.of(t, group)
            entry.prompt_ids = t.prompt_ids
            if t.metadata.get("gateway_log"):  # an agent program's logged calls
                entry.calls, entry.calls_tag = list(t.metadata["gateway_log"]), secrets.token_hex(6)
            partial.append(entry)
    return TaskSnapshot(partial, finished)


def restore(snapshot: TaskSnapshot) -> tuple[LogState, list[Trajectory]]:
    """One task's snapshot: what to resume (partial programs, and the samples already
    finished) and the finished trajectories themselves."""
    finished = [Trajectory.from_dict(d) for d in snapshot.finished]
    partial = {}
    for p in snapshot.partial:
        t = p.trajectory()
        partial[(t.task_id, t.sample_index)] = t
    groups = {p.task_id: p.group_id for p in snapshot.partial if p.group_id}
    groups.update({t.task_id: t.group_id for t in finished})
    by_task: dict[str, list[Trajectory]] = {}
    for t in finished:
        by_task.setdefault(t.task_id, []).append(t)
    return LogState({}, partial, {(t.task_id, t.sample_index) for t in finished}, groups, by_task), finished


__all__ = ["SNAPSHOT_VERSION", "InFlight", "ProgramSnapshot", "TaskSnapshot", "holding", "log_snapshot",
           "merge_snapshot", "read_snapshot", "restore", "snapshot_of", "upgrade"]
