"""Programs in flight held in memory (``agentenv.inflight``): ``InFlight``'s snapshots, which a
trainer checkpoint and a Ray driver keep, restore and log what the disk log would hold, and a
poll sends only what its holder lacks; their saved form, its version, and the one reader of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentenv import inflight, journal
from agentenv.errors import AgentEnvError
from agentenv.inflight import SNAPSHOT_VERSION, ProgramSnapshot, TaskSnapshot, read_snapshot
from agentenv.trajectory import ToolCall, Trajectory, TurnStats

from .test_journal import program, turn


def test_an_in_flight_snapshot_restores_and_logs_what_the_disk_log_would_hold(tmp_path: Path):
    """``InFlight`` (a trainer's, in memory) and ``Journal`` (the CLI's, on disk) told the same
    story hold the same state: the snapshot restores to the partial programs a replayed log
    gives, and logged to disk (``log_snapshot``) replays to the same snapshot (``snapshot_of``)."""
    mem, disk = inflight.InFlight(), journal.Journal.create(tmp_path / "run.log", {})
    progs = [program(f"k{i}", i) for i in range(3)]
    marks = {t.id: ([0, 0, 0], [0, 0, 0]) for t in progs}
    for t in progs:
        mem.start(t)
        disk.start(t)
    for t, turns in zip(progs, (2, 1, 0)):
        for _ in range(turns):
            turn(t, mem, marks[t.id][0])
            disk.turn(t, marks[t.id][1])
    progs[1].finish_reason, progs[1].reward = "stop", 1.0
    mem.finished(progs[1])
    disk.held(progs[1])
    disk.close()
    snap = read_snapshot(json.loads(json.dumps(mem.snapshot({"t"})["t"].to_dict())))  # as a checkpoint stores it
    state, finished = inflight.restore(snap)
    replayed = journal.load_state(journal.read(disk.path)[0])
    assert [f.id for f in finished] == ["k1"] and state.done == {("t", 1)} and state.groups == {"t": "t#g"}
    assert set(state.partial) == set(replayed.partial) == {("t", 0), ("t", 2)}
    for key, p in state.partial.items():
        q = replayed.partial[key]
        assert (p.id, p.prompt_ids, p.segments, p.tool_calls, p.turns) == \
            (q.id, q.prompt_ids, q.segments, q.tool_calls, q.turns)
    relog, written = journal.Journal.create(tmp_path / "relog.log", {}), {}
    inflight.log_snapshot(relog, snap, written)
    inflight.log_snapshot(relog, snap, written)  # a second poll with nothing new writes nothing
    relog.close()
    records = journal.read(relog.path)[0]
    assert [r["e"] for r in records] == ["header", "start", "turn", "start"]
    again = inflight.snapshot_of(journal.load_state(records), "t", snap.finished)
    assert sorted(again.partial, key=lambda p: p.key) == sorted(snap.partial, key=lambda p: p.key)
    mem.forget("t")
    assert mem.snapshot({"t"}) == {}


def test_a_snapshot_poll_sends_only_what_the_holder_lacks_and_merges_to_the_whole():
    """``InFlight.snapshot(have=...)`` (how a Ray driver polls its workers) sends each
    program's new turns and newly finished programs only; merged into what the driver held it
    equals the whole snapshot, poll after poll, while programs advance, finish and start."""
    import pickle

    from agentenv.inflight import InFlight, holding, merge_snapshot

    in_flight = InFlight()
    progs = [Trajectory(f"p{i}", "env", "t", "t#g", i, list(range(300))) for i in range(4)]
    marks = {p.id: [0, 0, 0] for p in progs}

    def turn(p: Trajectory, n: int) -> None:
        p.add_model(list(range(n, n + 200)), [-0.5] * 200, 3)
        p.add_env(list(range(40)))
        p.tool_calls.append(ToolCall(len(p.turns), "python", {"code": "1+1"}, "2", "ok", 0.01))
        p.turns.append(TurnStats(300, 288, 200, "stop", 0.5, 3))
        in_flight.turn(p, marks[p.id])

    for p in progs[:3]:
        in_flight.start(p)
    held, sizes = None, []
    for step in range(6):
        for p in progs[:3]:
            if p.id in marks and not p.finish_reason:
                turn(p, step)
        if step == 2:
            progs[0].finish_reason, progs[0].reward = "stop", 1.0
            in_flight.finished(progs[0])
        if step == 3:
            in_flight.start(progs[3])
            turn(progs[3], step)
        whole = in_flight.snapshot({"t"})["t"]
        reply = in_flight.snapshot({"t"}, {"t": holding(held)})["t"]
        held = merge_snapshot(held, reply)
        assert held == whole, step
        sizes.append((len(pickle.dumps(reply.to_dict())), len(pickle.dumps(whole.to_dict()))))  # as sent
    # Each reply carries one turn per live program (and a finished program once, at step 2),
    # not every prefix: from step 3 on a fraction of the whole.
    assert all(d < w / 4 for d, w in sizes[3:]) and sizes[2][0] < sizes[2][1], sizes
    assert merge_snapshot(held, whole) == whole  # a whole snapshot replaces what was held
    empty = in_flight.snapshot({"t"}, {"t": holding(held)})["t"]
    assert all(not e.segments and e.prompt_ids is None for e in empty.partial) and not empty.finished
    assert merge_snapshot(held, empty) == whole


def test_an_agent_programs_calls_travel_in_snapshots_deltas_and_the_log(tmp_path: Path):
    """An agent program completes no turns: its answered gateway calls are what a snapshot
    carries. Polled as deltas they merge to the whole; logged by a driver they load back as
    the ``gateway_log`` it is replayed from; restored on another holder they stay in its next
    snapshot; an attempt started again (a replay mismatch) drops the old attempt's calls."""
    from agentenv.inflight import InFlight, holding, merge_snapshot

    def gen(i: int) -> dict:
        return {"ids": [i, i + 1], "lp": [-0.1, -0.2], "v": [0, 0], "fin": "stop", "stop": None, "pt": 5, "ct": 0,
                "wv": 0}

    mem, held, written = InFlight(), None, {}
    agent = Trajectory("a0", "env", "t", "t#g", 0, [])
    disk = journal.Journal.create(tmp_path / "driver.log", {})
    mem.start(agent)
    for n in range(3):
        mem.call("a0", n, f"d{n}", "main", gen(n))
        whole = mem.snapshot({"t"})["t"]
        reply = mem.snapshot({"t"}, {"t": holding(held)})["t"]
        assert len(reply.partial[0].calls) == 1  # the new call only, never the ones held
        held = merge_snapshot(held, reply)
        assert held == whole
        inflight.log_snapshot(disk, held, written)
    disk.close()
    logged = journal.load_state(journal.read(disk.path)[0]).partial[("t", 0)]
    assert [c["d"] for c in logged.metadata["gateway_log"]] == ["d0", "d1", "d2"]
    state, _ = inflight.restore(inflight.snapshot_of(journal.load_state(journal.read(disk.path)[0]), "t", []))
    assert state.partial[("t", 0)].metadata["gateway_log"] == held.partial[0].calls
    # Restored on another holder (a worker taking over): the calls stay; a live call follows on.
    other = InFlight()
    other.restored(held)
    other.resumed(Trajectory("a0", "env", "t", "t#g", 0, []))
    other.call("a0", 3, "d3", "main", gen(3))
    again = merge_snapshot(held, other.snapshot({"t"}, {"t": holding(held)})["t"])
    assert [c["d"] for c in again.partial[0].calls] == ["d0", "d1", "d2", "d3"]
    # Started again: a new attempt, its calls alone, and the log's start record begins it anew.
    other.start(Trajectory("a0", "env", "t", "t#g", 0, []))
    other.call("a0", 0, "e0", "main", gen(7))
    fresh = merge_snapshot(again, other.snapshot({"t"}, {"t": holding(again)})["t"])
    assert [c["d"] for c in fresh.partial[0].calls] == ["e0"] and fresh == other.snapshot({"t"})["t"]
    relog = journal.Journal.create(tmp_path / "relog.log", {})
    written = {}
    inflight.log_snapshot(relog, again, written)
    inflight.log_snapshot(relog, fresh, written)
    relog.close()
    records = journal.read(relog.path)[0]
    assert [r["e"] for r in records] == ["header", "start", "call", "call", "call", "call", "start", "call"]
    assert [c["d"] for c in journal.load_state(records).partial[("t", 0)].metadata["gateway_log"]] == ["e0"]
    other.forget("t")
    assert other.snapshot({"t"}) == {} and not other._calls


