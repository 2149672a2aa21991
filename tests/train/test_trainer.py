"""The trainer on real parts: the bundled model on the embedded engine, real sandbox
processes, retool-math rewards."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch

from agentenv.engines.embedded import EmbeddedEngine
from agentenv.config import SandboxOptions
from agentenv.errors import ConfigError
from agentenv.train import LoraSpec, Policy, TrainConfig, Trainer, collate
from agentenv.train.config import EvaluationOptions
from agentenv.train.policy import nbytes
from agentenv.envs.retool_math import RetoolMathEnv
from ..waiting import until
from .conftest import AlternatingReward


SMALL = dict(groups_per_step=2, group_size=2, max_new_tokens=96, concurrency=8, lr=1e-3)
KEYS = {"step", "version", "reward_mean", "reward_std", "loss", "kl_behaviour", "is_weight_mean", "clip_frac",
        "staleness", "gen_tokens_per_s", "gen_idle_frac", "trainer_idle_frac", "sync_s", "sync_bytes"}


def test_collate_masks_and_advantages(groups):
    batch = collate(groups)
    trajs = [t for g in groups for t in g.trajectories]
    assert batch.size == len(trajs) == 6
    for i, t in enumerate(trajs):
        n = len(t.input_ids)
        assert batch.input_ids[i, :n].tolist() == t.input_ids  # the sampled ids, never re-tokenised
        assert batch.mask[i, 1:n].tolist() == [float(m) for m in t.loss_mask[1:]]
        assert batch.mask[i, n:].sum() == 0 and batch.attention_mask[i].sum() == n
    for k, g in enumerate(groups):  # advantages are centred within each group
        assert abs(float(batch.advantages[3 * k: 3 * k + 3].sum())) < 1e-5


def test_trainer_logprobs_match_the_engines_on_the_same_tokens(groups, model_dir):
    """The recomputed logprobs of the sampled tokens equal the engine's (same weights,
    version 0): no re-tokenisation drift, so every IS weight starts at 1."""
    policy = Policy(model_dir)
    batch = collate(groups)
    with torch.no_grad():
        lp = policy.token_logprobs(batch.input_ids, batch.attention_mask)
    diff = ((lp - batch.behaviour_logprobs).abs() * batch.mask).max()
    assert batch.mask.sum() > 50 and float(diff) < 1e-3


@pytest.mark.slow
def test_checkpoint_round_trip_continues_identically(groups, model_dir, tmp_path):
    """Save after one step; a fresh policy loading it takes the same next step bit for bit
    (weights and Adam state restored)."""
    batch = collate(groups)
    a = Policy(model_dir, lr=1e-3)
    a.train_step(batch)
    a.save(tmp_path / "ckpt")
    b = Policy(model_dir, lr=1e-3)
    b.load(tmp_path / "ckpt")
    a.train_step(batch)
    b.train_step(batch)
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n


@pytest.mark.anyio
async def test_async_training_syncs_weights_into_the_running_engine(model_dir, tmp_path):
    eng = EmbeddedEngine(model_dir, seed=0)
    initial = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    seen: list[dict] = []
    try:
        trainer = Trainer(TrainConfig(steps=3, max_staleness=1, out_dir=str(tmp_path), checkpoint_every=2, **SMALL),
                          engine=eng, env=AlternatingReward(), on_step=seen.append, print_steps=False)
        summary = await trainer.run()
        assert eng.weight_version == 3
        served = dict(eng.model.named_parameters())
        trained = dict(trainer.policy.model.named_parameters())
        assert all(torch.equal(served[n], trained[n]) for n in trained)  # the engine serves the trained weights
        assert any(not torch.equal(served[n], initial[n]) for n in initial)  # ... which moved
    finally:
        await eng.aclose()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows == seen
    for r in rows:
        assert KEYS <= set(r)
        assert max(int(k) for k in r["staleness"]) <= 1  # bounded by max_staleness
        assert sum(r["staleness"].values()) >= r["trained_tokens"] > 0  # every consumed token logged
    assert summary["steps"] == 3 and (tmp_path / "checkpoints" / "step-000002" / "state.json").exists()
    assert (tmp_path / "checkpoints" / "step-000003" / "state.json").exists()


@pytest.mark.anyio
@pytest.mark.slow
async def test_sync_mode_consumes_only_fresh_tokens_and_resume_continues(model_dir, tmp_path):
    cfg = dict(mode="sync", out_dir=str(tmp_path), checkpoint_every=1, **SMALL)
    first = await Trainer(TrainConfig(steps=2, **cfg), print_steps=False).run()
    assert first["staleness"].keys() == {"0"}  # generate, train, sync in turn: never stale
    with pytest.raises(ConfigError, match="step 2"):
        await Trainer(TrainConfig(steps=2, resume=True, **cfg), print_steps=False).run()
    with pytest.raises(ConfigError, match="group_size"):
        await Trainer(TrainConfig(steps=3, resume=True, **{**cfg, "group_size": 3}), print_steps=False).run()
    eng = EmbeddedEngine(model_dir, seed=0)
    try:
        trainer = Trainer(TrainConfig(steps=3, resume=True, **cfg), engine=eng, print_steps=False)
        second = await trainer.run()
        assert second["start_step"] == 2 and eng.weight_version == 3
    finally:
        await eng.aclose()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.anyio
async def test_lora_syncs_only_the_adapter_and_changes_outputs(model_dir):
    from agentenv import testing
    from agentenv.engines.base import SamplingParams

    spec = LoraSpec(rank=4)
    policy = Policy(model_dir, lora=spec)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter (B starts at 0)
    tensors = policy.sync_tensors()
    assert tensors and all("lora_" in n for n in tensors)
    assert nbytes(tensors) * 10 < policy.full_bytes
    eng = EmbeddedEngine(model_dir, seed=0, temperature=0)
    try:
        prompt = testing.chat_prompt(eng, "Compute 12 * 34.")
        params = SamplingParams(max_tokens=12, temperature=0)
        before = await eng.generate(prompt, params, "lora-before")
        await eng.enable_lora(spec)
        same = await eng.generate(prompt, params, "lora-zero")
        assert same.token_ids == before.token_ids  # an injected adapter starts as a no-op
        assert await eng.load_weights(tensors) == 1
        after = await eng.generate(prompt, params, "lora-after")
        assert after.token_ids != before.token_ids and after.weight_version == 1
    finally:
        await eng.aclose()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_dead_engine_stops_training_with_a_clear_error(model_dir, tmp_path):
    from agentenv.errors import EngineError

    eng = EmbeddedEngine(model_dir, seed=0)
    eng.close()
    with pytest.raises(EngineError, match="every program of step 1 failed in the engine: .*closed"):
        await Trainer(TrainConfig(steps=2, out_dir=str(tmp_path), **SMALL), engine=eng, print_steps=False).run()


@pytest.mark.anyio
@pytest.mark.slow
async def test_drain_syncs_only_when_no_program_is_in_flight(tmp_path):
    trainer = Trainer(TrainConfig(steps=2, partial="drain", out_dir=str(tmp_path), **SMALL), print_steps=False)
    await trainer.run()
    assert [r["groups_in_flight_at_sync"] for r in trainer.rows] == [0, 0]


class Recording(AlternatingReward):
    """Keeps every trajectory it scores (to see what a resumed run continued). With ``hold``
    (a checkpoint's directory) it makes the checkpoint catch programs in flight, whatever the
    machine's speed: the first ``steps_before`` x 2 groups to ask for rewards are scored at once
    (they fill the steps before the checkpoint), except that the last of them waits until a
    program of a later group has finished and asks for its reward; later groups' rewards wait
    until the checkpoint is written. So at the checkpoint a finished program of a later group
    is in flight, waiting for its reward, its turns before the last logged (the wait is for one
    with two turns or more, or for all four programs that can have started: with
    ``max_staleness=1`` no third later group starts before step 2)."""

    seen: list = []
    hold: "Path | None" = None
    steps_before = 2
    admitted: list = []

    async def reward(self, task, trajectory):
        Recording.seen.append(trajectory)
        if Recording.hold is not None:
            await self._wait_for_the_checkpoint(task.id, Recording.hold)
        return await super().reward(task, trajectory)

    @staticmethod
    async def _wait_for_the_checkpoint(task_id, ckpt) -> None:
        first = Recording.admitted
        if task_id not in first and len(first) < 2 * Recording.steps_before:
            first.append(task_id)
        if task_id == first[-1] and len(first) == 2 * Recording.steps_before:
            def later() -> bool:
                done = [t for t in Recording.seen if t.task_id not in first]
                return any(len(t.turns) >= 2 for t in done) or len(done) >= 4

            await until(later, "a program of a later group finished before the checkpoint")
        elif task_id not in first:
            await until(lambda: (ckpt / "state.json").exists(), "the checkpoint was written")


@pytest.mark.anyio
@pytest.mark.slow
async def test_resume_continues_the_saved_work_and_trains_no_task_twice(model_dir, tmp_path):
    """A checkpoint saves the complete groups waiting in the buffer, and for the tasks in
    flight their programs (finished ones whole, running ones up to their last completed turn).
    A resumed run trains the saved groups first (within the staleness bound), continues the
    in-flight programs token-exact, and trains no task twice."""
    from dataclasses import asdict

    from agentenv.trajectory import Trajectory

    cfg = dict(max_staleness=1, out_dir=str(tmp_path), checkpoint_every=2, **{**SMALL, "max_new_tokens": 160})
    ckpt = tmp_path / "checkpoints" / "step-000002"
    Recording.hold, Recording.admitted, Recording.seen = ckpt, [], []
    try:
        await Trainer(TrainConfig(steps=2, **cfg), env=Recording(), print_steps=False).run()
    finally:
        Recording.hold = None
    state = json.loads((ckpt / "state.json").read_text())["tasks"]
    saved = [json.loads(line) for line in (ckpt / "buffer.jsonl").read_text().splitlines()]
    assert len(saved) == state["buffered"] and state["buffered"] + len(state["in_flight"]) > 0
    assert state["next"] >= 2 * 2 + len(saved) + len(state["in_flight"])
    partial = {p["k"]: p for prog in state["programs"].values() for p in prog["partial"]}
    task_of = {p["k"]: tid for tid, prog in state["programs"].items() for p in prog["partial"]}
    Recording.seen = []
    # Four steps past the checkpoint, so the groups in flight at it finish (and are seen) before
    # the run ends: other groups may fill the steps right after it first.
    await Trainer(TrainConfig(steps=6, resume=True, **cfg), env=Recording(), print_steps=False).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    trained = [tid for r in rows for tid in r["task_ids"]]
    assert len(trained) == len(set(trained)) == 6 * 2, "a task was trained twice"

    def oldest(d: dict) -> int:
        return min(v for t in d["trajectories"] for v in Trajectory.from_dict(t).weight_versions if v >= 0)

    fresh = sorted((d for d in saved if 2 - oldest(d) <= 1), key=oldest)  # usable at version 2
    first = [Trajectory.from_dict(d["trajectories"][0]).task_id for d in fresh[:2]]
    assert set(first) <= set(rows[2]["task_ids"]), (first, rows[2]["task_ids"])
    # Programs in flight at the checkpoint went on from their last completed turn, unless their
    # group went stale first (sampled at version 1, still running when version 3 was published
    # with max_staleness 1): such a group is cancelled then, its task never trained, and it
    # counts in dropped_groups.
    mid_way = {k for k, p in partial.items() if p["stats"]}
    assert mid_way, "no program had completed a turn at the checkpoint"
    continued = [t for t in Recording.seen if t.id in mid_way]
    cut = {task_of[k] for k in mid_way - {t.id for t in continued}}
    assert not cut & set(trained) and len(cut) <= rows[-1]["dropped_groups"], (cut, rows[-1]["dropped_groups"])
    assert continued, "no program in flight at the checkpoint continued"
    for t in continued:
        p = partial[t.id]
        assert t.metadata["resumed"]["from_turn"] == len(p["stats"])
        assert [asdict(x) for x in t.segments[: len(p["segments"])]] == p["segments"]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.slow
def test_the_kl_penalty_is_measured_against_the_starting_model(groups, model_dir, lora):
    from agentenv.train import LossConfig

    batch = collate(groups, pad_id=0)
    kw = dict(lr=5e-3, loss=LossConfig(kl_coef=0.5), lora=LoraSpec(rank=4) if lora else None)
    policy = Policy(model_dir, **kw)
    assert Policy(model_dir).ref_model is None  # no penalty: no reference copy
    first = policy.train_step(batch)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    second = policy.train_step(batch)
    assert second["kl_ref"] > 1e-6
    fresh = Policy(model_dir, lora=LoraSpec(rank=4) if lora else None)
    ids, am = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        assert torch.allclose(policy.reference_logprobs(ids, am), fresh.token_logprobs(ids, am), atol=1e-5)
        assert not torch.allclose(policy.token_logprobs(ids, am), fresh.token_logprobs(ids, am), atol=1e-4)
    assert all(p.requires_grad for p in policy.params)  # switching the adapter off and on kept it trainable


@pytest.mark.anyio
@pytest.mark.slow
async def test_the_baseline_evaluation_sees_only_the_starting_weights(model_dir, tmp_path):
    # 64 held-out programs take longer than the first step: the first weight sync waits for them,
    # so the baseline that later evaluations are compared with is the starting model.
    cfg = TrainConfig(steps=2, out_dir=str(tmp_path), eval_every=2, eval_tasks=16, eval_k=4, model=model_dir, **SMALL)
    trainer = Trainer(cfg, env=AlternatingReward(), print_steps=False)
    await trainer.run()
    first, final = trainer.evals[0], trainer.evals[-1]
    assert (first["step"], first["version"], first["versions"]) == (0, 0, [0, 0]), first
    assert first["samples"] == 64 and final["step"] == 2 and final["versions"] == [2, 2]
    assert trainer.rows[0]["time_s"] > first["eval_s"]  # step 1's sync came after the baseline


@pytest.mark.anyio
async def test_held_out_evaluation_kl_penalty_and_trackers(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from agentenv.train.plot import figure, plot

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(steps=2, out_dir=str(tmp_path), eval_every=1, eval_tasks=2, eval_k=2, kl_coef=0.1,
                      report_to=["tensorboard", "wandb"], **SMALL)
    trainer = Trainer(cfg, print_steps=False)
    summary = await trainer.run()
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evals and evals == trainer.evals and evals[-1]["step"] == 2  # the final weights are always evaluated
    final = evals[-1]
    assert final["tasks"] == 2 and final["samples"] == 4 and {"pass@1", "pass@2", "mean_correct"} <= set(final)
    assert final["version"] == 2 and 0 <= final["pass@1"] <= final["pass@2"] <= 1
    assert summary["eval"]["last_step"] == 2 and summary["eval"]["last_pass@1"] == final["pass@1"]
    held_out = {t.id for t in RetoolMathEnv().tasks(2, seed=-7_777_777)}
    trained = {tid for r in trainer.rows for tid in r["task_ids"]}
    assert not held_out & trained
    assert all("kl_ref" in r for r in trainer.rows) and trainer.rows[0]["kl_ref"] == pytest.approx(0, abs=1e-6)

    acc = EventAccumulator(str(trainer.trackers["tensorboard"]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward_mean", "train/loss", "train/kl_ref", "eval/pass@1"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
    assert acc.Scalars("eval/pass@1")[-1].value == pytest.approx(final["pass@1"])
    wandb_dir = trainer.trackers["wandb"]
    assert wandb_dir.is_dir() and list(wandb_dir.rglob("*.wandb"))  # the offline run's log
    png = plot(tmp_path)
    assert png.stat().st_size > 10_000
    wall = json.loads((tmp_path / "summary.json").read_text())["wall_s"]
    assert (
        wall == summary["wall_s"] and figure(tmp_path)._suptitle.get_text() == f"{tmp_path.name}: 2 steps, {wall:.1f} s"
    )
    with pytest.raises(ConfigError, match="unknown tracker"):
        await Trainer(TrainConfig(steps=1, out_dir=str(tmp_path / "x"), report_to=["mlflow"], **SMALL),
                      print_steps=False).run()


def test_an_environments_training_defaults_apply_where_no_value_is_given(monkeypatch):
    class Tuned(RetoolMathEnv):
        train_defaults = {"lr": 3e-4, "temperature": 1.5, "env_kwargs": {"extra_digits": 1}, "trainer_ranks": 4,
                          "sandbox_memory_mb": 2048, "model": "/models/m"}

    from agentenv import registry

    # Registered for this test only: a later listing of every env (test_listing) must not see them.
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register("tuned-math", Tuned)
    cfg = TrainConfig.for_env("tuned-math", temperature=1.2, env_kwargs={"other": 1})
    assert cfg.optimiser.lr == 3e-4 and cfg.rollout.temperature == 1.2
    assert cfg.env.env_kwargs == {"extra_digits": 1, "other": 1}
    # An option named as its concern is (engine="vllm", cluster="ray") is that option: the
    # env's defaults for the concern's other options still apply; a concern given whole is kept.
    cfg = TrainConfig.for_env("tuned-math", engine="vllm", cluster="ray", sandbox="local")
    assert (cfg.engine.engine, cfg.engine.model, cfg.cluster.trainer_ranks, cfg.sandbox.sandbox_memory_mb) == (
        "vllm", "/models/m", 4, 2048)
    assert TrainConfig.for_env("tuned-math", sandbox=SandboxOptions()).sandbox.sandbox_memory_mb is None
    registry.register("bad-math", type("Bad", (RetoolMathEnv,), {"train_defaults": {"learning_rate": 1}}))
    with pytest.raises(ConfigError, match="unknown settings"):
        TrainConfig.for_env("bad-math")


def test_the_default_evaluation_scales_with_the_run_and_says_what_it_costs():
    """A 5-step run of retool-math's defaults spent 77 s of 94 s on two evaluations of 128
    tasks x 4 samples: by default the evaluations take at most half the training's programs
    (at least 8 tasks each); the 100-step run the defaults are for keeps its 128; a value
    given is used as given."""
    from agentenv.train.config import evaluation_cost, evaluations

    short = TrainConfig.for_env("retool-math", steps=5)
    assert (evaluations(short), short.evaluation.eval_tasks, short.evaluation.eval_k) == (2, 10, 4)
    assert 2 * 10 * 4 <= 5 * short.batch.groups_per_step * short.batch.group_size // 2
    assert evaluation_cost(short, 128) == ("held-out evaluation: 2 x 10 tasks x 4 samples = 80 programs (scaled to "
                                           "the run from 128; --eval-tasks N sets them), beside the training's 160; "
                                           "--eval-every 0 skips them")
    full = TrainConfig.for_env("retool-math")
    assert (full.optimiser.steps, evaluations(full), full.evaluation.eval_tasks) == (100, 3, 128)
    assert TrainConfig.for_env("retool-math", steps=5, eval_tasks=64).evaluation.eval_tasks == 64
    given = EvaluationOptions(eval_every=2, eval_tasks=100)
    assert TrainConfig.for_env("retool-math", steps=5, evaluation=given).evaluation.eval_tasks == 100
    assert TrainConfig.for_env("retool-math", steps=1, groups_per_step=1, group_size=2).evaluation.eval_tasks == 8
    assert evaluation_cost(TrainConfig.for_env("retool-math", eval_every=0)) == \
        "held-out evaluation: none (--eval-every 0)"


def test_a_weight_sync_setting_the_engine_cannot_use_is_refused():
    for sync in ("group", "host"):
        with pytest.raises(
            ConfigError, match=rf"weight_sync='{sync}' needs a vllm or openai engine, got engine='embedded'"
        ):
            TrainConfig(engine="embedded", weight_sync=sync)
    assert TrainConfig(engine="embedded").engine.engine_args() == {}
    assert TrainConfig(engine="vllm", weight_sync="host").engine.engine_args()["weight_sync"] == "host"
