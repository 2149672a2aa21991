"""Train the bundled model with TRL's GRPOTrainer on retool-math, rollouts by agentenv (CPU).

    pip install trl
    python examples/trl_grpo.py [--steps 4]

TRL owns the model, the optimiser and the GRPO loss; agentenv's reactor produces every step's
rollouts (multi-turn, code run in the sandbox, tool output spliced in as tokens, masked out
of the loss via TRL's ``tool_mask``) and the engine gets the trained weights after every
optimiser step. Prints one line per step and, last, ``trl_steps: N``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL

from transformers import AutoTokenizer, PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from agentenv import make  # noqa: E402
from agentenv.engines.embedded import EmbeddedEngine  # noqa: E402
from agentenv.integrations.trl import AgentEnvRollout, env_reward  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402


class PrintSteps(TrainerCallback):
    def __init__(self, rollout: AgentEnvRollout, steps: int) -> None:
        self.rollout, self.steps = rollout, steps

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            trajs = [t for g in self.rollout.groups for t in g.trajectories]
            tools = sum(len(t.tool_calls) for t in trajs)
            print(f"step {state.global_step}/{self.steps} loss {float(logs['loss']):+.4f} "
                  f"reward {float(logs.get('reward', float('nan'))):.3f} tool calls {tools} "
                  f"engine v{self.rollout.engine.weight_version}", flush=True)


def main(steps: int) -> None:
    model = str(default_model())
    engine = EmbeddedEngine(model, seed=0)
    with AgentEnvRollout(make("retool-math"), engine, sandbox=LocalSandbox()) as rollout, \
            tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                          max_steps=steps, max_completion_length=512, learning_rate=1e-4, beta=0.0,
                          logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
        trainer = GRPOTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(model),
                              train_dataset=rollout.dataset(8 * steps), reward_funcs=[env_reward],
                              rollout_func=rollout, callbacks=[rollout.callback(), PrintSteps(rollout, steps)])
        trainer.remove_callback(PrinterCallback)  # our line per step instead of TRL's log dicts
        try:
            trainer.train()
        finally:
            engine.close()
    print(f"trl_steps: {trainer.state.global_step}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    main(ap.parse_args().steps)
