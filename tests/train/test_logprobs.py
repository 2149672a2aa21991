"""Chunked per-token logprobs (``agentenv.train.logprobs``): the same values, entropies and
parameter gradients as the whole-logits computation, in float64 within 1e-6, on the bundled
model, random Qwen2 models (tied and untied head), a LoRA adapter on the head, Gemma 2's
soft-capped logits, temperatures, ragged right-padded rows, packed rows' position ids and
chunk sizes that do and do not divide the positions; the head never sees more than one chunk;
and the peak memory of a long row stays flat (measured in fresh processes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from agentenv.models.lora import LORA_TARGETS, LoraSpec, inject_lora
from agentenv.train.logprobs import full_token_logprobs, token_logprobs, unchunkable

TOL = 1e-6


def qwen2(tied: bool, vocab: int = 97, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).double().eval()


def ragged(vocab: int, lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of random tokens (pad id 0) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n], attn[i, :n] = torch.randint(1, vocab, (n,), generator=g), 1
    return ids, attn


def head_calls(model: torch.nn.Module) -> tuple[list[int], object]:
    """The positions each call of the model's output head received (a forward hook)."""
    seen: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: seen.append(math.prod(out.shape[:-1])))
    return seen, hook


def assert_exact(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor | None, *, chunk: int,
                 temperature: float = 1.0, position_ids: torch.Tensor | None = None) -> None:
    """Chunked == whole logits: values, entropies and every trainable parameter's gradient of
    a loss that weighs each position differently, within TOL; the head saw at most ``chunk``
    positions per call."""
    assert unchunkable(model) is None
    params = [p for p in model.parameters() if p.requires_grad]
    mask = attn if attn is not None else torch.ones_like(ids)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * mask
    kw = dict(attention_mask=attn, position_ids=position_ids, temperature=temperature, with_entropy=True)
    seen, hook = head_calls(model)
    try:
        got, got_h = token_logprobs(model, ids, chunk=chunk, **kw)
    finally:
        hook.remove()
    want, want_h = full_token_logprobs(model, ids, **kw)
    positions = ids.shape[0] * (ids.shape[1] - 1)
    assert seen == [min(chunk, positions - s) for s in range(0, positions, chunk)]
    assert got.shape == want.shape == ids.shape and got_h.shape == ids.shape
    assert (got[:, 0] == 0).all() and (got_h[:, 0] == 0).all()
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    assert torch.allclose(got_h, want_h, atol=TOL, rtol=0), (got_h - want_h).abs().max()
    assert not got_h.requires_grad and (want_h[:, 1:] > 0).all()
    g_got = torch.autograd.grad((got * weights).sum(), params)
    g_want = torch.autograd.grad((want * weights).sum(), params)
    assert max(float(g.abs().max()) for g in g_want) > 1e-3  # the gradients are not all zero
    for p, a, b in zip(params, g_got, g_want):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (p.shape, (a - b).abs().max())


@pytest.mark.parametrize("chunk", [7, 16, 1000])  # does not divide the 48 positions, divides them, exceeds them
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_bundled_model_gives_the_whole_logits_values_and_gradients(model_dir, chunk, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    assert model.config.tie_word_embeddings
    ids, attn = ragged(model.config.vocab_size, [17, 11, 5])
    assert_exact(model, ids, attn, chunk=chunk, temperature=temperature)


@pytest.mark.parametrize("tied", [True, False])
def test_a_random_qwen2_with_a_tied_or_untied_head(tied):
    model = qwen2(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, attn = ragged(97, [13, 20, 9, 20])
    assert_exact(model, ids, attn, chunk=9, temperature=1.3)


def test_a_lora_adapter_on_the_head_applies_and_gets_its_gradient():
    model = qwen2(tied=False)
    inject_lora(model, LoraSpec(rank=4, target_modules=LORA_TARGETS + ("lm_head",)))
    model.double()
    torch.manual_seed(3)
    with torch.no_grad():  # B = 0 at injection: give the adapter an effect on the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    assert any(n.startswith("lm_head.lora_A") for n, p in model.named_parameters() if p.requires_grad)
    ids, attn = ragged(97, [15, 8])
    assert_exact(model, ids, attn, chunk=4)


def test_packed_rows_position_ids_go_to_the_model_unchanged():
    model = qwen2(tied=True)
    ids, _ = ragged(97, [24])
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None]  # two rows packed in one
    assert_exact(model, ids, None, chunk=5, position_ids=position_ids)
    with torch.no_grad():
        packed = token_logprobs(model, ids, position_ids=position_ids, chunk=5)
        plain = token_logprobs(model, ids, chunk=5)
    assert not torch.allclose(packed[:, 11:], plain[:, 11:])  # the second row's positions restart


def test_gemma2_soft_capped_logits_are_capped_in_each_chunk():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():  # logits well past the cap, so an uncapped head would differ
        model.model.norm.weight.fill_(20.0)
    ids, attn = ragged(89, [12, 7])
    with torch.no_grad():
        uncapped = model.lm_head(model.model(input_ids=ids).last_hidden_state)
        assert float(uncapped.abs().max()) > 4.0 and float(model(input_ids=ids).logits.abs().max()) < 2.0
    assert_exact(model, ids, attn, chunk=5, temperature=0.8)


def test_a_head_not_known_to_be_plain_takes_the_whole_logits_path():
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    cfg = CohereConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, logit_scale=0.25, pad_token_id=0)
    model = CohereForCausalLM(cfg).double().eval()
    assert "cohere" in unchunkable(model)
    ids, attn = ragged(61, [9, 6])
    seen, hook = head_calls(model)
    try:
        with torch.no_grad():
            got = token_logprobs(model, ids, attention_mask=attn, chunk=2)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # scaled by logit_scale
    finally:
        hook.remove()
    assert seen == [ids.numel(), ids.numel()]  # one whole-logits call each, no chunks
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got[:, 1:], want, atol=TOL, rtol=0)


