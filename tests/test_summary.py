"""The closing summary (``agentenv.summary``): after a resume its outcome figures are the whole
output file's, counted from its lines, and what only the resumed invocation measured says so.
The file and the invocation's stats are real trajectories, counted by the run's own
``RunStats``; a real interrupted run is in tests/test_durability.py."""

from __future__ import annotations

import json

from agentenv.stats import RunStats
from agentenv.summary import OUTCOMES, over_file, summary_rows, summary_table
from agentenv.trajectory import ToolCall, Trajectory, TurnStats


def traj(task: str, sample: int, reward: float | None, *, reason: str = "stop", tokens: int = 2) -> Trajectory:
    t = Trajectory(f"{task}-{sample}", "e", task, f"{task}#g", sample, [1, 2], reward=reward, finish_reason=reason,
                   reward_components={} if reward is None else {"correct": reward})
    t.add_model(list(range(3, 3 + tokens)), [-0.1] * tokens, 0)
    t.tool_calls.append(ToolCall(0, "python", {"code": "1"}, "1", "ok" if sample % 2 else "error", 0.1))
    t.turns.append(TurnStats(2, 1, tokens, reason, 0.1, 0))
    return t


def test_after_a_resume_the_summary_is_the_whole_files(tmp_path):
    before = [traj("a", 0, 1.0), traj("a", 1, 0.0, tokens=5), traj("b", 0, None, reason="error:reward")]
    now = [traj("b", 1, 1.0, reason="length", tokens=7)]
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in before + now))
    stats = RunStats(slots=4)  # what the resumed invocation counted: its own program only
    stats.start(1)
    stats.add(now[0])
    stats.stop()
    mine = stats.summary()

    s = over_file(mine, out)
    assert s["this_run"] == {k: mine[k] for k in OUTCOMES}
    assert (s["programs"], s["turns"], s["tool_calls"], s["tool_errors"]) == (4, 4, 4, 2)
    assert s["tokens_generated"] == 2 + 5 + 2 + 7 and s["mean_reward"] == round(2 / 3, 4)
    assert s["reward_components"] == {"correct": round(2 / 3, 4)}
    assert s["finish_reasons"] == {"stop": 2, "error:reward": 1, "length": 1}
    assert s["prefix_cache_hit_pct"] == 50.0  # 1 of 2 prompt tokens cached, in every turn of the file
    assert {k: s[k] for k in mine if k not in OUTCOMES} == {k: v for k, v in mine.items() if k not in OUTCOMES}

    rows = dict(summary_rows(s, prepared=1, startup_s=2.0, startup="model, sandbox"))
    assert rows["programs"] == 4 and rows["mean reward"] == round(2 / 3, 4)
    assert rows["tokens generated"] == "16 (7 this run)" and rows["tokens/s (this run)"] == mine["tokens_per_s"]
    assert rows["wall time (this run)"].startswith(f"{mine['wall_s']}s rollout")
    assert rows["engine occupancy (mean requests in flight) (this run)"] == mine["mean_requests_in_flight"]
    assert "sandbox sessions prepared ahead (model loading) (this run)" in rows and "tokens/s" not in rows
    assert summary_table(list(rows.items()), 1, out, total=4).title == \
        f"4 trajectories (1 this run, 3 from before the resume) -> {out}"


def test_a_run_without_resume_reports_as_it_counted():
    stats = RunStats()
    stats.start(1)
    stats.add(traj("a", 0, 1.0))
    stats.stop()
    s = stats.summary()
    rows = dict(summary_rows(s, startup_s=1.0, startup="model"))
    assert rows["programs"] == 1 and rows["tokens generated"] == 2 and "tokens/s" in rows and "wall time" in rows
    assert not [label for label in rows if "this run" in label]
    assert summary_table(list(rows.items()), 1, "r.jsonl").title == "1 trajectory -> r.jsonl"
    assert summary_table(list(rows.items()), 2, "r.jsonl").title == "2 trajectories -> r.jsonl"
    assert summary_table(list(rows.items()), 0, "r.jsonl").title == "0 trajectories -> r.jsonl"
    assert summary_table(list(rows.items()), 0, "r.jsonl", total=1).title == \
        "1 trajectory (0 this run, 1 from before the resume) -> r.jsonl"


