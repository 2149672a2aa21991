"""GRPO loss with group-normalised advantages, clipping, and token-level truncated IS.

Three policies meet in asynchronous RL:

* behaviour ``mu``: the weights that sampled each token (``Trajectory.logprobs``, recorded at
  sampling time, possibly several versions old);
* proximal ``old``: the trainer's weights at the start of this step (``old_logprobs``,
  recomputed by the trainer, no gradient);
* current ``theta``: the weights being optimised (``logprobs``, with gradient).

Per token t (mask 1 only: tool output and prompt tokens never contribute):

    ratio_t = exp(logp_theta - logp_old)
    w_t     = min(exp(logp_old - logp_mu), is_cap)            (truncated IS, no gradient)
    obj_t   = w_t * min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)

With ``kl_coef > 0`` each token also pays ``kl_coef * k3_t``, where ``k3_t = exp(r_t) - r_t - 1``
and ``r_t = logp_ref - logp_theta`` (Schulman's low-variance estimator of KL(theta || ref), with
gradient; ``ref`` is the starting model), which keeps the policy near it.

The loss is ``-sum(obj_t) / sum(mask)`` over the whole batch ("token" aggregation, as in
DAPO: long sequences are not down-weighted) or the mean over sequences of each sequence's
token mean ("sequence"). The IS weight is per token and truncated: a sequence-level product
of ratios collapses on long episodes.
"""

from __future__ import annotations

import torch

# The loss's settings are the training config's loss concern, declared (with their defaults,
# help and checks) in ``agentenv.train.config``.
from .config import LossConfig


def group_advantages(rewards: list[float], eps: float = 1e-6, scale: bool = True) -> list[float]:
    """GRPO: each sample's reward minus its group's mean, over the group's std (if ``scale``)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    return [(r - mean) / (std + eps) if scale else r - mean for r in rewards]


def grpo_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, with grad
    old_logprobs: torch.Tensor,  # [B, T] proximal policy (trainer, step start)
    behaviour_logprobs: torch.Tensor,  # [B, T] recorded at sampling time
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 for sampled tokens
    cfg: LossConfig = LossConfig(),
    ref_logprobs: torch.Tensor | None = None,  # [B, T] the reference model, for kl_coef
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]
    ratio = torch.exp(logprobs - old_logprobs.detach())
    w = torch.exp(old_logprobs.detach() - behaviour_logprobs).clamp(max=cfg.is_cap).detach()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    obj = w * torch.minimum(unclipped, clipped) * mask
    kl = torch.zeros_like(obj)
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        r = (ref_logprobs.detach() - logprobs) * mask
        kl = (torch.exp(r) - r - 1) * mask
        obj = obj - cfg.kl_coef * kl
    if cfg.aggregation == "token":
        loss = -obj.sum() / mask.sum().clamp(min=1)
    else:
        per_seq = obj.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        loss = -per_seq.mean()
    n = mask.sum().clamp(min=1)
    with torch.no_grad():
        stats = {
            "loss": float(loss),
            "clip_frac": float(((unclipped != clipped).to(mask.dtype) * mask).sum() / n),
            "is_weight_mean": float((w * mask).sum() / n),
            "is_truncated_frac": float(
                ((torch.exp(old_logprobs - behaviour_logprobs) > cfg.is_cap).to(mask.dtype) * mask).sum() / n
            ),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl_ref": float(kl.sum() / n),
        }
    return loss, stats
