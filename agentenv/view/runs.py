"""What ``agentenv view`` shows: rollout files, eval reports and training runs, read as they grow.

:func:`open_run` tells the three apart by what ``path`` is:

* a rollout JSONL (``agentenv rollout --out``; one trajectory per line, docs/schemas.md) with
  its event log ``OUT.log`` beside it: a :class:`RolloutFile`;
* an eval report (the JSON ``agentenv eval --report`` writes, holding ``per_task``): an
  :class:`EvalRun`, whose trajectories are the JSONL its ``out`` names;
* a training run directory (``metrics.jsonl``, ``eval.jsonl``, ``summary.json``,
  ``config.json``; or its ``metrics.jsonl``): a :class:`TrainingRun`.

Every file is followed: :class:`Tail` keeps the byte offset it has read to and, on
``refresh()``, reads only the bytes appended since, keeping a torn last line for later. A file
that was rewritten (``--overwrite``, with a server up across it) is read again from the start,
whether it is now shorter or longer: it is another file (inode), shorter than what was read, or
its first bytes or the bytes before the offset are no longer the ones read there. The event
log is read by the journal's own reader (:class:`LogTail` on :func:`agentenv.journal.scan`),
so the viewer sees exactly the records a resume would.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import journal
from ..errors import AgentEnvError, ConfigError
from ..trajectory import Segment, Trajectory
from .tokens import TokenText, tokenizer_dir


class Tail:
    """The complete lines of a growing file, read once each. ``parse(line, at)`` turns a line's
    bytes (starting at byte ``at``) into an item (``None`` drops it); a rewritten file starts
    over (``generation`` counts, and ``restart()``, when given, is called before the file is
    read again). The file is read in chunks, so a large one never sits in memory whole; what
    is kept is what ``parse`` returns."""

    CHUNK = 1 << 24
    PROBE = 256  # bytes compared at the start of the file and before the offset

    def __init__(self, path: Path, parse: Callable[[bytes, int], Any],
                 restart: Callable[[], None] | None = None) -> None:
        self.path = path
        self.parse = parse
        self.restart = restart
        self.items: list[Any] = []
        self.offset = 0
        self.generation = 0
        self._inode: int | None = None
        self._head = b""  # the file's first bytes, as read
        self._mark = b""  # the bytes just before ``offset``, as read

    def _rewritten(self, f: Any, size: int) -> bool:
        """Whether the open file ``f`` is not the one read up to ``offset``: a rewrite that
        grew past the offset keeps neither its first bytes nor those before the offset."""
        if self.offset == 0:
            return False
        if size < self.offset or os.fstat(f.fileno()).st_ino != self._inode:
            return True
        f.seek(0)
        if f.read(len(self._head)) != self._head:
            return True
        f.seek(self.offset - len(self._mark))
        return f.read(len(self._mark)) != self._mark

    def _start_over(self) -> None:
        self.items, self.offset, self.generation = [], 0, self.generation + 1
        self._head = self._mark = b""
        if self.restart is not None:
            self.restart()

    def refresh(self) -> int:
        """Read what was appended; the number of new items."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:  # gone: what was read is gone with it
            if self.offset:
                self._start_over()
            return 0
        with f:
            size = os.fstat(f.fileno()).st_size
            if self._rewritten(f, size):
                self._start_over()
            self._inode = os.fstat(f.fileno()).st_ino
            before = len(self.items)
            if size > self.offset:
                self._read(f, size)
        return len(self.items) - before

    def _read(self, f: Any, size: int) -> None:
        """Parse the complete lines between ``offset`` and ``size``."""
        f.seek(self.offset)
        pending = b""
        while self.offset + len(pending) < size:
            data = pending + f.read(min(self.CHUNK, size - self.offset - len(pending)))
            end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
            if end == 0 and len(data) == len(pending):
                break
            at = self.offset
            for line in data[:end].split(b"\n")[:-1]:
                if line.strip():
                    item = self.parse(line, at)
                    if item is not None:
                        self.items.append(item)
                at += len(line) + 1
            self.offset += end
            pending = data[end:]
        self._remember(f)

    def _remember(self, f: Any) -> None:
        """Keep the first bytes of the file and those before ``offset``, as read: what
        :meth:`_rewritten` compares the next time."""
        if self.offset:
            if len(self._head) < self.PROBE:
                f.seek(0)
                self._head = f.read(min(self.PROBE, self.offset))
            f.seek(max(0, self.offset - self.PROBE))
            self._mark = f.read(self.offset - max(0, self.offset - self.PROBE))

    def line(self, at: int, length: int) -> bytes:
        """The bytes of the line at ``at`` (a position ``parse`` was given)."""
        with open(self.path, "rb") as f:
            f.seek(at)
            return f.read(length)


