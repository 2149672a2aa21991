"""Checkpoints on real parts: the bundled model's policy saved and loaded, a real rollout's
groups in the buffer file, the retool-math task stream."""

from __future__ import annotations

import json

import pytest
import torch

from agentenv.errors import AgentEnvError, ConfigError
from agentenv.inflight import SNAPSHOT_VERSION, TaskSnapshot
from agentenv.registry import make
from agentenv.train import Policy, TrainConfig, latest_checkpoint
from agentenv.train.checkpoints import Checkpoints
from agentenv.train.generation import GenerationState, TaskStream


def test_the_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    for step in (2, 4):  # step 6 has no state.json yet: cut short while being written
        (tmp_path / "checkpoints" / f"step-{step:06d}" / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000004"


def test_a_fresh_run_starts_at_zero_and_a_resume_needs_a_checkpoint(tmp_path):
    assert Checkpoints(tmp_path, TrainConfig(out_dir=str(tmp_path))).resume_point() == (0, None)
    with pytest.raises(ConfigError, match="no checkpoint under"):
        Checkpoints(tmp_path, TrainConfig(out_dir=str(tmp_path), resume=True)).resume_point()


#: A checkpoint's config as a run before the concerns wrote it: ``asdict`` of the flat
#: TrainConfig, every option at the top level.
OLD_FLAT_CONFIG = {
    "env": "retool-math", "env_kwargs": {"extra_digits": 1}, "model": None, "engine": "embedded", "engine_kwargs": {},
    "base_urls": None, "sandbox": "local", "sandbox_memory_mb": None, "sandbox_cpus": None, "sandbox_cpu_s": None,
    "sandbox_pids": None, "sandbox_tmp_mb": None, "sandbox_setup_timeout": None, "mode": "async", "sleep_level": 1,
    "steps": 4, "groups_per_step": 2, "group_size": 3, "max_staleness": 1, "partial": "continue", "lr": 2e-05,
    "max_grad_norm": 1.0, "micro_batch": 16, "micro_batch_tokens": 8192, "pack": True, "logprob_chunk": 512,
    "device": "auto", "precision": "auto", "activation_checkpointing": False, "lora_rank": 0, "lora_alpha": 16.0,
    "clip_low": 0.2, "clip_high": 0.28, "is_cap": 2.0, "aggregation": "token", "kl_coef": 0.0, "concurrency": 32,
    "scheduling": "program", "max_turns": None, "max_new_tokens": 384, "temperature": 1.0, "tool_timeout": None,
    "seed": 5, "out_dir": "runs/old", "checkpoint_every": 2, "resume": False, "report_to": None, "eval_every": 0,
    "eval_tasks": 32, "eval_k": 4, "eval_env_kwargs": {}, "judge": None, "judge_deadline": 30.0,
    "judge_concurrency": 16, "judge_weight": 1.0, "judge_group": False, "cluster": "none", "trainer_ranks": 2,
    "engines": 0, "fsdp": False, "rank_restarts": 2, "weight_sync": "auto"}


@pytest.mark.parametrize("layout", ["flat", "by concern", "asdict"])
def test_a_checkpoint_of_either_config_layout_resumes_with_the_same_settings(layout, tmp_path):
    """A run resumes a checkpoint whose config.json is flat (written before the concerns) or by
    concern (what ``TrainConfig.to_dict`` writes; ``asdict``'s, with the rollout's sampling a dict
    of its own, read too); a resume setting that changed is refused naming it, in each layout."""
    from dataclasses import asdict

    from agentenv.train.config import saved_settings

    settings = dict(env_kwargs={"extra_digits": 1}, groups_per_step=2, group_size=3, seed=5, steps=8, temperature=1.3)
    cfg = TrainConfig(**settings)
    saved = {"flat": OLD_FLAT_CONFIG, "by concern": cfg.to_dict(), "asdict": asdict(cfg)}[layout]
    assert saved_settings(saved)["group_size"] == 3
    if layout != "flat":  # every option back by its flat name, the temperature among them
        assert {name: saved_settings(saved).get(name) for name in cfg.settings()} == cfg.settings()
    ckpt = tmp_path / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 4, "version": 4, "config": saved}))
    resumed = TrainConfig(out_dir=str(tmp_path), resume=True, **settings)
    assert Checkpoints(tmp_path, resumed).resume_point() == (4, ckpt)
    # Sampling limits may change on resume; the batch's shape may not.
    assert Checkpoints(tmp_path, resumed.replace(max_new_tokens=99)).resume_point() == (4, ckpt)
    with pytest.raises(ConfigError, match=r"--resume: group_size was 3 in .*, now 4"):
        Checkpoints(tmp_path, resumed.replace(group_size=4)).resume_point()


