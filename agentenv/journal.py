"""The durable event log of a rollout run: an append-only journal beside the output.

Format (version ``LOG_VERSION``): UTF-8 text, one record per line, ``<crc32 as 8 hex
digits> <json object>``. The CRC covers the JSON bytes, so a torn or corrupted record (a
crash mid-write) is detected; reading stops at the first bad record and a resume truncates
the file there. Records (``"e"`` names the event):

  {"e": "header", "v": 1, "settings": {...}}        first line: what the run is
  {"e": "start", "k": key, "task": id, "sample": i, "group": gid, "prompt": [ids]}   a program started
  {"e": "turn", "k": key, "turn": n, "segments": [...], "tools": [...], "stats": [...]}
        a turn completed: the segments (model ids with logprobs and weight versions, env ids),
        tool calls and engine stats it added, exactly as in the trajectory
  {"e": "held", "k": key, "task": id, "sample": i, "traj": {...}}
        it finished, but its line waits: its group (an environment with a group reward) has a
        sample the engine failed on, and a group's lines are written together, scored whole
  {"e": "done", "k": key, "task": id, "sample": i}  its trajectory is in the output

A program is resumed from its last ``turn`` record: the state at the start of a turn is the
trajectory so far, so the rest of the program runs as if it had never stopped (its notebook
state is rebuilt by replaying its logged tool calls). Records are buffered and fsynced in
batches (``flush_interval``): a crash loses at most the last interval's turns, which are
then generated again.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .errors import AgentEnvError
from .trajectory import Segment, ToolCall, Trajectory, TurnStats

LOG_VERSION = 1


def encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, ensure_ascii=True, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The good records of a log and the byte length they span (a torn tail is ignored)."""
    records: list[dict[str, Any]] = []
    good = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
                break
            body = line[9:-1]
            try:
                if int(line[:8], 16) != zlib.crc32(body):
                    break
                records.append(json.loads(body))
            except ValueError:
                break
            good += len(line)
    return records, good


@dataclass(slots=True)
class Partial:
    """An unfinished program as the log left it."""

    key: str
    task_id: str
    sample_index: int
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)


@dataclass(slots=True)
class LogState:
    settings: dict[str, Any]
    partial: dict[tuple[str, int], Partial]  # (task id, sample index) -> its last state
    done: set[tuple[str, int]]
    groups: dict[str, str] = field(default_factory=dict)  # task id -> its group's id (resumed groups keep it)
    # task id -> the trajectories of its unfinished group that are in the output already: a
    # resumed group is scored whole (its group reward sees every sample, not only the new ones)
    finished: dict[str, list[Trajectory]] = field(default_factory=dict)
    # (task id, sample index) -> a finished trajectory (as a dict) held back with its group
    held: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)


def replay(records: list[dict[str, Any]]) -> LogState:
    if not records or records[0].get("e") != "header":
        raise AgentEnvError("the event log has no header record")
    if records[0].get("v") != LOG_VERSION:
        raise AgentEnvError(f"event log version {records[0].get('v')!r} is not {LOG_VERSION}")
    by_key: dict[str, Partial] = {}
    partial: dict[tuple[str, int], Partial] = {}
    done: set[tuple[str, int]] = set()
    groups: dict[str, str] = {}
    held: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records[1:]:
        e = r.get("e")
        if e == "start":
            p = Partial(r["k"], r["task"], r["sample"], r["prompt"])
            by_key[p.key] = p
            partial[(p.task_id, p.sample_index)] = p  # a later start of the same sample wins
            held.pop((p.task_id, p.sample_index), None)
            if r.get("group"):
                groups[p.task_id] = r["group"]
        elif e == "turn" and r["k"] in by_key:
            p = by_key[r["k"]]
            p.segments += [Segment(**s) for s in r["segments"]]
            p.tool_calls += [ToolCall(**t) for t in r["tools"]]
            p.turns += [TurnStats(**t) for t in r["stats"]]
        elif e == "held":
            held[(r["task"], r["sample"])] = r["traj"]
            partial.pop((r["task"], r["sample"]), None)
        elif e == "done":
            done.add((r["task"], r["sample"]))
            partial.pop((r["task"], r["sample"]), None)
            held.pop((r["task"], r["sample"]), None)
    return LogState(records[0]["settings"], partial, done, groups, held=held)