class LogTail(Tail):
    """A run's event log followed as it grows, read by the journal's own reader
    (:func:`agentenv.journal.scan`, the one a resume reads with): ``parse(record, at)`` gets
    each good record's JSON object and where its line starts. Reading stops at a torn or
    corrupted line and starts there again on the next :meth:`refresh`: a torn line is being
    written and is read once whole; a corrupted one ends the run's records, as it does for a
    resume, which truncates the log there and appends (then read on like any growth)."""

    def _read(self, f: Any, size: int) -> None:
        f.seek(self.offset)
        for obj, length in journal.scan(f):
            item = self.parse(obj, self.offset)
            if item is not None:
                self.items.append(item)
            self.offset += length
        self._remember(f)


def _json_line(line: bytes, at: int = 0) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


class Progress:
    """What a rollout's event log says of its programs, folded record by record as the log is
    read: the header, the keys started and done, and the programs in flight (started, not
    done) with their task, sample and turns. Nothing is kept per record, so memory grows with
    the programs, not the turns, and :meth:`figures` does not walk the log. Used as the log's
    :class:`LogTail` parse (it keeps no items) and restart."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (the log was rewritten)."""
        self.header: dict[str, Any] | None = None
        self.started: set[Any] = set()
        self.done: set[Any] = set()
        self.flight: dict[Any, list[Any]] = {}  # key -> [task, sample, turns], in order of start

    def __call__(self, rec: dict[str, Any], at: int = 0) -> None:
        """Fold one record (its JSON object, as :func:`agentenv.journal.scan` reads it)."""
        e, key = rec.get("e"), rec.get("k")
        if e == "header":
            self.header = self.header or rec
        elif e == "start":
            self.started.add(key)
            if key not in self.done:
                turns = self.flight[key][2] if key in self.flight else 0
                self.flight[key] = [rec.get("task"), rec.get("sample"), turns]
        elif e == "turn" and key not in self.done:
            self.flight.setdefault(key, [None, None, 0])[2] += 1
        elif e == "done":
            self.done.add(key)
            self.flight.pop(key, None)
        return None

    def figures(self, expected: int | None, limit: int = 50) -> dict[str, Any]:
        """Programs started and done, ``expected`` (the run's tasks x group size), and the
        first ``limit`` of those in flight."""
        flight = [{"task_id": t, "sample": s, "turns": n} for k, (t, s, n) in self.flight.items() if k in self.started]
        return {"started": len(self.started), "done": len(self.done), "expected": expected,
                "in_flight": flight[:limit], "in_flight_count": len(flight)}


def summary_of(row: dict[str, Any]) -> dict[str, Any]:
    """What the list of trajectories shows of one line."""
    tools = row.get("tool_calls") or []
    meta = row.get("metadata") or {}
    judged = row.get("reward_details") or {}  # a judge's verdict per component (agentenv.judge)
    branches = row.get("branches") or []  # an agent program's further sequences (docs/agents.md)
    return {
        "id": row["id"], "env": row.get("env", ""), "task_id": row.get("task_id", ""),
        "group_id": row.get("group_id", ""), "sample_index": row.get("sample_index", 0),
        "reward": row.get("reward"), "components": row.get("reward_components") or {},
        "finish_reason": row.get("finish_reason", ""), "error": row.get("error"),
        "tool_calls": len(tools), "tool_errors": sum(t.get("status") != "ok" for t in tools),
        "resumed": bool(meta.get("resumed")), "turns": len(row.get("turns") or []),
        "tokens": len(row.get("input_ids") or []), "sampled": sum(row.get("loss_mask") or []),
        "duration_s": row.get("duration_s", 0.0), "judged": sorted(judged),
        "judge_failures": sorted({d["failure"] for d in judged.values() if isinstance(d, dict) and d.get("failure")}),
        "branches": len(branches), "roles": list(dict.fromkeys(b["role"] for b in branches)),
    }