def agent_snapshot() -> tuple[inflight.InFlight, TaskSnapshot]:
    """A holder with a finished program, one mid-way with a turn and an agent with two calls,
    and its whole snapshot."""
    mem = inflight.InFlight()
    done, mid, agent = (program(f"k{i}", i) for i in range(3))
    for t in (done, mid, agent):
        mem.start(t)
    turn(mid, mem, [0, 0, 0])
    for n in range(2):
        mem.call(agent.id, n, f"d{n}", "main", {"ids": [n], "lp": [-0.5], "v": [0], "fin": "stop"})
    done.finish_reason, done.reward = "stop", 1.0
    mem.finished(done)
    return mem, mem.snapshot({"t"})["t"]


def test_a_snapshot_round_trips_through_its_saved_form_whole_and_as_a_delta():
    """``to_dict`` names the version and the writer; ``read_snapshot`` of it (through JSON, as
    a checkpoint or Ray carries it) gives the same record, whole or a delta."""
    mem, whole = agent_snapshot()
    saved = json.loads(json.dumps(whole.to_dict()))
    assert saved["v"] == SNAPSHOT_VERSION and saved["agentenv"] and not whole.delta
    assert {p["k"] for p in saved["partial"]} == {"k1", "k2"} and [d["id"] for d in saved["finished"]] == ["k0"]
    assert read_snapshot(saved) == whole == TaskSnapshot.from_dict(saved)
    calls = next(p for p in whole.partial if p.key == "k2")
    assert [c["d"] for c in calls.calls] == ["d0", "d1"] and calls.calls_tag
    mem.call("k2", 2, "d2", "main", {"ids": [2], "lp": [-0.5], "v": [0], "fin": "stop"})
    delta = mem.snapshot({"t"}, {"t": inflight.holding(whole)})["t"]
    sent = json.loads(json.dumps(delta.to_dict()))
    assert sent["delta"] and sent["finished_ids"] == ["k0"] and not sent["finished"]
    assert read_snapshot(sent) == delta and delta.delta
    merged = inflight.merge_snapshot(whole, read_snapshot(sent))
    assert merged == mem.snapshot({"t"})["t"]
    assert [c["d"] for p in merged.partial if p.key == "k2" for c in p.calls] == ["d0", "d1", "d2"]
    # A poll with nothing new: the agent's entry carries no call, and the merge keeps those held.
    quiet = read_snapshot(json.loads(json.dumps(mem.snapshot({"t"}, {"t": inflight.holding(merged)})["t"].to_dict())))
    assert [(p.calls, p.calls_base) for p in quiet.partial if p.key == "k2"] == [([], 3)]
    assert inflight.merge_snapshot(merged, quiet) == merged


