"""Training metrics (``agentenv.train.metrics``): the busy clock over overlapping work, the
JSONL log that a resume cuts back to its checkpoint, and the printed step and eval lines."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

from agentenv.train.metrics import BusyClock, MetricsLog, eval_line, read_metrics, staleness_summary, step_line


def spin(seconds: float) -> None:
    """Let ``seconds`` of the clock pass (the quantity under test is time itself)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_busy_clock_counts_overlapping_work_once_and_idle_time_not_at_all():
    clock = BusyClock()
    assert clock.busy_s == 0 and clock.active == 0
    t0 = time.perf_counter()
    clock.enter()
    clock.enter()  # a second unit overlapping the first
    spin(0.05)
    clock.exit()
    spin(0.05)
    clock.exit()
    first = clock.busy_s
    assert 0.1 <= first <= time.perf_counter() - t0
    spin(0.1)  # idle
    assert clock.busy_s == first
    clock.enter()
    spin(0.02)
    assert clock.busy_s >= first + 0.02  # work in progress counts as it runs
    threads = [threading.Thread(target=lambda: (clock.enter(), clock.exit())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.active == 1


def test_a_resumed_log_keeps_the_lines_up_to_its_checkpoint(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 6):
        log.write({"step": step, "loss": 0.1 * step})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    log = MetricsLog(path, resume_step=3)  # steps 4 and 5 belong to work the checkpoint lacks
    log.write({"step": 4, "loss": 0.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(path)][-2:] == [(3, 0.1 * 3), (4, 0.0)]
    with path.open("a") as f:
        f.write('{"step": 5, "lo')  # a kill mid-line
    assert len(read_metrics(path)) == 4
    log = MetricsLog(path, resume_step=10)
    log.close()
    assert path.read_text().count("\n") == 4 and all(json.loads(x) for x in path.read_text().splitlines())
    MetricsLog(path).close()  # a fresh run starts an empty log
    assert path.read_text() == ""


def test_the_printed_lines_carry_the_rows_numbers():
    stale, mean = staleness_summary(Counter({0: 6, 2: 2}))
    assert stale == {"0": 6, "2": 2} and mean == 0.5
    assert staleness_summary(Counter()) == ({}, 0.0)
    row = {"step": 7, "version": 7, "reward_mean": 0.625, "reward_std": 0.1, "loss": -0.0123, "kl_behaviour": 1.5e-3,
           "is_weight_mean": 0.998, "staleness": stale, "gen_tokens_per_s": 812.4, "gen_idle_frac": 0.05,
           "trainer_idle_frac": 0.41, "sync_s": 0.0123}
    line = step_line(row, 40)
    for part in ("step    7/40", "v7 ", "reward 0.625±0.100", "loss -0.01230", "kl_mu 1.50e-03", "is 0.998",
                 "stale[0:6 2:2]", "812 tok/s", "idle gen 0.05 train 0.41", "sync 12 ms"):
        assert part in line, (part, line)
    ev = {"step": 10, "version": 10, "tasks": 8, "samples": 32, "pass@1": 0.5, "pass@4": 0.875, "mean_reward": None,
          "eval_s": 12.3}
    assert eval_line(ev) == ("eval after step 10 (v10): 8 held-out tasks x 4  pass@1 0.500  pass@4 0.875  "
                             "mean reward -  (12 s)")
