"""The trainer's copy of the policy: recomputes logprobs on the exact sampled tokens, takes
optimiser steps with the GRPO loss, and hands out the tensors to sync into the engine.

Full fine-tuning syncs every parameter; with LoRA (peft) only the adapter is trained and only
the adapter tensors move. Both sides inject the same adapter into the same base model, so the
tensor names match one to one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..engines.base import DEFAULT_TEMPERATURE
from ..errors import ConfigError
from ..models import quiet_loading
from ..models.lora import LoraSpec, inject_lora
from .batch import Batch
from .config import OptimiserOptions
from .device import autocast, device_mesh, resolve_device, resolve_precision
from .logprobs import token_logprobs as chunked_logprobs
from .loss import LossConfig, grpo_loss
from .packing import Packed, micro_plan, use_varlen_attention
from .sharding import full

def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sum_over_ranks(params: list[torch.Tensor], sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum every rank's gradients and statistics, in one flat all-reduce on ``device`` (a rank
    whose rows trained no token contributes zeros)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    stats = torch.tensor(list(sums.values()), dtype=torch.float32, device=device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [stats])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
        offset += g.numel()
    return dict(zip(sums, flat[offset:].tolist()))


def optimiser_options(optimiser: OptimiserOptions | None, settings: dict[str, Any]) -> OptimiserOptions:
    """``optimiser`` (default: training's defaults) with ``settings``, its fields by name,
    changed; a name that is not one of its fields is a TypeError naming them."""
    opt = optimiser if optimiser is not None else OptimiserOptions()
    names = {f.name for f in fields(OptimiserOptions)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise TypeError(f"Policy got unknown settings {unknown}: the optimiser's are {sorted(names)}, and loss, "
                        f"temperature, lora, shard, weight_decay")
    return replace(opt, **settings) if settings else opt


class Policy:
    """The model being trained, its optimiser and (with ``kl_coef``) its reference, all on
    ``device`` (``"auto"``: a CUDA GPU where there is one, else the CPU; ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``). The weights and the optimiser state are float32; ``precision="bf16"``
    (``"auto"``: on a CUDA device that supports it) runs the forward under bf16 autocast.
    ``activation_checkpointing`` recomputes each decoder layer's activations in the backward
    pass instead of keeping them."""

    def __init__(self, model_dir: str | Path, optimiser: OptimiserOptions | None = None, *,
                 loss: LossConfig = LossConfig(), temperature: float = DEFAULT_TEMPERATURE,
                 lora: LoraSpec | None = None, shard: bool = False, weight_decay: float = 0.0,
                 **settings: Any) -> None:
        """``optimiser``: the optimiser concern training is configured with (default: its
        defaults), any of its fields also taken as a keyword (``Policy(d, lr=1e-3)``). LoRA is
        ``lora``, else the concern's ``lora_rank`` / ``lora_alpha``."""
        opt = optimiser_options(optimiser, settings)
        if lora is None and opt.lora_rank:
            lora = LoraSpec(rank=opt.lora_rank, alpha=opt.lora_alpha)
        #: The optimiser concern this policy was made with (the keywords applied).
        self.options = opt
        lr, max_grad_norm, device, precision = opt.lr, opt.max_grad_norm, opt.device, opt.precision
        micro_batch, micro_batch_tokens, logprob_chunk, pack = (opt.micro_batch, opt.micro_batch_tokens,
                                                                 opt.logprob_chunk, opt.pack)
        activation_checkpointing = opt.activation_checkpointing
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device)
        with quiet_loading():
            self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.lora = lora
        if lora is not None:
            inject_lora(self.model, lora)
        self.model.to(self.device)
        if activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The KL penalty's reference is the starting model: with LoRA the base (adapter off),
        # else a frozen copy made before any step (a resumed run loads the checkpoint after).
        self.ref_model = None
        if loss.kl_coef > 0 and lora is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # What a full sync moves: every base parameter (a merged adapter changes all of them).
        self.full_bytes = sum(p.numel() * p.element_size() for n, p in self.model.named_parameters()
                              if "lora_" not in n)
        #: FSDP2 over the process group (``agentenv.train.sharding``): parameters, gradients
        #: and optimiser state in 1/N shards.
        if _world() > 1:  # a rank of a process group starts from rank 0's weights, whatever its seed
            import torch.distributed as dist

            with torch.no_grad():
                for p in self.model.parameters():
                    dist.broadcast(p.data, src=0)
        self.sharded = shard and _world() > 1
        if self.sharded:
            from .sharding import shard_model

            shard_model(self.model, device_mesh(self.device))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature if temperature > 0 else 1.0
        self.micro_batch = micro_batch
        self.micro_batch_tokens = micro_batch_tokens
        self.loss_cfg = loss
        #: Positions per chunk of the output head (``agentenv.train.logprobs``); 0: whole logits.
        self.logprob_chunk = logprob_chunk
        #: Each pass's rows packed into one sequence (``agentenv.train.packing``), else padded.
        self.pack = pack
        if pack:
            for m in (self.model, self.ref_model):
                if m is not None:
                    use_varlen_attention(m)

    # -- logprobs ----------------------------------------------------------------------------
    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                       position_ids: torch.Tensor | None = None,
                       with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T]: position t holds log p(input_ids[t] | input_ids[:t]) at the sampling
        temperature (the distribution the engine sampled from); position 0 holds 0. With
        ``with_entropy``, also the [B, T] entropies of those distributions. The head runs on
        ``logprob_chunk`` positions at a time (:func:`agentenv.train.logprobs.token_logprobs`)."""
        with autocast(self.device, self.precision):
            return chunked_logprobs(self.model, input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    temperature=self.temperature, chunk=self.logprob_chunk, with_entropy=with_entropy)

    @contextlib.contextmanager
    def _adapter_off(self):
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        try:
            for m in layers:
                m.enable_adapters(False)
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)
            for p in self.params:  # enable_adapters(False) froze the adapter's parameters
                p.requires_grad_(True)

    @torch.no_grad()
    def reference_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                           position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] like :meth:`token_logprobs`, under the reference (starting) model."""
        if self.lora is not None:
            with self._adapter_off():
                return self.token_logprobs(input_ids, attention_mask, position_ids=position_ids)
        assert self.ref_model is not None, "no reference model (kl_coef is 0)"
        live, self.model = self.model, self.ref_model
        try:
            return self.token_logprobs(input_ids, attention_mask, position_ids=position_ids)
        finally:
            self.model = live

    def pass_logprobs(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One forward pass over a micro-batch: its [B, T] logprobs (with gradient), entropies
        and, with ``kl_coef``, reference logprobs, in the padded layout the loss reads. Packed
        (``pack``), the rows run as one sequence (:class:`~agentenv.train.packing.Packed`) and
        come back to that layout, so the loss and its gradient are the padded pass's."""
        kl = self.loss_cfg.kl_coef > 0
        if not self.pack:
            ref = self.reference_logprobs(mb.input_ids, mb.attention_mask) if kl else None
            logp, entropy = self.token_logprobs(mb.input_ids, mb.attention_mask, with_entropy=True)
            return logp, entropy, ref
        p = Packed.of(mb)
        ref = p.unpack(self.reference_logprobs(p.input_ids, None, position_ids=p.position_ids)) if kl else None
        logp, entropy = self.token_logprobs(p.input_ids, None, position_ids=p.position_ids, with_entropy=True)
        return p.unpack(logp), p.unpack(entropy), ref

    # -- one optimiser step ------------------------------------------------------------------
    def micro_plan(self, batch: Batch) -> list[list[int]]:
        """The rows of each forward/backward pass (:func:`~agentenv.train.packing.micro_plan`)."""
        return micro_plan(batch.lengths, self.micro_batch, self.micro_batch_tokens, self.pack)

    def train_step(self, batch: Batch, totals: tuple[float, int] | None = None,
                   micro_steps: int | None = None) -> dict[str, float]:
        """One GRPO step over the whole batch (micro-batched; the gradient equals the full
        batch's). The proximal policy is the weights at the start of the step.

        As a data-parallel rank (``torch.distributed`` initialised, see
        :mod:`agentenv.train.distributed`) ``batch`` is this rank's share of the rows and
        ``totals`` the whole batch's (trained tokens, rows): each rank weighs its loss by the
        whole batch, the gradients and statistics are summed over the ranks, and every rank
        then takes the one step a single process takes on the whole batch. Sharded, every rank
        runs ``micro_steps`` forward/backward passes (the most any rank's share needs; FSDP's
        gathers are collective): those past its rows weigh zero."""
        cfg = self.loss_cfg
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens, total_rows = totals if totals is not None else (float(batch.mask.sum()), batch.size)
        total_tokens = max(float(total_tokens), 1.0)
        sums = {"loss": 0.0, "clip_frac": 0.0, "is_weight_mean": 0.0, "is_truncated_frac": 0.0,
                "kl_behaviour": 0.0, "abs_logprob_diff": 0.0, "kl_ref": 0.0, "entropy": 0.0}
        plan = self.micro_plan(batch)
        steps = len(plan)
        if self.sharded:
            steps = max(steps, micro_steps or 0)
        for i in range(steps):
            mb = batch.rows(plan[i]).to(self.device) if i < len(plan) else None
            n = float(mb.mask.sum()) if mb is not None else 0.0
            if mb is None or n == 0:
                if self.sharded:  # take part in the shards' gathers and reductions, adding nothing
                    one = batch.rows(slice(0, 1)).to(self.device)
                    (self.token_logprobs(one.input_ids, one.attention_mask).sum() * 0.0).backward()
                continue
            logp, entropy, ref = self.pass_logprobs(mb)
            loss, st = grpo_loss(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.mask, cfg, ref)
            share = n / total_tokens if cfg.aggregation == "token" else mb.size / total_rows
            (loss * share).backward()
            with torch.no_grad():
                d = (logp.detach() - mb.behaviour_logprobs) * mb.mask  # log(pi_old / mu)
                k3 = (torch.exp(d) - 1 - d) * mb.mask  # KL(mu || pi_old), k3 estimator (tokens ~ mu)
                sums["kl_behaviour"] += float(k3.sum())
                sums["abs_logprob_diff"] += float(d.abs().sum())
                sums["entropy"] += float((entropy * mb.mask).sum())
            sums["loss"] += st["loss"] * share
            for k in ("clip_frac", "is_weight_mean", "is_truncated_frac", "kl_ref"):
                sums[k] += st[k] * n
        if self.sharded:  # FSDP summed the gradients already (reduce-scatter): the statistics
            sums = _sum_over_ranks([], sums, self.device)
        elif _world() > 1:
            sums = _sum_over_ranks(self.params, sums, self.device)
        grad_norm = full(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        self.optimizer.step()
        self.model.eval()
        out = {"loss": sums["loss"], "grad_norm": float(grad_norm)}
        for k in ("clip_frac", "is_weight_mean", "is_truncated_frac", "kl_behaviour", "abs_logprob_diff", "entropy"):
            out[k] = max(0.0, sums[k] / total_tokens)
        if cfg.kl_coef > 0:
            out["kl_ref"] = max(0.0, sums["kl_ref"] / total_tokens)  # all non-negative; no "-0.0" from rounding
        return out

    # -- weight sync -------------------------------------------------------------------------
    def sync_tensors(self) -> dict[str, torch.Tensor]:
        """What the engine needs after a step: every parameter, or only the adapter, on the
        policy's device (an engine that needs host copies makes them)."""
        if self.lora is not None:
            return {n: full(p).detach() for n, p in self.model.named_parameters() if "lora_" in n}
        return {n: full(p).detach() for n, p in self.model.named_parameters()}

    def base_tensors(self) -> dict[str, torch.Tensor]:
        """The base model's parameters under their Hugging Face names (what a fresh engine
        needs before the adapter, when it serves other weights)."""
        return {n.replace(".base_layer.", "."): full(p).detach() for n, p in self.model.named_parameters()
                if "lora_" not in n}

    def close(self) -> None:
        """Nothing to release in-process (:class:`~agentenv.train.distributed.RayPolicy` stops its ranks)."""

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: Path, write: bool = True) -> None:
        """Full fine-tuning: a Hugging Face model directory (config, weights, the tokenizer),
        so ``agentenv rollout --model PATH`` serves it; LoRA: the adapter tensors. Plus the
        optimiser state either way. Sharded, every rank calls this (the whole tensors are
        gathered) and the one with ``write`` writes."""
        from safetensors.torch import save_file

        if self.sharded:
            from .sharding import optimizer_state

            tensors = {n: t.contiguous() for n, t in self.sync_tensors().items()}
            optim = optimizer_state(self.model, self.optimizer)
            if not write:
                return
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is None:
            if self.sharded:  # the gathered weights under the model's own names, beside its config
                save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
                for f in Path(self.model_dir).glob("*config.json"):
                    shutil.copy2(f, path / f.name)
            else:
                with quiet_loading():  # no "Writing model shards" bar between the step lines
                    self.model.save_pretrained(str(path), safe_serialization=True)
            for f in Path(self.model_dir).iterdir():
                if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens"))
                                    or f.name in ("vocab.json", "merges.txt")):
                    shutil.copy2(f, path / f.name)
        else:
            adapter = tensors if self.sharded else {n: t.contiguous() for n, t in self.sync_tensors().items()}
            save_file(adapter, str(path / "adapter.safetensors"))
        torch.save(optim if self.sharded else self.optimizer.state_dict(), path / "optimizer.pt")
        (path / "policy.json").write_text(json.dumps({"lora": asdict(self.lora) if self.lora else None,
                                                      "sharded": self.sharded}))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        from .sharding import copy_full_, load_optimizer_state

        meta = json.loads((path / "policy.json").read_text()) if (path / "policy.json").exists() else {}
        if bool(meta.get("sharded")) != self.sharded:
            raise ConfigError(f"checkpoint {path} was written by a {'sharded' if meta.get('sharded') else 'unsharded'} "
                              "policy and its optimiser state does not load into this one (same --fsdp setting)")
        tensors = load_file(str(path / ("adapter.safetensors" if self.lora else "model.safetensors")),
                            device=str(self.device))
        params = dict(self.model.named_parameters())
        names = [n for n in params if (self.lora is None or "lora_" in n)]
        missing = {n for n in names if n not in tensors}
        if missing:
            raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for name in names:
                copy_full_(params[name], tensors[name])
        state = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=True)
        if self.sharded:
            load_optimizer_state(self.model, self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)
