"""The locally built tokenizer (``agentenv.models.tokenizer``): byte-level BPE with Qwen2's
pre-tokenization, so any text round-trips, digits are single tokens, the tool tags are one
token each, and a saved copy next to a ``qwen2`` config loads back through ``AutoTokenizer``
as the very same tokenizer."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from agentenv.models import default_model
from agentenv.models.tokenizer import EOS, SPECIAL, TAGS, build_tokenizer

CORPUS = ["Compute 123 * 45 with code.\n<code>\nprint(123 * 45)\n</code>\n<interpreter>\n5535\n</interpreter>",
          "The answer is \\boxed{5535}.", "system\nuser\nassistant\n"] * 20
TEXTS = ["  two leading spaces, and  two inside", "tabs\tand\nnewlines\r\n", "naïve café — 東京 🙂",
         "x = [1, 2, 3]\nprint(sum(x))", "<code>print(1)</code><interpreter>1</interpreter>"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=400)


def test_any_text_round_trips_and_digits_are_single_tokens(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    digits = tok.encode("9876543210", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == list("9876543210")
    assert len(tok) <= 400 + len(SPECIAL) + len(TAGS) and tok.model_max_length == 2048


def test_tags_and_specials_are_single_tokens_and_the_template_renders_chatml(tok):
    for tag in SPECIAL + TAGS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    assert tok.eos_token == EOS and tok.bos_token is None
    assert tok.encode("a</code>b", add_special_tokens=False)[1] == tok.convert_tokens_to_ids("</code>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "tool", "content": "42"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_saved_beside_a_qwen2_config_it_loads_back_as_the_same_tokenizer(tok, tmp_path):
    """AutoTokenizer rebuilds a qwen2 directory's tokenizer from its vocab and merges with
    Qwen2's own pipeline: it must come back identical (spaces included)."""
    tok.save_pretrained(tmp_path)
    shutil.copy(default_model() / "config.json", tmp_path / "config.json")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + CORPUS[:3]:
        ids = tok.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids and loaded.decode(ids) == text
    assert loaded.chat_template == tok.chat_template and loaded.eos_token_id == tok.eos_token_id
