"""Where the policy computes (``agentenv.train.device``): the CPU takes the same path a CUDA GPU
does (device, precision, activation checkpointing, the batch moved to the device), on the
bundled model; the choices that differ on CUDA (the process group's backend, a Ray rank's
device) are checked as plain functions for both inputs. Device names themselves
(``agentenv.devices``) are tests/test_devices.py's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentenv.errors import ConfigError
from agentenv.train.batch import Batch
from agentenv.train.config import TrainConfig
from agentenv.train.device import autocast, process_group_backend, rank_device, resolve_precision
from agentenv.train.loss import LossConfig
from agentenv.train.policy import Policy

from .test_policy import batch_for

ROOT = Path(__file__).resolve().parents[2]
HERE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def devices_of(policy: Policy) -> set[torch.device]:
    models = [policy.model] + ([policy.ref_model] if policy.ref_model is not None else [])
    held = {p.device for m in models for p in m.parameters()}
    return held | {s.device for st in policy.optimizer.state.values() for s in st.values() if s.dim() > 0}


def test_auto_is_this_machines_device_and_cpu_runs_the_whole_step_on_the_cpu(model_dir, tokenizer):
    assert Policy(model_dir, device="auto").device == HERE
    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-3, device="cpu", loss=LossConfig(kl_coef=0.1))
    assert policy.device == torch.device("cpu") and policy.precision == "fp32"  # auto on a CPU
    stats = policy.train_step(batch_for(policy, tokenizer, [1.0, -1.0]))
    assert all(type(v) is float for v in stats.values()) and stats["grad_norm"] > 0
    assert devices_of(policy) == {torch.device("cpu")}  # model, reference and optimiser state
    assert {t.device for t in policy.sync_tensors().values()} == {torch.device("cpu")}


def test_a_batch_moves_to_a_device_whole_and_stays_put_when_it_is_there(model_dir, tokenizer):
    policy = Policy(model_dir, device="cpu")
    batch = batch_for(policy, tokenizer, [1.0, -1.0])
    assert batch.to("cpu") is batch
    meta = batch.to("meta")  # a device without storage: every tensor moves, the rewards stay
    tensors = [f for f in Batch.__slots__ if f != "rewards"]
    assert {getattr(meta, f).device.type for f in tensors} == {"meta"}
    assert [getattr(meta, f).shape for f in tensors] == [getattr(batch, f).shape for f in tensors]
    assert meta.rewards == batch.rewards


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_where_there_is_none_is_a_config_error_that_says_what_to_use(model_dir):
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"device='{name}': torch sees no CUDA device.*use device='cpu'"):
            Policy(model_dir, device=name)
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        TrainConfig(device="gpu")
    with pytest.raises(ConfigError, match="precision must be auto, fp32 or bf16, got 'fp16'"):
        TrainConfig(precision="fp16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_training_on_a_cuda_device_this_machine_lacks_is_refused_before_the_engine_starts(tmp_path):
    import anyio

    from agentenv.registry import make
    from agentenv.train import Trainer

    # The engine would fail otherwise (no model there): the device is checked first.
    cfg = TrainConfig(device="cuda", steps=1, engine="vllm", model=str(tmp_path / "no-model"),
                      out_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="device='cuda': torch sees no CUDA device"):
        anyio.run(Trainer(cfg, env=make("retool-math"), print_steps=False).run)


def test_bf16_on_the_cpu_steps_with_float32_master_weights_and_logprobs_near_fp32s(model_dir, tokenizer):
    torch.manual_seed(0)
    fp32 = Policy(model_dir, lr=1e-3, device="cpu", precision="fp32")
    bf16 = Policy(model_dir, lr=1e-3, device="cpu", precision="bf16")
    assert bf16.precision == "bf16"
    batch = batch_for(fp32, tokenizer, [1.0, -1.0])
    with torch.no_grad():
        want = fp32.token_logprobs(batch.input_ids, batch.attention_mask)
        got = bf16.token_logprobs(batch.input_ids, batch.attention_mask)
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)  # the forward ran in bf16 ...
    real = batch.attention_mask.bool()  # ... close to fp32's: bf16 keeps ~3 digits of each logit, so a rare
    assert (got - want).abs()[real].mean() < 0.1  # token's logprob may move by tenths, its probability barely
    assert (got.exp() - want.exp()).abs()[real].max() < 0.05
    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    stats = bf16.train_step(batch)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert {s.dtype for st in bf16.optimizer.state.values() for k, s in st.items() if k != "step"} == {torch.float32}
    moved = [n for n, p in bf16.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)


def test_activation_checkpointing_recomputes_the_layers_and_gives_the_same_gradients(model_dir, tokenizer):
    plain = Policy(model_dir, device="cpu", precision="fp32")
    ckpt = Policy(model_dir, device="cpu", precision="fp32", activation_checkpointing=True)
    assert ckpt.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    batch = batch_for(plain, tokenizer, [1.0, -1.0])
    runs = {"plain": 0, "ckpt": 0}
    for name, policy in (("plain", plain), ("ckpt", ckpt)):
        layer = policy.model.model.layers[0]
        # A pre-hook: the recompute stops once it has what the backward needs, before the layer's end.
        layer.register_forward_pre_hook(lambda *_, name=name: runs.__setitem__(name, runs[name] + 1))
        policy.train_step(batch)
    passes = len(plain.micro_plan(batch))
    assert runs == {"plain": passes, "ckpt": 2 * passes}  # the backward ran each layer's forward again
    for (n, p), (_, q) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), n


def test_the_embedded_engine_generates_on_the_policys_device(engine):
    assert engine.device == HERE
    assert {p.device for p in engine.model.parameters()} == {HERE}


def test_precision_autocast_and_backend_on_each_device():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(cpu, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert process_group_backend("cuda") == "nccl" and process_group_backend("cpu") == "gloo"


def test_a_ray_rank_takes_a_gpu_only_when_every_rank_gets_one():
    assert rank_device("auto", cluster_gpus=2, ranks=2) == "cuda"
    assert rank_device("auto", cluster_gpus=1, ranks=2) == "cpu"
    assert rank_device("auto", cluster_gpus=0, ranks=1) == "cpu"
    assert rank_device("cpu", cluster_gpus=8, ranks=2) == "cpu"
    assert rank_device("cuda:3", cluster_gpus=4, ranks=4) == "cuda"  # each rank sees only its own GPU
    with pytest.raises(ConfigError, match="device='cuda' with 2 trainer ranks needs 2 GPUs .* which has 1"):
        rank_device("cuda", cluster_gpus=1, ranks=2)


@pytest.mark.slow
def test_the_gpu_benchmark_runs_its_quick_form_on_the_cpu():
    """``bench/gpu.py --device cpu --quick``: the same script a GPU machine runs, both parts
    (the bundled model through agentenv's trainer), each with its throughput, peak memory and
    sync time."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--quick"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr[-4000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_results: "), last
    results = json.loads(last.removeprefix("gpu_results: "))
    qwen, (bundled,) = results["qwen2-0.5b-shaped"], results["bundled"]
    assert qwen["synced_equal"] and len(qwen["step_s"]) == 2  # a warm-up and a timed step
    assert bundled["engine"] == "embedded" and bundled["steps"] == 2  # the trainer ran (not the fallback)
    for part in (qwen, bundled):
        assert part["train_tok_per_s"] > 0 and part["peak_mem_gib"] > 0 and part["sync_s"] > 0, part