def advantages(rewards: list[float | None], eps: float = 1e-6) -> list[float | None]:
    """GRPO advantages of a group, as ``agentenv.train.loss.group_advantages`` computes them
    (reward minus the group's mean, over its std) over the scored samples; None where a
    sample has no reward (the trainer gives it advantage 0 and mask 0)."""
    scored = [r for r in rewards if r is not None]
    if not scored:
        return [None] * len(rewards)
    mean = sum(scored) / len(scored)
    std = (sum((r - mean) ** 2 for r in scored) / len(scored)) ** 0.5
    return [None if r is None else (r - mean) / (std + eps) for r in rewards]


@dataclass(frozen=True, slots=True)
class _Line:
    """What the viewer keeps of a trajectory line: its list row and where the line is (the
    rest is read again when asked for, so a large file is not held in memory)."""

    summary: dict[str, Any]
    at: int
    length: int


class MalformedLine(Exception):
    """A trajectory line that is JSON with an ``id`` but not a trajectory the viewer can show
    (a segment without ``token_ids``, a reward that is not a number, ...)."""


_NUMBER = (int, float)
_TYPES = {"id": str, "env": str, "task_id": str, "group_id": str, "finish_reason": str, "sample_index": int,
          "components": dict, "duration_s": _NUMBER, "tokens": int, "sampled": _NUMBER, "branches": int}


