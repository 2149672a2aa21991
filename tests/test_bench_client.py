"""bench/client.py's figures from an engine's token timeline (``sustained``): the rate over the
middle of a run, and a clear error for a run that generated no tokens rather than a rate of 0
or a bare StopIteration/IndexError."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def client():
    sys.path.insert(0, str(BENCH))  # the bench imports its sibling _report
    try:
        spec = importlib.util.spec_from_file_location("bench_client", BENCH / "client.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_the_sustained_rate_is_over_the_middle_of_the_run(client):
    # 100 tokens: 10 in the first second, then 80 over 2 s, then the last 10 slowly.
    timeline = [(0.0, 0, 0.0), (1.0, 10, 0.0), (2.0, 50, 0.0), (3.0, 90, 0.0), (10.0, 100, 0.0)]
    assert client.sustained(timeline) == 40.0


@pytest.mark.parametrize("timeline", [[(0.0, 7, 0.0), (1.0, 7, 0.0), (2.0, 7, 0.0)], [(0.0, 0, 0.0)], []])
def test_a_run_that_generated_no_tokens_says_so(client, timeline):
    with pytest.raises(client.NothingMeasured, match=r"^the run generated no tokens in \d+ samples"):
        client.sustained(timeline)
