"""``agentenv.gateway.items``: a Responses request's ``instructions`` and ``input`` as the chat
messages the same conversation sent to Chat Completions would be, its tools as chat tools, and
a reply as ``output`` items that, sent back as input, are the assistant message recorded."""

from __future__ import annotations

import pytest

from agentenv.gateway.items import function_tools, input_messages, output_items
from agentenv.gateway.messages import MessageError, assistant_message, normalise_all
from agentenv.gateway.replies import Reply


def test_instructions_and_a_string_input_are_a_system_and_a_user_message():
    assert input_messages("Be brief.", "Hi") == [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}]
    assert input_messages(None, "Hi") == [{"role": "user", "content": "Hi"}]


def test_items_become_the_chat_messages_of_the_same_conversation():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Add."}]},  # no "type": a message
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3"},
                                                         {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
        {"type": "function_call", "call_id": "c0", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c0", "output": "5"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "0"}]},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},  # after a tool: its own message
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": a}}
             for c, a in (("c0", '{"a": 2, "b": 3}'), ("c1", "{}"))]
    assert input_messages(None, items) == [
        {"role": "developer", "content": "Add."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Adding.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "content": "0"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "assistant", "content": "No."},
    ]


@pytest.mark.parametrize("instructions, items, error", [
    (1, "hi", "instructions must be a string"),
    (None, [], "input must be a string or a non-empty list of items"),
    (None, ["hi"], "input[0] must be an object, got str"),
    (None, [{"role": "tool", "content": "x"}], "input[0].role must be one of user, system, developer, assistant; "
                                               "got 'tool'"),
    (None, [{"role": "user", "content": 3}], "input[0].content must be a string or a list of text parts, got int"),
    (None, [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0] has type 'input_image': the gateway serves a text model"),
    (None, [{"role": "user", "content": "q"}, {"type": "function_call", "name": "f", "arguments": "{}"}],
     "input[1].call_id must be a string (a function_call item is"),
    (None, [{"type": "function_call_output", "output": "5"}],
     "input[0].call_id must be a string (the call_id of the function_call it answers)"),
    (None, [{"type": "item_reference", "id": "msg_1"}], "input[0] has type 'item_reference', which the gateway "
                                                        "cannot take: it points at an item the gateway never stored"),
    (None, [{"type": "reasoning", "summary": []}], "the gateway's model writes no reasoning items"),
    (None, [{"type": "web_search_call"}], "input[0] has type 'web_search_call'; the gateway takes message, "
                                          "function_call and function_call_output items"),
])
def test_an_item_it_cannot_take_is_an_error_naming_it(instructions, items, error):
    with pytest.raises(MessageError) as caught:
        input_messages(instructions, items)
    assert error in str(caught.value)


def test_function_tools_are_chat_tools_and_other_tools_are_refused():
    assert function_tools(None) == []
    flat = {"type": "function", "name": "add", "description": None, "parameters": {"type": "object"}, "strict": True}
    assert function_tools([flat]) == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(MessageError, match="tools must be a list"):
        function_tools(flat)
    with pytest.raises(MessageError, match=r"tools\[0\] has type 'web_search': the gateway serves function tools "
                                           "only"):
        function_tools([{"type": "web_search"}])
    chat_form = {"type": "function", "function": {"name": "add"}}
    with pytest.raises(MessageError, match=r"tools\[1\] must be .*\(the Chat Completions form; the Responses API "
                                           r"takes it flat\)"):
        function_tools([flat, chat_form])


def test_a_reply_goes_out_as_a_message_or_as_calls_alone():
    text = output_items(Reply("The sum is 5."), "r1", "completed", None)
    assert text == [{"type": "message", "id": "msg_r1", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": "The sum is 5.", "annotations": []}]}]
    lps = [{"token": "x", "logprob": -0.5}]
    assert output_items(Reply(None), "r2", "incomplete", lps)[0]["content"] == [
        {"type": "output_text", "text": "", "annotations": [], "logprobs": lps}]  # an empty reply is a message
    calls = Reply("Adding.", [{"id": "call_0_0", "name": "add", "arguments": {"a": 2}}])
    out = output_items(calls, "r3", "completed", None)
    assert [i["type"] for i in out] == ["message", "function_call"]
    assert out[1] == {"type": "function_call", "id": "fc_r3_0", "call_id": "call_0_0", "name": "add",
                      "arguments": '{"a": 2}', "status": "completed"}
    assert [i["type"] for i in output_items(Reply(None, calls.calls), "r4", "completed", None)] == ["function_call"]


def test_output_sent_back_as_input_is_the_assistant_message_the_gateway_recorded():
    reply = Reply("Adding.", [{"id": "call_0_0", "name": "add", "arguments": {"a": 2, "b": 3}},
                              {"id": "call_0_1", "name": "add", "arguments": {"a": 1, "b": 1}}])
    back = input_messages(None, [{"role": "user", "content": "q"}, *output_items(reply, "r", "completed", None)])
    assert normalise_all(back)[1] == assistant_message(reply.content, reply.calls)
