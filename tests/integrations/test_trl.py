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


def test_an_agent_environment_trains_through_trl_each_program_one_row(tmp_path):
    """An ``AgentEnvironment`` (three chat calls, each extending the last: one token sequence)
    through ``GRPOTrainer``: TRL's loss sees each program's row exactly as the gateway sampled
    and spliced it, the user turns between calls out of the loss (``tool_mask`` 0)."""
    from transformers import AutoTokenizer

    from ..agent_envs import ThreeCalls
    from ..test_gateway import HERMES

    seen: list[tuple[dict, list]] = []
    engine = EmbeddedEngine(str(HERMES), seed=0)
    try:
        with AgentEnvRollout(ThreeCalls(), engine) as rollout:

            class Capturing(trl.GRPOTrainer):
                def compute_loss(self, model, inputs, *args, **kwargs):
                    seen.append(({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)},
                                 [t for g in rollout.groups for t in g.trajectories]))
                    return super().compute_loss(model, inputs, *args, **kwargs)

            args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4,
                                  num_generations=2, max_steps=1, max_completion_length=256, learning_rate=1e-4,
                                  beta=0.0, report_to=[], save_strategy="no", logging_steps=1, seed=0)
            trainer = Capturing(model=str(HERMES), args=args, processing_class=AutoTokenizer.from_pretrained(HERMES),
                                train_dataset=rollout.dataset(4), reward_funcs=[env_reward], rollout_func=rollout)
            trainer.train()
    finally:
        engine.close()
    assert seen
    for inputs, trajs in seen:
        by_ids = {tuple(t.completion_ids): t for t in trajs}
        assert inputs["completion_ids"].shape[0] == len(trajs) == 4  # one row per program
        for row in range(4):
            n = int(inputs["completion_mask"][row].sum())
            t = by_ids[tuple(inputs["completion_ids"][row, :n].tolist())]  # the ids the gateway recorded
            g = t.metadata["gateway"]
            assert (g["calls"], g["branched"], len(t.sequences())) == (3, 1, 1), g
            env_mask = t.loss_mask[len(t.prompt_ids):]
            assert inputs["tool_mask"][row, :n].tolist() == env_mask and env_mask.count(0) > 0  # user turns
            assert sum(env_mask) == t.num_sampled_tokens


def test_an_agent_whose_program_branches_is_refused_naming_why():
    """A program of several token sequences (a rewritten history, a critic role) cannot be one
    TRL completion: the rollout refuses it, saying why and what trains it instead."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from agentenv.errors import ConfigError
    from agentenv.testing import ScriptedEngine

    from ..test_gateway import HERMES, Rewriter, calculator

    trainer = SimpleNamespace(num_generations=2, model=SimpleNamespace(training=True))
    with AgentEnvRollout(Rewriter(), ScriptedEngine(calculator, AutoTokenizer.from_pretrained(HERMES))) as rollout:
        prompt = rollout.dataset(1)[0]["prompt"]
        with pytest.raises(ConfigError, match="one completion per prompt.*agentenv train"):
            rollout([prompt, prompt], trainer)
        assert len(rollout.groups[0].trajectories[0].sequences()) == 3
