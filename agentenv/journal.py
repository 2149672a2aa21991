"""The durable event log of a rollout run: an append-only journal beside the output.

Format (version ``LOG_VERSION``): UTF-8 text, one record per line, ``<crc32 as 8 hex
digits> <json object>``. The CRC covers the JSON bytes, so a torn or corrupted record (a
crash mid-write) is detected; reading stops at the first bad record and a resume truncates
the file there. :func:`scan` (and :func:`records` and :func:`read` on it) is the one reader
of the format: a resume and ``agentenv view`` both read through it. Each record is a typed
dataclass (:class:`Header`, :class:`Start`, :class:`Turn`, :class:`Held`, :class:`Done`,
:class:`Call`) whose ``to_json()`` gives its object (``"e"`` names the event) and whose
``from_json()`` reads it back:

  {"e": "header", "v": 2, "settings": {...}}        first line: what the run is (every resume
        setting named; a version-1 header is read through :func:`upgrade`)
  {"e": "start", "k": key, "task": id, "sample": i, "group": gid, "prompt": [ids]}   a program started
  {"e": "turn", "k": key, "turn": n, "segments": [...], "tools": [...], "stats": [...]}
        a turn completed: the segments (model ids with logprobs and weight versions, env ids),
        tool calls and engine stats it added, exactly as in the trajectory
  {"e": "held", "k": key, "task": id, "sample": i, "traj": {...}}
        it finished, but its line waits: its group (an environment with a group reward) has a
        sample the engine failed on, and a group's lines are written together, scored whole
  {"e": "done", "k": key, "task": id, "sample": i}  its trajectory is in the output
  {"e": "call", "k": key, "n": n, "d": digest, "role": r, "g": {...}}
        an agent program's gateway call ``n`` was answered: the request's digest and the
        generation (sampled ids, logprobs, versions, finish); a resumed agent is answered from
        these while its requests match (``agentenv.gateway``)

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Iterator, Protocol, Sequence, Union

from .errors import AgentEnvError
from .trajectory import Segment, ToolCall, Trajectory, TurnStats

LOG_VERSION = 2
#: Version 1's headers could lack settings the CLI could not set when they were written; their
#: runs ran with these values, which :func:`upgrade` fills in (version 2 headers name them all).
V1_IMPLIED_SETTINGS: dict[str, Any] = {"top_k": 0, "max_tokens_per_turn": 256, "judge": None, "judge_weight": 1.0,
                                       "judge_group": False}


def encode(obj: dict[str, Any]) -> bytes:
    """One record's line: ``obj`` (a record's ``to_json()``) as compact JSON, after its CRC."""
    body = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def decode(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one record's line (its bytes with the newline); None when the line
    is torn (no newline: cut short mid-write) or corrupted (no ``<crc> `` prefix, a checksum
    that does not match, a body that is not a JSON object)."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        obj = json.loads(body) if int(line[:8], 16) == zlib.crc32(body) else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def scan(f: BinaryIO) -> Iterator[tuple[dict[str, Any], int]]:
    """The good records of an open log from its position on, each as its JSON object and the
    byte length of its line, up to the first torn or corrupted line (:func:`decode`). They end
    there, whatever follows: a resume truncates the log at that line and appends after it, so
    nothing past it is a record of the run. A reader of a live log stops at the line being
    written and reads on from there once it is whole."""
    for line in f:
        obj = decode(line)
        if obj is None:
            return
        yield obj, len(line)


def records(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of the log's good records, in order (:func:`scan`: a torn tail and
    anything from a corrupted line on are not records); :func:`parse` makes each a typed
    record."""
    with open(path, "rb") as f:
        for obj, _ in scan(f):
            yield obj


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a log's good records (:func:`scan`) and the byte length they span:
    where a resume truncates the log before appending."""
    objs: list[dict[str, Any]] = []
    good = 0
    with open(path, "rb") as f:
        for obj, n in scan(f):
            objs.append(obj)
            good += n
    return objs, good


# -- records --------------------------------------------------------------------------------
def extent(t: Trajectory) -> tuple[int, int, int]:
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
        return {"e": self.E, "k": self.key, "turn": self.turn, "segments": [s.to_dict() for s in self.segments],
                "tools": [t.to_dict() for t in self.tool_calls], "stats": [t.to_dict() for t in self.stats]}

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


@dataclass(slots=True)
class Call:
    """An agent program's gateway call was answered (see the module docstring)."""

    E: ClassVar[str] = "call"
    key: str
    n: int
    digest: str
    role: str
    generation: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"e": self.E, "k": self.key, "n": self.n, "d": self.digest, "role": self.role, "g": self.generation}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Call":
        return cls(obj["k"], obj["n"], obj["d"], obj.get("role", "main"), obj["g"])


