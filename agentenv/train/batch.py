"""Scored GRPO groups -> padded training tensors (pure).

The token ids are the trajectories' ``input_ids`` exactly as sampled and spliced (never
re-tokenised). Per position ``t``: ``mask`` is 1 for tokens the model sampled (tool output and
prompt are 0), ``behaviour_logprobs`` the logprob recorded when it was sampled, ``versions``
the weight version that sampled it (-1 elsewhere). Groups with a failed reward (``None``) keep
their scored members; a sample without a reward gets advantage 0 and mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..reactor import Group
from .loss import group_advantages


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float, 1 = sampled token (trained on)
    behaviour_logprobs: torch.Tensor  # [B, T]
    versions: torch.Tensor  # [B, T] long, -1 where not sampled
    advantages: torch.Tensor  # [B]
    rewards: list[float | None]

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def lengths(self) -> list[int]:
        """Each row's length without padding."""
        return [int(n) for n in self.attention_mask.sum(dim=1)]

    def rows(self, idx: slice | Sequence[int]) -> "Batch":
        """A micro-batch of rows (a slice, or row indices in any order), trimmed to its own
        longest sequence."""
        if isinstance(idx, slice):
            rewards = self.rewards[idx]
        else:
            rewards, idx = [self.rewards[i] for i in idx], torch.tensor(list(idx), dtype=torch.long)
        width = max(1, int(self.attention_mask[idx].sum(dim=1).max()))
        cut = lambda t: t[idx, :width]  # noqa: E731
        return Batch(cut(self.input_ids), cut(self.attention_mask), cut(self.mask), cut(self.behaviour_logprobs),
                     cut(self.versions), self.advantages[idx], rewards)

    def to(self, device: torch.device | str) -> "Batch":
        """The same rows with every tensor on ``device`` (this batch itself when they are there)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        move = lambda t: t.to(device)  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.mask), move(self.behaviour_logprobs),
                     move(self.versions), move(self.advantages), self.rewards)


def micro_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Which rows go into each forward/backward pass: longest first, at most ``max_rows`` rows
    and (if given) at most ``max_tokens`` padded tokens (rows x the longest) per pass; a row
    longer than ``max_tokens`` goes alone. Rows of like length share a pass, so one long sample
    does not widen a pass full of short ones (the loss weighs every row the same in any order)."""
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError("max_rows and max_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    for i in order:
        cur = plan[-1] if plan else None
        # Longest first, so the pass's width is its first row's length.
        if cur is not None and len(cur) < max_rows and \
                (max_tokens is None or (len(cur) + 1) * max(1, lengths[cur[0]]) <= max_tokens):
            cur.append(i)
        else:
            plan.append([i])
    return plan


def collate(groups: list[Group], pad_id: int = 0, scale_advantages: bool = True) -> Batch:
    trajs, advs = [], []
    for g in groups:
        scored = [t for t in g.trajectories if t.reward is not None]
        adv = iter(group_advantages([t.reward for t in scored], scale=scale_advantages)) if scored else iter(())
        for t in g.trajectories:
            a = next(adv) if t.reward is not None else 0.0
            for row in t.sequences():  # an agent's branches and roles: each sequence a row, same advantage
                trajs.append(row)
                advs.append(a)
    if not trajs:
        raise ValueError("empty batch")
    width = max(len(t.input_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width)
    blp = torch.zeros(B, width)
    ver = torch.full((B, width), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        n = len(t.input_ids)
        ids[i, :n] = torch.tensor(t.input_ids)
        attn[i, :n] = 1
        if t.reward is not None:
            mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        blp[i, :n] = torch.tensor(t.logprobs)
        ver[i, :n] = torch.tensor(t.weight_versions)
    mask[:, 0] = 0  # the first token has no context to be predicted from
    return Batch(ids, attn, mask, blp, ver, torch.tensor(advs, dtype=torch.float32), [t.reward for t in trajs])
