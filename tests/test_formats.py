import copy

import pytest

from agentenv.errors import ConfigError
from agentenv.formats import HermesFormat, MalformedCall, ReToolFormat, ToolRequest, get_format


def test_retool_parses_the_last_closed_code_block():
    f = ReToolFormat()
    assert f.parse("Let me.\n<code>\nx = 1\nx\n</code>", ["python"]) == [ToolRequest("python", {"code": "x = 1\nx"})]
    assert f.parse("no call here", ["python"]) == []


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<code>\nprint(1)", "unclosed"),
        ("<code>\n\n</code>", "empty"),
        ("print(1)</code>", "without an opening"),
    ],
)
def test_retool_malformed(text, reason):
    (call,) = ReToolFormat().parse(text, ["python"])
    assert isinstance(call, MalformedCall) and reason in call.reason


def test_retool_observation_wraps_output():
    assert ReToolFormat().observation(["42"], None, False) == "\n<interpreter>\n42\n</interpreter>\n"


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "add", "arguments": {}}', "unclosed"),
    ],
)
def test_hermes_malformed_calls_are_data(text, reason):
    (call,) = HermesFormat().parse(text, ["add"])
    assert isinstance(call, MalformedCall)
    assert reason in call.reason


@pytest.mark.parametrize("text, name", [
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "mul"),  # unknown: the row says which
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "add"),
    ('<tool_call>{"arguments": {}}</tool_call>', ""),  # it named none
])
def test_a_malformed_call_keeps_the_tool_it_named_and_its_text(text, name):
    (call,) = HermesFormat().parse(text, ["add"])
    assert isinstance(call, MalformedCall) and call.name == name
    assert call.raw == text.removeprefix("<tool_call>").removesuffix("</tool_call>")


def test_hermes_parses_several_calls_and_string_arguments():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert HermesFormat().parse(text, ["add"]) == [
        ToolRequest("add", {"a": 1, "b": 2}),
        ToolRequest("add", {"a": 3, "b": 4}),
    ]


@pytest.mark.parametrize("ended_with_eos", [False, True])
def test_hermes_bridge_matches_the_chat_template_exactly(tokenizer, ended_with_eos):
    """The token bridge: prompt + model text (+ eos) + observation == the template's own rendering."""
    f = HermesFormat()
    msgs = [{"role": "user", "content": "add 1 and 2"}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    model_text = call + (tokenizer.eos_token if ended_with_eos else "")
    obs = f.observation(["3"], tokenizer, ended_with_eos)
    full = tokenizer.apply_chat_template(
        msgs + [{"role": "assistant", "content": call}, {"role": "tool", "content": "3"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt + model_text + obs == full


def test_hermes_observation_puts_each_output_once_whatever_the_outputs_hold(tokenizer):
    """Each output goes where the template put it, once, as text (``print`` can write anything,
    the assistant's marker included)."""
    f = HermesFormat()
    outputs = [f"a {f._A} \x00TOOL1\x00 b", "second", "\x00TOOL0\x00 \\1 \\g<0>"]
    obs = f.observation(outputs, tokenizer, False)
    assert [obs.count(o) for o in outputs] == [1, 1, 1]
    assert obs.index(outputs[0]) < obs.index("second") < obs.index(outputs[2])


def _writing_tool_outputs(how: str) -> str:
    """A chat template that writes a tool's output through ``how``."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'tool' %}" + how + "{% else %}{{ m['content'] }}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("how, written", [
    ("{{ m['content'] | trim | e }}", ["x = &#34;a&lt;b&#34;<|im_end|>", "\nsecond<|im_end|>"]),
    # Llama 3.1-4's templates: a string is iterable in Jinja, so a tool's output is written as JSON.
    ("{% if m.content is mapping or m.content is iterable %}{{ m.content | tojson }}{% else %}{{ m.content }}"
     "{% endif %}", ['"x = \\"a<b\\"\\n"<|im_end|>', '"  second  "<|im_end|>']),
])
def test_hermes_observation_is_what_a_template_that_transforms_tool_outputs_renders(tokenizer, how, written):
    f = HermesFormat()
    escaping = copy.copy(tokenizer)
    escaping.chat_template = _writing_tool_outputs(how)
    msgs = [{"role": "user", "content": "go"}]
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(x)"}}</tool_call>'
    outputs = ['x = "a<b"\n', "  second  "]
    obs = f.observation(outputs, escaping, False)
    prompt = escaping.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = escaping.apply_chat_template(
        msgs + [{"role": "assistant", "content": call}] + [{"role": "tool", "content": o} for o in outputs],
        tokenize=False, add_generation_prompt=True)
    assert prompt + call + obs == full
    assert all(w in obs for w in written), obs


CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
RUN = [ToolRequest("python", {"code": "print(1)"})]


@pytest.mark.parametrize(
    "text, calls",
    [
        ("<think>\nI compute it.\n</think>\n\n" + CALL, RUN),  # after the reasoning: a call
        ("<think>\nI might write " + CALL, []),  # inside an unclosed block (the turn stopped at </tool_call>)
        ("<think>\nnot " + CALL + " this\n</think>\n\nno call", []),  # inside a closed block
        ("the prompt opened the block: " + CALL + "\n</think>\n\n", []),  # </think> with no <think> before
        ("<think>\na\n</think>\n\n<think>\n" + CALL, []),  # a second block, unclosed
        ("<think>\n" + CALL + "\n</think>\n\n" + CALL, RUN),  # only the call outside the block runs
        (CALL, RUN),  # no reasoning at all
    ],
)
def test_hermes_calls_inside_think_are_not_calls(text, calls):
    assert HermesFormat().parse(text, ["python"]) == calls


def test_hermes_calls_in_think_can_be_allowed():
    text = "<think>\nI run it now: " + CALL
    assert HermesFormat(calls_in_think=True).parse(text, ["python"]) == RUN
    assert HermesFormat().parse(text, ["python"]) == [] and get_format("hermes").calls_in_think is False


def test_hermes_malformed_json_after_reasoning_is_data():
    (call,) = HermesFormat().parse('<think>\nok\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": '
                                   '"print(1)"}\n</tool_call>', ["python"])
    assert isinstance(call, MalformedCall) and "not valid JSON" in call.reason and call.raw.startswith('{"name"')


def test_unknown_format():
    with pytest.raises(ConfigError, match="unknown tool-call format"):
        get_format("xml")
