"""Packed micro-batches: a pass's rows concatenated into one ``[1, N]`` sequence, no padding.

    plan = pack_plan(batch.lengths, max_tokens=8192, max_rows=16)   # which rows share a pass
    packed = Packed.of(batch.rows(plan[0]))                         # its [1, N] sequence
    logp = model_logprobs(packed.input_ids, position_ids=packed.position_ids)  # [1, N]
    per_row = packed.unpack(logp)                                   # [B, T], the padded layout

A padded pass costs its row count times its longest row; a packed pass costs the tokens it
holds, so one long row does not widen a pass full of short ones, and a pass is filled to its
token budget whatever the rows' lengths (first-fit decreasing).

Each row keeps its own positions (``position_ids`` restart at 0 where a row starts), and
attention stays within a row:

* ``flash_attention_2`` (CUDA with flash-attn): transformers runs varlen attention over the
  rows it reads off ``position_ids``;
* ``sdpa`` (CPU, and CUDA without flash-attn): :func:`use_varlen_attention` switches the model
  to ``sdpa_varlen``, the same scaled-dot-product attention run row by row (causal within
  each row), so a pass of N tokens attends over sum(len_i^2) pairs, not N^2;
* any other implementation (eager, flex): transformers detects the packed rows from
  ``position_ids`` and builds a block-diagonal causal mask.

Every row's logprobs equal its padded pass's, so the loss and gradients are the padded path's:
:meth:`Packed.unpack` puts the packed logprobs back into the padded ``[B, T]`` layout the loss
reads (per-row quantities, such as the per-sequence mean of ``aggregation="sequence"`` and the
advantages, stay per row), and :meth:`Packed.pack` lays any per-token ``[B, T]`` tensor (mask,
behaviour logprobs, versions) out as the packed sequence is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .batch import Batch, micro_batches

#: The attention implementation :func:`use_varlen_attention` registers: ``sdpa`` row by row.
VARLEN_SDPA = "sdpa_varlen"


def pack_plan(lengths: Sequence[int], max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Which rows share each packed pass: first-fit decreasing, longest row first, each into
    the first pass with room for it (at most ``max_tokens`` tokens, at most ``max_rows`` rows;
    ``None``: unbounded). A row longer than ``max_tokens`` goes alone. Every row is in exactly
    one pass; within a pass, rows are in the order they were placed (longest first)."""
    if (max_tokens is not None and max_tokens < 1) or (max_rows is not None and max_rows < 1):
        raise ValueError("max_tokens and max_rows must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    passes: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = max(1, lengths[i])
        for p, rows in enumerate(passes):
            if (max_tokens is None or used[p] + n <= max_tokens) and (max_rows is None or len(rows) < max_rows):
                rows.append(i)
                used[p] += n
                break
        else:
            passes.append([i])
            used.append(n)
    return passes


def micro_plan(lengths: Sequence[int], max_rows: int, max_tokens: int | None, pack: bool) -> list[list[int]]:
    """The rows of each forward/backward pass: :func:`pack_plan` (``max_tokens`` counts the
    tokens a pass holds) or, unpacked, :func:`~agentenv.train.batch.micro_batches`
    (``max_tokens`` counts padded tokens); at most ``max_rows`` rows either way."""
    return pack_plan(lengths, max_tokens, max_rows) if pack else micro_batches(lengths, max_rows, max_tokens)


@dataclass(slots=True)
class Packed:
    """One packed pass: the rows of a micro-batch back to back, and where each token came from."""

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long, 0 at each row's first token
    lengths: list[int]  # each row's token count (sum: N)
    row_index: torch.Tensor  # [N] long: the row of each packed token
    col_index: torch.Tensor  # [N] long: its position in that row
    width: int  # the padded layout's T

    @classmethod
    def of(cls, mb: Batch) -> "Packed":
        """Pack a micro-batch's rows (right-padded, as :meth:`Batch.rows` trims them)."""
        lengths = [max(1, n) for n in mb.lengths]
        device = mb.input_ids.device
        row_index = torch.cat([torch.full((n,), r, dtype=torch.long, device=device) for r, n in enumerate(lengths)])
        col_index = torch.cat([torch.arange(n, device=device) for n in lengths])
        ids = mb.input_ids[row_index, col_index][None]
        return cls(ids, col_index[None].clone(), lengths, row_index, col_index, int(mb.input_ids.shape[1]))

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """A per-token tensor in the padded ``[B, T]`` layout, laid out as the packed ``[1, N]``."""
        return t[self.row_index, self.col_index][None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """Packed ``[1, N]`` logprobs back into the padded ``[B, T]`` layout (gradients flow).

        Position 0 of every row holds 0, as :meth:`~agentenv.train.policy.Policy.token_logprobs`
        gives it: in the packed sequence that slot holds the previous row's prediction of this
        row's first token, which belongs to no row. Padding holds 0."""
        keep = self.col_index > 0
        out = t.new_zeros(len(self.lengths), self.width)
        return out.index_put((self.row_index[keep], self.col_index[keep]), t[0, keep])


def _row_starts(position_ids: Any, length: int) -> list[int] | None:
    """Where each packed row starts in a ``[1, N]`` sequence, ending with N; ``None`` when
    it holds one row (or is not a single packed sequence)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    return starts + [length]


def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, run row by row on a packed ``[1, N]`` sequence (rows
    found where ``position_ids`` restart at 0; each row causal, attending only to itself);
    anything else goes to ``sdpa`` as it is, with its mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    starts = _row_starts(position_ids, query.shape[2])
    if starts is None or query.shape[2] != key.shape[2]:  # not packed, or a cache (no cache in training)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                   is_causal=True, **kwargs)[0]
            for a, b in zip(starts, starts[1:])]
    return torch.cat(outs, dim=1), None  # [1, N, heads, head_dim], as sdpa returns


def use_varlen_attention(model: Any) -> str:
    """Make ``model`` keep attention within packed rows, without an N x N mask: flash
    attention reads the rows from ``position_ids`` already; any other implementation (sdpa,
    eager, flex: the same attention, computed differently) becomes :data:`VARLEN_SDPA`, which
    equals ``sdpa`` on unpacked input. Returns the implementation the model uses.

    Switching matters beyond speed: transformers builds its block-diagonal mask from
    ``position_ids`` only when the forward holds no KV cache, and a decoder called without
    ``use_cache=False`` makes one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if VARLEN_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(VARLEN_SDPA, sdpa_varlen_forward)
        # The mask of an unpacked (padded) pass is sdpa's own.
        AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    config = model.config
    if not str(config._attn_implementation).startswith("flash_attention"):
        model.set_attn_implementation(VARLEN_SDPA)
    return config._attn_implementation


__all__ = ["Packed", "VARLEN_SDPA", "micro_plan", "pack_plan", "sdpa_varlen_forward", "use_varlen_attention"]
