"""Define an environment as a class and roll it out with the bundled model.

    python examples/custom_env.py
"""

import random

import anyio

from agentenv import Environment, FunctionTool, PythonTool, Reactor, RolloutConfig, Task, make, register
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.models import default_model
from agentenv.sandboxes.local import LocalSandbox


def is_prime(n: int) -> bool:
    """Whether n is prime."""
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


class Multiply(Environment):
    id = "multiply"
    tool_format = "retool"
    max_turns = 3
    system_prompt = (
        "Solve the problem with Python. Write code between <code> and </code>; its output "
        "comes back between <interpreter> and </interpreter>. Give the final answer as \\boxed{answer}."
    )

    def tasks(self, n, seed=0):
        rng = random.Random(seed)
        out = []
        for i in range(n):
            a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
            out.append(Task(f"multiply/{seed}/{i}", f"Compute {a} * {b} + {c}.", a * b + c))
        return out

    def tools(self):
        return [PythonTool(), FunctionTool(is_prime)]  # FunctionTool is for the hermes format

    async def reward(self, task, trajectory):
        return {"reward": float(f"\\boxed{{{task.answer}}}" in (trajectory.text or ""))}


async def main():
    register("multiply", Multiply)
    env = make("multiply")
    async with EmbeddedEngine(default_model()) as engine, LocalSandbox() as sandbox:
        reactor = Reactor(engine, env, sandbox, RolloutConfig(concurrency=8))
        groups = await reactor.collect(env.tasks(4, seed=0), group_size=2)
    for g in groups:
        print(g.task.question, g.rewards)
    print(reactor.stats.summary())


if __name__ == "__main__":
    anyio.run(main)
