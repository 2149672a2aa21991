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
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
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


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1024,
                    chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus``, with the special tokens, the tool tags
    as single tokens and ``chat_template`` (the ReTool model's by default)."""
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
        chat_template=chat_template,
    )
    fast.model_max_length = 2048
    return fast


#: The Hermes model's template (Qwen2.5/Qwen3 style): ``tools`` listed in the system turn,
#: consecutive tool messages rendered as one user turn of ``<tool_response>`` blocks, an
#: assistant message's ``reasoning_content`` as a ``<think>`` block and its ``tool_calls`` as
#: ``<tool_call>`` JSON; ``enable_thinking=False`` opens the reply with an empty think block.
#: Earlier turns render as they were written (no think block is dropped), so the rendering of
#: a conversation is a prefix of the rendering of its continuation.
HERMES_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content is defined and m.reasoning_content %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if m.content %}{{- m.content }}{%- endif %}"
    "{%- if m.tool_calls is defined and m.tool_calls %}"
    "{%- for call in m.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
