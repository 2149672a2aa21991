"""The viewer's readers: which kind of run a path is, files followed as they grow, the list
rows, a group's advantages, per-task passes and a training run's rows."""

from __future__ import annotations

import json

import pytest

from agentenv import journal
from agentenv.errors import ConfigError
from agentenv.evaluation import read_jsonl, report
from agentenv.view.runs import (EvalRun, MalformedLine, RolloutFile, RolloutRun, Tail, TrainingRun, advantages,
                                open_run, summary_of)


def test_open_run_tells_the_kinds_apart(rollout, eval_report, train_run, tmp_path):
    assert type(open_run(rollout)) is RolloutFile
    assert RolloutRun is RolloutFile  # the former name, kept for code that imports it
    assert type(open_run(eval_report)) is EvalRun
    assert type(open_run(train_run)) is TrainingRun
    assert type(open_run(train_run / "metrics.jsonl")) is TrainingRun
    with pytest.raises(ConfigError, match="no such rollout file"):
        open_run(tmp_path / "missing.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a training run"):
        open_run(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not an eval report"):
        open_run(tmp_path / "bad.json")


def test_an_empty_rollout_file_is_accepted_while_its_run_writes_it(tmp_path):
    """A run that has started but written no line yet: its output is empty (or holds the
    start of a first line) and its event log is beside it; the viewer follows it."""
    out = tmp_path / "live.jsonl"
    out.write_bytes(b"")
    with pytest.raises(ConfigError, match="it is empty, with no event log beside it"):
        open_run(out)
    out.with_name("live.jsonl.log").write_text('{"e": "header"}\n')
    assert type(open_run(out)) is RolloutFile
    out.write_bytes(b'{"id": "t0-0", "task')  # the first line, half written
    assert type(open_run(out)) is RolloutFile


def test_tail_reads_complete_lines_once_and_starts_over_on_a_rewritten_file(tmp_path):
    path = tmp_path / "f.jsonl"
    tail = Tail(path, lambda line, at: (json.loads(line), at))
    assert tail.refresh() == 0  # not there yet
    path.write_text('{"a": 1}\n{"a": 2')
    assert tail.refresh() == 1 and tail.items == [({"a": 1}, 0)]  # the torn line waits
    with open(path, "a") as f:
        f.write('}\n\n{"a": 3}\n')
    assert tail.refresh() == 2 and tail.items[1:] == [({"a": 2}, 9), ({"a": 3}, 19)]
    assert tail.line(19, 8) == b'{"a": 3}'
    assert tail.refresh() == 0
    path.write_text('{"b": 1}\n')  # shorter: rewritten
    assert tail.refresh() == 1 and tail.items == [({"b": 1}, 0)] and tail.generation == 1


def test_tail_starts_over_on_a_file_rewritten_larger(tmp_path):
    """``--overwrite`` with the server up: the new file grows past what was read of the old one,
    in place (same inode) or as a new file moved over it; either way it is read from the start."""
    path = tmp_path / "f.jsonl"
    restarts = []
    tail = Tail(path, lambda line, at: json.loads(line)["a"], restart=lambda: restarts.append(tail.generation))
    path.write_text('{"a": 1}\n{"a": 2}\n')
    assert tail.refresh() == 2 and tail.items == [1, 2]
    path.write_text('{"a": 10}\n{"a": 20}\n{"a": 30}\n')  # truncated and written again, larger
    assert tail.refresh() == 3 and tail.items == [10, 20, 30] and tail.generation == 1 and restarts == [1]
    with open(path, "a") as f:  # then it grows as usual: only the new line is read
        f.write('{"a": 40}\n')
    assert tail.refresh() == 1 and tail.items == [10, 20, 30, 40] and tail.generation == 1
    # the same first line, another file after it (a rerun with the same header)
    path.write_text('{"a": 10}\n{"a": 21}\n{"a": 31}\n{"a": 41}\n{"a": 51}\n')
    assert tail.refresh() == 5 and tail.items == [10, 21, 31, 41, 51] and tail.generation == 2
    other = tmp_path / "new.jsonl"  # written beside it and moved over it: another inode
    other.write_text("".join(f'{{"a": {i}}}\n' for i in range(100, 106)))
    other.replace(path)
    assert tail.refresh() == 6 and tail.items == list(range(100, 106)) and tail.generation == 3
    path.unlink()  # gone: nothing is shown of it
    assert tail.refresh() == 0 and tail.items == [] and restarts == [1, 2, 3, 4]


def test_tail_reads_a_large_file_in_chunks(tmp_path):
    path = tmp_path / "f.jsonl"
    lines = [json.dumps({"i": i, "pad": "x" * (i * 7)}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n" + lines[0][:5])
    tail = Tail(path, lambda line, at: (json.loads(line)["i"], at))
    tail.CHUNK = 64  # lines longer than a chunk, chunks ending mid-line
    assert tail.refresh() == 40 and [i for i, _ in tail.items] == list(range(40))
    assert all(tail.line(at, len(lines[i])) == lines[i].encode() for i, at in tail.items)
    assert tail.offset == path.stat().st_size - 5


def test_rollout_rows_and_progress_follow_the_files(rollout):
    lines = rollout.read_text().splitlines(keepends=True)
    rollout.write_text("".join(lines[:2]))
    run = RolloutFile(rollout)
    first = run.summaries()
    assert first["total"] == 2 and first["progress"]["started"] == first["progress"]["done"] == 6
    assert first["progress"]["expected"] == 6 and first["progress"]["in_flight_count"] == 0
    with open(rollout, "a") as f:
        f.writelines(lines[2:])
    more = run.summaries(since=2)
    assert more["total"] == 6 and [r["id"] for r in more["rows"]] == [json.loads(x)["id"] for x in lines[2:]]
    rows = run.summaries()["rows"]
    assert {r["finish_reason"] for r in rows} == {"stop", "length"}
    assert sum(r["tool_errors"] for r in rows) == 2 and all(r["tool_calls"] == 1 for r in rows)
    assert all(r["sampled"] < r["tokens"] and not r["resumed"] for r in rows)
    # a program starts: the log grows by a checksummed record; a torn one is not read
    with open(rollout.with_name("rollout.jsonl.log"), "ab") as f:
        f.write(journal.encode({"e": "start", "k": "p7", "task": "retool-math/0/3", "sample": 0,
                                "group": "g", "prompt": [1, 2]}))
        f.write(b"0badc0de {\"e\": \"done\", \"k\": \"p7\"}\n")
    progress = run.summaries()["progress"]
    assert progress["in_flight_count"] == 1 and progress["in_flight"] == [
        {"task_id": "retool-math/0/3", "sample": 0, "turns": 0}]


def _walked(records: list[dict]) -> dict:
    """Progress the plain way, every record walked: the figures the fold must give."""
    started, turns, done = {}, {}, set()
    for rec in records:
        e, key = rec.get("e"), rec.get("k")
        if e == "start":
            started[key] = rec
        elif e == "turn":
            turns[key] = turns.get(key, 0) + 1
        elif e == "done":
            done.add(key)
    flight = [{"task_id": r["task"], "sample": r["sample"], "turns": turns.get(k, 0)}
              for k, r in started.items() if k not in done]
    return {"started": len(started), "done": len(done), "in_flight": flight[:50], "in_flight_count": len(flight)}


def test_progress_is_folded_as_the_log_is_read_and_keeps_no_record(rollout):
    """The event log's records are folded into counters as they are read: the figures are the
    walk's at every point of the recorded log, and the log's tail keeps no per-record list."""
    log = rollout.with_name("rollout.jsonl.log")
    lines = log.read_bytes().splitlines(keepends=True)
    records, _ = journal.read(log)
    assert len(records) == len(lines) and sum(r["e"] == "turn" for r in records) > 0
    log.write_bytes(b"")
    run = RolloutFile(rollout)
    for n in range(1, len(lines) + 1):
        with open(log, "ab") as f:
            f.write(lines[n - 1])
        got = run.summaries(since=6)["progress"]
        assert {k: got[k] for k in ("started", "done", "in_flight", "in_flight_count")} == _walked(records[:n]), n
        assert run.log.items == []
    # the data's log is version 1: its header's settings as the upgrade reads them
    assert run.settings() == {**journal.V1_IMPLIED_SETTINGS, **records[0]["settings"]} and got["expected"] == 6
    assert run.events.flight == {} and len(run.events.started) == len(run.events.done) == 6
    log.write_bytes(b"".join(lines[:9]))  # rewritten (shorter): the fold starts over
    got = run.summaries(since=6)["progress"]
    assert {k: got[k] for k in ("started", "done", "in_flight", "in_flight_count")} == _walked(records[:9])
    assert got["in_flight_count"] == 6 and {f["turns"] for f in got["in_flight"]} == {0, 1}


def test_the_log_is_read_as_a_resume_reads_it(rollout):
    """The viewer reads the event log through the journal's reader: a torn record waits for
    its newline, and a corrupted one ends the records, as for a resume, which truncates the
    log there and appends: the page then reads on from there."""
    log = rollout.with_name("rollout.jsonl.log")
    start = {"e": "start", "k": "p7", "task": "retool-math/0/3", "sample": 0, "group": "g", "prompt": [1, 2]}
    done = {"e": "done", "k": "p7", "task": "retool-math/0/3", "sample": 0}
    run = RolloutFile(rollout)
    assert run.summaries()["progress"]["in_flight_count"] == 0
    good = log.stat().st_size
    with open(log, "ab") as f:
        f.write(journal.encode(start)[:-1])  # torn: no newline yet
    assert run.summaries()["progress"]["in_flight_count"] == 0 and run.log.offset == good
    with open(log, "ab") as f:
        f.write(b"\n" + journal.encode(start).replace(b'"k":"p7"', b'"k":"p8"'))  # checksum fails
        f.write(journal.encode(done))  # after the corrupted line: not the run's record
    got = run.summaries()["progress"]
    assert got["started"] == 7 and got["in_flight"] == [{"task_id": "retool-math/0/3", "sample": 0, "turns": 0}]
    at = run.log.offset
    assert journal.read(log)[1] == at  # where a resume truncates
    with open(log, "r+b") as f:  # the resume: truncated there, then its records appended
        f.truncate(at)
        f.seek(at)
        f.write(journal.encode(done))
    got = run.summaries()["progress"]
    assert got["started"] == got["done"] == 7 and got["in_flight_count"] == 0 and run.log.generation == 0


def test_a_trajectory_has_each_tokens_text_mask_logprob_and_version(rollout):
    row = read_jsonl(rollout)[0]
    t = RolloutFile(rollout).trajectory(row["id"])
    n = len(row["input_ids"])
    assert len(t["pieces"]) == len(t["loss_mask"]) == len(t["logprobs"]) == len(t["weight_versions"]) == n
    assert "".join(t["pieces"][len(row["prompt_ids"]):]) == row["text"]
    assert [s["kind"] for s in t["spans"]] == ["prompt"] + [s["kind"] for s in row["segments"]]
    assert t["spans"][-1]["end"] == n
    for s in t["spans"]:
        assert set(t["loss_mask"][s["start"]:s["end"]]) == {1 if s["kind"] == "model" else 0}
    assert t["tool_calls"] == row["tool_calls"] and t["reward_components"] == row["reward_components"]
    assert RolloutFile(rollout).trajectory("no-such-id") is None


def test_group_advantages_are_the_trainers():
    from agentenv.train.loss import group_advantages  # imports torch

    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [1.0, 0.25, 0.0]):
        assert advantages(rewards) == pytest.approx(group_advantages(rewards))
    assert advantages([1.0, None, 0.0]) == pytest.approx([1.0, None, -1.0], abs=1e-5)
    assert advantages([None]) == [None]


def test_a_group_is_its_samples_in_order_with_advantages(rollout):
    rows = read_jsonl(rollout)
    gid = rows[0]["group_id"]
    samples = RolloutFile(rollout).group(gid)
    assert [s["sample_index"] for s in samples] == sorted(r["sample_index"] for r in rows if r["group_id"] == gid)
    assert all(s["text"] for s in samples)
    assert sum(s["advantage"] for s in samples) == pytest.approx(0.0, abs=1e-6)


def test_per_task_passes_are_the_evaluation_reports(rollout, eval_report):
    expected = {t["task_id"]: (t["samples"], t["passed"]) for t in report(read_jsonl(rollout))["per_task"]}
    for run in (RolloutFile(rollout), EvalRun(eval_report)):
        assert {k: (t["samples"], t["passed"]) for k, t in run.per_task().items()} == expected
    info = EvalRun(eval_report).info()
    assert info["report"]["per_task"] and info["rows"] == 6 and info["report_path"] == str(eval_report)


def test_a_training_run_is_followed_step_by_step(train_run):
    rows = (train_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (train_run / "metrics.jsonl").write_text(rows[0])
    run = TrainingRun(train_run)
    first = run.curves()
    assert first["total"] == 1 and first["evals_total"] == 3 and first["summary"]["steps"] == 3
    with open(train_run / "metrics.jsonl", "a") as f:
        f.writelines(rows[1:])
    more = run.curves(since=1, evals_since=3)
    assert [r["step"] for r in more["rows"]] == [2, 3] and more["evals"] == []
    assert run.info()["config"]["steps"] == 3


def test_a_judges_verdicts_reach_the_list_row(rollout):
    row = read_jsonl(rollout)[0]
    assert summary_of(row)["judged"] == [] and summary_of(row)["judge_failures"] == []
    row["reward_details"] = {  # what agentenv.judge records (docs/schemas.md)
        "judge": {"score": 0.0, "failure": "deadline", "error": "no reply in 5 s", "latency_s": 5.0, "cached": False},
        "style": {"score": 0.8, "reply": "<score>8</score>", "latency_s": 0.4, "cached": True}}
    s = summary_of(row)
    assert s["judged"] == ["judge", "style"] and s["judge_failures"] == ["deadline"]


def test_a_model_segment_after_a_model_segment_is_marked_continued(cut_rollout):
    """A turn cut at --max-tokens-per-turn without a tool call is followed by another model
    turn with nothing inserted: the viewer's span says "continued" (docs/schemas.md)."""
    run = RolloutFile(cut_rollout)
    seen = 0
    for row in read_jsonl(cut_rollout):
        spans = run.trajectory(row["id"])["spans"]
        kinds = [s["kind"] for s in spans]
        assert kinds == ["prompt"] + [s["kind"] for s in row["segments"]]
        for before, span in zip(spans, spans[1:]):
            assert span.get("continued", False) == (before["kind"] == span["kind"] == "model")
            seen += bool(span.get("continued"))
    assert seen, "the cap of 8 tokens per turn cut no turn"


def test_an_agent_programs_branches_are_shown_each_with_its_role_and_tokens(agent_rollout):
    """A trajectory of an agent program (the real gateway) holds its main sequence and two
    branches of different roles: the list row counts them, and the trajectory gives each one
    token by token, as the main sequence: text, mask, logprob, weight version, segments."""
    from tokenizers import Tokenizer

    from agentenv.trajectory import Trajectory

    from .agent_run import HERMES

    tok = Tokenizer.from_file(str(HERMES / "tokenizer.json"))
    run = RolloutFile(agent_rollout)
    assert run.info()["tokenizer"] == str(HERMES)  # the log's header names the model
    lines = read_jsonl(agent_rollout)
    rows = run.summaries()["rows"]
    assert len(rows) == 2 and all((r["branches"], r["roles"]) == (2, ["main", "critic"]) for r in rows)
    for line in lines:
        t = run.trajectory(line["id"])
        assert t["role"] == "main" and [(b["index"], b["role"]) for b in t["branches"]] == [(1, "main"), (2, "critic")]
        seqs = Trajectory.from_dict(line).sequences()  # the trainer's rows: one per sequence
        assert len(seqs) == 3
        for seq, row in zip([t, *t["branches"]], seqs):
            assert seq["ids"] == row.input_ids and seq["loss_mask"] == row.loss_mask
            assert seq["logprobs"] == row.logprobs and seq["weight_versions"] == row.weight_versions
            assert "".join(seq["pieces"]) == tok.decode(row.input_ids, skip_special_tokens=False)
            assert [s["kind"] for s in seq["spans"]] == ["prompt"] + [s.kind for s in row.segments]
            assert seq["spans"][-1]["end"] == len(row.input_ids) and seq["spans"][0]["end"] == len(row.prompt_ids)
        critic = t["branches"][1]
        sampled = "".join(p for p, m in zip(critic["pieces"], critic["loss_mask"]) if m)
        assert sampled == "Looks right.<|im_end|>" and "Critique" in "".join(critic["pieces"])
        assert [s["kind"] for s in t["branches"][0]["spans"]] == ["prompt", "model", "env", "model"]


def test_a_branch_that_is_not_a_sequence_is_a_malformed_line(rollout):
    row = read_jsonl(rollout)[0]
    with open(rollout, "a") as f:
        f.write(json.dumps({**row, "id": "no-role", "branches": [{"prompt_ids": [1]}]}) + "\n")
        f.write(json.dumps({**row, "id": "no-ids", "branches": [{"role": "critic", "prompt_ids": [1],
                                                                  "segments": [{"kind": "model"}]}]}) + "\n")
    run = RolloutFile(rollout)
    by_id = {r["id"]: r for r in run.summaries()["rows"]}
    assert by_id["no-role"]["finish_reason"] == "error: malformed line" and "KeyError" in by_id["no-role"]["error"]
    assert by_id["no-ids"]["branches"] == 1 and by_id["no-ids"]["roles"] == ["critic"]
    with pytest.raises(MalformedLine, match="trajectory 'no-ids' is malformed"):
        run.trajectory("no-ids")
    assert run.trajectory(row["id"])["branches"] == [] and by_id[row["id"]]["branches"] == 0
