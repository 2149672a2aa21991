"""The GRPO loss and its gradient against a straightforward per-token reference (1e-6)."""

import math

import pytest
import torch

from agentenv.train import LossConfig, group_advantages, grpo_loss


def reference(lp, old, mu, adv, mask, cfg, ref=None):
    """Loops over tokens in float64 Python: the definition, written out."""
    total, count, per_seq = 0.0, 0, []
    for b in range(len(lp)):
        s, c = 0.0, 0
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            w = min(math.exp(old[b][t] - mu[b][t]), cfg.is_cap)
            clipped = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high)
            obj = w * min(ratio * adv[b], clipped * adv[b])
            if cfg.kl_coef:
                r = ref[b][t] - lp[b][t]
                obj -= cfg.kl_coef * (math.exp(r) - r - 1)
            s, c = s + obj, c + 1
        total, count = total + s, count + c
        per_seq.append(s / max(c, 1))
    return -total / count if cfg.aggregation == "token" else -sum(per_seq) / len(per_seq)


def recorded_batch(seed=0, B=6, T=17):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3  # behaviour (sampling time)
    old = mu + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5  # proximal, drifted
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3  # current
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    mask[:, :3] = 0  # prompt
    adv = torch.tensor(group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), dtype=torch.float64)
    return lp, old, mu, adv, mask


@pytest.mark.parametrize("aggregation, kl_coef", [("token", 0.0), ("sequence", 0.0), ("token", 0.3), ("sequence", 0.3)])
def test_loss_and_gradient_match_the_reference(aggregation, kl_coef):
    cfg = LossConfig(aggregation=aggregation, kl_coef=kl_coef)
    lp, old, mu, adv, mask = recorded_batch()
    refp = (mu + torch.randn(mu.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 0.4)
    lp = lp.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, old, mu, adv, mask, cfg, refp if kl_coef else None)
    loss.backward()
    ref = reference(lp.tolist(), old.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), cfg, refp.tolist())
    assert abs(loss.item() - ref) < 1e-6
    assert (stats["kl_ref"] > 0) == bool(kl_coef)
    # Gradient by central differences of the reference, token by token.
    h = 1e-6
    base = lp.detach().tolist()
    for b, t in [(0, 5), (1, 9), (3, 16), (5, 4), (2, 3)]:
        up = [row[:] for row in base]
        dn = [row[:] for row in base]
        up[b][t] += h
        dn[b][t] -= h
        num = (reference(up, old.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), cfg, refp.tolist())
               - reference(dn, old.tolist(), mu.tolist(), adv.tolist(), mask.tolist(), cfg, refp.tolist())) / (2 * h)
        assert abs(lp.grad[b, t].item() - num) < 1e-6, (b, t)


def test_masked_tokens_get_no_gradient_and_is_weights_are_truncated():
    lp, old, mu, adv, mask = recorded_batch(seed=1)
    mu[0, 5] = old[0, 5] - 10  # a token the behaviour policy found very unlikely
    lp = lp.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, old, mu, adv, mask, LossConfig(is_cap=2.0))
    loss.backward()
    assert torch.all(lp.grad[mask == 0] == 0)
    assert stats["is_truncated_frac"] > 0 and stats["is_weight_mean"] <= 2.0


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    a = group_advantages([1.0, 0.0])
    assert a[0] == pytest.approx(1.0, abs=1e-5) and a[1] == pytest.approx(-1.0, abs=1e-5)
