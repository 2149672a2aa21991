"""``agentenv.gateway.replies``: one sampled turn as the assistant message an agent is shown,
split by the model's tool-call format; a call that does not parse is content plus a reason,
never an exception."""

from __future__ import annotations

import json

from agentenv.formats import HermesFormat, Llama3JsonFormat, MalformedCall
from agentenv.gateway.replies import Reply, parse_reply

HERMES = HermesFormat()
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_a_hermes_turn_is_its_visible_text_and_its_calls_with_ids_fixed_by_the_request():
    text = "I will add.\n\n" + CALL + "\n" + CALL.replace("2", "7")
    reply = parse_reply(HERMES, text, ["add"], call_id="call_4")
    assert reply == Reply("I will add.", [{"id": "call_4_0", "name": "add", "arguments": {"a": 2, "b": 3}},
                                          {"id": "call_4_1", "name": "add", "arguments": {"a": 7, "b": 3}}], [])
    assert parse_reply(HERMES, text, ["add"], call_id="call_4") == reply  # a replay gets the same ids
    assert parse_reply(HERMES, CALL, ["add"]).content is None  # calls alone: no content


def test_without_tools_or_with_tool_choice_none_the_whole_turn_is_content():
    assert parse_reply(HERMES, CALL, []) == Reply(CALL)
    assert parse_reply(HERMES, CALL, ["add"], "none") == Reply(CALL)
    assert parse_reply(HERMES, "The sum is 5.", ["add"]) == Reply("The sum is 5.")


def test_a_malformed_call_is_content_with_its_reason_and_no_calls():
    unknown = CALL.replace('"add"', '"mul"')
    reply = parse_reply(HERMES, "ok " + unknown, ["add"])
    assert reply.content == "ok " + unknown and reply.calls == []
    assert [(m.reason, m.name) for m in reply.malformed] == [("unknown tool 'mul'; available: add", "mul")]
    # One bad call among good ones: the turn is not half-executed, all of it is content.
    reply = parse_reply(HERMES, CALL + "<tool_call>{not json</tool_call>", ["add"])
    assert reply.calls == [] and len(reply.malformed) == 1 and "not valid JSON" in reply.malformed[0].reason


def test_a_llama3_call_is_the_whole_turn_so_it_shows_no_content():
    turn = json.dumps({"name": "add", "parameters": {"a": 1, "b": 1}})
    reply = parse_reply(Llama3JsonFormat(), turn, ["add"], call_id="call_0")
    assert reply == Reply(None, [{"id": "call_0_0", "name": "add", "arguments": {"a": 1, "b": 1}}])


def test_openai_calls_carry_the_arguments_as_a_json_string_unescaped():
    reply = Reply(None, [{"id": "call_1_0", "name": "say", "arguments": {"text": "héllo"}}])
    assert reply.openai_calls() == [{"id": "call_1_0", "type": "function",
                                     "function": {"name": "say", "arguments": '{"text": "héllo"}'}}]
    assert Reply("x").openai_calls() == []


def test_a_call_whose_arguments_hold_nan_or_infinity_is_malformed_not_nonstandard_json():
    for number in ("NaN", "Infinity", "-Infinity", "1e400"):
        text = CALL.replace("3}", number + "}")
        reply = parse_reply(HERMES, text, ["add"])
        assert reply == Reply(text, [], [MalformedCall("the arguments of 'add' hold NaN, Infinity or a number past "
                                                       "a double's range, which JSON cannot carry", name="add")])
    assert parse_reply(HERMES, CALL.replace("3}", "1e308}"), ["add"]).calls[0]["arguments"] == {"a": 2, "b": 1e308}


def test_a_turn_that_does_not_meet_a_required_or_named_tool_choice_is_content_with_its_reason():
    required, named = "required", {"type": "function", "function": {"name": "add"}}
    text = "The sum is 5."
    assert parse_reply(HERMES, text, ["add"], required) == Reply(
        text, [], [MalformedCall('tool_choice "required" asks for a tool call; the model made none')])
    assert parse_reply(HERMES, text, ["add", "mul"], named) == Reply(
        text, [], [MalformedCall("tool_choice asks for calls of 'add' only; the model called none")])
    mul = CALL.replace('"add"', '"mul"')
    assert parse_reply(HERMES, CALL + mul, ["add", "mul"], named) == Reply(
        CALL + mul, [], [MalformedCall("tool_choice asks for calls of 'add' only; the model called 'add', 'mul'")])
    # Met: the calls are returned as under "auto".
    for choice in (required, named):
        auto = parse_reply(HERMES, CALL, ["add", "mul"], call_id="c")
        assert parse_reply(HERMES, CALL, ["add", "mul"], choice, call_id="c") == auto
        assert parse_reply(HERMES, CALL, ["add", "mul"], choice).calls[0]["name"] == "add"
    assert parse_reply(HERMES, mul, ["add", "mul"], required).calls[0]["name"] == "mul"
