"""Reward parts: extraction, exact and symbolic comparison (math-verify in a worker process), rubrics."""

import time

import anyio
import pytest

from agentenv.env import Task
from agentenv.rewards import (
    Rubric, as_number, correct_answer, extract_answer, extract_boxed, extract_tag, final_text, has_answer,
    math_equal, stopped, tool_ran, well_formed_calls,
)
from agentenv.trajectory import ToolCall, Trajectory


def traj(text, calls=(), finish="stop"):
    t = Trajectory("t", "env", "task", "task#g", 0, [1, 2])
    t.text, t.finish_reason = text, finish
    t.tool_calls = [ToolCall(0, "python", {"code": "x"}, "", status, 0.0) for status in calls]
    return t


def test_extraction_takes_the_last_answer_and_nested_braces():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_tag("<answer> 4 </answer> and <answer>5</answer>") == "5"
    assert extract_answer(r"<answer>5</answer> so \boxed{6}") == "6"
    assert extract_answer(r"\boxed{6} no: <answer>7</answer>") == "7"
    assert extract_answer("no answer here") is None


def test_only_the_models_final_words_count():
    text = r"<code>print(2+2)</code><interpreter>\boxed{4}</interpreter> I think \boxed{5}"
    assert final_text(text) == r" I think \boxed{5}"
    assert final_text("plain") == "plain"
    t = traj(r"<code>print(7)</code><interpreter>\boxed{7}</interpreter> done")
    assert anyio.run(correct_answer(), Task("q", "?", 7), t) == 0.0  # the answer was only in the tool output


@pytest.mark.parametrize("given, expected, equal", [
    ("1,234", 1234, True), ("$5", "5.00", True), ("3/4", "0.75", True), ("0.1", 0.1, True),
    ("12%", 12, True), ("-3", "3", False), ("1/0", "1", False), ("x", 3, False),
])
def test_numbers_compare_exactly(given, expected, equal):
    assert anyio.run(lambda: math_equal(given, expected, symbolic=False)) is equal


def test_as_number_rejects_non_numbers():
    assert as_number("abc") is None and as_number(True) is None and as_number(float("nan")) is None
    assert as_number("2e3") == 2000


def test_symbolic_equivalence_runs_in_a_worker_and_a_hostile_answer_costs_only_the_timeout():
    async def main():
        assert await math_equal(r"\frac{1}{2}", "0.5")
        assert await math_equal("(x+1)^2", "x^2+2x+1")
        assert await math_equal(r"\sqrt{2}", r"2^{1/2}")
        assert not await math_equal(r"\sqrt{3}", r"2^{1/2}")
        assert not await math_equal("((((", "1")  # unparseable: not equal, no error
        t0 = time.monotonic()
        assert not await math_equal("9^{9^{9^{9}}}", "2", timeout=1.0)
        assert time.monotonic() - t0 < 60  # the computation itself would never end
        assert await math_equal(r"\frac{3}{4}", "0.75")  # the next check gets a fresh worker

    anyio.run(main)


def test_format_parts():
    task = Task("q", "?", 3)
    assert has_answer(task, traj(r"so \boxed{3}")) == 1.0
    assert has_answer(task, traj(r"\boxed{3} or \boxed{4}")) == 0.0
    assert has_answer(task, traj("three")) == 0.0
    assert tool_ran(task, traj("", ["error", "ok"])) == 1.0 and tool_ran(task, traj("", ["error"])) == 0.0
    assert well_formed_calls(task, traj("", ["ok", "malformed"])) == 0.5
    assert well_formed_calls(task, traj("")) == 1.0
    assert stopped(task, traj("", finish="length")) == 0.0


def test_a_rubric_sums_weighted_parts_and_reports_each():
    async def slow_judge(task, trajectory):
        await anyio.sleep(0.01)
        return 0.5

    rubric = Rubric(correct_answer(), (has_answer, 0.1), (tool_ran, 0.0), (slow_judge, 2.0, "judge"))
    out = anyio.run(rubric, Task("q", "?", 3), traj(r"\boxed{3}", ["ok"]))
    assert out == {"reward": pytest.approx(1.0 + 0.1 + 0.0 + 1.0), "correct": 1.0, "has_answer": 1.0,
                   "tool_ran": 1.0, "judge": 0.5}
    with pytest.raises(ValueError, match="used twice"):
        Rubric(tool_ran, tool_ran)
    with pytest.raises(ValueError, match="reserved"):
        Rubric((tool_ran, 1.0, "reward"))
