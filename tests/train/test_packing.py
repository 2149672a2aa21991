"""Packed micro-batches (``agentenv.train.packing``): the plan holds every row once within its
budgets, a packed row attends only to itself, and a packed step's loss and gradients are the
padded step's (float64, 1e-6) in both aggregation modes, with LoRA and with a KL penalty."""

from __future__ import annotations

import random

import pytest
import torch

from agentenv.models.lora import LoraSpec
from agentenv.train import LossConfig, collate
from agentenv.train.batch import micro_batches
from agentenv.train.packing import VARLEN_SDPA, Packed, micro_plan, pack_plan
from agentenv.train.policy import Policy


def test_first_fit_decreasing_holds_every_row_once_within_both_budgets():
    lengths = [100, 900, 120, 880, 110, 1500, 95, 100]
    plan = pack_plan(lengths, max_tokens=1000, max_rows=3)
    # 1500 alone (over the budget); 900 and 880 each take the first short row that fits beside
    # them; the other short rows share a pass.
    assert plan == [[5], [1, 0], [3, 2], [4, 7, 6]]
    # The padded plan of the same rows needs more passes: each counts rows x its longest.
    assert len(micro_batches(lengths, 3, 1000)) > len(plan)
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 200), rng.randint(200, 3000)]) for _ in range(rng.randint(1, 40))]
        budget, rows = rng.choice([None, rng.randint(1, 4000)]), rng.choice([None, rng.randint(1, 8)])
        plan = pack_plan(lengths, budget, rows)
        assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
        for p in plan:
            assert rows is None or len(p) <= rows
            assert budget is None or len(p) == 1 or sum(lengths[i] for i in p) <= budget
    assert micro_plan([5, 3], 4, 8, pack=True) == [[0, 1]] and micro_plan([5, 3], 4, 8, pack=False) == [[0], [1]]
    with pytest.raises(ValueError):
        pack_plan([1, 2], max_tokens=0)


def test_a_packed_pass_lays_each_row_out_from_position_0_and_back(groups):
    batch = collate(groups)
    mb = batch.rows([3, 0, 5])
    p = Packed.of(mb)
    assert p.tokens == sum(mb.lengths) == p.input_ids.shape[1]
    start = 0
    for r, n in enumerate(mb.lengths):
        assert p.input_ids[0, start:start + n].tolist() == mb.input_ids[r, :n].tolist()
        assert p.position_ids[0, start:start + n].tolist() == list(range(n))
        start += n
    torch.testing.assert_close(p.pack(mb.mask), mb.mask[mb.attention_mask.bool()][None])
    # Unpacked: every row's tokens where they were, 0 at each row's first position and in padding.
    back = p.unpack(p.pack(mb.behaviour_logprobs))
    want = mb.behaviour_logprobs * mb.attention_mask
    want[:, 0] = 0
    assert torch.equal(back, want)


def _policy(model_dir, *, pack: bool, **kw) -> Policy:
    """A float64 copy of the bundled model (exactness is checked in float64)."""
    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-4, pack=pack, **kw)
    for m in (policy.model, policy.ref_model):
        if m is not None:
            m.double()
    return policy


def test_a_packed_row_attends_only_to_itself(groups, model_dir):
    batch = collate(groups)
    policy = _policy(model_dir, pack=True)
    assert policy.model.config._attn_implementation == VARLEN_SDPA
    mb = batch.rows([0, 3])
    p = Packed.of(mb)
    n0 = mb.lengths[0]
    with torch.no_grad():
        before = p.unpack(policy.token_logprobs(p.input_ids, None, position_ids=p.position_ids))
        changed = p.input_ids.clone()
        changed[0, 1:n0] = (changed[0, 1:n0] + 7) % policy.model.config.vocab_size  # row A's tokens, not its length
        after = p.unpack(policy.token_logprobs(changed, None, position_ids=p.position_ids))
        alone = policy.token_logprobs(mb.input_ids[1:, :mb.lengths[1]], mb.attention_mask[1:, :mb.lengths[1]])
    assert not torch.equal(before[0], after[0])  # row A did change
    assert torch.equal(before[1], after[1])  # row B, bit for bit
    torch.testing.assert_close(before[1, :mb.lengths[1]], alone[0], atol=1e-10, rtol=0)


def _step(model_dir, batch, pack: bool, **kw):
    policy = _policy(model_dir, pack=pack, **kw)
    stats = policy.train_step(batch)
    return policy, stats, {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize(
    "aggregation,lora,kl_coef",
    [
        ("token", None, 0.0),
        ("sequence", None, 0.0),
        ("sequence", None, 0.05),
        ("token", LoraSpec(rank=4, alpha=8.0), 0.05),
    ],
)
def test_a_packed_step_has_the_padded_steps_loss_and_gradients(groups, model_dir, aggregation, lora, kl_coef):
    batch = collate(groups)
    budget = 2 * max(batch.lengths) - 1  # several passes either way, planned differently
    kw = dict(loss=LossConfig(aggregation=aggregation, kl_coef=kl_coef), lora=lora, micro_batch_tokens=budget)
    padded, s_pad, g_pad = _step(model_dir, batch, False, **kw)
    packed, s_pack, g_pack = _step(model_dir, batch, True, **kw)
    assert padded.micro_plan(batch) != packed.micro_plan(batch)
    assert len(packed.micro_plan(batch)) > 1
    assert s_pad["grad_norm"] > 0 and set(g_pad) == set(g_pack) and g_pad
    for k, v in s_pad.items():
        assert s_pack[k] == pytest.approx(v, abs=1e-6), k
    for n, g in g_pad.items():
        torch.testing.assert_close(g_pack[n], g, atol=1e-6, rtol=0, msg=n)
    # The same step moved both to the same weights.
    for (n, a), b in zip(padded.model.named_parameters(), packed.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=n)
