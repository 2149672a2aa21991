"""agentenv inside verl: an agent loop that runs an agentenv environment in verl's rollout.

verl (0.9) runs rollouts as *agent loops*: an ``AgentLoopBase`` subclass whose ``run`` turns
one dataset row into an ``AgentLoopOutput``, instantiated per sample by verl's agent-loop
workers, generating through verl's ``LLMServerClient`` (its engines, load balancing, sticky
routing and weight sync). :class:`AgentEnvAgentLoop` is such a loop. For each row it runs one
agentenv program, the same coroutine the reactor runs (``agentenv.program.run_program``):

* generation goes through verl's server manager, token ids in, token ids out: the sampled ids
  are appended verbatim, tool output is encoded once and spliced in (never re-tokenised);
  every turn of a program uses one request id, so verl's sticky routing keeps its prefix cache;
* tools run in an agentenv sandbox (one local pool per verl worker process);
* the environment's reward is the row's ``reward_score`` (0.0 where the reward failed, with
  ``agentenv_reward_ok`` false beside it: verl needs a number for every row).

It returns verl's ``AgentLoopOutput``: ``prompt_ids``, ``response_ids`` (every turn, tool
tokens included), ``response_mask`` (1 model token, 0 tool token), ``response_logprobs``
(the sampler's, 0.0 on tool tokens), ``num_turns``, ``reward_score``, metrics, and in
``extra_fields`` the reward components, tool statistics, finish reason and the weight versions
that sampled it (``min_global_steps``/``max_global_steps``, verl's staleness fields).

Using it::

    from agentenv import make
    from agentenv.integrations.verl import agent_loop_config_path, write_dataset

    write_dataset(make("retool-math"), 1024, "train.parquet")      # rows name the loop
    # then, in verl's config:
    #   data.train_files=train.parquet
    #   actor_rollout_ref.rollout.agent.agent_loop_config_path=<agent_loop_config_path()>
    #   actor_rollout_ref.rollout.calculate_log_probs=True

An :class:`~agentenv.AgentEnvironment` runs here too: its agent's calls go through an agentenv
gateway (one per verl worker process, on verl's event loop, loopback only) into verl's server
manager, token-exact, and the row is the program's token sequence (``prompt_ids``: its first
request's rendering; ``response_ids``: the replies as sampled and the later messages spliced,
mask 0). verl's ``AgentLoopOutput`` holds one token sequence per sample, so a program whose
agent started a second one (a rewritten history, a sub-agent's role: its ``branches``) is
refused (:class:`ConfigError`) rather than trained in part; ``agentenv train`` trains every
sequence as a row.

Each row carries its environment and task (``agentenv`` column, JSON), so verl's workers need
nothing but an installed agentenv. ``Environment.group_reward`` does not run here (verl forms
groups itself; use its advantage estimators). verl pins ``transformers<5.11`` while agentenv
needs a newer one; install verl with ``pip install --no-deps verl`` plus what its rollout
imports (``pip install agentenv[verl]``), or run verl in its own environment with an agentenv
that matches it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "agentenv.integrations.verl needs verl (>= 0.9): pip install --no-deps verl && pip install 'agentenv[verl]'"
    ) from exc

from ..agent import AgentEnvironment
from ..config import RolloutConfig
from ..engines.base import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, Engine, Generation, SamplingParams
from ..env import Environment, Task, bind_tool_format
from ..errors import ConfigError, EngineError
from ..formats import get_format
from ..program import ProgramContext, render_prompt, run_program, score_program, stop_token_ids
from ..registry import make
from ..tools import needs_sandbox
from ..trajectory import Trajectory

log = logging.getLogger("agentenv.integrations.verl")

#: The name rows use (``agent_name`` column) to pick this loop.
AGENT_NAME = "agentenv"
COLUMN = "agentenv"


def agent_loop_config_path() -> str:
    """A YAML for ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` that registers
    :class:`AgentEnvAgentLoop` as ``agentenv`` in every verl worker process."""
    return str(Path(__file__).with_name("verl_agent_loops.yaml"))


def dataset_rows(env: Environment, n: int, seed: int = 0, env_args: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """``n`` of ``env``'s tasks as rows of verl's RL dataset: ``prompt`` (chat messages),
    ``data_source``, ``agent_name`` (this loop), ``reward_model`` (the ground truth, for verl's
    bookkeeping) and ``agentenv`` (the environment and the task, JSON)."""
    rows = []
    for i, task in enumerate(env.tasks(n, seed=seed)):
        spec = {"env": env.id, "env_args": env_args or {}, "task": asdict(task)}
        rows.append({
            "data_source": f"agentenv/{env.id}",
            "prompt": env.prompt(task),
            "agent_name": AGENT_NAME,
            "ability": "agent",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(task.answer, default=str)},
            "extra_info": {"index": i, "task_id": task.id},
            COLUMN: json.dumps(spec, default=str),
        })
    return rows


def write_dataset(env: Environment, n: int, path: str | Path, seed: int = 0,
                  env_args: dict[str, Any] | None = None) -> Path:
    """Write :func:`dataset_rows` as a parquet file for ``data.train_files``/``val_files``."""
    import pandas as pd

    path = Path(path)
    pd.DataFrame(dataset_rows(env, n, seed, env_args)).to_parquet(path)
    return path


class ServerManagerEngine(Engine):
    """An agentenv :class:`Engine` over verl's ``LLMServerClient``: every request goes through
    verl's server manager (its routing, its engines, its weights). One per program: it knows
    the program's request id (so verl routes every turn to the same server) and its context
    budget (prompt + verl's ``response_length``). Inference only, no :class:`~agentenv.engines.WeightSink`:
    verl syncs its own servers' weights."""

    def __init__(self, server_manager: Any, tokenizer: Any, max_model_len: int, *, request_id: str,
                 extra_sampling: dict[str, Any] | None = None) -> None:
        self.server_manager, self.tokenizer, self.max_model_len = server_manager, tokenizer, max_model_len
        self.request_id = request_id
        self.extra_sampling = dict(extra_sampling or {})
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        sampling = {**self.extra_sampling, "max_tokens": params.max_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1, "logprobs": True,
                    # Stop only at the ids the program names (EOS among them), like every agentenv engine.
                    "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True}
        kwargs = {"priority": priority} if priority else {}
        t0 = time.perf_counter()
        try:
            out = await self.server_manager.generate(self.request_id, prompt_ids=list(prompt_ids),
                                                     sampling_params=sampling, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the program records it as error:engine
            raise EngineError(f"verl server manager: {type(exc).__name__}: {exc}") from exc
        ids = list(out.token_ids)
        if out.log_probs is None or len(out.log_probs) != len(ids):
            raise EngineError("verl's server returned no logprob per token (agentenv asked with logprobs=True)")
        extra = dict(out.extra_fields or {})
        version = extra.get("max_global_steps", extra.get("global_steps"))
        if isinstance(version, int):
            self._version = version
        stop_id = ids[-1] if ids and ids[-1] in params.stop_token_ids else None
        if out.stop_reason == "aborted":
            finish = "abort"
        else:
            finish = "stop" if stop_id is not None else "length"
        return Generation(token_ids=ids, logprobs=[float(x) for x in out.log_probs], finish_reason=finish,
                          prompt_tokens=len(prompt_ids), cached_tokens=int(extra.get("num_cached_tokens") or 0),
                          weight_version=self._version, stop_token_id=stop_id,
                          latency_s=time.perf_counter() - t0, extra={"verl": extra})

    async def abort(self, request_id: str) -> None:  # cancellation reaches verl's client as such
        return None

    async def aclose(self) -> None:
        return None


class _Direct:
    """``ProgramHooks`` without a scheduler (verl's server manager balances the load): a turn
    goes at once, and the sandbox session opens at the first tool call."""

    def __init__(self, sandbox: Any, setup: str | None) -> None:
        self.sandbox, self.setup, self.opened = sandbox, setup, None

    async def before_turn(self, tokens: int, max_tokens: int) -> int:
        return 0

    def after_turn(self, tokens: int, prefilled: int = 0) -> None:
        return None

    async def session(self) -> Any:
        if self.opened is None:
            self.opened = await self.sandbox.session(self.setup)
        return self.opened


class _VerlProcess:
    """What the loops of one verl worker process share: environments (by name and arguments)
    and one sandbox pool, open for the process's life (a task on verl's event loop owns it)."""

    envs: dict[str, Environment] = {}
    gateways: ClassVar[dict[int, Any]] = {}  # id of the event loop -> the agentenv gateway started on it
    sandbox: Any = None
    _ready: asyncio.Event | None = None
    _holder: asyncio.Task | None = None

    @classmethod
    def env(cls, name: str, args: dict[str, Any]) -> Environment:
        key = json.dumps([name, args], sort_keys=True)
        if key not in cls.envs:
            cls.envs[key] = make(name, **args)
        return cls.envs[key]

    @classmethod
    async def gateway(cls, tokenizer: Any) -> Any:
        """The gateway agent programs on this event loop call: started on first use, serving for
        the loop's life (a verl worker's: the process's)."""
        from ..extras import require
        from ..gateway.server import start_gateway

        loop = id(asyncio.get_running_loop())
        if loop not in cls.gateways:
            require("openai", "starlette", "uvicorn", extra="agents", what="an AgentEnvironment under verl")
            cls.gateways[loop] = asyncio.ensure_future(start_gateway(tokenizer))  # one start, however many wait
        return await asyncio.shield(cls.gateways[loop])

    @classmethod
    async def open_sandbox(cls) -> Any:
        if cls._ready is None:
            cls._ready = asyncio.Event()
            cls._holder = asyncio.get_running_loop().create_task(cls._hold())
        await cls._ready.wait()
        if cls.sandbox is None:
            raise ConfigError("the agentenv sandbox pool failed to start in this verl worker (see its log)")
        return cls.sandbox

    @classmethod
    async def _hold(cls) -> None:
        from ..sandboxes import default_sandbox

        try:
            async with default_sandbox("local") as sb:
                cls.sandbox = sb
                cls._ready.set()
                await asyncio.Event().wait()  # the process's life
        finally:
            cls.sandbox = None
            cls._ready.set()


def _spec(kwargs: dict[str, Any]) -> dict[str, Any]:
    raw = kwargs.get(COLUMN)
    if raw is None:
        raw = (kwargs.get("extra_info") or {}).get(COLUMN)
    if raw is None:
        raise ConfigError(f"a row for the {AGENT_NAME!r} agent loop needs an {COLUMN!r} column (environment and task; "
                          "see agentenv.integrations.verl.dataset_rows)")
    spec = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    for key in ("env", "task"):
        if key not in spec:
            raise ConfigError(f"the {COLUMN!r} column lacks {key!r}: {str(raw)[:200]}")
    return spec


@register(AGENT_NAME)
class AgentEnvAgentLoop(AgentLoopBase):
    """verl agent loop running one agentenv program per dataset row (see the module doc)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        spec = _spec(kwargs)
        env = _VerlProcess.env(spec["env"], dict(spec.get("env_args") or {}))
        task = Task(**spec["task"])
        rollout = self.rollout_config
        prompt_length, response_length = int(rollout.prompt_length), int(rollout.response_length)
        if env.tool_format is None:  # the served model's own format
            bind_tool_format(env, self.tokenizer)
        fmt = get_format(env.tool_format)
        tools = {tool.name: tool for tool in env.tools()}
        uses_sandbox = needs_sandbox(env)
        sandbox = await _VerlProcess.open_sandbox() if uses_sandbox else None
        temperature = float(sampling_params.get("temperature", DEFAULT_TEMPERATURE))
        config = RolloutConfig(max_new_tokens=response_length, temperature=temperature,
                               top_p=float(sampling_params.get("top_p", DEFAULT_TOP_P)),
                               top_k=max(0, int(sampling_params.get("top_k", DEFAULT_TOP_K) or 0))).for_env(env)
        offered = [t.schema() for t in tools.values()] if getattr(env, "tools_in_prompt", False) else None
        prompt_ids = render_prompt(self.tokenizer, env.prompt(task), offered)
        agent = isinstance(env, AgentEnvironment)  # its prompt is its first request: checked once it is known
        if len(prompt_ids) > prompt_length and not agent:
            raise ConfigError(_too_long(task, len(prompt_ids), prompt_length))
        # The context budget: the prompt plus verl's response_length, so the response always fits
        # verl's padded tensors (and the server's own window).
        limit = (prompt_length if agent else len(prompt_ids)) + response_length
        if rollout.get("max_model_len", None):
            limit = min(limit, int(rollout.max_model_len))
        key = f"agentenv-{task.id}-{kwargs.get('index', '')}-{id(self):x}"
        extra = {k: v for k, v in sampling_params.items()
                 if k in ("repetition_penalty", "seed", "min_p", "presence_penalty", "frequency_penalty")}
        engine = ServerManagerEngine(self.server_manager, self.tokenizer, limit, request_id=key, extra_sampling=extra)
        ctx = ProgramContext(engine=engine, env=env, sandbox=sandbox, config=config, fmt=fmt, tools=tools,
                             prompt_cache={task.id: prompt_ids}, stop_token_ids=stop_token_ids(self.tokenizer, fmt))
        hooks = _Direct(sandbox, env.sandbox_setup() if uses_sandbox else None)
        t0 = time.perf_counter()
        try:
            traj = await self._program(ctx, task, int(kwargs.get("index", 0) or 0), hooks, key)
        finally:
            if hooks.opened is not None:
                await hooks.opened.aclose()
        if agent:
            _check_agent_row(traj, prompt_length)
            traj.prompt_ids = traj.prompt_ids or prompt_ids  # no call made: the task's prompt, no response
        generated = time.perf_counter() - t0
        t1 = time.perf_counter()
        await score_program(env, task, traj, config.reward_timeout)
        if traj.reward is None:  # verl needs a number for every row: 0.0, flagged (and logged)
            log.warning("agentenv: no reward for %s (%s); verl gets 0.0", traj.id, traj.error)
        return _output(traj, generated, time.perf_counter() - t1)

    async def _program(self, ctx: ProgramContext, task: Task, index: int, hooks: _Direct, key: str) -> Trajectory:
        """The program: the reactor's turn loop, or an agent environment's agent through the gateway."""
        if isinstance(ctx.env, AgentEnvironment):
            from ..gateway.program import run_agent_program

            gateway = await _VerlProcess.gateway(self.tokenizer)
            return await run_agent_program(ctx, gateway, task, task.id, index, hooks, program_id=key)
        return await run_program(ctx, task, group_id=task.id, sample_index=index, hooks=hooks, program_id=key)


def _too_long(task: Task, n: int, prompt_length: int) -> str:
    return (f"task {task.id}: the prompt is {n} tokens, over verl's rollout.prompt_length={prompt_length}; "
            "raise it (verl would cut the prompt)")


def _check_agent_row(traj: Trajectory, prompt_length: int) -> None:
    """An agent's program is one verl row: one token sequence, its prompt within verl's."""
    if traj.branches:
        raise ConfigError(
            f"{traj.id}: the agent's program has {len(traj.branches) + 1} token sequences (roles "
            f"{traj.metadata.get('gateway', {}).get('roles')}: a rewritten history or a sub-agent starts one), and "
            "verl's AgentLoopOutput holds one per sample, so the others cannot be trained here; train it with "
            "`agentenv train` (each sequence a row with the program's advantage), or have the agent extend one "
            "history")
    if len(traj.prompt_ids) > prompt_length:
        raise ConfigError(_too_long(Task(traj.task_id, ""), len(traj.prompt_ids), prompt_length))


def _output(traj: Trajectory, generated: float, scored: float) -> AgentLoopOutput:
    """verl's row for a scored trajectory (see the module doc)."""
    n = len(traj.prompt_ids)
    versions = traj.weight_versions[n:]
    model_versions = [v for v, m in zip(versions, traj.loss_mask[n:]) if m]
    tool_errors = sum(c.status != "ok" for c in traj.tool_calls)
    return AgentLoopOutput(
        prompt_ids=list(traj.prompt_ids),
        response_ids=traj.completion_ids,
        response_mask=traj.loss_mask[n:],
        response_logprobs=traj.logprobs[n:],
        reward_score=0.0 if traj.reward is None else traj.reward,
        num_turns=1 + len(traj.turns) + sum(1 for seg in traj.segments if seg.mask == 0),  # user, assistant, tool
        metrics=AgentLoopMetrics(generate_sequences=generated - sum(c.duration_s for c in traj.tool_calls),
                                 tool_calls=sum(c.duration_s for c in traj.tool_calls),
                                 compute_score=scored),
        extra_fields={
            # Columns verl adds to the batch and logs with the rewards (same keys on every row).
            "reward_extra_info": {"agentenv_reward_ok": traj.reward is not None,
                                  "agentenv_tool_calls": len(traj.tool_calls),
                                  "agentenv_tool_errors": tool_errors},
            "min_global_steps": min(model_versions) if model_versions else None,
            "max_global_steps": max(model_versions) if model_versions else None,
            "agentenv_finish_reason": traj.finish_reason,
            "agentenv_error": traj.error,
            "agentenv_reward_components": dict(traj.reward_components),
            "agentenv_trajectory_id": traj.id,
        },
    )


__all__ = ["AGENT_NAME", "AgentEnvAgentLoop", "ServerManagerEngine", "agent_loop_config_path", "dataset_rows",
           "write_dataset"]
