"""Per-token logprobs and entropy of a causal LM without materialising its full logits.

A causal LM's head maps each position's hidden state to one logit per vocabulary entry: for a
Qwen-family model (vocabulary 151,936) an 8k-token row is ~5 GB of float32 logits per copy,
and a log-softmax with its backward holds several copies. Here the backbone runs once, and the
head, the temperature, the log-softmax and the gather run on ``chunk`` positions at a time;
each chunk is recomputed in the backward pass (``torch.utils.checkpoint``), so neither pass
keeps more than one chunk's logits alive and the peak grows with ``chunk x vocabulary``, not
with the row's length.

The head is called as the model's own module (``model.get_output_embeddings()``), so a tied
embedding and a LoRA adapter injected on ``lm_head`` apply exactly as in ``model(...)``.
Final-logit soft-capping (Gemma 2) is applied. The values equal :func:`full_token_logprobs`
(the whole-logits computation, kept as the reference and as the fallback) up to float
rounding; the tests hold them, and the gradients, within 1e-6 in float64.

Only positions are chunked, not the vocabulary: one chunk's logits are ``chunk x vocabulary``
floats, which a smaller ``chunk`` bounds as well, and the head's weight gradient
(``vocabulary x hidden``) is a fixed cost either way.
"""

from __future__ import annotations

from typing import Any

import torch

#: Model types whose causal-LM forward is ``lm_head(decoder(...).last_hidden_state)``, soft-capped
#: when the config says so. Another model's head may transform its logits (Cohere's
#: ``logit_scale``, Granite's ``logits_scaling``, ...): it takes the whole-logits path.
CHUNKABLE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                       "phi3", "olmo", "olmo2"})

#: Positions per chunk by default (``TrainConfig.optimiser.logprob_chunk``).
DEFAULT_CHUNK = 512


def unchunkable(model: Any) -> str | None:
    """Why ``model`` takes the whole-logits path, or None when the chunked one applies."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in CHUNKABLE:
        return (f"model type {model_type!r} is not one whose head is known to be a plain linear map "
                f"(chunked: {', '.join(sorted(CHUNKABLE))})")
    if _fsdp_root(model):
        # FSDP2 gathers the root's parameters (embeddings, final norm, head) only around the
        # whole model's forward; the backbone and the head called apart would see shards.
        return "the model is FSDP-sharded at its root"
    return None


def _fsdp_root(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support shards nothing
        return False
    return isinstance(model, FSDPModule)


def token_logprobs(model: Any, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK,
                   with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, T]: position t holds log p(input_ids[t] | input_ids[:t]) with the logits divided by
    ``temperature``; position 0 holds 0. With ``with_entropy``, also [B, T] entropies (nats)
    of the same distributions, position 0 again 0, carrying no gradient.

    ``attention_mask`` and ``position_ids`` go to the model unchanged (a packed micro-batch
    passes its own). ``chunk`` positions of the head run at a time; ``chunk <= 0``, or a model
    :func:`unchunkable` names, computes the whole logits (:func:`full_token_logprobs`)."""
    if chunk <= 0 or unchunkable(model) is not None:
        return full_token_logprobs(model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   temperature=temperature, with_entropy=with_entropy)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids).last_hidden_state
    picked, entropy = head_logprobs(model.get_output_embeddings(), hidden[:, :-1], input_ids[:, 1:],
                                    temperature=temperature, chunk=chunk,
                                    softcap=getattr(model.config, "final_logit_softcapping", None),
                                    with_entropy=with_entropy)
    return _shifted(picked, entropy, with_entropy)


def full_token_logprobs(model: Any, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                        position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                        with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` from the whole [B, T, V] logits (at least float32) of ``model(...)``: the
    reference the chunked path is held to, and the path of a model it does not apply to."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    logp = torch.log_softmax(_upcast(logits) / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
    return _shifted(picked, entropy, with_entropy)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  chunk: int = DEFAULT_CHUNK, softcap: float | None = None,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(targets) under ``head(hidden)`` ([..., H] -> [..., V] logits, soft-capped by
    ``softcap`` when given, divided by ``temperature``), and the entropies when asked (else
    None): tensors shaped like ``targets``. ``chunk`` positions at a time, each recomputed in
    the backward pass when gradients are recorded; ``chunk <= 0`` computes all at once."""
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = flat_t.numel()
    step = n if chunk <= 0 else chunk
    track = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    picked, entropy = [], []
    for start in range(0, max(n, 1), max(step, 1)):
        h, t = flat_h[start:start + step], flat_t[start:start + step]
        if track and chunk > 0:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk, head, h, t, temperature, softcap, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, t, temperature, softcap, with_entropy)
        picked.append(lp)
        entropy.append(ent)
    out = torch.cat(picked).view(shape)
    return out, (torch.cat(entropy).view(shape) if with_entropy else None)


def _chunk(head: torch.nn.Module, h: torch.Tensor, t: torch.Tensor, temperature: float, softcap: float | None,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = _upcast(head(h))
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:  # z / 1.0 == z: no second copy of the chunk's logits
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, t[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():  # H = logsumexp(z) - sum softmax(z) * z
            entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return picked, entropy


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """At least float32 (a bf16 model's logits are upcast; a float64 model's stay float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _shifted(picked: torch.Tensor, entropy: torch.Tensor | None,
             with_entropy: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Position 0 (no prediction) as 0 before the per-token values of positions 1..T-1."""
    logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    if not with_entropy:
        return logp
    assert entropy is not None
    return logp, torch.cat([torch.zeros_like(entropy[:, :1]), entropy], dim=1)
