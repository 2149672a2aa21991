"""A minimal GRPO training loop in plain PyTorch on ``agentenv.RolloutProducer``.

    python examples/producer_loop.py [--steps 3]

What an external trainer (prime-rl-style or home-grown) needs from agentenv: batches of
complete GRPO groups as tensors (token ids exactly as sampled, loss mask, behaviour
logprobs, weight versions, group-normalised advantages), produced in the background while
the trainer steps, with backpressure and bounded staleness. The loop below is the whole
trainer: a clipped, importance-weighted policy gradient over the sampled tokens, then the new
weights into the engine (which bumps its version, so the staleness bound can hold).
"""

from __future__ import annotations

import argparse

import anyio
import torch
from transformers import AutoModelForCausalLM

from agentenv import Reactor, RolloutConfig, RolloutProducer, make
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.models import default_model
from agentenv.sandboxes.local import LocalSandbox


def loss_fn(model: torch.nn.Module, batch, clip: tuple[float, float] = (0.2, 0.28)) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.mask[:, 1:]  # 1 on sampled tokens only: prompt and tool output are not trained
    ratio = torch.exp(logprobs - batch.behaviour_logprobs[:, 1:])
    adv = batch.advantages[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv)
    return -(objective * mask).sum() / mask.sum().clamp(min=1)


async def main(steps: int) -> None:
    env = make("retool-math")
    model = AutoModelForCausalLM.from_pretrained(default_model(), dtype=torch.float32)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    async with EmbeddedEngine(default_model(), seed=0) as engine, LocalSandbox() as sandbox:
        reactor = Reactor(engine, env, sandbox, RolloutConfig(max_turns=env.max_turns, max_new_tokens=128))
        tasks = lambda i: env.tasks(1, seed=i)[0]  # noqa: E731 - an endless task stream
        async with RolloutProducer(reactor, tasks, group_size=4, groups_per_batch=4, max_staleness=1) as producer:
            for step in range(1, steps + 1):
                batch = await producer.next_batch()
                loss = loss_fn(model, batch)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                version = await engine.load_weights({n: p.detach() for n, p in model.named_parameters()})
                sampled = batch.versions[batch.mask.bool()]
                rewards = [r for r in batch.rewards if r is not None]
                print(f"step {step} loss {loss.item():+.4f} reward {sum(rewards) / max(1, len(rewards)):.3f} "
                      f"tokens {int(batch.mask.sum())} sampled at v{int(sampled.min())}-v{int(sampled.max())} "
                      f"-> engine v{version} (dropped {producer.dropped})", flush=True)
    print(f"producer_steps: {steps}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    anyio.run(main, ap.parse_args().steps)
