"""The trainer's copy of the model (``agentenv.train.policy``), on the bundled model: logprobs
of the exact tokens, a GRPO step that moves each row's tokens the way its advantage says, the
tensors a sync moves (all, or only the LoRA adapter), and checkpoints that continue exactly."""

from __future__ import annotations

import json

import pytest
import torch

from agentenv.errors import ConfigError
from agentenv.models.lora import LoraSpec
from agentenv.train.batch import Batch
from agentenv.train.policy import Policy

PROMPT, COMPLETIONS = "<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n", \
    ["<code>\nprint(2 + 3)\n</code>", "The answer is \\boxed{6}."]


def batch_for(policy: Policy, tokenizer, advantages: list[float]) -> Batch:
    """Two rows, prompt then completion (trained on); behaviour logprobs are the policy's own."""
    rows = [tokenizer.encode(PROMPT + c, add_special_tokens=False) for c in COMPLETIONS]
    n_prompt = len(tokenizer.encode(PROMPT, add_special_tokens=False))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, :len(r)], attn[i, :len(r)], mask[i, n_prompt:len(r)] = torch.tensor(r), 1, 1
    with torch.no_grad():
        mu = policy.token_logprobs(ids, attn) * attn
    return Batch(ids, attn, mask, mu, torch.zeros_like(ids), torch.tensor(advantages), [1.0, 0.0])


def completion_logprob(policy: Policy, batch: Batch) -> list[float]:
    with torch.no_grad():
        return (policy.token_logprobs(batch.input_ids, batch.attention_mask) * batch.mask).sum(dim=1).tolist()


def test_logprobs_are_of_the_tokens_given_at_the_sampling_temperature(model_dir, tokenizer):
    hot, cold = Policy(model_dir, temperature=2.0), Policy(model_dir, temperature=1.0)
    batch = batch_for(cold, tokenizer, [0.0, 0.0])
    ids, attn = batch.input_ids[:1], batch.attention_mask[:1]
    with torch.no_grad():
        logits = cold.model(input_ids=ids).logits[0, :-1]
        for policy, t in ((cold, 1.0), (hot, 2.0)):
            want = torch.log_softmax(logits / t, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            got = policy.token_logprobs(ids, attn)[0]
            assert got[0] == 0 and torch.allclose(got[1:], want, atol=1e-5)


def test_a_step_raises_the_tokens_of_a_positive_advantage_and_lowers_a_negative_ones(model_dir, tokenizer):
    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-3)
    batch = batch_for(policy, tokenizer, [1.0, -1.0])
    before = completion_logprob(policy, batch)
    stats = policy.train_step(batch)
    after = completion_logprob(policy, batch)
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    # On-policy (behaviour = proximal): IS weights are 1, nothing clipped, no behaviour KL.
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and stats["clip_frac"] == 0
    assert stats["kl_behaviour"] == pytest.approx(0.0, abs=1e-6) and stats["grad_norm"] > 0
    synced = policy.sync_tensors()
    assert set(synced) == {n for n, _ in policy.model.named_parameters()}
    assert policy.full_bytes == sum(t.numel() * t.element_size() for t in synced.values())


def test_a_checkpoint_continues_exactly_and_serves_as_a_model_directory(model_dir, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    a = Policy(model_dir, lr=1e-3)
    batch = batch_for(a, tokenizer, [1.0, -1.0])
    a.train_step(batch)
    a.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "policy.json").read_text()) == {"lora": None, "sharded": False}
    assert AutoTokenizer.from_pretrained(str(tmp_path / "ckpt")).encode(PROMPT) == tokenizer.encode(PROMPT)
    b = Policy(model_dir, lr=1e-3)
    b.load(tmp_path / "ckpt")
    sa, sb = a.train_step(batch), b.train_step(batch)  # the optimiser state came back too
    assert sa == sb
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n
    meta = tmp_path / "ckpt" / "policy.json"
    meta.write_text(json.dumps({"lora": None, "sharded": True}))
    with pytest.raises(ConfigError, match="written by a sharded policy"):
        b.load(tmp_path / "ckpt")


@pytest.mark.slow
def test_lora_trains_and_syncs_only_the_adapter_and_its_reference_is_the_base(model_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    base = Policy(model_dir)
    policy = Policy(model_dir, lr=1e-2, lora=LoraSpec(rank=4, target_modules=("q_proj",)))
    batch = batch_for(policy, tokenizer, [1.0, -1.0])
    start = completion_logprob(policy, batch)
    assert start == pytest.approx(completion_logprob(base, batch), abs=1e-5)  # B = 0: outputs unchanged
    policy.train_step(batch)
    assert completion_logprob(policy, batch) != pytest.approx(start, abs=1e-5)
    ref = policy.reference_logprobs(batch.input_ids, batch.attention_mask)
    assert torch.allclose((ref * batch.mask).sum(dim=1), torch.tensor(start), atol=1e-4)  # the adapter is off
    synced = policy.sync_tensors()
    assert synced and all("lora_" in n for n in synced)
    assert policy.base_tensors().keys() == dict(base.model.named_parameters()).keys()
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.model.named_parameters())
    policy.save(tmp_path / "lora")
    wider = Policy(model_dir, lora=LoraSpec(rank=4, target_modules=("q_proj", "v_proj")))
    with pytest.raises(ConfigError, match="lacks .* tensors, e.g. .*v_proj"):
        wider.load(tmp_path / "lora")  # an adapter on other modules than this one's


def test_the_policy_is_made_from_trainings_optimiser_concern(model_dir):
    """One default for each setting: a bare Policy trains with training's optimiser defaults;
    the concern, or any of its fields as a keyword, changes them; LoRA comes from its rank."""
    from agentenv.train.config import OptimiserOptions

    bare = Policy(model_dir, device="cpu")
    assert bare.options == OptimiserOptions(device="cpu")
    assert bare.optimizer.param_groups[0]["lr"] == OptimiserOptions().lr
    assert bare.micro_batch_tokens == OptimiserOptions().micro_batch_tokens and bare.lora is None
    opt = OptimiserOptions(lr=1e-3, micro_batch=4, pack=False, device="cpu", lora_rank=2, lora_alpha=4.0)
    tuned = Policy(model_dir, opt, max_grad_norm=0.5)
    assert tuned.optimizer.param_groups[0]["lr"] == 1e-3 and tuned.max_grad_norm == 0.5
    assert (tuned.micro_batch, tuned.pack) == (4, False) and tuned.options.lr == 1e-3
    assert tuned.lora is not None and (tuned.lora.rank, tuned.lora.alpha) == (2, 4.0)
    with pytest.raises(TypeError, match=r"unknown settings \['learning_rate'\]"):
        Policy(model_dir, learning_rate=1e-3)