Record = Union[Header, Start, Turn, Held, Done, Call]
_KINDS: dict[str, Any] = {k.E: k for k in (Header, Start, Turn, Held, Done, Call)}


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


def upgrade(head: Header) -> Header:
    """``head`` as this format version's header: the one place an older log's header is read.
    Version 1: its settings with the values its run used for those it could not name
    (:data:`V1_IMPLIED_SETTINGS`). A version this code does not know is refused, naming it."""
    if head.version == LOG_VERSION:
        return head
    if head.version == 1:
        return Header({**V1_IMPLIED_SETTINGS, **head.settings}, LOG_VERSION)
    raise AgentEnvError(f"event log version {head.version!r} is not one this agentenv reads (1 to {LOG_VERSION}): "
                        "a newer agentenv wrote it; resume it with that version")


def load_state(records: list[dict[str, Any]]) -> LogState:
    """The state a log's records (as :func:`read` gives them) leave: its settings, the samples
    done, the finished ones held back, and each unfinished program's trajectory as of its last
    ``turn`` record (a later ``start`` of the same sample wins)."""
    if not records or records[0].get("e") != Header.E:
        raise AgentEnvError("the event log has no header record")
    head = upgrade(Header.from_json(records[0]))
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
        elif isinstance(r, Call) and r.key in by_key:  # an agent program's answered call, for its replay
            log = by_key[r.key].metadata.setdefault("gateway_log", [])
            if r.n == len(log):
                log.append({"d": r.digest, "role": r.role, "g": r.generation})
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


def settings_difference(logged: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first setting a resume (``now``) has other than the log's header (upgraded), or None."""
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
        #: Where the log belongs: ``path``, or for a staged log the one it replaces on :meth:`commit`.
        self.target = path
        self._f = open(path, "ab", buffering=1 << 16)
        self._lock = threading.Lock()
        self._interval = flush_interval
        self._closed = threading.Event()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._flusher, name="agentenv-journal", daemon=True)
        self._thread.start()
        self.records = 0

    @classmethod
    def create(cls, path: Path, settings: dict[str, Any], *, staged: bool = False, **kw: Any) -> "Journal":
        """A new log at ``path`` (replacing any), its header written and synced. ``staged``: it
        is written beside ``path`` (``<path>.new``) and moved over it by :meth:`commit`, so that
        the log there stays whole until the run replacing it has started; :meth:`discard`
        drops it instead."""
        file = Path(f"{path}.new") if staged else path
        with open(file, "wb") as f:
            f.write(encode(Header(settings).to_json()))
            f.flush()
            os.fsync(f.fileno())
        log = cls(file, **kw)
        log.target = path
        return log

    def commit(self) -> None:
        """A staged log takes the place of the one it replaces (one atomic rename; records
        written so far and later stay in it). Nothing to do for a log written in place."""
        if self.path != self.target:
            os.replace(self.path, self.target)
            self.path = self.target

    def discard(self) -> None:
        """Close a staged log that was never committed and remove it: the log it was to replace
        is left as it was. Nothing to do for a log written in place or committed."""
        if self.path == self.target:
            return
        try:
            self.close()
        finally:
            self.path.unlink(missing_ok=True)

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
        mark[:] = extent(traj)

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

    def call(self, key: str, n: int, digest: str, role: str, generation: dict[str, Any]) -> None:
        """An agent program's gateway call ``n`` was answered."""
        self.write(Call(key, n, digest, role, generation))

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
