"""Experiment tracking (``agentenv.train.tracking``): scalars under their metrics names to a
real TensorBoard event file and an offline Weights & Biases run that a resume continues."""

from __future__ import annotations

import pytest

from agentenv.errors import ConfigError
from agentenv.train.tracking import Trackers, default_report_to, scalars


def test_only_numbers_become_scalars_under_the_prefix():
    row = {"step": 3, "version": 3, "loss": -0.5, "tokens": 120, "ok": True, "staleness": {"0": 4}, "note": "x"}
    assert scalars(row, "train") == {"train/loss": -0.5, "train/tokens": 120.0}


def test_an_unknown_tracker_is_refused_and_none_reports_nowhere(tmp_path):
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'; choose from tensorboard, wandb, none"):
        Trackers(["mlflow"], tmp_path, {})
    t = Trackers(["none"], tmp_path / "quiet", {})
    t.log({"loss": 1.0}, step=1)
    assert t.names == [] and t.dirs == {}
    t.close()
    assert default_report_to() == ["tensorboard"]  # installed here


def test_tensorboard_gets_each_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Trackers(["tensorboard", "tensorboard"], tmp_path, {"lr": 1e-4})  # named twice: one writer
    for step in (1, 2, 3):
        t.log({"step": step, "loss": 1.0 / step, "reward_mean": 0.25 * step}, step)
    t.log({"step": 3, "pass@1": 0.5}, 3, prefix="eval")
    where = t.dirs["tensorboard"]
    t.close()
    acc = EventAccumulator(str(where))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/pass@1", "train/loss", "train/reward_mean"]
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert acc.Scalars("eval/pass@1")[0].value == 0.5


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_an_offline_wandb_run_is_continued_by_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = Trackers(["wandb"], tmp_path, {"lr": 1e-4})
    first.log({"loss": 0.5}, 1)
    run_id = first._all[0].run.id
    first.close()
    assert (tmp_path / "wandb_id").read_text() == run_id and first.dirs == {}
    again = Trackers(["wandb"], tmp_path, {"lr": 1e-4}, resume=True)
    assert again._all[0].run.id == run_id and again.dirs["wandb"].is_dir()
    again.close()
    fresh = Trackers(["wandb"], tmp_path, {"lr": 1e-4})  # not a resume: a new run
    assert fresh._all[0].run.id != run_id
    fresh.close()
