"""``agentenv.models.lora``: the one trainable LoRA adapter the trainer's policy and an engine
both inject, on the bundled model: outputs unchanged at injection, only the adapter trainable,
and the same tensor names wherever it is injected (a weight sync carries them one to one)."""

from __future__ import annotations

import pytest
import torch

from agentenv.models.lora import LORA_TARGETS, LoraSpec, inject_lora


def load(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def test_the_spec_is_peft_config_of_the_same_rank_alpha_and_targets():
    spec = LoraSpec()
    assert (spec.rank, spec.alpha, spec.target_modules) == (8, 16.0, LORA_TARGETS)
    cfg = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",)).peft_config()
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, set(cfg.target_modules), cfg.bias) == (4, 8.0, 0.0, {"q_proj"},
                                                                                            "none")
    with pytest.raises(AttributeError):
        spec.rank = 2  # frozen: the policy and the engine hold the same spec


def test_an_injected_adapter_changes_no_output_and_is_all_that_trains(model_dir):
    model = load(model_dir)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        before = model(ids).logits
    inject_lora(model, LoraSpec(rank=4, target_modules=("q_proj", "down_proj")))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # B = 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = model.config.num_hidden_layers
    assert len(trainable) == layers * 2 * 2 and all("lora_" in n for n in trainable)  # A and B on 2 targets
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "down_proj"}
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_two_injections_of_one_spec_name_the_same_tensors(model_dir):
    spec = LoraSpec(rank=2, target_modules=("v_proj",))
    a, b = load(model_dir), load(model_dir)
    inject_lora(a, spec)
    inject_lora(b, spec)
    names = [n for n in a.state_dict() if "lora_" in n]
    assert names and names == [n for n in b.state_dict() if "lora_" in n]
    assert {a.state_dict()[n].shape for n in names if "lora_A" in n} == {torch.Size([2, a.config.hidden_size])}
