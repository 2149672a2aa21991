"""The durable event log of a rollout run: an append-only journal beside the output.

Format (version ``LOG_VERSION``): UTF-8 text, one record per line, ``<crc32 as 8 hex
digits> <json object>``. The CRC covers the JSON bytes, so a torn or corrupted record (a
crash mid-write) is detected; reading stops at the first bad record and a resume truncates
the file there. Each record is a typed dataclass (:class:`Header`, :class:`Start`,
:class:`Turn`, :class:`Held`, :class:`Done`) whose ``to_json()`` gives its object (``"e"``
names the event) and whose ``from_json()`` reads it back:

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
state is rebuilt by replaying its logged tool calls). :func:`load_state` reads a log's
records into that state (:class:`LogState`). Records are buffered and fsynced in batches
(``flush_interval``): a crash loses at most the last interval's turns, which are then
generated again.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence, Union

from .errors import AgentEnvError
from .trajectory import Segment, ToolCall, Trajectory, TurnStats

LOG_VERSION = 1


def encode(obj: dict[str, Any]) -> bytes:
    """One record's line: ``obj`` (a record's ``to_json()``) as compact JSON, after its CRC."""
    body = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a log's good records and the byte length they span (a torn tail is
    ignored); :func:`parse` makes each a typed record."""
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


# -- records --------------------------------------------------------------------------------
def _extent(t: Trajectory) -> tuple[int, int, int]:
    """How far ``t`` goes: its numbers of segments, tool calls and turns."""
    return len(t.segments), len(t.tool_calls), len(t.turns)


@dataclass(slots=True)
class Header:
    """The first record: the log's format version and the run's settings (a resume must use
    the same)."""

    E: ClassVar[str] = "header"
    settings: dict[str, Any]
    version: int | None = LOG_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "v": self.version, "settings": self.settings}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Header":
        return cls(obj.get("settings", {}), obj.get("v"))


@dataclass(slots=True)
class Start:
    """A program started, with its prompt's ids (``key`` is the trajectory's id)."""

    E: ClassVar[str] = "start"
    key: str
    task_id: str
    sample_index: int
    group_id: str
    prompt_ids: list[int]

    @classmethod
    def of(cls, traj: Trajectory) -> "Start":
        return cls(traj.id, traj.task_id, traj.sample_index, traj.group_id, traj.prompt_ids)

    def trajectory(self) -> Trajectory:
        """The program's trajectory as it started (its environment's id is not logged: empty)."""
        return Trajectory(self.key, "", self.task_id, self.group_id, self.sample_index, list(self.prompt_ids))

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "k": self.key, "task": self.task_id, "sample": self.sample_index,
                "group": self.group_id, "prompt": self.prompt_ids}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Start":
        return cls(obj["k"], obj["task"], obj["sample"], obj.get("group") or "", obj["prompt"])


@dataclass(slots=True)
class Turn:
    """A program completed turns: the segments, tool calls and engine stats its trajectory
    gained since its previous record; ``turn`` is how many turns it has completed."""

    E: ClassVar[str] = "turn"
    key: str
    turn: int
    segments: list[Segment]
    tool_calls: list[ToolCall]
    stats: list[TurnStats]

    @classmethod
    def of(cls, traj: Trajectory, since: Sequence[int]) -> "Turn":
        """What ``traj`` gained past ``since`` (its extent at the previous record)."""
        seg, tools, turns = since
        return cls(traj.id, len(traj.turns), traj.segments[seg:], traj.tool_calls[tools:], traj.turns[turns:])

    def extend(self, traj: Trajectory) -> None:
        """Add what this record holds to ``traj``, the program's trajectory so far."""
        traj.segments += self.segments
        traj.tool_calls += self.tool_calls
        traj.turns += self.stats

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "k": self.key, "turn": self.turn, "segments": [asdict(s) for s in self.segments],
                "tools": [asdict(t) for t in self.tool_calls], "stats": [asdict(t) for t in self.stats]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Turn":
        return cls(obj["k"], obj["turn"], [Segment(**s) for s in obj["segments"]],
                   [ToolCall(**t) for t in obj["tools"]], [TurnStats(**t) for t in obj["stats"]])


