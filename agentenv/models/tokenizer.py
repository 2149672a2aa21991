"""A tokenizer built locally (no hub): byte-level BPE, special tags, a chat template.

It is built with exactly the pipeline of Qwen2's tokenizer (NFC, Qwen2's split regex, which
puts every digit in its own token, byte-level BPE), because transformers' ``AutoTokenizer``
rebuilds a ``qwen2`` model directory's tokenizer from its vocab and merges with that
pipeline: a SentencePiece-style ``byte_fallback`` tokenizer saved next to a Qwen2 config
loads back with the wrong decoder and silently loses spaces. Byte-level BPE has the 256
bytes as its base alphabet, so any text still encodes (every byte has a token), and
transformers, vLLM and our own code all see the same tokenizer.

The tool tags are single added tokens, so an engine can stop on ``</code>`` by token id.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2's pre-tokenization regex (transformers/models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = [
    "<code>", "</code>", "<interpreter>", "</interpreter>", "<answer>", "</answer>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[SPECIAL[0]],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    fast.model_max_length = 2048
    return fast
