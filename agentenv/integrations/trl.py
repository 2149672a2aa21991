"""agentenv inside TRL: a ``rollout_func`` for ``trl.GRPOTrainer`` backed by the reactor.

    rollout = AgentEnvRollout(make("retool-math"), engine, sandbox=LocalSandbox())
    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), train_dataset=rollout.dataset(64),
                          reward_funcs=[env_reward], rollout_func=rollout, callbacks=[rollout.callback()])

* ``rollout.dataset(n)``: a ``datasets.Dataset`` whose ``prompt`` column is each task's chat
  messages; the rollout finds the task (question, answer) behind each prompt it is given.
* ``rollout(prompts, trainer)`` runs every program of the step in the reactor (any agentenv
  environment, engine and sandbox: multi-turn, tools, the program scheduler) and returns TRL's
  fields: ``prompt_ids``, ``completion_ids`` (every turn, tool output included, exactly as
  sampled and spliced, never re-tokenised), ``logprobs`` (the sampler's, 0.0 on tool tokens),
  ``env_mask`` (1 model token, 0 tool token: TRL's ``tool_mask``, so tool tokens are out of
  the loss), plus ``env_reward``, ``reward_components``, ``tool_calls``, ``tool_errors`` and
  ``finish_reason`` for TRL's reward functions (:func:`env_reward` returns the environment's).
* ``rollout.callback()``: a ``TrainerCallback`` that puts the trainer's weights into the
  engine after every optimiser step (``engine.load_weights``, version = global step), so the
  next rollouts sample from the policy being trained.

An :class:`~agentenv.AgentEnvironment` runs here too (its agent's calls through the gateway,
which the reactor starts on the portal's loop): each program is one row, its first token
sequence. TRL's ``rollout_func`` returns one completion per prompt it was given, so a program
whose agent started a second sequence (a rewritten history, a sub-agent's role: its
``branches``) cannot be handed over whole: the call refuses it (:class:`ConfigError`) rather
than train part of the program; ``agentenv train`` trains every sequence as a row. An agent
that failed before its first call has no tokens: its row is the task's prompt, rendered as the
environment gives it, with an empty completion (and no reward: NaN).

TRL calls ``rollout_func`` synchronously; the engine, sandbox and reactor live on an event
loop in a background thread (an anyio blocking portal) for the trainer's whole life.
``close()`` shuts them down.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio
import anyio.from_thread

from ..agent import AgentEnvironment
from ..config import RolloutConfig
from ..env import Environment, Task
from ..errors import ConfigError
from ..program import render_prompt
from ..reactor import Group, Reactor
from ..trajectory import Trajectory


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def env_reward(completions: list[Any], env_reward: list[float | None], **kwargs: Any) -> list[float]:
    """A TRL reward function: the agentenv environment's own reward (NaN where it failed, which
    TRL leaves out of the group statistics)."""
    return [math.nan if r is None else float(r) for r in env_reward]


class AgentEnvRollout:
    def __init__(self, env: Environment, engine: Any, *, sandbox: Any = None, config: RolloutConfig | None = None
                 ) -> None:
        self.env, self.engine = env, engine
        self.config = config or RolloutConfig()
        self._tasks: dict[str, Task] = {}
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._sandbox_cm = None
        if sandbox is not None and hasattr(sandbox, "__aenter__"):
            self._sandbox_cm = self._portal.wrap_async_context_manager(sandbox)
            sandbox = self._sandbox_cm.__enter__()
        self.sandbox = sandbox
        self.reactor = Reactor(engine, env, sandbox, self.config)
        self.groups: list[Group] = []  # the last call's groups (for inspection and tests)
        self._closed = False

    # -- the dataset TRL iterates ---------------------------------------------------------------
    def dataset(self, n: int, seed: int = 0) -> Any:
        """``n`` tasks of the environment as a ``datasets.Dataset`` with a ``prompt`` column."""
        from ..extras import require

        require("datasets", extra="trl", what="AgentEnvRollout.dataset")
        from datasets import Dataset

        rows = []
        for task in self.env.tasks(n, seed=seed):
            prompt = self.env.prompt(task)
            self._tasks[_key(prompt)] = task
            rows.append({"prompt": prompt, "task_id": task.id})
        return Dataset.from_list(rows)

    def _task(self, prompt: Any) -> Task:
        task = self._tasks.get(_key(prompt))
        if task is None:
            raise ConfigError("a prompt that did not come from AgentEnvRollout.dataset(): build the trainer's "
                              "train_dataset with rollout.dataset(n) so each prompt maps to its task")
        return task

    # -- rollout_func ---------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        g = int(trainer.num_generations if trainer.model.training else trainer.num_generations_eval)
        # TRL's sampler hands each prompt over G times in a row; older versions once each.
        repeated = len(prompts) % g == 0 and all(
            _key(prompts[i]) == _key(prompts[i - i % g]) for i in range(len(prompts)))
        heads = prompts[::g] if repeated else prompts
        tasks = [self._task(p) for p in heads]
        self.groups = self._portal.call(self._run, tasks, g)
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward",
                                                "reward_components", "tool_calls", "tool_errors", "finish_reason")}
        for group in self.groups:
            for t in sorted(group.trajectories, key=lambda t: t.sample_index):
                n = len(t.prompt_ids)
                out["prompt_ids"].append(self._prompt_ids(group.task, t))
                out["completion_ids"].append(t.completion_ids)
                out["logprobs"].append(t.logprobs[n:])
                out["env_mask"].append(t.loss_mask[n:])
                out["env_reward"].append(t.reward)
                out["reward_components"].append(dict(t.reward_components))
                out["tool_calls"].append(len(t.tool_calls))
                out["tool_errors"].append(sum(c.status != "ok" for c in t.tool_calls))
                out["finish_reason"].append(t.finish_reason)
        return out

    def _prompt_ids(self, task: Task, t: Trajectory) -> list[int]:
        """The row's prompt: the program's (an agent's first sequence), checked to be all of it."""
        if t.branches:
            raise ConfigError(
                f"{t.id}: the agent's program has {len(t.branches) + 1} token sequences (roles "
                f"{t.metadata.get('gateway', {}).get('roles')}: a rewritten history or a sub-agent starts one), and "
                "TRL's rollout_func returns one completion per prompt, so the others cannot be trained here; "
                "train it with `agentenv train` (each sequence a row with the program's advantage), or have the "
                "agent extend one history")
        if not t.prompt_ids and isinstance(self.env, AgentEnvironment):  # no call made: the task's prompt
            return render_prompt(self.engine.tokenizer, self.env.prompt(task))
        return list(t.prompt_ids)

    async def _run(self, tasks: list[Task], group_size: int) -> list[Group]:
        groups: dict[str, Group] = {}
        async with self.reactor.rollouts(tasks, group_size) as results:
            async for item in results:
                if isinstance(item, Group):
                    groups[item.task.id] = item
        return [groups[t.id] for t in tasks]

    # -- weight sync ----------------------------------------------------------------------------
    def sync_weights(self, model: Any, version: int | None = None) -> int:
        """Put ``model``'s parameters into the engine (what the callback does after each step)."""
        from ..engines.base import weight_sink

        sink = weight_sink(self.engine, "AgentEnvRollout.sync_weights (TRL's callback)")
        tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
        return self._portal.call(lambda: sink.load_weights(tensors, version))

    def callback(self) -> Any:
        from transformers import TrainerCallback

        rollout = self

        class SyncWeights(TrainerCallback):
            """After every optimiser step, the engine serves the trainer's weights."""

            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
                if model is not None:
                    rollout.sync_weights(model, version=state.global_step)

        return SyncWeights()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._sandbox_cm is not None:
                self._sandbox_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> "AgentEnvRollout":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AgentEnvRollout", "env_reward"]
