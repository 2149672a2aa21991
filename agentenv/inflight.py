"""Programs in flight, held in memory: what a trainer checkpoint saves of its unfinished
groups, and what Ray rollout workers send the driver of theirs.

:class:`InFlight` is the in-memory counterpart of the on-disk event log
(:class:`agentenv.journal.Journal`): both are a :class:`~agentenv.journal.ProgramLog`, told of
every program's start, turns and end. A *snapshot* is the JSON-ready state of some tasks'
unfinished groups: per program its start record's fields and every turn so far, plus the
group's finished trajectories. :func:`restore` turns one back into the state a reactor resumes
from; :func:`snapshot_of` builds one from a log's state; :func:`log_snapshot` writes one into a
log, so a driver's log holds what its workers had done.

An agent program (``agentenv.gateway``) completes no turns while it runs: what it has done is
its answered gateway calls (the journal's ``call`` records). Its entry carries them as
``calls`` (``{"d", "role", "g"}`` each, in order) with ``calls_tag``, which names the attempt
they belong to (an agent whose replay mismatched starts again: a new tag, no calls); restored,
they are the trajectory's ``metadata["gateway_log"]``, from which the agent is replayed.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

from .journal import Call, Journal, LogState, Start, Turn, extent
from .trajectory import Segment, ToolCall, Trajectory, TurnStats


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

    def restored(self, snapshot: dict[str, Any]) -> None:
        """A task's programs resume from ``snapshot``: their agents' calls so far are held again,
        under the same tag, so the next snapshot still carries them (a second loss replays too)."""
        for p in snapshot.get("partial", []):
            if p.get("calls"):
                self._calls[p["k"]] = (p["calls_tag"], list(p["calls"]))

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

    def snapshot(self, task_ids: set[str], have: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """JSON-ready: for each task, its programs' logged prefixes and its finished trajectories.

        ``have`` (task id -> :func:`holding` of the snapshot the caller keeps): only what the
        caller lacks, a *delta* (each program's segments, tool calls and stats past what it
        holds; finished trajectories it does not hold, with the ids of all of them), which
        :func:`merge_snapshot` turns back into the whole snapshot. A Ray driver polls its
        workers so: the same state, without sending every program's whole prefix each time."""
        out: dict[str, Any] = {}
        for tid in task_ids:
            held = None if have is None else have.get(tid, {"partial": {}, "finished": []})
            partial = []
            for t, m in self._live.get(tid, {}).values():
                base = None if held is None else held["partial"].get(t.id)
                start = base if base is not None and all(b <= x for b, x in zip(base, m)) else (0, 0, 0)
                entry = _entry(t, t.group_id, start, m)
                if base is None:  # new to the caller
                    entry["prompt"] = t.prompt_ids
                if held is not None:
                    entry["base"] = list(start)
                self._add_calls(entry, t.id, None if held is None else held.get("calls", {}).get(t.id, [None, 0]))
                partial.append(entry)
            finished = self._finished.get(tid, [])
            if held is None:
                if partial or finished:
                    out[tid] = {"partial": partial, "finished": [t.to_dict() for t in finished]}
            elif partial or finished:
                known = set(held["finished"])
                out[tid] = {"delta": True, "partial": partial,
                            "finished": [t.to_dict() for t in finished if t.id not in known],
                            "finished_ids": [t.id for t in finished]}
        return out

    def _add_calls(self, entry: dict[str, Any], key: str, held: Sequence[Any] | None) -> None:
        """An agent program's calls into its snapshot entry: all of them, or (``held``: the tag
        and count the caller holds) those past what it holds of the same attempt."""
        tag, log = self._calls.get(key, (None, []))
        if not log:
            return  # not an agent program, or one before its first answered call
        base = held[1] if held is not None and held[0] == tag and held[1] <= len(log) else 0
        entry["calls"], entry["calls_tag"] = log[base:], tag
        if held is not None:
            entry["calls_base"] = base


