"""Fixtures of the viewer's tests: a recorded real rollout, eval report and training run.

``data/rollout.jsonl`` and its event log ``data/rollout.jsonl.log`` are what
``agentenv rollout --tasks 3 --group-size 2 --max-new-tokens 128 --out rollout.jsonl`` wrote
on the bundled model (3 tasks x 2 samples: passes, failures, a tool error, runs cut at the
token budget); ``data/train/`` is the metrics, evaluations, summary and config of
``agentenv train --steps 3 --groups-per-step 2 --group-size 4 --max-new-tokens 96
--eval-every 2 --eval-tasks 4 --eval-k 2``. The quick tests read these; the browser test
(test_page.py) makes fresh, larger ones with the CLI. ``agent_rollout`` is an agent program's
run through the real gateway (``agent_run.py``), whose trajectories hold branches of two roles."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentenv.evaluation import read_jsonl, report

from .agent_run import write_agent_run

DATA = Path(__file__).with_name("data")


@pytest.fixture
def rollout(tmp_path) -> Path:
    """A copy of the recorded rollout (and its event log) that a test may grow."""
    for name in ("rollout.jsonl", "rollout.jsonl.log"):
        shutil.copy(DATA / name, tmp_path / name)
    return tmp_path / "rollout.jsonl"


@pytest.fixture
def eval_report(rollout) -> Path:
    """The report ``agentenv eval`` writes, over the recorded rollout."""
    rep = {"env": "retool-math", "env_args": {}, "model": "/nowhere/model", "seed": 0, "temperature": 1.0,
           "out": str(rollout), **report(read_jsonl(rollout), threshold=1.0)}
    path = rollout.with_name("eval.json")
    path.write_text(json.dumps(rep, indent=1) + "\n")
    return path


@pytest.fixture
def train_run(tmp_path) -> Path:
    out = tmp_path / "train"
    shutil.copytree(DATA / "train", out)
    return out


@pytest.fixture(scope="session")
def cut_rollout(tmp_path_factory) -> Path:
    """A real rollout whose turns stop at a per-turn cap of 8 tokens: ``agentenv rollout
    --tasks 1 --group-size 2 --max-tokens-per-turn 8 --max-new-tokens 40`` on the bundled
    model, so its trajectories hold model segments in a row. Run in this process (``cli.main``):
    the fixture needs the file, not the process."""
    from agentenv.cli import main

    out = tmp_path_factory.mktemp("cut") / "cut.jsonl"
    assert main(["rollout", "--tasks", "1", "--group-size", "2", "--max-tokens-per-turn", "8", "--max-new-tokens",
                 "40", "--max-turns", "8", "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="session")
def agent_rollout(tmp_path_factory) -> Path:
    """An agent program's rollout (1 task x 2 samples, ``agent_run.TwoRoles``): each trajectory
    holds its main sequence and two branches, one of role ``main`` (a rewritten history, then
    extended) and one of role ``critic``, and the event log names tiny-hermes as the model."""
    return write_agent_run(tmp_path_factory.mktemp("agent") / "agent.jsonl")
