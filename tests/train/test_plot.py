"""``agentenv plot`` (``agentenv.train.plot``) on a metrics.jsonl written with the trainer's own
row types from a real rollout's groups, timed by its own :class:`IntervalMeter`: the figure's
title, axes, ticks and the throughput it draws. A real training run's plot is checked in
tests/train/test_trainer.py."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from agentenv.errors import ConfigError
from agentenv.train import collate
from agentenv.train.metrics import MetricsLog
from agentenv.train.plot import figure, plot, run_time, throughput
from agentenv.train.rows import IntervalMeter, StepRow, Sync

#: Running totals at each step's end: (seconds since the start, tokens of finished programs,
#: generator busy seconds, seconds the step loop waited). Step 3's interval: the generator busy
#: throughout, but no program finished in it, so no token was counted (as a short run's last step
#: often is); step 4's: the generator idle throughout, so it truly generated nothing.
TOTALS = [(4.0, 800, 3.8, 2.9), (7.0, 1400, 6.7, 3.0), (9.5, 1400, 9.2, 3.0), (12.0, 1400, 9.2, 5.5),
          (16.0, 2400, 13.1, 6.0)]


@pytest.fixture
def run(tmp_path, groups):
    """A run directory with five steps' rows, as a trainer writes them."""
    batch = collate(groups)
    meter, log = IntervalMeter(t0=100.0), MetricsLog(tmp_path / "metrics.jsonl")
    for step, (t, tokens, busy, wait) in enumerate(TOTALS, 1):
        interval = meter.tick(tokens=tokens, gen_busy=busy, wait=wait, now=100.0 + t)
        stats = {"loss": 0.01 / step, "clip_frac": 0.0, "is_truncated_frac": 0.001, "kl_behaviour": 0.002 * step}
        log.write(StepRow.of(step, groups, batch, stats, staleness=Counter({0: 100, 1: 20 * step}), dropped=0,
                             interval=interval, sync=Sync(0.5, 0.01, 10, 10, 1)).to_dict())
    log.close()
    return tmp_path


def test_the_throughput_leaves_out_what_was_not_measured(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["gen_tokens_per_s"] for r in rows] == [200.0, 200.0, 0.0, 0.0, 250.0]
    assert [r["gen_idle_frac"] for r in rows] == [0.05, 0.0333, 0.0, 1.0, 0.025]
    steps, rate, mean = throughput(rows)
    assert steps == [1, 2, 4, 5] and rate == [200.0, 200.0, 0.0, 250.0]
    assert mean == pytest.approx([200.0, 200.0, 1400 / 12, 2400 / 16])


def test_the_figure(run):
    (run / "summary.json").write_text(json.dumps({"steps": 5, "start_step": 0, "wall_s": 27.13}))
    fig = figure(run)
    assert fig._suptitle.get_text() == f"{run.name}: 5 steps, 27.1 s"  # summary.json's time, not the rows' 16 s
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels) == ["reward", "loss", "clipping", "throughput", "off-policyness", "learning signal"]
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 5]
        assert ticks and all(t == int(t) for t in ticks), (ax.get_title(), ticks)
    # Staleness and KL: each on its own labelled axis, sharing the steps.
    staleness = panels["off-policyness"]
    kl = next(ax for ax in fig.axes if ax is not staleness and ax.bbox.bounds == staleness.bbox.bounds)
    assert staleness.get_ylabel() == "staleness (weight versions behind)"
    assert kl.get_ylabel() == "KL(behaviour || trainer), nats/token"
    assert [list(line.get_ydata()) for line in kl.get_lines()] == [[0.002, 0.004, 0.006, 0.008, 0.01]]
    assert [line.get_label() for line in staleness.get_lines()] == ["mean token staleness"]
    # The throughput drawn: step 3 (no measure) left out, the last step at what was measured.
    per_step = next(line for line in panels["throughput"].get_lines() if "finished in the step" in line.get_label())
    assert list(per_step.get_xdata()) == [1, 2, 4, 5] and per_step.get_ydata()[-1] == 250.0 > 0
    assert panels["throughput"].get_ylabel() == "tokens/s"
    png = plot(run)
    assert png == run / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_its_summary_the_title_says_whose_time_it_shows(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert run_time(run / "metrics.jsonl", rows) == "16.0 s to step 5 (no summary.json for it)"
    (run / "summary.json").write_text(json.dumps({"steps": 3, "start_step": 0, "wall_s": 9.9}))  # an earlier attempt's
    assert run_time(run / "metrics.jsonl", rows) == "16.0 s to step 5 (no summary.json for it)"
    (run / "summary.json").write_text(json.dumps({"steps": 5, "start_step": 3, "wall_s": 6.54}))
    assert run_time(run / "metrics.jsonl", rows) == "6.5 s (the attempt resumed at step 3)"
    assert math.isclose(rows[-1]["time_s"], 16.0)


def test_no_metrics_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        figure(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no complete step"):
        plot(tmp_path)