def holding(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    """What one task's snapshot (whole, as :meth:`InFlight.snapshot` or :func:`merge_snapshot`
    gives it) holds: each program's (segments, tool calls, stats) counts and the finished
    trajectories' ids. The ``have`` entry for :meth:`InFlight.snapshot`."""
    if not snapshot:
        return {"partial": {}, "finished": []}
    return {"partial": {p["k"]: (len(p["segments"]), len(p["tools"]), len(p["stats"])) for p in snapshot["partial"]},
            "calls": {p["k"]: [p["calls_tag"], len(p["calls"])] for p in snapshot["partial"] if p.get("calls")},
            "finished": [d["id"] for d in snapshot["finished"]]}


def merge_snapshot(held: dict[str, Any] | None, reply: dict[str, Any]) -> dict[str, Any]:
    """The whole snapshot of one task from the one held before and a worker's reply to a
    poll with ``have=holding(held)`` (a whole snapshot is returned as it is). Programs the
    reply does not list any more (finished, or gone) are dropped, as a whole snapshot would."""
    if not reply.get("delta"):
        return reply
    before = {p["k"]: p for p in (held or {}).get("partial", [])}
    partial = []
    for e in reply["partial"]:
        old, (seg, tools, stats) = before.get(e["k"]), e["base"]
        p = {k: e[k] for k in ("k", "task", "sample", "group")}
        p["prompt"] = e["prompt"] if "prompt" in e else old["prompt"]
        p["segments"] = (old["segments"][:seg] if old else []) + e["segments"]
        p["tools"] = (old["tools"][:tools] if old else []) + e["tools"]
        p["stats"] = (old["stats"][:stats] if old else []) + e["stats"]
        if "calls" in e:  # an agent's calls: those held of the same attempt, then the new ones
            p["calls"] = (old or {}).get("calls", [])[: e["calls_base"]] + e["calls"]
            p["calls_tag"] = e["calls_tag"]
        partial.append(p)
    finished = {d["id"]: d for d in (held or {}).get("finished", [])}
    finished.update((d["id"], d) for d in reply["finished"])
    return {"partial": partial, "finished": [finished[i] for i in reply["finished_ids"]]}


def log_snapshot(log: Journal, snapshot: dict[str, Any], written: dict[str, tuple[Any, ...]]) -> None:
    """Append to ``log`` what one task's :meth:`InFlight.snapshot` entry adds to it: a ``start``
    record for a program it has not seen, a ``turn`` record with the segments, tool calls and
    stats logged since, a ``call`` record for each agent call logged since (``written``
    remembers how far each program's records go: segments, tool calls, stats, the calls' tag
    and count). A Ray rollout driver logs its workers' snapshots so, so a ``--resume``
    continues their programs (an agent's calls replayed from the log)."""
    for p in snapshot["partial"]:
        n = (len(p["segments"]), len(p["tools"]), len(p["stats"]))
        calls, tag = p.get("calls", []), p.get("calls_tag")
        seen = written.get(p["k"])
        # New to the log, or an agent that started again with calls of the old attempt logged:
        # a start record (a later start of the same program wins, its calls logged afresh).
        if seen is None or (seen[3] != tag and seen[4]):
            log.write(Start.from_json(p))  # an entry has a start record's fields
            seen = (0, 0, 0, tag, 0)
        if n[0] > seen[0]:
            log.write(Turn.from_json({"k": p["k"], "turn": n[2], "segments": p["segments"][seen[0]:],
                                      "tools": p["tools"][seen[1]:], "stats": p["stats"][seen[2]:]}))
            seen = (*n, *seen[3:])
        for i in range(seen[4], len(calls)):
            c = calls[i]
            log.write(Call(p["k"], i, c["d"], c["role"], c["g"]))
        written[p["k"]] = (*seen[:3], tag, max(seen[4], len(calls)))


def _entry(t: Trajectory, group: str, start: Sequence[int] = (0, 0, 0),
           end: Sequence[int] | None = None) -> dict[str, Any]:
    """A program's entry in a snapshot (JSON-ready): the segments, tool calls and stats of
    ``t`` from ``start`` to ``end`` (its whole extent by default)."""
    end = extent(t) if end is None else end
    return {"k": t.id, "task": t.task_id, "sample": t.sample_index, "group": group,
            "segments": [x.to_dict() for x in t.segments[start[0]:end[0]]],
            "tools": [x.to_dict() for x in t.tool_calls[start[1]:end[1]]],
            "stats": [x.to_dict() for x in t.turns[start[2]:end[2]]]}


def _prefix(entry: dict[str, Any]) -> Trajectory:
    """The trajectory a snapshot's program entry holds (its environment's id is not in a
    snapshot: empty)."""
    t = Trajectory(entry["k"], "", entry["task"], entry.get("group") or "", entry["sample"], entry["prompt"],
                   [Segment(**x) for x in entry["segments"]], [ToolCall(**x) for x in entry["tools"]],
                   [TurnStats(**x) for x in entry["stats"]])
    if entry.get("calls"):  # an agent program: replayed from its calls (``agentenv.gateway.program``)
        t.metadata["gateway_log"] = list(entry["calls"])
    return t


def snapshot_of(state: LogState, task_id: str, finished: list[dict[str, Any]]) -> dict[str, Any]:
    """The :meth:`InFlight.snapshot` entry of one task from a loaded log (its partial
    programs) and its trajectories already in the output (``finished``, as dicts)."""
    group = state.groups.get(task_id, "")
    partial = []
    for (tid, _), p in sorted(state.partial.items()):
        if tid == task_id:
            entry = {**_entry(p, group), "prompt": p.prompt_ids}
            if p.metadata.get("gateway_log"):  # an agent program's logged calls
                entry["calls"], entry["calls_tag"] = list(p.metadata["gateway_log"]), secrets.token_hex(6)
            partial.append(entry)
    return {"partial": partial, "finished": finished}


def restore(snapshot: dict[str, Any]) -> tuple[LogState, list[Trajectory]]:
    """One task's entry of :meth:`InFlight.snapshot`: what to resume (partial programs, and the
    samples already finished) and the finished trajectories themselves."""
    finished = [Trajectory.from_dict(d) for d in snapshot["finished"]]
    partial = {}
    for r in snapshot["partial"]:
        t = _prefix(r)
        partial[(t.task_id, t.sample_index)] = t
    groups = {r["task"]: r["group"] for r in snapshot["partial"] if r.get("group")}
    groups.update({t.task_id: t.group_id for t in finished})
    by_task: dict[str, list[Trajectory]] = {}
    for t in finished:
        by_task.setdefault(t.task_id, []).append(t)
    return LogState({}, partial, {(t.task_id, t.sample_index) for t in finished}, groups, by_task), finished
