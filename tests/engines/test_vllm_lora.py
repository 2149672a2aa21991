"""The adapters a vLLM engine serves: the trained adapter published as a PEFT directory (what
vLLM's ``LoRARequest`` loads), refusals that name the fix, and the files gone at close."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agentenv.engines.vllm_lora import LoraAdapters
from agentenv.errors import ConfigError
from agentenv.models.lora import LoraSpec


def test_an_engine_made_without_lora_support_names_the_flags_to_make_it_with():
    with pytest.raises(ConfigError, match="enable_lora=true --engine-arg max_lora_rank"):
        LoraAdapters(enabled=False).enable(LoraSpec(rank=4))


def test_a_published_version_is_a_peft_directory_and_close_removes_every_version(tmp_path):
    adapters = LoraAdapters(enabled=True, model_path=tmp_path / "base")
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(4, 8),
               "model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(8, 4)}
    assert not adapters.is_adapter(list(tensors.items()))  # not before train-time LoRA is on
    adapters.enable(LoraSpec(rank=4))
    assert adapters.is_adapter(list(tensors.items()))
    assert not adapters.is_adapter([("model.embed_tokens.weight", torch.zeros(2, 2))])

    paths = []
    for version in (1, 2):
        name, path = adapters.publish(tensors, version)
        assert name == f"agentenv-policy-v{version}"
        paths.append(path)
    config = json.loads((paths[1] / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tmp_path / "base")
    # PEFT's on-disk names: no adapter name, under "base_model.model."
    assert sorted(load_file(str(paths[1] / "adapter_model.safetensors"))) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    request = adapters.new_request("agentenv-policy-v2", paths[1])
    assert request.lora_name == "agentenv-policy-v2" and request.lora_path == str(paths[1])

    adapters.close()
    assert not any(p.exists() for p in paths) and not paths[0].parent.exists()
    adapters.close()  # idempotent


def test_a_directory_without_an_adapter_config_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path} is not a PEFT adapter directory"):
        LoraAdapters(enabled=True).new_request("x", tmp_path)