def finished_lines(out: Path) -> tuple[set[tuple[str, int]], int]:
    """The (task, sample) of every complete trajectory line in ``out`` and the byte length
    those lines span (a torn last line, from a crash mid-write, is not counted)."""
    done: set[tuple[str, int]] = set()
    good = 0
    with open(out, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                d = json.loads(line)
                key = (d["task_id"], d["sample_index"])
            except (ValueError, KeyError, TypeError):
                break
            done.add(key)
            good += len(line)
    return done, good


def lines_of(out: Path, task_ids: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The trajectory lines in ``out`` of the tasks in ``task_ids``, as dicts, by task."""
    found: dict[str, list[dict[str, Any]]] = {}
    if task_ids and out.exists():  # none asked for: the output is not read
        with out.open(encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                if d["task_id"] in task_ids:
                    found.setdefault(d["task_id"], []).append(d)
    return found


def settings_difference(logged: dict[str, Any], now: dict[str, Any]) -> str | None:
    for key in sorted(set(logged) | set(now)):
        if logged.get(key) != now.get(key):
            return f"{key} was {logged.get(key)!r}, now {now.get(key)!r}"
    return None


class ProgramLog(Protocol):
    """What a program and the reactor tell a log: :class:`Journal` (the rollout CLI's, on
    disk) and :class:`InFlight` (the trainer's, in memory, saved with each checkpoint)."""

    def start(self, traj: Trajectory) -> None: ...
    def resumed(self, traj: Trajectory) -> None: ...
    def turn(self, traj: Trajectory, mark: list[int]) -> None: ...
    def finished(self, traj: Trajectory) -> None: ...


class Journal:
    """Appends records; a background thread fsyncs them in batches. Thread-safe."""

    def __init__(self, path: Path, *, flush_interval: float = 0.2) -> None:
        self.path = path
        self._f = open(path, "ab", buffering=1 << 16)
        self._lock = threading.Lock()
        self._interval = flush_interval
        self._closed = threading.Event()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._flusher, name="agentenv-journal", daemon=True)
        self._thread.start()
        self.records = 0

    @classmethod
    def create(cls, path: Path, settings: dict[str, Any], **kw: Any) -> "Journal":
        with open(path, "wb") as f:
            f.write(encode({"e": "header", "v": LOG_VERSION, "settings": settings}))
            f.flush()
            os.fsync(f.fileno())
        return cls(path, **kw)

    @classmethod
    def resume(cls, path: Path, settings: dict[str, Any], **kw: Any) -> tuple["Journal", LogState]:
        records, good = read(path)
        state = replay(records)
        diff = settings_difference(state.settings, settings)
        if diff is not None:
            raise AgentEnvError(f"cannot resume with different settings: {diff}")
        with open(path, "r+b") as f:  # drop a torn tail before appending
            f.truncate(good)
        return cls(path, **kw), state

    def write(self, record: dict[str, Any]) -> None:
        if self._error is not None:
            raise AgentEnvError(f"cannot write the event log {self.path}: {self._error}")
        data = encode(record)
        with self._lock:
            self._f.write(data)
            self.records += 1

    def start(self, traj: Trajectory) -> None:
        self.write({"e": "start", "k": traj.id, "task": traj.task_id, "sample": traj.sample_index,
                    "group": traj.group_id, "prompt": traj.prompt_ids})

    def turn(self, traj: Trajectory, mark: list[int]) -> None:
        """Log what ``traj`` gained since ``mark`` (segments, tool calls, turns), then move it."""
        seg, tools, turns = mark
        self.write({"e": "turn", "k": traj.id, "turn": len(traj.turns),
                    "segments": [asdict(s) for s in traj.segments[seg:]],
                    "tools": [asdict(t) for t in traj.tool_calls[tools:]],
                    "stats": [asdict(t) for t in traj.turns[turns:]]})
        mark[:] = [len(traj.segments), len(traj.tool_calls), len(traj.turns)]

    def resumed(self, traj: Trajectory) -> None:
        """A program continues from the log: its records are there already."""

    def finished(self, traj: Trajectory) -> None:
        """A program ended; ``done`` is logged once its line is in the output, not before."""

    def held(self, traj: Trajectory) -> None:
        """A finished program whose line waits for its group (see the module's ``held``)."""
        self.write({"e": "held", "k": traj.id, "task": traj.task_id, "sample": traj.sample_index,
                    "traj": traj.to_dict()})

    def done(self, traj: Trajectory) -> None:
        self.write({"e": "done", "k": traj.id, "task": traj.task_id, "sample": traj.sample_index})

    def sync(self) -> None:
        try:
            with self._lock:  # writers wait only for the copy into the OS, not for the disk
                self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            self._error = exc
        if self._error is not None:
            raise AgentEnvError(f"cannot write the event log {self.path}: {self._error}")

    def _flusher(self) -> None:
        while not self._closed.wait(self._interval):
            try:
                self.sync()
            except AgentEnvError:
                return

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join()
        try:
            self.sync()
        finally:
            try:
                self._f.close()
            except OSError:
                pass  # the error is recorded (and raised by sync)


class InFlight:
    """The in-memory counterpart of :class:`Journal` for the trainer: it keeps a reference to
    every running program's trajectory and how far it was complete at its last logged turn, and
    the finished (scored) trajectories of groups not yet complete, so a checkpoint can save
    exactly the in-flight work (:meth:`snapshot`) and a resumed run continue it."""

    def __init__(self) -> None:
        self._live: dict[str, dict[str, tuple[Trajectory, tuple[int, int, int]]]] = {}  # task -> key -> ...
        self._finished: dict[str, list[Trajectory]] = {}

    def start(self, traj: Trajectory) -> None:
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, (0, 0, 0))

    def resumed(self, traj: Trajectory) -> None:
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, (len(traj.segments), len(traj.tool_calls),
                                                                  len(traj.turns)))

    def turn(self, traj: Trajectory, mark: list[int]) -> None:
        mark[:] = [len(traj.segments), len(traj.tool_calls), len(traj.turns)]
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, tuple(mark))  # type: ignore[assignment]

    def finished(self, traj: Trajectory) -> None:
        self._live.get(traj.task_id, {}).pop(traj.id, None)
        self._finished.setdefault(traj.task_id, []).append(traj)

    def forget(self, task_id: str) -> None:
        """The task's group is complete (it went to the buffer)."""
        self._live.pop(task_id, None)
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
                entry = {"k": t.id, "task": t.task_id, "sample": t.sample_index, "group": t.group_id,
                         "segments": [asdict(x) for x in t.segments[start[0]:m[0]]],
                         "tools": [asdict(x) for x in t.tool_calls[start[1]:m[1]]],
                         "stats": [asdict(x) for x in t.turns[start[2]:m[2]]]}
                if base is None:  # new to the caller
                    entry["prompt"] = t.prompt_ids
                if held is not None:
                    entry["base"] = list(start)
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


