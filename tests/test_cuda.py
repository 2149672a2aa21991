"""The CUDA lines (docs/architecture.md, "GPU-only lines") run on a CUDA device, on the bundled
model: the device and precision a GPU resolves to, a bf16 training step, chunked logprobs and
packed micro-batches held to their whole and padded forms, the embedded engine generating and
sleeping, and the weight-update group over NCCL. ``pytest -m gpu`` on a GPU machine
(``bench/gpu_check.sh`` runs it there); on a machine without CUDA each test is skipped, saying
so. Their CPU forms are the tests of the modules they name. ``AGENTENV_GPU_DRY_RUN=1`` runs
them on the CPU instead (all but what only CUDA has: its memory counters, NCCL), so that on a
GPU machine only CUDA itself can fail."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from agentenv import testing
from agentenv.devices import resolve_device
from agentenv.engines.base import SamplingParams
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.train.batch import Batch
from agentenv.train.device import resolve_precision
from agentenv.train.logprobs import full_token_logprobs, token_logprobs
from agentenv.train.loss import LossConfig
from agentenv.train.policy import Policy

DRY = os.environ.get("AGENTENV_GPU_DRY_RUN") == "1"
DEV = "cpu" if DRY else "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not DRY and not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = "<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n"
COMPLETIONS = ["<code>\nprint(2 + 3)\n</code>", "The answer is \\boxed{6}.", "5", "Let me add: 2 + 3 = 5. " * 6]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def rows(policy: Policy, tokenizer, n: int) -> Batch:
    """``n`` rows of different lengths, prompt then completion (trained on), as a host batch
    (the policy moves it); behaviour logprobs are the policy's own."""
    ids_of = [tokenizer.encode(PROMPT + c, add_special_tokens=False) for c in COMPLETIONS[:n]]
    n_prompt = len(tokenizer.encode(PROMPT, add_special_tokens=False))
    width = max(map(len, ids_of))
    ids = torch.zeros(n, width, dtype=torch.long)
    attn, mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
    for i, r in enumerate(ids_of):
        ids[i, :len(r)], attn[i, :len(r)], mask[i, n_prompt:len(r)] = torch.tensor(r), 1, 1
    with torch.no_grad():
        mu = (policy.token_logprobs(ids.to(policy.device), attn.to(policy.device)) * attn.to(policy.device)).cpu()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5][:n])
    return Batch(ids, attn, mask, mu.float(), torch.zeros_like(ids), advantages, [1.0] * n)


@pytest.mark.skipif(DRY, reason="a dry run has no GPU to resolve to")
def test_auto_is_the_gpu_and_its_precision_bf16():
    here = torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("auto") == resolve_device("cuda") == here
    assert resolve_precision("auto", here) == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def test_a_bf16_step_keeps_float32_master_weights_on_the_gpu_and_moves_them(model_dir, tokenizer):
    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-3, device=DEV, precision="bf16", loss=LossConfig(kl_coef=0.1))
    assert policy.device.type == DEV and policy.precision == "bf16"
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    stats = policy.train_step(rows(policy, tokenizer, 2))
    assert all(math.isfinite(v) for v in stats.values()) and stats["grad_norm"] > 0, stats
    params = dict(policy.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # autocast computes in bf16; the weights stay
    assert {p.device for p in params.values()} == {policy.device}
    assert {s.device for st in policy.optimizer.state.values() for s in st.values() if s.dim() > 0} == {policy.device}
    assert any(not torch.equal(p, before[n]) for n, p in params.items())  # the step moved the weights
    assert {t.device.type for t in policy.sync_tensors().values()} == {DEV}


def test_chunked_logprobs_on_the_gpu_are_the_whole_logits_values_and_gradients(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).to(DEV).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [37, 20, 9]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n], attn[i, :n] = torch.randint(1, model.config.vocab_size, (n,), generator=g), 1
    ids, attn = ids.to(DEV), attn.to(DEV)
    weights = torch.randn(ids.shape, generator=g, dtype=torch.float64).to(DEV) * attn
    got = token_logprobs(model, ids, attention_mask=attn, temperature=0.7, chunk=16)
    want = full_token_logprobs(model, ids, attention_mask=attn, temperature=0.7)
    assert got.device.type == DEV and torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad((got * weights).sum(), params)
    g_want = torch.autograd.grad((want * weights).sum(), params)
    assert max(float(x.abs().max()) for x in g_want) > 1e-3
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def _step(model_dir, tokenizer, pack: bool):
    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-4, device=DEV, precision="fp32", pack=pack, micro_batch_tokens=64)
    policy.model.double()  # exactness is checked in float64
    batch = rows(policy, tokenizer, 4)
    stats = policy.train_step(batch)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return policy, batch, stats, grads


