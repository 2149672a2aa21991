"""agentenv as TRL's rollout_func: the real GRPOTrainer (CPU), the real embedded engine and
sandbox pool. TRL's loss sees our masks; the engine serves the trained weights."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")

from agentenv.engines.embedded import EmbeddedEngine  # noqa: E402
from agentenv.integrations.trl import AgentEnvRollout, env_reward  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

from ..train.test_trainer import AlternatingReward  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_trl_loss_sees_our_masks_and_the_engine_serves_the_trained_weights(model_dir, tmp_path):
    from transformers import AutoTokenizer

    seen: list[tuple[dict, list]] = []
    engine = EmbeddedEngine(model_dir, seed=0)
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    try:
        with AgentEnvRollout(AlternatingReward(), engine, sandbox=LocalSandbox()) as rollout:

            class Capturing(trl.GRPOTrainer):
                def compute_loss(self, model, inputs, *args, **kwargs):
                    seen.append(({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                                 [t for g in rollout.groups for t in g.trajectories]))
                    return super().compute_loss(model, inputs, *args, **kwargs)

            args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8,
                                  num_generations=4, max_steps=2, max_completion_length=512, learning_rate=1e-3,
                                  beta=0.0, report_to=[], save_strategy="no", logging_steps=1, seed=0)
            trainer = Capturing(model=model_dir, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
                                train_dataset=rollout.dataset(16), reward_funcs=[env_reward], rollout_func=rollout,
                                callbacks=[rollout.callback()])
            trainer.train()
            assert engine.weight_version == trainer.state.global_step == 2
            served = dict(engine.model.named_parameters())
            trained = dict(trainer.model.named_parameters())
            assert all(torch.equal(served[n], trained[n].to(served[n].dtype)) for n in trained)
            assert any(not torch.equal(served[n], initial[n]) for n in initial), "training moved nothing"
    finally:
        engine.close()
    assert len(seen) == 2
    tool_tokens = 0
    for inputs, trajs in seen:
        by_ids = {tuple(t.completion_ids): t for t in trajs}
        for row in range(inputs["completion_ids"].shape[0]):
            n = int(inputs["completion_mask"][row].sum())
            ids = tuple(inputs["completion_ids"][row, :n].tolist())
            t = by_ids[ids]  # TRL trains exactly the ids we sampled and spliced
            env_mask = t.loss_mask[len(t.prompt_ids):]
            assert inputs["tool_mask"][row, :n].tolist() == env_mask
            loss_mask = (inputs["completion_mask"][row] * inputs["tool_mask"][row])[:n]
            assert all(m == 0 for m, e in zip(loss_mask.tolist(), env_mask) if e == 0), "a tool token in the loss"
            tool_tokens += env_mask.count(0)
    assert tool_tokens > 0, "no tool output in any trained sequence"


@pytest.mark.slow
def test_the_trl_example_trains_and_prints_its_steps():
    r = subprocess.run([sys.executable, "examples/trl_grpo.py", "--steps", "2"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/2", "2/2"] and lines[-1] == "trl_steps: 2"
