"""A trainable LoRA adapter: what both the trainer's policy and an engine that serves it inject.

The trainer (``agentenv.train.Policy``) and the embedded engine inject the same adapter into
the same base model, so their tensor names match one to one and a weight sync carries only
the adapter's tensors. It lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = LORA_TARGETS

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0,
                          target_modules=list(self.target_modules), bias="none")


def inject_lora(model: Any, spec: LoraSpec) -> None:
    """Add the adapter (B = 0, so outputs are unchanged) and freeze everything else."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(spec.peft_config(), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
