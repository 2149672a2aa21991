"""pass@k and the evaluation report on a fixed set of trajectories with known rewards."""

import math

import pytest

from agentenv.errors import ConfigError
from agentenv.evaluation import pass_at_k, report


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # any 2 of 4 include a pass
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def line(task, reward, comps=None, finish="stop", error=None, calls=1):
    return {"task_id": task, "reward": reward, "reward_components": comps or {}, "finish_reason": finish,
            "error": error, "tool_calls": [{}] * calls}


def test_report_on_a_fixed_set():
    rows = (
        [line("a", 1.0, {"correct": 1.0, "tool_ran": 1.0})] * 2
        + [line("a", 0.0, {"correct": 0.0, "tool_ran": 0.0})] * 2
        + [line("b", 0.0, {"correct": 0.0, "tool_ran": 1.0})] * 3
        + [line("b", None, finish="error:reward", error="reward: ZeroDivisionError: x", calls=0)]
        + [line("c", 1.0, {"correct": 1.0, "tool_ran": 1.0})] * 4
    )
    rep = report(rows)
    assert rep["tasks"] == 3 and rep["samples"] == 12 and rep["samples_per_task"] == 4
    # a: c=2 of 4 -> pass@1 .5, pass@2 1-C(2,2)/C(4,2)=5/6, pass@4 1; b: 0; c: 1
    assert rep["pass@k"] == {"1": round((0.5 + 0 + 1) / 3, 4), "2": round((5 / 6 + 0 + 1) / 3, 4),
                             "4": round((1 + 0 + 1) / 3, 4)}
    assert rep["mean_reward"] == round(6 / 11, 4)  # the failed reward is left out of the mean...
    assert [t["passed"] for t in rep["per_task"]] == [2, 0, 4]  # ...and counts as not passing
    assert rep["components"] == {"correct": round(6 / 11, 4), "tool_ran": round(9 / 11, 4)}
    assert rep["reward_failures"] == 1 and "ZeroDivisionError" in rep["first_reward_error"]
    assert rep["finish_reasons"] == {"error:reward": 1, "stop": 11}
    assert rep["tool_calls_per_sample"] == round(11 / 12, 3)
    assert report(rows, threshold=0.0)["pass@k"]["1"] == round((1 + 0.75 + 1) / 3, 4)
    assert list(report(rows, ks=[3])["pass@k"]) == ["3"]
    with pytest.raises(ConfigError, match="between 1 and the samples per task"):
        report(rows, ks=[5])
    with pytest.raises(ConfigError, match="no trajectories"):
        report([])


def test_the_table_marks_a_component_whose_weight_is_not_1():
    """eval's table, as the run summary: ``mean tool_ran (weight 0)``, so the components add up."""
    from agentenv import make
    from agentenv.evaluation import table
    from agentenv.summary import weights

    rows = [line("a", 1.0, {"correct": 1.0, "tool_ran": 1.0}), line("a", 0.0, {"correct": 0.0, "tool_ran": 1.0})]
    t = table(report(rows), weights=weights(make("retool-math")))
    labels = list(t.columns[0].cells)
    assert "  mean correct" in labels and "  mean tool_ran (weight 0)" in labels and "  mean tool_ran" not in labels
    assert "  mean tool_ran" in list(table(report(rows)).columns[0].cells)  # weights unknown: bare names