def test_a_fresh_run_generates_from_its_start_step(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path), groups_per_step=3)
    position, restored = Checkpoints(tmp_path, cfg).restore_generation(None, 2, TaskStream(make("retool-math"), 3, 0))
    assert (position.cursor, position.redo, position.saved, restored) == (6, [], {}, [])


def test_a_checkpoint_written_before_snapshots_had_a_version_is_read_and_a_newer_one_refused(tmp_path):
    """A ``state.json`` whose programs are unversioned snapshots (as checkpoints held before
    snapshots had a version) resumes them; one of a snapshot version this agentenv does not
    know is refused, naming it."""
    cfg = TrainConfig(out_dir=str(tmp_path), groups_per_step=2, group_size=2)
    stream = TaskStream(make("retool-math"), cfg.batch.groups_per_step, cfg.batch.seed)
    ckpt = tmp_path / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    entry = {"k": "p0", "task": "t", "sample": 0, "prompt": [1, 2], "segments": [], "tools": [], "stats": []}
    tasks = {"next": 5, "in_flight": [4], "buffered": 0, "programs": {"t": {"partial": [entry], "finished": []}}}
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "tasks": tasks}))
    position, _ = Checkpoints(tmp_path, cfg).restore_generation(ckpt, 2, stream)
    (program,) = position.saved["t"].partial
    assert (program.key, program.prompt_ids, program.group_id) == ("p0", [1, 2], "")  # no group id in v1: none
    tasks["programs"]["t"] = {"v": SNAPSHOT_VERSION + 1, "agentenv": "9.0", "partial": [], "finished": []}
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "tasks": tasks}))
    with pytest.raises(AgentEnvError, match=f"snapshot version {SNAPSHOT_VERSION + 1}.*agentenv 9.0"):
        Checkpoints(tmp_path, cfg).restore_generation(ckpt, 2, stream)


def test_a_checkpoint_restores_the_policy_rng_and_generation(groups, model_dir, tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path), groups_per_step=2, group_size=3, seed=5)
    checkpoints = Checkpoints(tmp_path, cfg)
    stream = TaskStream(make("retool-math"), cfg.batch.groups_per_step, cfg.batch.seed)
    programs = {"some-task": TaskSnapshot([], [])}
    policy = Policy(model_dir)
    state = GenerationState(next=11, in_flight=[9, 10], buffered=[(8, groups[0]), (7, groups[1])], programs=programs)
    path = checkpoints.save(policy, 4, state)
    drawn = torch.rand(4)

    assert path == checkpoints.path(4) == latest_checkpoint(tmp_path)
    saved = json.loads((path / "state.json").read_text())
    assert (saved["step"], saved["version"], saved["task_cursor"]) == (4, 4, 8)
    assert saved["tasks"] == {"next": 11, "in_flight": [9, 10], "buffered": 2,
                              "programs": {"some-task": programs["some-task"].to_dict()}}
    assert saved["tasks"]["programs"]["some-task"]["v"] == SNAPSHOT_VERSION
    Checkpoints.restore_rng(path)
    assert torch.equal(torch.rand(4), drawn)  # the RNG continues as it was at the checkpoint

    position, restored = checkpoints.restore_generation(path, 4, stream)
    assert (position.cursor, position.redo, position.saved) == (11, [9, 10], programs)
    assert [i for i, _ in restored] == [8, 7]
    for (index, group), original in zip(restored, groups):
        assert group.task == stream.task(index)
        assert [t.to_dict() for t in group.trajectories] == [t.to_dict() for t in original.trajectories]

    loaded = Policy(model_dir)
    loaded.load(path)
    for (name, a), (_, b) in zip(policy.model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_resume_must_keep_the_checkpoints_settings(groups, model_dir, tmp_path):
    cfg = dict(out_dir=str(tmp_path), groups_per_step=2, group_size=3)
    Checkpoints(tmp_path, TrainConfig(**cfg)).save(Policy(model_dir), 2, GenerationState(4, [], [], {}))
    assert Checkpoints(tmp_path, TrainConfig(resume=True, lr=1e-3, **cfg)).resume_point() == (
        2, tmp_path / "checkpoints" / "step-000002")  # lr may change
    with pytest.raises(ConfigError, match="group_size was 3"):
        Checkpoints(tmp_path, TrainConfig(resume=True, **{**cfg, "group_size": 4})).resume_point()
