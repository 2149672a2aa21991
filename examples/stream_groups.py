"""Use agentenv as a rollout producer for an external trainer: consume complete GRPO groups.

    python examples/stream_groups.py
"""

import anyio

from agentenv import Group, Reactor, RolloutConfig, make
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.models import default_model
from agentenv.sandboxes.local import LocalSandbox


def grpo_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


async def main():
    env = make("retool-math")
    async with EmbeddedEngine(default_model()) as engine, LocalSandbox() as sandbox:
        reactor = Reactor(engine, env, sandbox, RolloutConfig(concurrency=16))
        async with reactor.rollouts(env.tasks(8, seed=1), group_size=4) as results:
            async for item in results:
                if isinstance(item, Group):
                    rewards = [t.reward if t.reward is not None else 0.0 for t in item.trajectories]
                    adv = grpo_advantages(rewards)
                    tokens = sum(sum(t.loss_mask) for t in item.trajectories)
                    print(f"{item.task.id}: rewards {rewards} advantages {[round(a, 2) for a in adv]} "
                          f"trainable tokens {tokens}")


if __name__ == "__main__":
    anyio.run(main)