def holding(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    """What one task's snapshot (whole, as :meth:`InFlight.snapshot` or :func:`merge_snapshot`
    gives it) holds: each program's (segments, tool calls, stats) counts and the finished
    trajectories' ids. The ``have`` entry for :meth:`InFlight.snapshot`."""
    if not snapshot:
        return {"partial": {}, "finished": []}
    return {"partial": {p["k"]: (len(p["segments"]), len(p["tools"]), len(p["stats"])) for p in snapshot["partial"]},
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
        partial.append(p)
    finished = {d["id"]: d for d in (held or {}).get("finished", [])}
    finished.update((d["id"], d) for d in reply["finished"])
    return {"partial": partial, "finished": [finished[i] for i in reply["finished_ids"]]}


def log_snapshot(log: Journal, snapshot: dict[str, Any], written: dict[str, tuple[int, int, int]]) -> None:
    """Append to ``log`` what one task's :meth:`InFlight.snapshot` entry adds to it: a ``start``
    record for a program it has not seen, a ``turn`` record with the segments, tool calls and
    stats logged since (``written`` remembers how far each program's records go). A Ray
    rollout driver logs its workers' snapshots so, so a ``--resume`` continues their programs."""
    for p in snapshot["partial"]:
        n = (len(p["segments"]), len(p["tools"]), len(p["stats"]))
        seen = written.get(p["k"])
        if seen is None:
            log.write({"e": "start", "k": p["k"], "task": p["task"], "sample": p["sample"], "group": p["group"],
                       "prompt": p["prompt"]})
            seen = written[p["k"]] = (0, 0, 0)
        if n[0] > seen[0]:
            log.write({"e": "turn", "k": p["k"], "turn": n[2], "segments": p["segments"][seen[0]:],
                       "tools": p["tools"][seen[1]:], "stats": p["stats"][seen[2]:]})
            written[p["k"]] = n


def snapshot_of(state: LogState, task_id: str, finished: list[dict[str, Any]]) -> dict[str, Any]:
    """The :meth:`InFlight.snapshot` entry of one task from a replayed log (its partial
    programs) and its trajectories already in the output (``finished``, as dicts)."""
    partial = [{"k": p.key, "task": p.task_id, "sample": p.sample_index, "group": state.groups.get(task_id, ""),
                "prompt": p.prompt_ids, "segments": [asdict(x) for x in p.segments],
                "tools": [asdict(x) for x in p.tool_calls], "stats": [asdict(x) for x in p.turns]}
               for (tid, _), p in sorted(state.partial.items()) if tid == task_id]
    return {"partial": partial, "finished": finished}


def restore(snapshot: dict[str, Any]) -> tuple[LogState, list[Trajectory]]:
    """One task's entry of :meth:`InFlight.snapshot`: what to resume (partial programs, and the
    samples already finished) and the finished trajectories themselves."""
    finished = [Trajectory.from_dict(d) for d in snapshot["finished"]]
    partial = {}
    for r in snapshot["partial"]:
        p = Partial(r["k"], r["task"], r["sample"], r["prompt"], [Segment(**x) for x in r["segments"]],
                    [ToolCall(**x) for x in r["tools"]], [TurnStats(**x) for x in r["stats"]])
        partial[(p.task_id, p.sample_index)] = p
    groups = {r["task"]: r["group"] for r in snapshot["partial"] if r.get("group")}
    groups.update({t.task_id: t.group_id for t in finished})
    by_task: dict[str, list[Trajectory]] = {}
    for t in finished:
        by_task.setdefault(t.task_id, []).append(t)
    return LogState({}, partial, {(t.task_id, t.sample_index) for t in finished}, groups, by_task), finished
