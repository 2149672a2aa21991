"""``agentenv.gateway.messages``: every shape an SDK sends one message in maps to one canonical
dict (what "does this request extend the last one?" compares), and what cannot be taken is a
``MessageError`` naming the field."""

from __future__ import annotations

import pytest

from agentenv.gateway.messages import (
    MessageError,
    assistant_message,
    digest,
    for_template,
    normalise,
    normalise_all,
    normalise_tools,
    same,
)

CALL = {"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


def test_an_sdks_echo_of_a_reply_normalises_to_what_the_gateway_recorded():
    """The openai SDK sends back ``refusal``, ``audio``, ``function_call`` as None, its own key
    order, the arguments as a string and the call id: none of it changes the message."""
    echoed = {"tool_calls": [CALL], "refusal": None, "audio": None, "function_call": None, "content": None,
              "role": "assistant"}
    recorded = assistant_message(None, [{"name": "add", "arguments": {"a": 2, "b": 3}}])
    assert normalise(echoed) == recorded == {
        "role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                               "arguments": {"a": 2, "b": 3}}}]}
    # The arguments compare as JSON values: spacing and key order do not matter, the id is left out.
    other = {**CALL, "id": "another", "function": {"name": "add", "arguments": '{"b":3,"a":2}'}}
    assert normalise({"role": "assistant", "tool_calls": [other]}) == recorded
    # LangChain's flat form (no "function" wrapper) names the same call.
    flat = {"role": "assistant", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}
    assert normalise(flat) == recorded


def test_content_parts_join_and_a_part_that_is_not_text_is_kept_whole():
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "output_text", "text": "c"}]
    assert normalise({"role": "user", "content": parts}) == {"role": "user", "content": "abc"}
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert normalise({"role": "user", "content": image})["content"] == image


def test_roles_and_empty_fields():
    assert normalise({"role": "developer", "content": "rules"}) == {"role": "system", "content": "rules"}
    # A message other than the assistant's always has content; the assistant's only when it said something.
    assert normalise({"role": "user", "content": None}) == {"role": "user", "content": ""}
    assert normalise({"role": "assistant", "content": ""}) == {"role": "assistant"}
    tool = {"role": "tool", "content": "5", "tool_call_id": "call_0_0", "name": "", "reasoning_content": None}
    assert normalise(tool) == {"role": "tool", "content": "5", "tool_call_id": "call_0_0"}
    # Arguments that are not JSON stay the string the model wrote.
    bad = normalise({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})
    assert bad["tool_calls"][0]["function"]["arguments"] == "{oops"


@pytest.mark.parametrize("message, index, error", [
    ("hi", 2, "messages[2] must be an object, got str"),
    ({"role": "robot", "content": "x"}, 0, "messages[0].role must be one of system, developer, user, assistant, "
                                           "tool, function; got 'robot'"),
    ({"role": "user", "content": 5}, 1, "messages[1].content must be a string or a list of content parts, got int"),
    ({"role": "user", "content": ["x"]}, 0, "messages[0].content[0] must be an object"),
    ({"role": "assistant", "tool_calls": {"name": "f"}}, 0, "messages[0].tool_calls must be a list"),
    ({"role": "assistant", "tool_calls": ["f"]}, 3, "messages[3].tool_calls[0] must be an object"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, 0,
     "messages[0].tool_calls[0].function.name must be a string"),
])
def test_a_message_it_cannot_take_is_an_error_naming_the_field(message, index, error):
    with pytest.raises(MessageError) as caught:
        normalise(message, index)
    assert str(caught.value) == error


def test_a_request_needs_messages_and_tools_of_the_chat_form():
    for bad in (None, [], {"role": "user"}):
        with pytest.raises(MessageError, match="messages must be a non-empty list of message objects"):
            normalise_all(bad)
    assert normalise_all([{"role": "user", "content": "q"}]) == [{"role": "user", "content": "q"}]
    assert normalise_tools(None) == []
    fn = {"name": "add", "description": None, "parameters": {"type": "object"}}
    assert normalise_tools([{"type": "function", "function": fn}]) == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]  # None fields dropped
    with pytest.raises(MessageError, match="tools must be a list of tool objects"):
        normalise_tools({"function": fn})
    with pytest.raises(MessageError, match=r'tools\[1\] must be \{"type": "function", "function": \{"name"'):
        normalise_tools([{"type": "function", "function": fn}, {"type": "function", "name": "flat"}])


def test_a_message_for_the_template_has_content_and_copies_its_calls():
    msg = assistant_message(None, [{"name": "add", "arguments": {"a": 1}}])
    out = for_template(msg)
    assert out == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    out["tool_calls"][0]["function"]["name"] = "changed"  # the template's copy is its own
    assert msg["tool_calls"][0]["function"]["name"] == "add" and "content" not in msg


def test_a_digest_is_stable_across_key_order_and_differs_with_any_value():
    a = digest("main", [{"role": "user", "content": "q"}], {"x": 1, "y": 2})
    assert a == digest("main", [{"content": "q", "role": "user"}], {"y": 2, "x": 1})
    assert len(a) == 32 and a != digest("main", [{"role": "user", "content": "Q"}], {"x": 1, "y": 2})
    assert a != digest("critic", [{"role": "user", "content": "q"}], {"x": 1, "y": 2})


def test_same_compares_json_values_as_json_spells_them():
    assert same({"a": [1, "x", {"b": 1.5}], "c": None}, {"c": None, "a": [1, "x", {"b": 1.5}]})  # key order
    for a, b in ((True, 1), (1, 1.0), (0.0, -0.0), ({"a": [False]}, {"a": [0]}), ([1, "x"], [1.0, "x"]),
                 ({"a": 1}, {"a": 1, "b": 2}), ("1", 1), (float("nan"), float("nan"))):
        assert not same(a, b) and not same(b, a), (a, b)
    deep_a, deep_b = [1], [1.0]
    for _ in range(100):
        deep_a, deep_b = {"x": deep_a, "s": "text"}, {"s": "text", "x": deep_b}
    assert same(deep_a, deep_a) and not same(deep_a, deep_b)  # told apart at any depth
