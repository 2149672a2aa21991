"""check_tokenizer on real model families (Qwen2.5, Qwen3, Llama 3 formats over Qwen's real BPE
vocabulary, built locally) and on the bundled tokenizer: exact where it is, and where it is not,
the report says what breaks and what to do."""

import pytest

from agentenv import check_tokenizer
from agentenv.formats import get_format
from agentenv.models.families import family_tokenizer
from agentenv.program import observation_ids, render_prompt


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    cache = tmp_path_factory.mktemp("families")
    return {f: family_tokenizer(f, cache_dir=cache) for f in ("qwen2.5", "qwen3", "llama3")}


@pytest.mark.parametrize("family, fmt", [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3", "llama3-json"),
                                         ("qwen2.5", "llama3-json")])
@pytest.mark.slow
def test_each_familys_own_tool_format_is_exact(families, family, fmt):
    report = check_tokenizer(families[family], fmt)
    assert report.exact, str(report)
    assert all(report.checks.values()) and len(report.checks) >= 6


@pytest.mark.slow
def test_the_spliced_tool_tokens_are_what_each_template_renders(families):
    """The same functions the reactor uses, compared with the template's own rendering."""
    for family, fmt_name, role_text in (
        ("qwen2.5", "hermes", "<|im_start|>user\n<tool_response>\n391\n"),
        ("llama3", "llama3-json", "<|start_header_id|>ipython<|end_header_id|>\n\n391"),
    ):
        tok, fmt = families[family], get_format(fmt_name)
        msgs = [{"role": "user", "content": "17 * 23?"}]
        prompt = render_prompt(tok, msgs)
        assert tok.decode(prompt) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        env = observation_ids(fmt, tok, ["391"], ended_with_eos=fmt_name == "llama3-json")
        text = tok.decode(env, skip_special_tokens=False)
        assert role_text in text and text.endswith(tok.apply_chat_template(msgs, tokenize=False,
                                                                            add_generation_prompt=True)[-12:])


@pytest.mark.slow
def test_qwen3_rewrites_history_and_the_report_says_so(families):
    notes = " ".join(check_tokenizer(families["qwen3"], "hermes").notes)
    assert "rewrites earlier turns" in notes and "<think>" in notes
    assert not check_tokenizer(families["qwen2.5"], "hermes").notes  # Qwen2.5 keeps history as it was


@pytest.mark.slow
def test_what_breaks_is_named_with_what_to_do(families):
    llama_hermes = check_tokenizer(families["llama3"], "hermes")
    assert not llama_hermes.exact
    assert any("'</tool_call>' is 4 tokens" in p and "tokenizer.add_tokens" in p for p in llama_hermes.problems)
    qwen_retool = check_tokenizer(families["qwen2.5"], "retool")
    assert not qwen_retool.exact and "'</code>' is 3 tokens" in qwen_retool.problems[0]
    assert any("re-tokenizing" in n for n in qwen_retool.notes)  # '>\n<' splits otherwise in one piece
    from transformers import PreTrainedTokenizerFast

    base = families["qwen2.5"]  # as a base model ships it: eos <|endoftext|>, turns end with <|im_end|>
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>",
                                  chat_template=base.chat_template)
    report = check_tokenizer(tok, "hermes")
    assert not report.exact and "is not what ends an assistant turn" in report.problems[0]
    assert "'<|im_end|>\\n'" in report.problems[0]


def test_the_bundled_tokenizer_is_exact_for_both_its_formats(model_dir):
    from transformers import AutoTokenizer

    bundled = AutoTokenizer.from_pretrained(model_dir)
    assert check_tokenizer(bundled, "retool").exact and check_tokenizer(bundled, "hermes").exact
    assert "EXACT" in str(check_tokenizer(bundled, "retool"))
