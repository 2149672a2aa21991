"""Micro-batch planning: rows grouped by length under a padded-token budget, and the step's
gradient is the same however the rows are split."""

from __future__ import annotations

import pytest
import torch

from agentenv.train import LossConfig, collate
from agentenv.train.batch import micro_batches
from agentenv.train.policy import Policy


def test_every_row_once_longest_first_within_both_bounds():
    lengths = [100, 900, 120, 880, 110, 1500, 95, 100]
    plan = micro_batches(lengths, max_rows=3, max_tokens=2000)
    assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
    # 1500 alone (two would be 3000), 900 + 880, then the short rows three at a time.
    assert plan == [[5], [1, 3], [2, 4, 0], [7, 6]]
    for p in plan:
        assert len(p) <= 3
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 2000
    # A row longer than the budget still goes (alone); without a budget only rows bound a pass.
    assert micro_batches([5000, 10], max_rows=4, max_tokens=1000) == [[0], [1]]
    assert micro_batches(lengths, max_rows=16) == [[5, 1, 3, 2, 4, 0, 7, 6]]
    with pytest.raises(ValueError):
        micro_batches(lengths, max_rows=0)


def test_a_batch_takes_rows_in_any_order_trimmed_to_their_width(groups):
    batch = collate(groups)
    lengths = batch.lengths
    short = min(range(batch.size), key=lengths.__getitem__)
    part = batch.rows([short, 0])
    assert part.input_ids.shape == (2, max(lengths[short], lengths[0]))
    assert part.input_ids[0, :lengths[short]].tolist() == batch.input_ids[short, :lengths[short]].tolist()
    assert part.rewards == [batch.rewards[short], batch.rewards[0]]
    assert float(part.advantages[0]) == float(batch.advantages[short])


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.slow
def test_the_gradient_does_not_depend_on_how_rows_are_split(groups, model_dir, aggregation):
    batch = collate(groups)
    grads = []
    # One pass; one row per pass; at most two of the longest rows' worth of tokens per pass.
    for micro_batch, budget in ((64, None), (1, None), (4, 2 * max(batch.lengths))):
        torch.manual_seed(0)
        policy = Policy(model_dir, lr=1e-4, micro_batch=micro_batch, micro_batch_tokens=budget,
                        loss=LossConfig(aggregation=aggregation))
        passes = len(policy.micro_plan(batch))
        stats = policy.train_step(batch)
        grads.append((passes, stats, {n: p.grad.clone() for n, p in policy.model.named_parameters()}))
    assert grads[0][0] == 1 and grads[1][0] == batch.size and 1 < grads[2][0] < batch.size
    (_, s0, g0) = grads[0]
    assert s0["grad_norm"] > 0
    for _, s, g in grads[1:]:
        assert s["loss"] == pytest.approx(s0["loss"], abs=1e-6)
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], atol=1e-6, rtol=1e-4, msg=n)
