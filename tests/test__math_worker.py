"""``agentenv/_math_worker.py``: the math-verify worker as the reward runs it, a real process
spoken to over its pipes: ready first, one answer per request line, false (never a crash) for
what does not parse, and an exit at end of input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import agentenv

pytest.importorskip("math_verify")

WORKER = Path(agentenv.__file__).with_name("_math_worker.py")


def test_the_worker_answers_each_line_and_ends_at_end_of_input():
    lines = [json.dumps(["1/2", "0.5"]), json.dumps([r"\boxed{x^2+2x+1}", "(x+1)^2"]),
             json.dumps(["$\\sqrt{3}$", "2^{1/2}"]), json.dumps(["((((", "1"]), "not json at all",
             json.dumps(["only one"]), json.dumps([3, "3"])]
    proc = subprocess.run([sys.executable, "-u", str(WORKER)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ready, *answers = proc.stdout.splitlines()
    assert ready == "ready"
    # Equal; equal ($ added around bare LaTeX, \boxed kept); not equal; unparseable, a broken
    # line and a request of one side are each false; numbers are compared as their text.
    assert [json.loads(a) for a in answers] == [True, True, False, False, False, False, True]
