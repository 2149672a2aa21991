"""``agentenv.gateway.requests``: a Chat Completions or a Responses body checked into the one
request a program session serves, or a ``RequestError`` naming the bad field (the 400's
``param``) and saying what to send instead."""

from __future__ import annotations

import pytest

from agentenv.gateway.requests import RequestError, parse_chat, parse_responses

USER = [{"role": "user", "content": "q"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def chat(**kw):
    return parse_chat({"model": "m", "messages": USER, **kw})


def refused(parse, body) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse(body)
    return caught.value


def test_a_chat_body_becomes_its_request_and_ignored_fields_change_nothing():
    req = chat(tools=[ADD], tool_choice="auto", stream=True, stream_options={"include_usage": True}, logprobs=True,
               top_logprobs=3, temperature=0.5, top_p=1, seed=-7, stop="END", max_completion_tokens=9,
               max_tokens=100, user="u", presence_penalty=1.0, response_format={"type": "text"})
    assert (req.model, req.messages, req.tool_names, req.tool_choice) == ("m", USER, ["add"], "auto")
    assert (req.stream, req.include_usage, req.logprobs, req.top_logprobs) == (True, True, True, 3)
    assert (req.temperature, req.top_p, req.seed, req.stop, req.max_tokens) == (0.5, 1.0, -7, ["END"], 9)
    assert type(req.top_p) is float  # an integer in the body is a float in the request
    plain = chat()
    assert (plain.tools, plain.stop, plain.max_tokens, plain.temperature, plain.top_logprobs) == ([], [], None,
                                                                                                  None, 0)
    assert chat(max_tokens=5).max_tokens == 5  # the older name where the newer is missing
    named = {"type": "function", "function": {"name": "add"}}
    assert chat(tools=[ADD], tool_choice=named).tool_choice == named
    assert [chat(tools=[ADD], tool_choice=c).tool_choice for c in ("none", "required")] == ["none", "required"]
    assert (chat(stream=False).stream, chat(logprobs=None).logprobs) == (False, False)


@pytest.mark.parametrize("body, param, text", [
    ([], None, "the request body must be a JSON object"),
    ({"model": "m", "messages": USER, "n": 2}, "n", "n=2 is not supported: the gateway samples one choice"),
    ({"messages": USER}, "model", "model must be a string"),
    ({"model": "m", "messages": []}, "messages", "messages must be a non-empty list"),
    ({"model": "m", "messages": [{"role": "bot"}]}, "messages", "messages[0].role must be one of"),
    ({"model": "m", "messages": USER, "tools": [{"name": "add"}]}, "tools", "tools[0] must be"),
    ({"model": "m", "messages": USER, "temperature": 2.5}, "temperature",
     "temperature must be a number in [0.0, 2.0], got 2.5"),
    ({"model": "m", "messages": USER, "top_p": float("nan")}, "top_p", "top_p must be a number in [0.0, 1.0]"),
    ({"model": "m", "messages": USER, "top_p": 0}, "top_p", "top_p must be a number in (0.0, 1.0], got 0"),
    ({"model": "m", "messages": USER, "temperature": True}, "temperature", "got True"),
    ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"model": "m", "messages": USER, "max_completion_tokens": 1.5}, "max_completion_tokens", "got 1.5"),
    ({"model": "m", "messages": USER, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be at most 20"),
    ({"model": "m", "messages": USER, "stop": ["a", ""]}, "stop", "stop must be a string or a list of up to 4"),
    ({"model": "m", "messages": USER, "stop": list("abcde")}, "stop", "up to 4 non-empty strings"),
    # a careless client's types: "false" is a true value in Python, so it is refused, not taken
    ({"model": "m", "messages": USER, "stream": "false"}, "stream", "stream must be true or false, got 'false'"),
    ({"model": "m", "messages": USER, "logprobs": "false"}, "logprobs", "logprobs must be true or false"),
    ({"model": "m", "messages": USER, "n": True}, "n", "n=True is not supported"),
    ({"model": "m", "messages": USER, "tools": [ADD], "tool_choice": 42}, "tool_choice",
     "tool_choice 42 is not supported"),
    ({"model": "m", "messages": USER, "tools": [ADD], "tool_choice": {"type": "function", "name": "add"}},
     "tool_choice", "is not supported"),  # the Responses form on the chat path
    ({"model": "m", "messages": USER, "tools": [ADD], "tool_choice": {"type": "function", "function": {
        "name": "mul"}}}, "tool_choice", "the function 'mul', which tools does not offer (tools: add)"),
    ({"model": "m", "messages": USER, "tools": [{"type": "web_search", "function": {"name": "add"}}]}, "tools",
     "tools[0] has type 'web_search': the gateway serves function tools only"),
    ({"model": "m", "messages": USER, "tool_choice": "required"}, "tool_choice",
     'tool_choice "required" asks for a tool call, and the request offers no tools'),
    ({"model": "m", "messages": USER, "top_logprobs": 2}, "top_logprobs", "top_logprobs=2 needs logprobs: true"),
    ({"model": "m", "messages": USER, "stream_options": {"include_usage": "no"}}, "stream_options",
     "stream_options must be an object with include_usage true or false, got {'include_usage': 'no'}"),
    ({"model": "m", "messages": USER, "stream_options": True}, "stream_options", "must be an object"),
])
def test_a_bad_chat_body_is_refused_naming_the_field(body, param, text):
    err = refused(parse_chat, body)
    assert text in str(err) and err.param == param and err.code == "invalid_request"


@pytest.mark.parametrize("extra, fix", [
    ({"functions": [{"name": "add"}]}, 'send each function as a tool: tools=[{"type"'),
    ({"function_call": "auto"}, 'send tool_choice ("auto", "none", "required"'),
])
def test_the_deprecated_function_calling_is_refused_with_its_replacement(extra, fix):
    """Ignored, ``functions`` would leave the model told of no tool at all."""
    err = refused(parse_chat, {"model": "m", "messages": USER, **extra})
    (key,) = extra
    assert str(err).startswith(f"{key} (the deprecated function calling) is not supported: {fix}")
    assert (err.param, err.code) == (key, "unsupported_parameter")


def test_a_field_not_applied_that_asks_for_something_or_an_unknown_one_is_logged_once(caplog, monkeypatch):
    import agentenv.gateway.requests as requests

    monkeypatch.setattr(requests, "_warned", set())
    quiet = dict(user="u", frequency_penalty=0, logit_bias={}, parallel_tool_calls=True, store=False,
                 response_format={"type": "text"}, stream_options={"include_usage": False})
    with caplog.at_level("WARNING", logger="agentenv.gateway.requests"):
        chat(**quiet)
        assert caplog.messages == []  # defaults, and fields that change nothing
        for _ in range(2):
            chat(temprature=0.2, presence_penalty=1.0)
            parse_responses({"model": "m", "input": "q", "reasoning": {"effort": "high"}, "parallel_tool_calls": False})
    assert caplog.messages == [
        "the gateway ignores the request field 'temprature', which it does not know",
        "the gateway does not apply presence_penalty=1.0 (it samples from the policy as it is and constrains "
        "nothing); it is accepted and ignored",
        "the gateway does not apply reasoning={'effort': 'high'} (it samples from the policy as it is and "
        "constrains nothing); it is accepted and ignored",
        "the gateway does not apply parallel_tool_calls=False (it samples from the policy as it is and "
        "constrains nothing); it is accepted and ignored"]


def test_the_digest_covers_what_a_replay_must_match():
    base = chat(temperature=0.5)
    same = chat(temperature=0.5, user="someone else", stream=True, logprobs=True)  # nothing sampled differs
    assert base.digest("main") == same.digest("main")
    for other in (chat(temperature=0.6), chat(temperature=0.5, seed=1), chat(temperature=0.5, stop="x"),
                  chat(temperature=0.5, max_tokens=3), chat(temperature=0.5, tools=[ADD]),
                  parse_chat({"model": "m", "messages": [{"role": "user", "content": "Q"}], "temperature": 0.5})):
        assert other.digest("main") != base.digest("main")
    assert base.digest("critic") != base.digest("main")


def responses(**kw):
    return parse_responses({"model": "m", "input": "q", **kw})


def test_a_responses_body_is_served_as_the_chat_request_of_the_same_conversation():
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    req = responses(instructions="Add.", tools=[tool], tool_choice={"type": "function", "name": "add"},
                    max_output_tokens=7, include=["message.output_text.logprobs"], top_logprobs=2, temperature=0,
                    metadata={"k": "v"}, parallel_tool_calls=False, store=False, stream=True)
    c = req.chat
    assert c.messages == [{"role": "system", "content": "Add."}, {"role": "user", "content": "q"}]
    assert c.tool_names == ["add"] and c.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert (c.max_tokens, c.logprobs, c.top_logprobs, c.temperature, c.include_usage, c.stream) == (7, True, 2, 0.0,
                                                                                                    True, True)
    # What the answer echoes is the request as the agent sent it.
    assert (req.instructions, req.tools, req.tool_choice, req.max_output_tokens) == ("Add.", [tool],
                                                                                     {"type": "function",
                                                                                      "name": "add"}, 7)
    assert (req.metadata, req.parallel_tool_calls) == ({"k": "v"}, False)
    plain = responses()
    assert (plain.tool_choice, plain.parallel_tool_calls, plain.text, plain.chat.logprobs) == (
        "auto", True, {"format": {"type": "text"}}, False)
    assert responses(tools=[tool], tool_choice="required").chat.tool_choice == "required"


@pytest.mark.parametrize("extra, param, code, text", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter",
     "previous_response_id is not supported: the gateway keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter", "the gateway keeps no conversations"),
    ({"background": True}, "background", "unsupported_parameter", "leave background out"),
    ({"store": True}, "store", "unsupported_parameter", "store=true is not supported"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "reasoning"}]}, "input[1]", "invalid_request",
     "input[1] has type 'reasoning'"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "invalid_request", "got int"),
    ({"input": []}, "input", "invalid_request", "input must be a string or a non-empty list"),
    ({"tools": [{"type": "file_search"}]}, "tools[0]", "invalid_request", "function tools only"),
    ({"include": "message.output_text.logprobs"}, "include", "invalid_request", "include must be a list of strings"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "invalid_request",
     "tool_choice {'type': 'web_search'} is not supported"),
    ({"max_output_tokens": -1}, "max_output_tokens", "invalid_request", "max_output_tokens must be an integer >= 1"),
    ({"stream": "false"}, "stream", "invalid_request", "stream must be true or false"),
    ({"top_p": 0.0}, "top_p", "invalid_request", "for greedy sampling send temperature 0"),
    ({"tools": [{"type": "function", "name": "add"}], "tool_choice": {"type": "function", "name": "mul"}},
     "tool_choice", "invalid_request", "tool_choice names the function 'mul', which tools does not offer"),
])
def test_a_bad_responses_body_is_refused_naming_the_field(extra, param, code, text):
    err = refused(parse_responses, {"model": "m", "input": "q", **extra})
    assert text in str(err) and (err.param, err.code) == (param, code)
