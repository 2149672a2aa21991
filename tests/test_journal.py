"""The event log (``agentenv.journal``): checksummed records, replay into finished, held and
partial programs, and resume on the same settings, on real files."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from agentenv import journal
from agentenv.errors import AgentEnvError
from agentenv.trajectory import ToolCall, Trajectory, TurnStats


def program(key: str, sample: int, task: str = "t") -> Trajectory:
    return Trajectory(key, "env", task, f"{task}#g", sample, [1, 2, 3])


def turn(t: Trajectory, log, mark: list[int], n: int = 4) -> None:
    """One completed turn of ``t`` (sampled ids, a tool call, its output spliced), logged."""
    t.add_model(list(range(10, 10 + n)), [-0.5] * n, len(t.turns))
    t.tool_calls.append(ToolCall(len(t.turns), "python", {"code": "1 + 1"}, "2", "ok", 0.01))
    t.add_env([7, 8])
    t.turns.append(TurnStats(t.num_tokens - n - 2, 0, n, "stop", 0.1, len(t.turns)))
    log.turn(t, mark)


def test_a_program_logged_turn_by_turn_replays_as_its_last_state_until_done(tmp_path: Path):
    path = tmp_path / "run.log"
    log = journal.Journal.create(path, {"seed": 1})
    a, b = program("ka", 0), program("kb", 1)
    marks = {}
    for t in (a, b):
        log.start(t)
        marks[t.id] = [0, 0, 0]
    turn(a, log, marks["ka"])
    turn(a, log, marks["ka"], n=3)
    turn(b, log, marks["kb"])
    log.close()
    state = journal.load_state(journal.read(path)[0])
    assert state.settings == {"seed": 1} and state.groups == {"t": "t#g"} and state.done == set()
    p = state.partial[("t", 0)]
    assert (p.id, p.prompt_ids) == ("ka", a.prompt_ids)
    assert (p.segments, p.tool_calls, p.turns) == (a.segments, a.tool_calls, a.turns)  # two turns, in order
    assert state.partial[("t", 1)].segments == b.segments
    log = journal.Journal(path)  # appending to an existing log
    log.done(a)
    log.close()
    state = journal.load_state(journal.read(path)[0])
    assert state.done == {("t", 0)} and set(state.partial) == {("t", 1)}


def test_resume_drops_a_torn_tail_and_refuses_other_settings(tmp_path: Path):
    path = tmp_path / "run.log"
    log = journal.Journal.create(path, {"seed": 1, "tasks": 3})
    log.start(program("ka", 0))
    log.close()
    good = path.read_bytes()
    path.write_bytes(good + b"0000beef {\"e\": \"do")  # a crash in the middle of a write
    with pytest.raises(AgentEnvError, match="cannot resume with different settings: seed was 1, now 2"):
        journal.Journal.resume(path, {"seed": 2, "tasks": 3})
    log, state = journal.Journal.resume(path, {"seed": 1, "tasks": 3})
    assert path.read_bytes() == good and set(state.partial) == {("t", 0)}
    log.done(program("ka", 0))
    log.close()
    records, size = journal.read(path)
    assert size == path.stat().st_size and [r["e"] for r in records] == ["header", "start", "done"]
    assert journal.settings_difference({"a": 1}, {"a": 1}) is None
    assert journal.settings_difference({"a": 1}, {"a": 1, "b": 2}) == "b was None, now 2"


def test_a_version_1_header_is_read_through_the_upgrade(tmp_path):
    """Version 1 headers could lack settings added later (top_k, max_tokens_per_turn, the
    judge's): their runs ran with the defaults, which the upgrade names; a resume with those
    continues the run, one with other values is refused; this version's own are untouched."""
    v1 = journal.Header({"seed": 1, "top_k": 0}, 1)
    up = journal.upgrade(v1)
    assert up.version == journal.LOG_VERSION == 2
    assert up.settings == {"seed": 1, "top_k": 0, "max_tokens_per_turn": 256, "judge": None, "judge_weight": 1.0,
                           "judge_group": False}
    assert journal.upgrade(up) is up
    path = tmp_path / "v1.log"
    path.write_bytes(journal.encode(v1.to_json()))
    now = {**up.settings, "seed": 1}
    log, state = journal.Journal.resume(path, now)
    log.close()
    assert state.settings == up.settings
    with pytest.raises(AgentEnvError, match="cannot resume with different settings: max_tokens_per_turn was 256, "
                                            "now 512"):
        journal.Journal.resume(path, {**now, "max_tokens_per_turn": 512})


def test_a_log_without_a_header_or_of_another_version_is_refused():
    with pytest.raises(AgentEnvError, match="no header"):
        journal.load_state([{"e": "start"}])
    newer = rf"version 99 is not one this agentenv reads \(1 to {journal.LOG_VERSION}\)"
    with pytest.raises(AgentEnvError, match=newer):
        journal.load_state([{"e": "header", "v": 99, "settings": {}}])


def test_the_outputs_complete_lines_are_found_and_a_torn_last_line_is_not(tmp_path: Path):
    out = tmp_path / "r.jsonl"
    lines = [
        json.dumps({"task_id": t, "sample_index": i, "reward": 1.0}) + "\n" for t, i in (("a", 0), ("b", 0), ("a", 1))
    ]
    out.write_text("".join(lines) + '{"task_id": "b", "sam')
    done, size = journal.finished_lines(out)
    assert done == {("a", 0), ("b", 0), ("a", 1)} and size == len("".join(lines))
    out.write_text("".join(lines))
    found = journal.lines_of(out, {"a"})
    assert [d["sample_index"] for d in found["a"]] == [0, 1] and set(found) == {"a"}
    assert journal.lines_of(tmp_path / "missing.jsonl", {"a"}) == {}


def test_a_torn_log_record_is_ignored(tmp_path):
    path = tmp_path / "x.log"
    j = journal.Journal.create(path, {"a": 1})
    j.write(journal.Done("k1", "t", 0))
    j.close()
    good = path.read_bytes()
    path.write_bytes(good + journal.encode({"e": "done", "k": "k2", "task": "t", "sample": 1})[:-7])
    records, size = journal.read(path)
    assert size == len(good) and journal.load_state(records).done == {("t", 0)}
    flipped = bytearray(good)
    flipped[-5] ^= 1  # a corrupted last record fails its checksum
    path.write_bytes(bytes(flipped))
    assert len(journal.read(path)[0]) == 1


def test_records_are_the_logs_good_records_in_order_up_to_a_torn_or_corrupted_line(tmp_path):
    """``records`` (and ``read``, and the viewer's tail, through ``scan``): every good record in
    the order written; a torn last line is none, and a line failing its checksum ends them
    (the resume truncates there, so what follows it is not the run's)."""
    path = tmp_path / "x.log"
    j = journal.Journal.create(path, {"a": 1})
    for i in range(3):
        j.write(journal.Start(f"k{i}", "t", i, "g", [1, 2]))
    j.write(journal.Done("k0", "t", 0))
    j.close()
    written = path.read_bytes()
    kinds = [("header", None), ("start", "k0"), ("start", "k1"), ("start", "k2"), ("done", "k0")]
    assert [(r["e"], r.get("k")) for r in journal.records(path)] == kinds
    assert [type(journal.parse(r)) for r in journal.records(path)] == [journal.Header] + [journal.Start] * 3 + [
        journal.Done]
    torn = journal.encode(journal.Done("k1", "t", 1).to_json())
    path.write_bytes(written + torn[:-1])  # no newline yet: being written, or cut short by a crash
    assert [(r["e"], r.get("k")) for r in journal.records(path)] == kinds
    path.write_bytes(written + torn)
    assert [(r["e"], r.get("k")) for r in journal.records(path)] == kinds + [("done", "k1")]
    lines = written.splitlines(keepends=True)
    bad = lines[2].replace(b'"k1"', b'"k9"')  # the same framing, a body its checksum does not cover
    assert journal.decode(bad) is None and journal.decode(lines[2])["k"] == "k1"
    path.write_bytes(b"".join(lines[:2] + [bad] + lines[3:]))
    assert [(r["e"], r.get("k")) for r in journal.records(path)] == kinds[:2]
    assert journal.read(path) == (list(journal.records(path)), len(lines[0]) + len(lines[1]))
    for junk in (b"\n", b"not a record\n", b"%08x [1, 2]\n" % zlib.crc32(b"[1, 2]")):  # no record: not an object
        assert journal.decode(junk) is None


def test_a_held_trajectory_replays_as_held_until_its_line_is_done(tmp_path):
    """``held``: a finished trajectory waiting for its group. It is no longer in flight; a
    ``done`` for it (its line written) or a new ``start`` of the sample ends the wait."""
    path = tmp_path / "x.log"
    j = journal.Journal.create(path, {"a": 1})
    t0 = Trajectory(id="k0", env="e", task_id="t", group_id="g", sample_index=0, prompt_ids=[1, 2],
                    finish_reason="stop")
    t0.add_model([3, 4], [-0.5, -0.25], [0, 0])
    for k, i in (("k0", 0), ("k1", 1), ("k2", 2)):
        j.write(journal.Start(k, "t", i, "g", [1, 2]))
    j.held(t0)
    j.held(Trajectory(id="k1", env="e", task_id="t", group_id="g", sample_index=1, prompt_ids=[1, 2],
                      finish_reason="stop"))
    j.close()
    state = journal.load_state(journal.read(path)[0])
    assert set(state.partial) == {("t", 2)} and set(state.held) == {("t", 0), ("t", 1)}
    assert Trajectory.from_dict(state.held[("t", 0)]).segments == t0.segments
    j = journal.Journal(path)
    j.done(t0)
    j.write(journal.Start("k3", "t", 1, "g", [1, 2]))
    j.close()
    state = journal.load_state(journal.read(path)[0])
    assert state.held == {} and state.done == {("t", 0)} and set(state.partial) == {("t", 1), ("t", 2)}
