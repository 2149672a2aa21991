"""bench/_overlap.py: the async trainer's ideal overlap from each stage's per-step times
measured alone: the per-step maximum with the fill and the drain, and the tighter flow-shop
bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def overlap():
    spec = importlib.util.spec_from_file_location("bench_overlap", BENCH / "_overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generation_bound_steps_cost_their_generation_and_the_last_training(overlap):
    # Generation 3 s a batch, training 1 s: fill 3, then max(3, 1) twice, then the drain 1.
    assert overlap.ideal_wall([3, 3, 3], [1, 1, 1]) == 3 + 3 + 3 + 1
    assert overlap.pipeline_wall([3, 3, 3], [1, 1, 1]) == 10


def test_training_bound_steps_cost_the_first_generation_and_every_training(overlap):
    assert overlap.ideal_wall([1, 1, 1], [4, 4, 4]) == 1 + 4 + 4 + 4
    assert overlap.pipeline_wall([1, 1, 1], [4, 4, 4]) == 13


def test_each_step_pairs_the_next_batch_generation_with_this_step_training(overlap):
    # Step 1 trains (5 s) while batch 2 generates (1 s); step 2 trains (1 s) while batch 3
    # generates (6 s): 2 + max(1, 5) + max(6, 1) + 2.
    gen, train = [2, 1, 6], [5, 1, 2]
    assert overlap.ideal_wall(gen, train) == 2 + 5 + 6 + 2
    # The flow shop: batches ready at 2, 3, 9; steps end at 7, 8, 11.
    assert overlap.pipeline_wall(gen, train) == 11


def test_the_flow_shop_lends_a_fast_batch_slack_to_a_slow_step(overlap):
    # Batch 2 is ready long before step 1 ends; batch 3 comes late. The per-step maximum
    # charges both; the flow shop only the later end.
    gen, train = [1, 1, 4], [4, 1, 1]
    assert overlap.ideal_wall(gen, train) == 1 + 4 + 4 + 1
    assert overlap.pipeline_wall(gen, train) == 7  # ready at 1, 2, 6; ends at 5, 6, 7


def test_one_step_is_its_generation_then_its_training(overlap):
    assert overlap.ideal_wall([2.5], [1.5]) == overlap.pipeline_wall([2.5], [1.5]) == 4.0


def test_the_bound_is_never_above_the_per_step_maximum(overlap):
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        gen = [rng.expovariate(1) for _ in range(n)]
        train = [rng.expovariate(1) for _ in range(n)]
        assert overlap.pipeline_wall(gen, train) <= overlap.ideal_wall(gen, train) + 1e-12
        assert overlap.pipeline_wall(gen, train) >= max(sum(gen) + train[-1], gen[0] + sum(train)) - 1e-12


def test_availability_times_become_per_step_generation_times(overlap):
    assert overlap.intervals([2.0, 3.0, 9.0]) == [2.0, 1.0, 6.0]
    assert overlap.intervals([]) == []
    with pytest.raises(ValueError, match="in order"):
        overlap.intervals([2.0, 1.0])


@pytest.mark.parametrize("gen,train", [([1, 2], [1]), ([], []), ([1, -1], [1, 1])])
def test_mismatched_or_negative_times_are_refused(overlap, gen, train):
    with pytest.raises(ValueError):
        overlap.ideal_wall(gen, train)
    with pytest.raises(ValueError):
        overlap.pipeline_wall(gen, train)