@dataclass(slots=True)
class Held:
    """A program finished, but its line waits for its group (see the module docstring);
    ``trajectory`` is the line it will be (:meth:`Trajectory.to_dict`)."""

    E: ClassVar[str] = "held"
    key: str
    task_id: str
    sample_index: int
    trajectory: dict[str, Any]

    @classmethod
    def of(cls, traj: Trajectory) -> "Held":
        return cls(traj.id, traj.task_id, traj.sample_index, traj.to_dict())

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "k": self.key, "task": self.task_id, "sample": self.sample_index,
                "traj": self.trajectory}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Held":
        return cls(obj["k"], obj["task"], obj["sample"], obj["traj"])


@dataclass(slots=True)
class Done:
    """A program's trajectory is in the output."""

    E: ClassVar[str] = "done"
    key: str
    task_id: str
    sample_index: int

    @classmethod
    def of(cls, traj: Trajectory) -> "Done":
        return cls(traj.id, traj.task_id, traj.sample_index)

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "k": self.key, "task": self.task_id, "sample": self.sample_index}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Done":
        return cls(obj["k"], obj["task"], obj["sample"])


Record = Union[Header, Start, Turn, Held, Done]
_KINDS: dict[str, Any] = {k.E: k for k in (Header, Start, Turn, Held, Done)}


def parse(obj: dict[str, Any]) -> Record | None:
    """The typed record of one JSON object of a log (None for an event this version does not
    know, which a reader skips)."""
    kind = _KINDS.get(obj.get("e"))  # type: ignore[arg-type]
    return None if kind is None else kind.from_json(obj)


# -- the state a log leaves -----------------------------------------------------------------
@dataclass(slots=True)
class LogState:
    """What a run's log (or a checkpoint's snapshot) says: what to skip and what to continue."""

    settings: dict[str, Any]
    # (task id, sample index) -> the unfinished program's trajectory as of its last logged turn
    partial: dict[tuple[str, int], Trajectory]
    done: set[tuple[str, int]]
    groups: dict[str, str] = field(default_factory=dict)  # task id -> its group's id (resumed groups keep it)
    # task id -> the trajectories of its unfinished group that are in the output already: a
    # resumed group is scored whole (its group reward sees every sample, not only the new ones)
    finished: dict[str, list[Trajectory]] = field(default_factory=dict)
    # (task id, sample index) -> a finished trajectory (as a dict) held back with its group
    held: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)


def load_state(records: list[dict[str, Any]]) -> LogState:
    """The state a log's records (as :func:`read` gives them) leave: its settings, the samples
    done, the finished ones held back, and each unfinished program's trajectory as of its last
    ``turn`` record (a later ``start`` of the same sample wins)."""
    if not records or records[0].get("e") != Header.E:
        raise AgentEnvError("the event log has no header record")
    head = Header.from_json(records[0])
    if head.version != LOG_VERSION:
        raise AgentEnvError(f"event log version {head.version!r} is not {LOG_VERSION}")
    state = LogState(head.settings, {}, set())
    by_key: dict[str, Trajectory] = {}
    for obj in records[1:]:
        r = parse(obj)
        if isinstance(r, Start):
            t = by_key[r.key] = r.trajectory()
            state.partial[(r.task_id, r.sample_index)] = t
            state.held.pop((r.task_id, r.sample_index), None)
            if r.group_id:
                state.groups[r.task_id] = r.group_id
        elif isinstance(r, Turn) and r.key in by_key:
            r.extend(by_key[r.key])
        elif isinstance(r, Held):
            state.held[(r.task_id, r.sample_index)] = r.trajectory
            state.partial.pop((r.task_id, r.sample_index), None)
        elif isinstance(r, Done):
            state.done.add((r.task_id, r.sample_index))
            state.partial.pop((r.task_id, r.sample_index), None)
            state.held.pop((r.task_id, r.sample_index), None)
    return state


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


#: Settings a header may lack because the CLI could not set them when it was written: such a
#: run ran with these values, so a resume with the same values continues it.
IMPLIED_SETTINGS: dict[str, Any] = {"top_k": 0, "max_tokens_per_turn": 256}


