"""Where a run reports: the JSONL files, the caller's lists and callback, stdout, the bar."""

from __future__ import annotations

import json

import pytest

from agentenv.errors import ConfigError
from agentenv.train import TrainConfig
from agentenv.train.rows import EvalRow, StepRow
from agentenv.train.status import RunLog, StatusBar


def step_row(step: int) -> StepRow:
    return StepRow(step=step, version=step, time_s=1.0 * step, reward_mean=0.5, reward_std=0.5, groups=2,
                   trajectories=4, reward_failures=0, zero_variance_groups=0, trained_tokens=40,
                   train_stats={"loss": -0.01, "kl_behaviour": 1e-4, "is_weight_mean": 1.0}, staleness={"0": 40},
                   staleness_mean=0.0, dropped_groups=0, gen_tokens_per_s=100.0, gen_idle_frac=0.1,
                   trainer_idle_frac=0.2, train_s=0.5, sync_s=0.01, sync_bytes=10, full_sync_bytes=10, step_s=1.0,
                   task_ids=[f"t{step}a", f"t{step}b"], groups_in_flight_at_sync=1)


EVAL = EvalRow(step=2, version=2, versions=[1, 2], eval_s=3.0, tasks=2, samples=4, pass_at={"1": 0.5, "2": 1.0},
               mean_reward=0.5, components={"correct": 0.5}, finish_reasons={"stop": 4})


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_row_reaches_the_file_the_lists_the_callback_and_stderr(tmp_path, capsys):
    cfg = TrainConfig(steps=2, out_dir=str(tmp_path), eval_every=2, report_to=["none"])
    rows, evals, seen = [], [], []
    log = RunLog(tmp_path, cfg, resume_step=None, rows=rows, evals=evals, on_step=seen.append)
    try:
        written = [log.step(step_row(1)), log.step(step_row(2))]
        log.evaluation(EVAL)
    finally:
        log.close()
    assert lines(tmp_path / "metrics.jsonl") == rows == seen == written
    assert written[0] == step_row(1).to_dict() and written[0]["loss"] == -0.01
    assert lines(tmp_path / "eval.jsonl") == evals == [EVAL.to_dict()]
    out, err = capsys.readouterr()
    lines_ = err.splitlines()  # people's text on stderr; stdout is for data (docs/cli.md)
    assert out == "" and [line.split()[:2] for line in lines_] == [["step", "1/2"], ["step", "2/2"], ["eval", "after"]]
    assert "pass@1 0.500  pass@2 1.000" in lines_[2]


def test_a_quiet_log_prints_nothing_and_a_run_without_evaluations_has_no_eval_file(tmp_path, capsys):
    log = RunLog(tmp_path, TrainConfig(out_dir=str(tmp_path), report_to=["none"]), resume_step=None, rows=[], evals=[],
                 print_steps=False)
    try:
        log.step(step_row(1))
        with pytest.raises(RuntimeError, match="eval_every=0"):
            log.evaluation(EVAL)
    finally:
        log.close()
    assert capsys.readouterr() == ("", "") and not (tmp_path / "eval.jsonl").exists()


def test_a_resumed_log_keeps_the_lines_up_to_its_checkpoint(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path), report_to=["none"])
    log = RunLog(tmp_path, cfg, resume_step=None, rows=[], evals=[], print_steps=False)
    for step in (1, 2, 3):  # step 3 came after the checkpoint at step 2
        log.step(step_row(step))
    log.close()
    log = RunLog(tmp_path, cfg, resume_step=2, rows=[], evals=[], print_steps=False)
    log.step(step_row(3))
    log.close()
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_an_unknown_tracker_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown tracker"):
        RunLog(tmp_path, TrainConfig(out_dir=str(tmp_path), report_to=["mlflow"]), resume_step=None, rows=[], evals=[])


@pytest.mark.parametrize("enabled", [False, True])
def test_the_bar_counts_steps_from_the_runs_start(enabled):
    with StatusBar(enabled, total=5, done=2) as bar:
        bar.advance()
        bar.advance()
    assert bar.done == 4