def test_an_agent_runs_tool_calls_are_not_said_to_have_run():
    """An agent run's tool calls are the gateway's parsed calls, handed to the agent: the table
    says so rather than that they ran (a native run's rows keep their labels)."""
    stats = RunStats()
    stats.start(1)
    t = traj("a", 0, 1.0)
    t.metadata["gateway"] = {"calls": 2, "extended": 1, "branched": 0, "replayed": 0, "restarts": 0,
                             "malformed_tool_calls": 0}
    stats.add(t)
    stats.stop()
    rows = dict(summary_rows(stats.summary(), startup_s=1.0, startup="model"))
    assert "tool calls (parsed, handed to the agent)" in rows and "programs with a well-formed tool call" in rows
    assert "tool calls" not in rows and "programs with a tool call that ran" not in rows
    assert rows["gateway calls (extended / branched / from the journal)"].startswith("2 (1 / 0")


def test_session_starts_are_shown_in_microseconds_when_under_a_millisecond():
    """A session prepared ahead is handed over in microseconds: measured to the microsecond and
    shown in µs, not rounded to 0.0 ms; slower starts stay in ms."""
    label = "sandbox sessions (started, p50 / p90 start)"
    for starts, shown in (([12e-6, 15e-6, 40e-6], "3, 15 / 40 µs"), ([0.002, 0.0025, 0.0041], "3, 2.5 / 4.1 ms")):
        stats = RunStats()
        stats.start(1)
        for seconds in starts:
            stats.sessions.session_started(seconds)
        stats.stop()
        rows = dict(summary_rows(stats.summary(), startup_s=1.0, startup="model"))
        assert rows[label] == shown


def test_the_summary_marks_the_components_that_are_not_added_to_the_reward():
    """retool-math's reward is ``correct`` (weight 1) with ``tool_ran`` at weight 0: the table
    says so beside the component, so ``mean reward 0.5, correct 0.5, tool_ran 1.0`` adds up."""
    from agentenv import make
    from agentenv.rewards import Rubric
    from agentenv.summary import weights

    env = make("retool-math")
    assert weights(env) == {"correct": 1.0, "tool_ran": 0.0}
    stats = RunStats()
    stats.start(2)
    for i, right in enumerate((1.0, 0.0)):
        t = traj("a", i, right)
        t.reward_components = {"correct": right, "tool_ran": 1.0}
        stats.add(t)
    stats.stop()
    rows = dict(summary_rows(stats.summary(), startup_s=1.0, startup="model", weights=weights(env)))
    assert rows["mean reward"] == 0.5 and rows["  mean correct"] == 0.5
    assert rows["  mean tool_ran (weight 0)"] == 1.0 and "  mean tool_ran" not in rows
    # Other weights are shown as they are; an environment without a rubric shows bare names.
    env.rubric = Rubric(env.rubric.parts[0][1], (env.rubric.parts[1][1], 0.25))
    assert "  mean tool_ran (weight 0.25)" in dict(summary_rows(stats.summary(), startup_s=1.0, startup="m",
                                                                weights=weights(env)))
    assert weights(object()) == {}


def test_a_summary_saved_with_the_former_session_keys_reads_as_a_new_one():
    """The session figures were ``env_waits``, ``env_wait_s``, ``env_starts`` and
    ``env_start_p50_ms``/``p90``: a summary saved with those keys gives the same table, and
    :func:`~agentenv.stats.current_summary` names them as today."""
    import pytest

    from agentenv.stats import FORMER_SUMMARY_KEYS, current_summary

    stats = RunStats()
    stats.start(1)
    for seconds in (0.002, 0.0025, 0.0041):
        stats.sessions.session_started(seconds)
    stats.sessions.session_waits, stats.sessions.session_wait_s = 2, 0.5
    stats.stop()
    new = stats.summary()
    old = {({v: k for k, v in FORMER_SUMMARY_KEYS.items()}).get(k, k): v for k, v in new.items()}
    assert "session_starts" not in old and old["env_starts"] == 3 and old["env_waits"] == 2
    assert current_summary(old) == new and list(current_summary(old)) == list(new)
    assert current_summary(new) is new
    rows = summary_rows(new, startup_s=1.0, startup="model")
    assert summary_rows(old, startup_s=1.0, startup="model") == rows
    assert dict(rows)["sandbox sessions (started, p50 / p90 start)"] == "3, 2.5 / 4.1 ms"
    assert dict(rows)["programs that waited for their session"] == "2 (0.5s in all)"
    with pytest.warns(DeprecationWarning, match="session_waits"):
        assert stats.sessions.env_waits == 2