def settings_difference(logged: dict[str, Any], now: dict[str, Any]) -> str | None:
    logged = {**{k: v for k, v in IMPLIED_SETTINGS.items() if k in now}, **logged}
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
        """A new log at ``path`` (replacing any), its header written and synced."""
        with open(path, "wb") as f:
            f.write(encode(Header(settings).to_json()))
            f.flush()
            os.fsync(f.fileno())
        return cls(path, **kw)

    @classmethod
    def resume(cls, path: Path, settings: dict[str, Any], **kw: Any) -> tuple["Journal", LogState]:
        """The log at ``path``, to append to, and the state its records leave; refused when it
        was written with other ``settings``."""
        records, good = read(path)
        state = load_state(records)
        diff = settings_difference(state.settings, settings)
        if diff is not None:
            raise AgentEnvError(f"cannot resume with different settings: {diff}")
        with open(path, "r+b") as f:  # drop a torn tail before appending
            f.truncate(good)
        return cls(path, **kw), state

    def write(self, record: Record) -> None:
        """Append ``record`` (written to disk by the next batch's fsync)."""
        if self._error is not None:
            raise AgentEnvError(f"cannot write the event log {self.path}: {self._error}")
        data = encode(record.to_json())
        with self._lock:
            self._f.write(data)
            self.records += 1

    def start(self, traj: Trajectory) -> None:
        self.write(Start.of(traj))

    def turn(self, traj: Trajectory, mark: list[int]) -> None:
        """Log what ``traj`` gained since ``mark`` (segments, tool calls, turns), then move it."""
        self.write(Turn.of(traj, mark))
        mark[:] = _extent(traj)

    def resumed(self, traj: Trajectory) -> None:
        """A program continues from the log: its records are there already."""

    def finished(self, traj: Trajectory) -> None:
        """A program ended; ``done`` is logged once its line is in the output, not before."""

    def held(self, traj: Trajectory) -> None:
        """A finished program whose line waits for its group (see the module's ``held``)."""
        self.write(Held.of(traj))

    def done(self, traj: Trajectory) -> None:
        """``traj``'s line is in the output."""
        self.write(Done.of(traj))

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
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, _extent(traj))

    def turn(self, traj: Trajectory, mark: list[int]) -> None:
        mark[:] = _extent(traj)
        self._live.setdefault(traj.task_id, {})[traj.id] = (traj, _extent(traj))

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
                entry = _entry(t, t.group_id, start, m)
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
            log.write(Start.from_json(p))  # an entry has a start record's fields
            seen = written[p["k"]] = (0, 0, 0)
        if n[0] > seen[0]:
            log.write(Turn.from_json({"k": p["k"], "turn": n[2], "segments": p["segments"][seen[0]:],
                                      "tools": p["tools"][seen[1]:], "stats": p["stats"][seen[2]:]}))
            written[p["k"]] = n


def _entry(t: Trajectory, group: str, start: Sequence[int] = (0, 0, 0),
           end: Sequence[int] | None = None) -> dict[str, Any]:
    """A program's entry in a snapshot (JSON-ready): the segments, tool calls and stats of
    ``t`` from ``start`` to ``end`` (its whole extent by default)."""
    end = _extent(t) if end is None else end
    return {"k": t.id, "task": t.task_id, "sample": t.sample_index, "group": group,
            "segments": [asdict(x) for x in t.segments[start[0]:end[0]]],
            "tools": [asdict(x) for x in t.tool_calls[start[1]:end[1]]],
            "stats": [asdict(x) for x in t.turns[start[2]:end[2]]]}


def _prefix(entry: dict[str, Any]) -> Trajectory:
    """The trajectory a snapshot's program entry holds (its environment's id is not in a
    snapshot: empty)."""
    return Trajectory(entry["k"], "", entry["task"], entry.get("group") or "", entry["sample"], entry["prompt"],
                      [Segment(**x) for x in entry["segments"]], [ToolCall(**x) for x in entry["tools"]],
                      [TurnStats(**x) for x in entry["stats"]])


def snapshot_of(state: LogState, task_id: str, finished: list[dict[str, Any]]) -> dict[str, Any]:
    """The :meth:`InFlight.snapshot` entry of one task from a loaded log (its partial
    programs) and its trajectories already in the output (``finished``, as dicts)."""
    group = state.groups.get(task_id, "")
    partial = [{**_entry(p, group), "prompt": p.prompt_ids}
               for (tid, _), p in sorted(state.partial.items()) if tid == task_id]
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