def test_an_unversioned_snapshot_is_read_as_version_1_and_resumes():
    """A snapshot as checkpoints saved them before snapshots had a version (no ``"v"``; an
    entry without a group id, one with a null one, an agent's calls) is read through
    ``inflight.upgrade``: the same programs, restored and logged as a current one is."""
    seg = {"kind": "model", "token_ids": [7, 8], "logprobs": [-0.1, -0.2], "weight_versions": [0, 0]}
    stats = {"prompt_tokens": 3, "cached_tokens": 0, "new_tokens": 2, "finish_reason": "stop", "latency_s": 0.1,
             "weight_version": 0}
    old = {"partial": [
        {"k": "a", "task": "t", "sample": 0, "prompt": [1, 2, 3], "segments": [seg], "tools": [], "stats": [stats]},
        {"k": "b", "task": "t", "sample": 1, "group": None, "prompt": [1, 2, 3], "segments": [], "tools": [],
         "stats": [], "calls": [{"d": "x", "role": "main", "g": {"ids": [9]}}], "calls_tag": "tag1"}],
        "finished": []}
    assert inflight.upgrade(json.loads(json.dumps(old)))["v"] == SNAPSHOT_VERSION
    snap = read_snapshot(old)
    assert snap.partial == [
        ProgramSnapshot("a", "t", 0, "", [1, 2, 3], [seg], [], [stats]),
        ProgramSnapshot("b", "t", 1, "", [1, 2, 3], [], [], [], [{"d": "x", "role": "main", "g": {"ids": [9]}}],
                        "tag1")]
    state, finished = inflight.restore(snap)
    assert not finished and state.partial[("t", 0)].segments[0].token_ids == [7, 8]
    assert state.partial[("t", 1)].metadata["gateway_log"] == old["partial"][1]["calls"]
    assert read_snapshot(snap.to_dict()) == snap  # written again, as the current version


@pytest.mark.parametrize("version", [SNAPSHOT_VERSION + 1, 99])
def test_a_snapshot_of_a_version_this_agentenv_does_not_know_is_refused(version: int):
    """A newer agentenv's snapshot is not guessed at: the error names its version and the
    agentenv that wrote it (the one to resume with)."""
    newer = {"v": version, "agentenv": "7.3.0", "partial": [], "finished": []}
    known = rf"snapshot version {version} .*\(1 to {SNAPSHOT_VERSION}\)"
    with pytest.raises(AgentEnvError, match=known + r".*agentenv 7\.3\.0 wrote it"):
        read_snapshot(newer)
