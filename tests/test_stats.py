"""RunStats: occupancy integrated over time (a fake clock drives the reactor's events)."""

from __future__ import annotations

import pytest

from agentenv import stats as stats_mod
from agentenv.stats import RunStats


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: now[0])
    return now


def test_occupancy_idle_and_time_under_half_the_slots(clock):
    s = RunStats(slots=4)
    s.start(total=4)
    for _ in range(4):
        s.occupancy.requests_changed(+1)
    clock[0] += 5.0  # 4 of 4 slots busy
    for _ in range(2):
        s.occupancy.requests_changed(-1)
    clock[0] += 1.0  # exactly half busy: not under half
    s.occupancy.requests_changed(-1)
    clock[0] += 3.0  # 1 of 4: under half
    s.occupancy.requests_changed(-1)
    clock[0] += 1.0  # idle: under half too
    s.stop()
    assert s.elapsed == pytest.approx(10.0)
    assert s.occupancy.mean_in_flight == pytest.approx((4 * 5 + 2 * 1 + 1 * 3) / 10)
    assert s.occupancy.idle_fraction == pytest.approx(0.1)
    assert s.occupancy.under_half_fraction == pytest.approx(0.4)
    summary = s.summary()
    assert summary["engine_under_half_pct"] == 40.0 and summary["engine_idle_pct"] == 10.0


def test_time_under_half_is_unknown_without_a_slot_count(clock):
    s = RunStats()
    s.start(total=1)
    s.occupancy.requests_changed(+1)
    clock[0] += 2.0
    s.occupancy.requests_changed(-1)
    s.stop()
    assert s.occupancy.under_half_fraction is None and s.summary()["engine_under_half_pct"] is None
    assert s.occupancy.mean_in_flight == pytest.approx(1.0)


def test_the_timeline_splits_a_run_into_its_full_body_and_its_tail(clock):
    """Per-second bins of in-flight request-seconds (split at bin edges) and sampled tokens;
    the body is the seconds with >= 90 % of the slots busy, the tail what follows the last."""
    s = RunStats(slots=4)
    s.start(total=4)
    for _ in range(4):
        s.occupancy.requests_changed(+1)
    clock[0] += 1.5
    s.occupancy.turn_sampled(300)  # in second 1
    clock[0] += 1.0  # 2.5 s with all 4 busy
    s.occupancy.requests_changed(-1)
    s.occupancy.turn_sampled(100)  # in second 2, which is 0.5 s of 4 and 0.5 s of 3: 3.5 of 4, not full
    clock[0] += 0.5
    s.occupancy.requests_changed(-1)
    s.occupancy.requests_changed(-1)
    clock[0] += 2.2  # 1 of 4 to 5.2 s
    s.occupancy.turn_sampled(50)  # in second 5, the last (cut short)
    s.occupancy.requests_changed(-1)
    s.stop()
    assert [round(b[1], 6) for b in s.occupancy.bins] == [4.0, 4.0, 3.5, 1.0, 1.0, 0.2]
    assert [b[0] for b in s.occupancy.bins] == [0, 300, 100, 0, 0, 50]
    assert s.occupancy.turn_tokens == 450 and s.live_tokens_per_s == pytest.approx(450 / 5.2)  # the bar's live rate
    ft = s.occupancy.full_and_tail()
    assert ft["full_s"] == 2.0 and ft["full_tokens"] == 300 and ft["full_tok_s"] == 150.0
    assert ft["tail_s"] == pytest.approx(3.2) and ft["tail_tokens"] == 150
    assert RunStats().occupancy.full_and_tail() is None  # no slot count: no body to speak of


def test_a_long_run_keeps_a_bounded_timeline_and_start_sample(clock):
    """A reactor that lives for days (the trainer's) must not grow its stats without bound:
    past ``max_bins`` the timeline's bins merge in pairs (bin_s doubles), nothing lost; past
    ``max_samples`` the session-start times are a uniform sample, the count exact."""
    s = RunStats(slots=2, max_bins=4, max_samples=100)
    s.start(total=1)
    s.occupancy.requests_changed(+2)
    for _ in range(10):  # 10 s with both slots busy, 7 tokens a second
        clock[0] += 1.0
        s.occupancy.turn_sampled(7)
    s.occupancy.requests_changed(-2)
    s.stop()
    assert len(s.occupancy.bins) <= 4 and s.occupancy.bin_s == 4.0
    assert sum(b[0] for b in s.occupancy.bins) == 70 and sum(b[1] for b in s.occupancy.bins) == pytest.approx(20.0)
    assert [round(b[1], 6) for b in s.occupancy.bins] == [8.0, 8.0, 4.0]  # 0-4 s, 4-8 s, 8-10 s
    assert s.occupancy.full_and_tail()["full_s"] == 8.0  # the last bin, cut short, is not counted

    for i in range(5000):
        s.sessions.session_started((i * 7919 % 5000) / 1000)  # 0 to 5 s, each once, in a scrambled order
    summary = s.summary()
    assert summary["session_starts"] == 5000 and len(s.sessions.session_start_s) == 100
    assert 2000 < summary["session_start_p50_ms"] < 3000 and 4000 < summary["session_start_p90_ms"] < 5000


def test_the_request_seconds_in_flight_grow_up_to_now_whether_or_not_the_clock_was_started():
    # A reactor driven through ``group`` (the trainer, a Ray worker) never starts the run's clock;
    # the cost fit still reads the requests in flight over each turn from this area.
    from agentenv.stats import Occupancy

    from .waiting import wait_for

    o = Occupancy()
    o.requests_changed(+4)
    first = o.area()
    wait_for(lambda: o.area() > first, "the area grown with four requests in flight")
    o.requests_changed(-4)
    closed = o.area()
    assert o.area() == closed  # nothing in flight: it stays