def test_a_packed_step_on_the_gpu_has_the_padded_steps_loss_and_gradients(model_dir, tokenizer):
    padded, batch, s_pad, g_pad = _step(model_dir, tokenizer, False)
    packed, _, s_pack, g_pack = _step(model_dir, tokenizer, True)
    assert len(packed.micro_plan(batch)) > 1 and padded.micro_plan(batch) != packed.micro_plan(batch)
    assert s_pad["grad_norm"] > 0 and g_pad and set(g_pad) == set(g_pack)
    for k, v in s_pad.items():
        assert s_pack[k] == pytest.approx(v, abs=1e-6), k
    for n, g in g_pad.items():
        torch.testing.assert_close(g_pack[n], g, atol=1e-6, rtol=0, msg=n)


@pytest.mark.anyio
async def test_the_embedded_engine_generates_on_the_gpu_and_sleeps_off_it(model_dir):
    eng = EmbeddedEngine(model_dir, device=DEV, temperature=0.0, seed=0)
    try:
        assert eng.device.type == DEV and {p.device.type for p in eng.model.parameters()} == {DEV}
        prompt = testing.chat_prompt(eng, "Compute 12 * 34.")
        before = await eng.generate(prompt, GREEDY, "before")
        assert before.token_ids and all(math.isfinite(x) and x <= 0 for x in before.logprobs)
        awake = allocated()
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        await eng.sleep(1)
        assert await eng.is_sleeping() and eng.kv_cache_bytes == 0
        assert {p.device.type for p in eng.model.parameters()} == {"cpu"}
        if not DRY:
            assert awake - allocated() >= weights  # the weights and the KV cache left the GPU
        await eng.wake_up()
        assert {p.device.type for p in eng.model.parameters()} == {DEV}
        again = await eng.generate(prompt, GREEDY, "after")
        assert again.token_ids == before.token_ids  # greedy: the same weights give the same tokens
    finally:
        await eng.aclose()


def allocated() -> int:
    """The bytes the CUDA caching allocator holds for tensors now (0 in a dry run)."""
    if DRY:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.skipif(DRY or torch.cuda.device_count() < 2, reason="an NCCL group of two ranks needs two GPUs")
def test_the_weight_update_group_carries_every_tensor_bit_for_bit_over_nccl():
    from agentenv.engines.weight_group import join, leave, listen, metadata, receive, send

    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 5, generator=gen), "h": torch.randn(300, generator=gen).to(torch.bfloat16),
               "i": torch.arange(9)}
    sock = listen("127.0.0.1")
    port = sock.getsockname()[1]
    got: dict[str, torch.Tensor] = {}

    def worker() -> None:
        torch.cuda.set_device(1)
        group = join("127.0.0.1", port, 1, 2, backend_name="nccl", timeout_s=60)
        got.update((n, t.cpu()) for n, t in receive(group, metadata(tensors), device="cuda:1"))
        leave(group)

    t = threading.Thread(target=worker)
    t.start()
    torch.cuda.set_device(0)
    group = join("127.0.0.1", port, 0, 2, backend_name="nccl", listen_socket=sock, timeout_s=60)
    send(group, {n: v.to("cuda:0") for n, v in tensors.items()}, device="cuda:0")
    t.join(60)
    leave(group)
    assert list(got) == list(tensors)
    for name, v in tensors.items():
        assert got[name].dtype == v.dtype and torch.equal(got[name], v), name
