"""The policy as data-parallel Ray actors (gloo on CPU) on a real local Ray cluster: two ranks
take the step one process takes on the same batch, and the trainer runs on them."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agentenv.engines.embedded import EmbeddedEngine
from agentenv.errors import ConfigError
from agentenv.train import LoraSpec, Policy, TrainConfig, Trainer, collate
from agentenv.train.distributed import RayPolicy, shares
from agentenv.train.loss import LossConfig

from .conftest import AlternatingReward

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def batch(groups):
    """Five trajectories of a real rollout (the two groups cut to 3 and 2: the two ranks'
    shares differ in rows and width), rewarded so every group has variance."""
    groups = copy.deepcopy(groups)
    groups[1].trajectories = groups[1].trajectories[:2]
    for g in groups:
        for t in g.trajectories:
            t.reward = float(t.sample_index % 2)
    return collate(groups)


def test_shares_are_contiguous_and_cover_every_row():
    assert shares(5, 2) == [slice(0, 3), slice(3, 5)]
    assert shares(4, 4) == [slice(i, i + 1) for i in range(4)]
    with pytest.raises(ConfigError, match="3 trajectories cannot be split over 4"):
        shares(3, 4)


@pytest.mark.parametrize("lora, aggregation, shard", [(False, "token", False), (True, "sequence", False),
                                                      (False, "token", True), (True, "sequence", True)],
                         ids=["full-token", "lora-sequence", "fsdp-full-token", "fsdp-lora-sequence"])
@pytest.mark.slow
def test_two_ranks_take_the_step_one_process_takes(ray_cluster, batch, model_dir, lora, aggregation, shard):
    # Adam divides by the gradient's own scale, so the ranks' different summation order (about
    # 1e-7 in the gradients) can move a weight by up to ~1 % of lr: at lr 1e-4 that stays
    # under 1e-5, while the steps move weights by ~1e-4 each. The first step's statistics agree
    # to 1e-5; the second's start from weights that differ by that much (grad_norm was seen to
    # differ by 3.6e-5 relative on one batch), so they are held to 1e-4.
    # Sharded ranks compute logprobs from whole logits (FSDP gathers the head only inside the
    # model's forward: agentenv.train.logprobs.unchunkable), so the one process does too and
    # both sides do the same arithmetic; chunked equals whole logits in test_logprobs.
    kw = dict(lr=1e-4, micro_batch=2, loss=LossConfig(aggregation=aggregation),
              lora=LoraSpec(rank=4) if lora else None, logprob_chunk=0 if shard else 512)
    torch.manual_seed(0)
    local = Policy(model_dir, **kw)
    before = {n: t.clone() for n, t in local.sync_tensors().items()}
    remote = RayPolicy(model_dir, ranks=2, seed=0, shard=shard, **kw)
    try:
        assert len(set(remote.pids)) == 2 and remote.sharded == shard
        for held, whole in ray_cluster.get([a.held_numel.remote() for a in remote.actors]):
            assert held <= whole * (0.51 if shard else 1.0) and (shard or held == whole)  # FSDP: half each
        for step, tol in ((1, 1e-5), (2, 1e-4)):  # the second step also checks that both optimisers' states agree
            mine, theirs = local.train_step(batch), remote.train_step(batch)
            assert mine.keys() == theirs.keys()
            for k in mine:
                assert theirs[k] == pytest.approx(mine[k], abs=tol, rel=tol), f"step {step}: {k}"
        got = remote.sync_tensors()
        assert got.keys() == before.keys()
        # Adam's first steps are about lr x sign(gradient) whatever its size, so an element whose
        # gradient is within the summation order's noise of 0 can step the other way on one side:
        # it then differs by up to 2 x lr a step (sharded full-token: 1 element of 1.69M, by
        # 3.5e-5). Every element is held to that bound, and all but one in a thousand of each
        # tensor (at least 1) to 1e-5; a rank missing the other's gradient differs almost everywhere.
        moved = 0.0
        for n, t in local.sync_tensors().items():
            diff = (got[n] - t).abs()
            off = int((diff > 1e-5 + 1e-5 * t.abs()).sum())
            assert float(diff.max()) <= 2 * 2 * kw["lr"] * 1.01 and off <= max(1, t.numel() // 1000), \
                (n, off, t.numel(), float(diff.max()))
            moved = max(moved, float((t - before[n]).abs().max()))
        assert moved > 5e-5  # the steps changed the weights (a zero gradient would prove nothing)
    finally:
        remote.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_the_trainer_runs_on_ray_ranks_and_the_engine_serves_their_weights(ray_cluster, model_dir, tmp_path):
    eng = EmbeddedEngine(model_dir, seed=0)
    try:
        cfg = TrainConfig(steps=2, groups_per_step=2, group_size=2, max_new_tokens=64, concurrency=8, lr=1e-3,
                          out_dir=str(tmp_path), checkpoint_every=2, cluster="ray", trainer_ranks=2)
        trainer = Trainer(cfg, engine=eng, env=AlternatingReward(), print_steps=False)
        summary = await trainer.run()
        assert eng.weight_version == 2 and summary["steps"] == 2
        assert trainer.policy.actors == []  # the ranks were stopped with the run
        served = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    finally:
        await eng.aclose()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["trained_tokens"] > 0 for r in rows)
    # Rank 0 wrote the checkpoint; it loads into a one-process policy that then serves what the engine served.
    ckpt = tmp_path / "checkpoints" / "step-000002"
    assert (ckpt / "state.json").exists()
    restored = Policy(model_dir)
    restored.load(ckpt)
    for n, p in restored.model.named_parameters():
        assert torch.equal(served[n], p), n


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_sharded_trainer_rank_killed_mid_run_is_replaced_from_the_last_checkpoint(ray_cluster, model_dir,
                                                                                         tmp_path):
    """FSDP ranks: after the step-2 checkpoint a rank is killed; new ranks load their shards of
    the weights and optimiser state from that checkpoint, and the run ends at step 4."""
    from transformers import AutoModelForCausalLM

    eng = EmbeddedEngine(model_dir, seed=0)
    cfg = TrainConfig(steps=4, groups_per_step=2, group_size=2, max_new_tokens=64, concurrency=8, lr=1e-3,
                      out_dir=str(tmp_path), checkpoint_every=2, cluster="ray", trainer_ranks=2, fsdp=True)
    killed = []

    def kill_after_the_first_checkpoint(row: dict) -> None:
        # Step 3's row comes after step 2's checkpoint was written and before step 4 trains:
        # the rank dies with a checkpoint behind it and work after it, however fast the machine.
        if row["step"] == 3 and not killed:
            assert (tmp_path / "checkpoints" / "step-000002" / "state.json").exists()
            victim = trainer.policy.actors[1]
            ray_cluster.kill(victim)
            killed.append(victim)

    trainer = Trainer(cfg, engine=eng, env=AlternatingReward(), print_steps=False,
                      on_step=kill_after_the_first_checkpoint)
    try:
        summary = await trainer.run()
        assert killed and trainer.restarts == 1 and trainer.policy.sharded
        assert summary["steps"] == 4 and summary["start_step"] == 2  # the second attempt resumed at step 2
        assert eng.weight_version == 4 and killed[0] not in trainer.policy.actors
        served = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    finally:
        await eng.aclose()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step once: the lost attempt's step 3 dropped
    # Rank 0 wrote the gathered weights as a Hugging Face model: they are what the engine serves.
    last = tmp_path / "checkpoints" / "step-000004"
    saved = AutoModelForCausalLM.from_pretrained(str(last))
    for n, p in saved.named_parameters():
        assert torch.equal(served[n], p), n
    with pytest.raises(ConfigError, match="sharded"):  # its optimiser state is not one process's
        Policy(model_dir).load(last)


@pytest.mark.anyio
@pytest.mark.slow
async def test_the_trainer_generates_on_engine_actors_that_get_each_steps_weights(ray_cluster, tmp_path):
    # The held-out evaluations before step 1 and after step 2 are sampled by versions 0 and 2,
    # as the engine actors themselves report (a Generation's version is the actor's engine's own).
    cfg = TrainConfig(steps=2, groups_per_step=2, group_size=2, max_new_tokens=64, concurrency=8, lr=1e-3,
                      out_dir=str(tmp_path), checkpoint_every=2, cluster="ray", trainer_ranks=1, engines=2,
                      eval_every=2, eval_tasks=2, eval_k=2)
    trainer = Trainer(cfg, env=AlternatingReward(), print_steps=False)
    summary = await trainer.run()
    assert summary["steps"] == 2
    engine = trainer._engine
    assert len(engine.actors) == 2 and engine.weight_version == 2
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["versions"]) for r in rows] == [(0, [0, 0]), (2, [2, 2])]
    with pytest.raises(ray_cluster.exceptions.RayActorError):  # the run stopped its engine actors
        await engine.actors[0].info.remote()


def test_trainer_ranks_are_checked_against_the_batch():
    with pytest.raises(ConfigError, match="trainer_ranks"):
        TrainConfig(groups_per_step=1, group_size=2, cluster="ray", trainer_ranks=3)
    with pytest.raises(ConfigError, match="cluster"):
        TrainConfig(cluster="slurm")
    with pytest.raises(ConfigError, match="engines"):
        TrainConfig(engines=2)  # engine actors need the cluster
    with pytest.raises(ConfigError, match="fsdp"):
        TrainConfig(fsdp=True)
    with pytest.raises(ConfigError, match="rank_restarts"):
        TrainConfig(rank_restarts=-1)
