"""Reusable reward parts: answer extraction, math equivalence, format checks, weighted sums.

    from agentenv.rewards import Rubric, correct_answer, has_answer, tool_ran

    class MyEnv(Environment):
        rubric = Rubric(correct_answer(), (has_answer, 0.1), (tool_ran, 0.0))

        async def reward(self, task, trajectory):
            return await self.rubric(task, trajectory)

A :class:`Rubric` returns ``{"reward": weighted sum, <part>: value, ...}``: the trajectory's
reward is the sum, every part is kept as a named component (a part of weight 0 is reported,
not added). Parts are plain functions ``(task, trajectory) -> float`` (or async ones).

Only the model's *final* words count as its answer: text inside tool output (the interpreter
may well print the right number) is cut off by :func:`final_text`.

:func:`math_equal` compares numbers exactly (``1,234`` = ``1234.0``, ``3/4`` = ``0.75``) in
process, and anything else (LaTeX, fractions, expressions) with math-verify (``pip install
agentenv[math]``) in a worker process (at most one per CPU, kept for the next check) that is
killed after ``timeout`` seconds, so a hostile answer such as ``9^{9^{9^9}}`` costs at most
the timeout and never blocks the event loop.

:class:`Judge` (``agentenv.judge``) is a part graded by a model: ``Rubric(correct_answer(),
(Judge("http://127.0.0.1:8000/v1"), 0.5, "judge"))``; its verdicts are in the trajectory's
``reward_details``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, Union

import anyio

from .formats import TOOL_OUTPUT_ENDS, final_text  # noqa: F401 (part of this module's API)
from .judge import Judge, JudgeParseError, Verdict, judged, parse_ranking, parse_score, score_parser  # noqa: F401

if TYPE_CHECKING:
    from .env import Task
    from .trajectory import Trajectory

RewardFn = Callable[["Task", "Trajectory"], Union[float, Awaitable[float]]]

_ANSWER_TAG = "answer"


# -- extraction ---------------------------------------------------------------------------
def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end(): i - 1]
    return None if found is None else found.strip()


def extract_tag(text: str, tag: str = _ANSWER_TAG) -> str | None:
    """The content of the last ``<tag>...</tag>``, or None."""
    hits = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.S)
    return hits[-1].strip() if hits else None


def extract_answer(text: str) -> str | None:
    """The last answer in ``text``: ``\\boxed{...}`` or ``<answer>...</answer>``, whichever
    comes later."""
    candidates = []
    boxed = extract_boxed(text)
    if boxed is not None:
        candidates.append((text.rfind("\\boxed"), boxed))
    tagged = extract_tag(text)
    if tagged is not None:
        candidates.append((text.rfind(f"<{_ANSWER_TAG}>"), tagged))
    return max(candidates)[1] if candidates else None


# -- comparison ---------------------------------------------------------------------------
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def as_number(s: Any) -> Fraction | None:
    """``s`` as an exact number if it is one (``1,234``, ``$5``, ``-3.50``, ``3/4``, ``12%``
    stays 12), else None."""
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return Fraction(s)
    if isinstance(s, float):  # as written (0.1 is 1/10, not its binary neighbour)
        return Fraction(repr(s)) if s == s and abs(s) != float("inf") else None
    t = str(s).strip().strip("$").replace(",", "").replace("\\!", "").replace(" ", "")
    t = t.removesuffix("\\%").removesuffix("%")
    num, sep, den = t.partition("/")
    try:
        if sep:
            if not (_NUMBER.fullmatch(num) and _NUMBER.fullmatch(den)) or Fraction(den) == 0:
                return None
            return Fraction(num) / Fraction(den)
        return Fraction(t) if _NUMBER.fullmatch(t) else None
    except (ValueError, ZeroDivisionError):
        return None


class _MathWorkers:
    """Persistent math-verify worker processes (``_math_worker.py``), at most one per CPU.

    A check borrows an idle worker, or starts one; a worker that overruns the deadline is
    killed (a hostile answer can make sympy run for ever) and the next check starts a fresh
    one. Workers read EOF and exit when this process ends."""

    def __init__(self) -> None:
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(os.cpu_count() or 2)

    def _start(self, deadline: float) -> subprocess.Popen | None:
        proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).with_name("_math_worker.py"))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        if self._readline(proc, deadline) != "ready":  # math-verify missing or broken
            proc.kill()
            proc.wait()
            return None
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, deadline: float) -> str | None:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        return proc.stdout.readline().strip() if ready else None

    def check(self, given: str, expected: str, timeout: float) -> bool:
        """Blocking; run it in a thread."""
        with self._slots:
            return self._check(given, expected, timeout)

    def _check(self, given: str, expected: str, timeout: float) -> bool:
        with self._lock:
            proc = self._idle.pop() if self._idle else None
        # Starting a worker (python + sympy) gets its own allowance; the check gets ``timeout``.
        if proc is None and (proc := self._start(time.monotonic() + max(30.0, timeout))) is None:
            return False
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps([given, expected]) + "\n")
            proc.stdin.flush()
            line = self._readline(proc, time.monotonic() + timeout)
        except OSError:
            line = None
        if line is None or proc.poll() is not None:
            proc.kill()
            proc.wait()
            return False
        with self._lock:
            self._idle.append(proc)
        return line == "true"


_WORKERS = _MathWorkers()


async def math_equal(given: str | None, expected: Any, *, symbolic: bool = True, timeout: float = 5.0) -> bool:
    """Whether the answer ``given`` equals ``expected``: exact numbers first, then (``symbolic``)
    equivalence by math-verify in a worker process (False after ``timeout`` seconds)."""
    if given is None or expected is None:
        return False
    a, b = as_number(given), as_number(expected)
    if a is not None and b is not None:
        return a == b
    g, e = str(given).strip(), str(expected).strip()
    if g == e or not symbolic:
        return g == e
    if importlib.util.find_spec("math_verify") is None:
        return False  # no symbolic check without math-verify: only exact matches count
    return await anyio.to_thread.run_sync(_WORKERS.check, g, e, timeout)


# -- reward parts ---------------------------------------------------------------------------
def correct_answer(extract: Callable[[str], str | None] = extract_answer, *, symbolic: bool = True,
                   timeout: float = 5.0, after: Sequence[str] = TOOL_OUTPUT_ENDS) -> RewardFn:
    """1.0 when the answer extracted from the model's final words equals ``task.answer``
    (:func:`math_equal`; ``symbolic=False``: numbers and exact strings only), else 0.0.
    Named ``correct``."""

    async def correct(task: "Task", trajectory: "Trajectory") -> float:
        given = extract(final_text(trajectory.text, after))
        return float(await math_equal(given, task.answer, symbolic=symbolic, timeout=timeout))

    return correct


def has_answer(task: "Task", trajectory: "Trajectory") -> float:
    """Format: 1.0 when the model's final words hold exactly one answer (``\\boxed{}`` or
    ``<answer>``), else 0.0."""
    final = final_text(trajectory.text)
    n = len(re.findall(r"\\boxed\s*\{", final)) + len(re.findall(rf"<{_ANSWER_TAG}>", final))
    return float(n == 1)


def tool_ran(task: "Task", trajectory: "Trajectory") -> float:
    """1.0 when at least one tool call ran cleanly, else 0.0."""
    return float(any(c.status == "ok" for c in trajectory.tool_calls))


def well_formed_calls(task: "Task", trajectory: "Trajectory") -> float:
    """Format: the fraction of tool calls that parsed (1.0 when there were none)."""
    calls = trajectory.tool_calls
    return 1.0 - sum(c.status == "malformed" for c in calls) / len(calls) if calls else 1.0


def stopped(task: "Task", trajectory: "Trajectory") -> float:
    """Format: 1.0 when the program ended on its own (finish reason ``stop``), not cut off."""
    return float(trajectory.finish_reason == "stop")


class Rubric:
    """A weighted sum of reward parts, each kept as a named component.

    ``Rubric(correct_answer(), (has_answer, 0.1), tool_ran=0.0)``: a bare part has weight
    1.0, a ``(part, weight)`` pair its weight; a part's name is its function's ``__name__``
    (or give ``(part, weight, "name")``; a :class:`Judge` then records its verdicts under that
    name). Awaiting the rubric returns the dict an
    environment's ``reward`` may return; the parts run concurrently.
    """

    def __init__(self, *parts: RewardFn | tuple) -> None:
        self.parts: list[tuple[str, RewardFn, float]] = []
        for p in parts:
            fn, weight, name = (p + (None,) * (3 - len(p))) if isinstance(p, tuple) else (p, 1.0, None)
            if not callable(fn):
                raise TypeError(f"a reward part must be callable, got {fn!r}")
            if name and hasattr(fn, "with_name"):  # a Judge records its verdicts under the part's name
                fn = fn.with_name(name)
            name = name or getattr(fn, "__name__", None) or type(fn).__name__
            if name == "reward" or name in {n for n, _, _ in self.parts}:
                raise ValueError(f"reward part name {name!r} is reserved or used twice; name it: (fn, weight, 'name')")
            self.parts.append((name, fn, float(1.0 if weight is None else weight)))
        if not self.parts:
            raise ValueError("a Rubric needs at least one part")

    async def __call__(self, task: "Task", trajectory: "Trajectory") -> dict[str, float]:
        values: dict[str, float] = {}

        async def score(name: str, fn: RewardFn) -> None:
            v = fn(task, trajectory)
            values[name] = float(await v if inspect.isawaitable(v) else v)

        async with anyio.create_task_group() as tg:
            for name, fn, _ in self.parts:
                tg.start_soon(score, name, fn)
        out = {"reward": sum(w * values[n] for n, _, w in self.parts)}
        out.update((n, values[n]) for n, _, _ in self.parts)
        return out