def test_a_policy_step_is_the_same_chunked_or_not_and_reports_the_entropy(model_dir, tokenizer):
    from agentenv.train.batch import Batch
    from agentenv.train.policy import Policy

    policies = {chunk: Policy(model_dir, lr=1e-3, temperature=0.9, logprob_chunk=chunk) for chunk in (5, 0)}
    ids, attn = ragged(policies[0].model.config.vocab_size, [30, 22, 14])
    mask = attn.double().clone()
    mask[:, :6] = 0  # the prompt is not trained on
    with torch.no_grad():
        mu = policies[0].token_logprobs(ids, attn) * attn
        logits = policies[0].model(input_ids=ids, attention_mask=attn).logits[:, :-1] / 0.9
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
    want_entropy = float((entropy * mask[:, 1:]).sum() / mask.sum())
    batch = Batch(ids, attn, mask.float(), mu, torch.zeros_like(ids), torch.tensor([1.0, -1.0, 0.5]), [1.0, 0.0, 0.5])
    stats = {chunk: p.train_step(batch) for chunk, p in policies.items()}
    assert stats[5]["entropy"] == pytest.approx(want_entropy, rel=1e-5) and want_entropy > 0.1
    for k, v in stats[0].items():
        assert stats[5][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    # The step's gradients (left on the parameters after the step; float32, so to rounding).
    # Adam's first step moves each weight by about lr * sign(gradient), which turns rounding
    # of a near-zero gradient into a whole step: the gradients are compared, not the weights.
    grads = {chunk: [p.grad for p in policy.params] for chunk, policy in policies.items()}
    assert stats[0]["grad_norm"] > 1e-3
    for p, a, b in zip(policies[0].params, grads[5], grads[0]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (p.shape, (a - b).abs().max())


_PEAK = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from agentenv.train.logprobs import head_logprobs

    chunk, positions, vocab = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    head = torch.nn.Linear(64, vocab, bias=False)
    hidden = torch.randn(1, positions, 64, requires_grad=True)
    targets = torch.randint(0, vocab, (1, positions))
    warm = torch.randn(1, 8, 64, requires_grad=True)  # load the kernels and start the threads first
    head_logprobs(head, warm, targets[:, :8], chunk=chunk)[0].sum().backward()

    def kib(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

    # The high-water mark reset to what is resident now (Linux), so an earlier peak (the
    # imports, a thread's exit) cannot hide this part's: ru_maxrss keeps the larger of them.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    logp, _ = head_logprobs(head, hidden, targets, chunk=chunk)
    logp.sum().backward()
    after = kib("VmHWM")
    print(json.dumps({"peak_kib": after - before, "grad": float(hidden.grad.abs().sum())}))
""")


def _peak(chunk: int, positions: int, vocab: int) -> dict:
    """The peak in a fresh process. glibc's malloc returns a freed block of at least
    MALLOC_MMAP_THRESHOLD_ bytes to the system at once; left to adjust that threshold itself it
    keeps freed blocks up to 32 MiB in its heap, and the peak would count its fragmentation."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(chunk), str(positions), str(vocab)],
                         capture_output=True, text=True, check=True, timeout=120, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_peak_of_a_long_row_is_a_chunk_not_the_whole_logits():
    """Peak RSS growth of a fresh process over the logprob part (head, log-softmax, gather,
    backward) of a 4096-position row, vocabulary 16384: whole logits hold several
    4096 x 16384 float32 copies (256 MiB each), chunks of 256 positions one 16 MiB copy."""
    positions, vocab = 4096, 16384
    one_copy_kib = positions * vocab * 4 // 1024
    whole, chunked = _peak(0, positions, vocab), _peak(256, positions, vocab)
    assert whole["grad"] == pytest.approx(chunked["grad"], rel=1e-4)  # the same computation
    assert whole["peak_kib"] > 2 * one_copy_kib, whole  # the measure sees the whole logits
    assert chunked["peak_kib"] * 4 < whole["peak_kib"], (chunked, whole)
    assert chunked["peak_kib"] < one_copy_kib / 2, chunked
