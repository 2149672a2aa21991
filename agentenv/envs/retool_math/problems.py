"""Procedurally generated math problems that need computation.

Each generator returns ``(question, answer, solution)`` where ``solution`` is the list of
code cells a careful solver would run, in order (used to build supervised ReTool
transcripts for the bundled tiny model; the environment never shows it to the model).
Everything is driven by one ``random.Random``, so a seed fixes the whole task list.
"""

from __future__ import annotations

import random
from typing import Callable

Problem = tuple[str, int, list[str]]


# Extra digits added to every operand's upper bound (set by ``generate``): the difficulty knob.
_EXTRA = [0]


def _n(rng: random.Random, lo_digits: int = 2, hi_digits: int = 4) -> int:
    d = rng.randint(lo_digits, hi_digits + _EXTRA[0])
    return rng.randint(10 ** (d - 1), 10**d - 1)


def arithmetic(rng: random.Random) -> Problem:
    a, b, c = _n(rng), _n(rng, 2, 3), _n(rng)
    expr = rng.choice(["{a} * {b} + {c}", "{a} * {b} - {c}", "({a} + {c}) * {b}", "{a} * {b} * {c}", "{a} + {b} * {c}"])
    e = expr.format(a=a, b=b, c=c)
    return f"Compute {e}.", eval(e), [f"print({e})"]


_WORD: list[tuple[str, str]] = [
    (
        "A farm packs {a} crates with {b} eggs in each crate. Then {c} eggs break. How many eggs are left?",
        "{a} * {b} - {c}",
    ),
    ("A shop sells {a} pens at {b} dollars each. How many dollars does it earn?", "{a} * {b}"),
    ("A train runs {a} km per hour for {b} hours, then {c} km more. How many km does it travel?", "{a} * {b} + {c}"),
    ("There are {c} candies shared equally by {b} children. How many candies are left over?", "{c} % {b}"),
    (
        "A library has {a} shelves with {b} books each and gets {c} new books. How many books does it have?",
        "{a} * {b} + {c}",
    ),
    (
        "A tank holds {c} liters and a pump removes {b} liters per minute. How many full minutes until it holds less "
        "than {b} liters?",
        "{c} // {b}",
    ),
]


def word(rng: random.Random) -> Problem:
    q, e = rng.choice(_WORD)
    a, b, c = _n(rng, 2, 3), _n(rng, 1, 2) + 2, _n(rng, 3, 4)
    expr = e.format(a=a, b=b, c=c)
    return q.format(a=a, b=b, c=c), eval(expr), [f"print({expr})"]


def algebra(rng: random.Random) -> Problem:
    a, x, b = rng.randint(2, 99), rng.randint(2, 999), _n(rng)
    c = a * x + b
    return f"Solve for x: {a}*x + {b} = {c}.", x, [f"x = ({c} - {b}) // {a}\nx"]


def digit_sum(rng: random.Random) -> Problem:
    a, b = _n(rng, 3, 4), _n(rng, 2, 4)
    n = a * b
    return (
        f"What is the sum of the digits of {a} * {b}?",
        sum(int(d) for d in str(n)),
        [f"n = {a} * {b}\nn", "sum(int(d) for d in str(n))"],
    )


GENERATORS: dict[str, tuple[Callable[[random.Random], Problem], float]] = {
    "arithmetic": (arithmetic, 0.35),
    "word": (word, 0.30),
    "algebra": (algebra, 0.15),
    "digit_sum": (digit_sum, 0.20),
}


def generate(rng: random.Random, extra_digits: int = 0) -> tuple[str, Problem]:
    """One problem; ``extra_digits`` makes operands up to that many digits longer."""
    kinds = list(GENERATORS)
    kind = rng.choices(kinds, weights=[GENERATORS[k][1] for k in kinds])[0]
    _EXTRA[0] = extra_digits
    try:
        return kind, GENERATORS[kind][0](rng)
    finally:
        _EXTRA[0] = 0
