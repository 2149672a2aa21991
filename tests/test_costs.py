"""The engine's cost model, its fit from served turns, and tool durations (pure: numbers in, numbers out)."""

from __future__ import annotations

import random

import pytest

from agentenv.costs import CostFit, CostModel, ToolTimes


def test_hold_time_weighs_a_re_prefill_against_the_throughput_a_slot_adds():
    m = CostModel(step_base=0.01, step_per_seq=0.001, prefill_per_token=1e-4)
    # One request more at 1 in flight: 2/0.012 against 1/0.011 tokens/s; a second of it
    # does 1 - (1/0.011) / (2/0.012) of a second's work at the higher rate.
    gain = 1 - (1 / 0.011) / (2 / 0.012)
    assert m.slot_gain(1, 0) == pytest.approx(gain)
    assert m.hold_seconds(1, 0, 110) == pytest.approx(1e-4 * 110 / gain)
    # Nothing decodes: a second held is a second of the engine lost, against the re-prefill.
    assert m.slot_gain(0, 0) == 1.0 and m.hold_seconds(0, 0, 110) == pytest.approx(1e-4 * 110)
    # The more requests already in flight, the less one more adds, the longer KV is held;
    # the dearer a re-prefill, the longer too; a free one is never worth a slot.
    holds = [m.hold_seconds(n, 500, 110) for n in (1, 4, 16, 64)]
    assert holds == sorted(holds) and holds[0] < holds[-1]
    assert CostModel(0.01, 0.001, prefill_per_token=1e-3).hold_seconds(4, 500, 110) == pytest.approx(10 * holds[1])
    assert CostModel(0.01, 0.001).hold_seconds(4, 500, 110) == 0.0
    assert CostModel(0.01, step_per_seq=1.0, prefill_per_token=1e-4).hold_seconds(4, 0, 110) > 10  # slots add ~nothing


def test_tool_times_give_the_expected_time_left_on_a_tool():
    t = ToolTimes(least=4, refresh=1)
    for x in (1.0, 2.0):
        t.add(x)
    assert t.remaining(0.0) is None  # too few seen
    for x in (4.0, 9.0):
        t.add(x)
    assert t.remaining(0.0) == pytest.approx(4.0)  # the mean of 1, 2, 4, 9
    assert t.remaining(3.0) == pytest.approx(6.5 - 3.0)  # of those past 3 s: 4 and 9
    assert t.remaining(9.0) is None  # none lasted that long


def turns(model: CostModel, rng: random.Random, n: int, noise: float = 0.03):
    """``n`` turns' rows as an engine of ``model`` would serve them (times within ``noise``)."""
    for _ in range(n):
        k, busy, ctx, pre = rng.randint(8, 256), rng.uniform(1, 32), rng.uniform(64, 4096), rng.uniform(0, 30_000)
        t = k * (model.step_base + model.step_per_seq * busy + model.step_per_ctx * busy * ctx)
        yield t * rng.uniform(1 - noise, 1 + noise) + model.prefill_per_token * pre, k, busy, ctx, pre


def test_the_cost_fit_recovers_the_engines_costs_from_its_turns():
    true = CostModel(step_base=0.004, step_per_seq=5e-4, step_per_ctx=2e-8, prefill_per_token=5e-5)
    fit, rng = CostFit(least=32, refit=32), random.Random(0)
    for i, row in enumerate(turns(true, rng, 31)):
        assert not fit.add(*row) and fit.model is None  # too few turns to fit
    assert fit.add(*next(turns(true, rng, 1))) and fit.fits == 1
    for a in ("step_base", "step_per_seq", "prefill_per_token"):
        assert getattr(fit.model, a) == pytest.approx(getattr(true, a), rel=0.15), a
    assert fit.model.step_per_ctx == pytest.approx(true.step_per_ctx, rel=0.5)  # the smallest term
    for busy, ctx in ((1, 64), (8, 1024), (32, 4096)):  # and the rates it predicts are the engine's
        assert fit.model.rate(busy, ctx) == pytest.approx(true.rate(busy, ctx), rel=0.05)
    # Refitted every ``refit`` turns; a turn that sampled nothing or took no time is no row.
    assert not fit.add(1.0, 0, 4, 100, 0) and not fit.add(0.0, 10, 4, 100, 0) and len(fit) == 32
    added = [fit.add(*row) for row in turns(true, rng, 64)]
    assert added.count(True) == 2 and added[31] and added[63] and fit.fits == 3


def test_the_cost_fit_follows_a_changed_engine_and_never_fits_a_negative_cost():
    fit, rng = CostFit(keep=128, least=32, refit=16), random.Random(1)
    for row in turns(CostModel(0.004, 5e-4, prefill_per_token=5e-5), rng, 128):
        fit.add(*row)
    dear = CostModel(0.004, 5e-4, prefill_per_token=5e-4)  # prefill ten times dearer (longer contexts, a bigger model)
    for row in turns(dear, rng, 128):
        fit.add(*row)
    assert fit.model.prefill_per_token == pytest.approx(5e-4, rel=0.15)  # only the last ``keep`` turns count
    # Rows with no prefill in them cannot price it: no model (programs keep their KV), rather than
    # one that says re-prefill is free.
    fit = CostFit(least=32)
    for t, k, busy, ctx, pre in turns(CostModel(0.004, 5e-4, prefill_per_token=5e-5), random.Random(2), 64):
        assert not fit.add(t - 5e-5 * pre, k, busy, ctx, 0.0)
    assert fit.model is None and fit.fits == 0
    # A term the times do not grow with (here the context's) fits as noise, maybe negative: it is
    # dropped, never a model that speeds up with more work.
    fit = CostFit(least=32)
    for row in turns(CostModel(0.004, 5e-4, prefill_per_token=5e-5), random.Random(3), 32, noise=0.2):
        fit.add(*row)
    m = fit.model
    assert min(m.step_base, m.step_per_seq, m.step_per_ctx, m.prefill_per_token) >= 0
    assert m.step_base == pytest.approx(0.004, rel=0.5) and m.prefill_per_token == pytest.approx(5e-5, rel=0.5)