def _checked(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` when the page can show it (each field of the type the list expects); else
    TypeError naming the field."""
    for key, kind in _TYPES.items():
        if not isinstance(summary[key], kind) or isinstance(summary[key], bool) and kind is not bool:
            raise TypeError(f"{key} is {summary[key]!r}")
    if summary["reward"] is not None and (
        not isinstance(summary["reward"], _NUMBER) or isinstance(summary["reward"], bool)
    ):
        raise TypeError(f"reward is {summary['reward']!r}")
    if not all(isinstance(r, str) for r in summary["roles"]):
        raise TypeError(f"a branch's role is not a string: {summary['roles']!r}")
    return summary


def _malformed(row: dict[str, Any], at: int, exc: Exception) -> dict[str, Any]:
    """The list row of a line that is not a trajectory the viewer can show: its id and task
    when they are strings, and the error."""
    text = lambda key: row.get(key) if isinstance(row.get(key), str) else ""  # noqa: E731
    return {"id": str(row["id"]), "env": text("env"), "task_id": text("task_id"), "group_id": text("group_id"),
            "sample_index": 0, "reward": None, "components": {}, "finish_reason": "error: malformed line",
            "error": f"malformed line at byte {at}: {type(exc).__name__}: {exc}", "tool_calls": 0, "tool_errors": 0,
            "resumed": False, "turns": 0, "tokens": 0, "sampled": 0, "duration_s": 0.0, "judged": [],
            "judge_failures": [], "branches": 0, "roles": []}


def _trajectory_line(line: bytes, at: int) -> _Line | None:
    row = _json_line(line)
    if not isinstance(row, dict) or "id" not in row:
        return None
    try:
        summary = _checked(summary_of(row))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # shown as an error in its row
        summary = _malformed(row, at, exc)
    return _Line(summary, at, len(line))


def spans_of(prompt_length: int, segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The extents (token positions) of a sequence's prompt and of each of its segments."""
    at = prompt_length
    spans = [{"kind": "prompt", "start": 0, "end": at}]
    for seg in segments:
        span = {"kind": seg["kind"], "start": at, "end": at + len(seg["token_ids"])}
        if seg["kind"] == "model" and spans[-1]["kind"] == "model":
            span["continued"] = True  # the turn before stopped at its token cap (docs/schemas.md)
        spans.append(span)
        at += len(seg["token_ids"])
    return spans


def flat_arrays(branch: dict[str, Any]) -> dict[str, list[Any]]:
    """A branch's flat arrays (``input_ids``, ``loss_mask``, ``logprobs``, ``weight_versions``),
    which its line does not hold: derived from its segments by :class:`Trajectory`, as the main
    sequence's are and as the trainer's rows are (``Trajectory.sequences``)."""
    segments = [Segment(**s) for s in branch.get("segments") or []]
    seq = Trajectory("", "", "", "", 0, list(branch["prompt_ids"]), segments)
    return {"input_ids": seq.input_ids, "loss_mask": seq.loss_mask, "logprobs": seq.logprobs,
            "weight_versions": seq.weight_versions}


class RolloutFile:
    """A rollout JSONL and its event log, followed as they grow (the viewer's model of the file;
    the run that writes it is ``rollout_run.RolloutJob``)."""

    kind = "rollout"

    def __init__(self, path: Path, threshold: float = 1.0) -> None:
        self.path = path
        self.threshold = threshold
        self.lock = threading.Lock()
        self.rows = Tail(path, _trajectory_line)
        self.events = Progress()
        self.log = LogTail(path.with_name(path.name + ".log"), self.events, restart=self.events.clear)
        self._index: dict[str, int] = {}
        self._tokens: TokenText | None = None

    @property
    def label(self) -> str:
        return self.path.name

    def refresh(self) -> None:
        """Read what both files gained since the last call."""
        with self.lock:
            generation = self.rows.generation
            self.rows.refresh()
            self.log.refresh()
            if generation != self.rows.generation:
                self._index = {}
            for i in range(len(self._index), len(self.rows.items)):
                self._index[self.rows.items[i].summary["id"]] = i

    def settings(self) -> dict[str, Any]:
        """The run's settings from its log's header, upgraded to this format (empty without a
        log; as written, from a version this agentenv does not know)."""
        if self.events.header is None:
            return {}
        try:
            return journal.upgrade(journal.Header.from_json(self.events.header)).settings
        except AgentEnvError:
            return self.events.header.get("settings", {})

    def progress(self) -> dict[str, Any]:
        """What the event log says of programs: started, written, and those in flight (turns done)."""
        s = self.settings()
        expected = s["tasks"] * s["group_size"] if "tasks" in s and "group_size" in s else None
        return {"log": self.log.path.is_file(), **self.events.figures(expected)}

    def info(self) -> dict[str, Any]:
        self.refresh()
        model = self.settings().get("model")
        tok, own = tokenizer_dir(model)
        return {"kind": self.kind, "path": str(self.path), "label": self.label, "rows": len(self.rows.items),
                "settings": self.settings(), "threshold": self.threshold, "tokenizer": str(tok),
                "tokenizer_is_runs": own, "progress": self.progress()}

    def summaries(self, since: int = 0) -> dict[str, Any]:
        """The list's rows from ``since`` on, and the run's progress (the page polls this)."""
        self.refresh()
        with self.lock:
            items = self.rows.items[since:]
            return {"since": since, "total": len(self.rows.items), "generation": self.rows.generation,
                    "rows": [r.summary for r in items], "progress": self.progress()}

    def token_text(self) -> TokenText:
        if self._tokens is None:
            self._tokens = TokenText(tokenizer_dir(self.settings().get("model"))[0])
        return self._tokens

    def _row(self, line: _Line) -> dict[str, Any]:
        return json.loads(self.rows.line(line.at, line.length))

    def trajectory(self, tid: str) -> dict[str, Any] | None:
        """One line in full, with each token's text and the segments' extents."""
        self.refresh()
        with self.lock:
            i = self._index.get(tid)
            row = self._row(self.rows.items[i]) if i is not None else None
        if row is None:
            return None
        try:
            return self._shown(row)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise MalformedLine(f"{self.path.name}: the line of trajectory {tid!r} is malformed "
                                f"({type(exc).__name__}: {exc})") from None

    def _shown(self, row: dict[str, Any]) -> dict[str, Any]:
        """What :meth:`trajectory` answers for ``row``: its fields, its main sequence token by
        token (with its role, for an agent program's) and each of its ``branches`` the same way,
        numbered from 1 in the line's order, with its role."""
        keep = {k: v for k, v in row.items() if k not in ("input_ids", "prompt_ids", "segments", "loss_mask",
                                                          "logprobs", "weight_versions", "branches")}
        roles = ((row.get("metadata") or {}).get("gateway") or {}).get("roles") or [None]
        branches = [{"index": k, "role": b["role"],
                     **self._sequence(b["prompt_ids"], b.get("segments"), flat_arrays(b))}
                    for k, b in enumerate(row.get("branches") or [], 1)]
        return {**keep, "summary": summary_of(row), "role": roles[0],
                **self._sequence(row.get("prompt_ids"), row.get("segments"), row), "branches": branches}

    def _sequence(self, prompt_ids: list[int] | None, segments: list[dict[str, Any]] | None,
                flat: dict[str, Any]) -> dict[str, Any]:
        """One token sequence as the page draws it: its segments' extents (:func:`spans_of`) and
        per token its text, id, loss mask, logprob and weight version (``flat``'s arrays)."""
        ids = flat.get("input_ids") or []
        return {"spans": spans_of(len(prompt_ids or []), segments or []), "pieces": self.token_text().pieces(ids),
                "ids": ids, "loss_mask": flat.get("loss_mask"), "logprobs": flat.get("logprobs"),
                "weight_versions": flat.get("weight_versions")}

    def group(self, gid: str) -> list[dict[str, Any]]:
        """A group's samples side by side: each one's list row, completion text and advantage."""
        self.refresh()
        with self.lock:
            lines = sorted((r for r in self.rows.items if r.summary["group_id"] == gid),
                           key=lambda r: r.summary["sample_index"])
            texts = [self._row(r).get("text") or "" for r in lines]
        adv = advantages([r.summary["reward"] for r in lines])
        return [{**r.summary, "advantage": a, "text": t} for r, a, t in zip(lines, adv, texts)]

    def per_task(self) -> dict[str, dict[str, Any]]:
        """Each task's samples, passes (reward >= threshold, as ``agentenv.evaluation.report``
        counts them) and mean reward."""
        self.refresh()
        by_task: dict[str, list[float | None]] = defaultdict(list)
        with self.lock:
            for r in self.rows.items:
                by_task[r.summary["task_id"]].append(r.summary["reward"])
        out = {}
        for task, rewards in sorted(by_task.items()):
            scored = [r for r in rewards if r is not None]
            out[task] = {"task_id": task, "samples": len(rewards), "passed": sum(r >= self.threshold for r in scored),
                         "mean_reward": round(sum(scored) / len(scored), 4) if scored else None}
        return out


class EvalRun(RolloutFile):
    """An eval report and the trajectories it was computed from (its ``out``)."""

    kind = "eval"

    def __init__(self, path: Path) -> None:
        try:
            self.report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not an eval report ({exc})") from None
        out = Path(self.report.get("out") or path.with_suffix(".jsonl"))
        if not out.is_absolute() and not out.exists():
            out = path.parent / out
        super().__init__(out, threshold=float(self.report.get("threshold", 1.0)))
        self.report_path = path

    @property
    def label(self) -> str:
        return self.report_path.name

    def settings(self) -> dict[str, Any]:
        logged = super().settings()
        return logged or {k: self.report[k] for k in ("env", "env_args", "model", "seed") if k in self.report}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "report_path": str(self.report_path), "report": self.report}


_RATE_KEYS = ("gen_tokens_per_s", "step_s", "gen_idle_frac")


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def derived(rows: list[dict[str, Any]], window: int = 5) -> list[dict[str, float | None]]:
    """Per step row, the series ``agentenv plot`` draws that are not in the row, computed by
    its own functions (:func:`agentenv.train.plot.moving`, :func:`~agentenv.train.plot.throughput`):
    ``reward_moving`` (the reward's moving mean over ``window`` steps),
    ``gen_tokens_per_s_measured`` (the generation rate, None in an interval in which the
    generator was busy but no program finished: it measured no rate) and
    ``gen_tokens_per_s_run_mean`` (the run's mean rate up to that step, where measured)."""
    from ..train.plot import moving, throughput

    reward = moving([_number(r.get("reward_mean")) for r in rows], window)
    timed = [(i, r) for i, r in enumerate(rows) if all(not math.isnan(_number(r.get(k))) for k in _RATE_KEYS)]
    at, rate, mean = throughput([{**{k: r[k] for k in _RATE_KEYS}, "step": i} for i, r in timed])
    rates, means = dict(zip(at, rate)), dict(zip(at, mean))
    return [{"reward_moving": None if math.isnan(reward[i]) else reward[i],
             "gen_tokens_per_s_measured": rates.get(i), "gen_tokens_per_s_run_mean": means.get(i)}
            for i in range(len(rows))]


class TrainingRun:
    """A training run's directory: its step and evaluation rows (followed), summary and config.
    The step rows are served with the series :func:`derived` adds (``agentenv plot``'s)."""

    kind = "train"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.metrics = Tail(path / "metrics.jsonl", _json_line)
        self.evals = Tail(path / "eval.jsonl", _json_line)

    @property
    def label(self) -> str:
        return self.path.name

    def _json(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def info(self) -> dict[str, Any]:
        """The run's summary and its config by flat option name (``steps``, ``mode``), whichever
        layout its config.json has (by concern, or flat as runs before the concerns wrote it)."""
        from ..train.config import saved_settings

        with self.lock:
            self.metrics.refresh()
        config = self._json("config.json")
        return {"kind": self.kind, "path": str(self.path), "label": self.label, "rows": len(self.metrics.items),
                "config": saved_settings(config) if isinstance(config, dict) else None,
                "summary": self._json("summary.json")}

    def curves(self, since: int = 0, evals_since: int = 0) -> dict[str, Any]:
        """Step rows from ``since`` on, each with its :func:`derived` series, and evaluation rows
        from ``evals_since`` on (the page polls)."""
        with self.lock:
            self.metrics.refresh()
            self.evals.refresh()
            rows = self.metrics.items
            more = derived(rows) if since < len(rows) else []  # a run mean needs the rows before
            return {
                "since": since,
                "total": len(rows),
                "rows": [{**r, **d} for r, d in zip(rows[since:], more[since:])],
                "evals_total": len(self.evals.items),
                "evals": self.evals.items[evals_since:],
                "summary": self._json("summary.json"),
            }


#: The former name of :class:`RolloutFile` (deprecated: it named the file, not a run).
RolloutRun = RolloutFile
Run = RolloutFile | EvalRun | TrainingRun


def open_run(path: str | Path) -> Run:
    """The run at ``path``: a training run directory (or its metrics.jsonl), an eval report
    (.json) or a rollout JSONL (which may not exist yet when its event log does: a run that
    has only started). ConfigError when it is none of these."""
    path = Path(path)
    if path.is_dir():
        if (path / "metrics.jsonl").is_file() or (path / "config.json").is_file():
            return TrainingRun(path)
        raise ConfigError(f"{path}: a directory without metrics.jsonl (not a training run)")
    if path.name == "metrics.jsonl":
        return TrainingRun(path.parent)
    if path.suffix == ".json":
        return EvalRun(path)
    if not path.is_file() and not path.with_name(path.name + ".log").is_file():
        raise ConfigError(f"{path}: no such rollout file (nor its event log {path.name}.log)")
    _check_rollout(path)
    return RolloutFile(path)


def _check_rollout(path: Path) -> None:
    """ConfigError unless ``path`` is a rollout file: its first line a trajectory (a JSON
    object with an ``id`` and a ``task_id``). A file with no complete line yet is one when its
    event log is beside it (a run that is writing it, followed live)."""
    if path.name.endswith(".jsonl.log"):
        raise ConfigError(f"{path} is a rollout's event log: view its output, {path.name[:-4]} (the log beside it "
                          "is read with it)")
    if not path.is_file():
        return  # its log is there: a run that has only started
    with open(path, "rb") as f:
        first = f.readline()
    if not first.endswith(b"\n") and path.with_name(path.name + ".log").is_file():
        return  # empty, or its first line still being written
    row = _json_line(first.strip())
    if not (isinstance(row, dict) and "id" in row and "task_id" in row):
        why = (
            "it is empty, with no event log beside it"
            if not first.strip()
            else ("line 1 is not JSON" if row is None else "line 1 is not a trajectory: no id and task_id")
        )
        raise ConfigError(f"{path} is not a rollout file, an eval report or a training run ({why}); agentenv "
                          "view takes a rollout JSONL, an eval report (.json) or a run directory")


__all__ = ["EvalRun", "LogTail", "MalformedLine", "Progress", "RolloutFile", "RolloutRun", "Run", "Tail",
           "TrainingRun", "advantages", "derived", "open_run", "summary_of"]
