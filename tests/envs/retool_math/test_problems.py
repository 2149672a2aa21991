"""``agentenv.envs.retool_math.problems``: procedurally generated problems whose solution cells,
run in order, print or end with the answer; one seed fixes them all, and ``extra_digits``
lengthens the operands of that one problem only."""

from __future__ import annotations

import ast
import contextlib
import io
import random
import re
from collections import Counter

import pytest

from agentenv.envs.retool_math import problems
from agentenv.envs.retool_math.problems import GENERATORS, generate


def run_cells(cells: list[str]) -> str:
    """The cells run in one namespace, as a notebook would: the last one's printed output or
    the value of its last expression."""
    scope: dict = {}
    out = ""
    for cell in cells:
        tree = ast.parse(cell)
        last = tree.body.pop() if isinstance(tree.body[-1], ast.Expr) else None
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(tree, "<cell>", "exec"), scope)
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope) if last else None
        out = buf.getvalue().strip() or ("" if value is None else str(value))
    return out


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_every_kinds_solution_computes_its_answer(kind):
    make = GENERATORS[kind][0]
    rng = random.Random(kind)
    for _ in range(50):
        question, answer, solution = make(rng)
        assert isinstance(answer, int) and question.strip() and solution
        assert run_cells(solution) == str(answer), (question, solution)


def test_one_seed_fixes_the_problems_and_the_kinds_follow_their_weights():
    first = [generate(random.Random(7)) for _ in range(3)]
    assert first == [generate(random.Random(7)) for _ in range(3)]
    rng = random.Random(0)
    kinds = Counter(generate(rng)[0] for _ in range(4000))
    for kind, (_, weight) in GENERATORS.items():
        assert abs(kinds[kind] / 4000 - weight) < 0.03, (kind, kinds)


def test_extra_digits_lengthen_the_operands_of_that_problem_only():
    def longest(extra: int) -> int:
        """The longest operand of 300 arithmetic problems generated with ``extra`` digits."""
        rng, lengths = random.Random(1), []
        while len(lengths) < 300:
            kind, (question, _, _) = generate(rng, extra)
            if kind == "arithmetic":
                lengths.append(max(len(n) for n in re.findall(r"\d+", question)))
        return max(lengths)

    assert longest(0) == 4 and longest(3) == 7
    assert problems._EXTRA == [0]  # back to none after each problem: the next one is not lengthened
