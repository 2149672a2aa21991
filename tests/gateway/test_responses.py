"""``agentenv.gateway.responses``: the OpenAI-shaped bodies of the gateway's answers, and their
server-sent event streams, built from one reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import agentenv.models
from agentenv.engines.embedded import load_tokenizer
from agentenv.gateway.replies import Reply
from agentenv.gateway.requests import parse_responses
from agentenv.gateway.responses import (
    completion_body,
    error_body,
    finish_reason,
    logprobs_body,
    response_body,
    response_events,
    stream_events,
)

TEXT = Reply("The sum is 5.")
CALLS = Reply("Adding.", [{"id": "call_0_0", "name": "add", "arguments": {"a": 2, "b": 3}}])
USAGE = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}


def data(events) -> list:
    """The JSON of each ``data:`` event (``[DONE]`` as itself)."""
    out = []
    for e in events:
        assert e.endswith("\n\n")
        line = [x for x in e.splitlines() if x.startswith("data: ")][0].removeprefix("data: ")
        out.append(line if line == "[DONE]" else json.loads(line))
    return out


def test_the_error_object_and_the_finish_reason():
    assert error_body("bad", param="n", code="x") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                                "param": "n", "code": "x"}}
    assert finish_reason(CALLS, "length") == "tool_calls"  # whole calls parsed: they are the reason
    assert (finish_reason(TEXT, "length"), finish_reason(TEXT, "stop"), finish_reason(TEXT, "abort")) == (
        "length", "stop", "stop")


def test_logprobs_give_each_sampled_tokens_text_and_bytes():
    tok = load_tokenizer(Path(agentenv.models.__file__).parent / "tiny-hermes")
    ids = tok.encode("Hello, world", add_special_tokens=False)
    body = logprobs_body(tok, ids, [-0.5] * len(ids), top=0)
    assert len(body["content"]) == len(ids) > 1 and body["refusal"] is None
    assert "".join(e["token"] for e in body["content"]) == "Hello, world"
    assert all(e["logprob"] == -0.5 and e["top_logprobs"] == [] for e in body["content"])
    assert b"".join(bytes(e["bytes"]) for e in body["content"]) == b"Hello, world"
    top = logprobs_body(tok, ids[:1], [-0.25], top=5)["content"][0]
    assert top["top_logprobs"] == [{"token": top["token"], "logprob": -0.25, "bytes": top["bytes"]}]


def sentencepiece_with_byte_fallback():
    """A small SentencePiece-style BPE (``▁`` for a space, ``<0xE6>`` pieces for bytes it has no
    piece for), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz\u2581"))
    backend.train_from_iterator(["hello world the cat sat on the mat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.mark.parametrize("which", ["tiny-hermes", "qwen3", "sentencepiece"])
def test_the_bytes_of_a_replys_tokens_join_into_its_text_where_a_character_spans_tokens(which, tmp_path):
    """A client joins the tokens' bytes to rebuild the text (OpenAI's ``bytes``): each token's
    own bytes, not those of its text decoded alone, which is U+FFFD for part of a character."""
    from agentenv.models.families import family_tokenizer

    tok = {"tiny-hermes": lambda: load_tokenizer(Path(agentenv.models.__file__).parent / "tiny-hermes"),
           "qwen3": lambda: family_tokenizer("qwen3", cache_dir=tmp_path),
           "sentencepiece": sentencepiece_with_byte_fallback}[which]()
    text = "the w\u00f6rld \u65e5\u672c \U0001f642" + ("" if which == "sentencepiece" else "<|im_end|> <tool_call>")
    ids = tok.encode(text, add_special_tokens=False)
    content = logprobs_body(tok, ids, [-0.5] * len(ids), top=0)["content"]
    assert len(ids) > len(text.split()) and any(e["token"] == "\ufffd" for e in content[:-1]) == (which != "qwen3")
    joined = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8")
    assert joined == (" " + text if which == "sentencepiece" else text)  # "▁the": the first piece's space


def test_a_completion_carries_the_reply_as_the_assistant_message():
    body = completion_body("chatcmpl-1", "m", CALLS, "stop", USAGE, None)
    assert body["object"] == "chat.completion" and body["usage"] == USAGE and body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": "Adding.", "refusal": None,
                                 "tool_calls": CALLS.openai_calls()}
    assert "tool_calls" not in completion_body("c", "m", TEXT, "stop", USAGE, None)["choices"][0]["message"]


def test_a_stream_sends_the_role_content_each_call_the_reason_the_usage_then_done():
    lp = {"content": [], "refusal": None}
    events = data(stream_events("c1", "m", CALLS, "stop", USAGE, lp))
    deltas = [e["choices"][0]["delta"] if e != "[DONE]" and e["choices"] else None for e in events]
    assert deltas[:4] == [{"role": "assistant", "content": ""}, {"content": "Adding."},
                          {"tool_calls": [{"index": 0, **CALLS.openai_calls()[0]}]}, {}]
    assert events[1]["choices"][0]["logprobs"] == lp and events[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[4]["choices"] == [] and events[4]["usage"] == USAGE and events[5] == "[DONE]"
    assert {e["id"] for e in events[:5]} == {"c1"} and len({e["created"] for e in events[:5]}) == 1
    # No content, no usage asked: neither is sent.
    quiet = data(stream_events("c2", "m", Reply(None, CALLS.calls), "stop", None, None))
    assert len(quiet) == 4 and quiet[-1] == "[DONE]" and "tool_calls" in quiet[1]["choices"][0]["delta"]
    # A reply of calls alone carries its logprobs on its first call; an empty one on its last chunk.
    lp = {"content": [{"token": "<tool_call>", "logprob": -0.5, "bytes": [60], "top_logprobs": []}], "refusal": None}
    calls = data(stream_events("c3", "m", Reply(None, CALLS.calls + CALLS.calls), "stop", None, lp))
    assert [e["choices"][0]["logprobs"] for e in calls[:-1]] == [None, lp, None, None]
    empty = data(stream_events("c4", "m", Reply(""), "length", None, {"content": [], "refusal": None}))
    assert [e["choices"][0]["logprobs"] for e in empty[:-1]] == [None, {"content": [], "refusal": None}]


def request(**kw):
    return parse_responses({"model": "m", "input": "q", **kw})


def test_a_response_echoes_the_request_and_a_cut_reply_is_incomplete():
    req = request(instructions="Add.", max_output_tokens=4, metadata={"k": "v"}, temperature=0.5)
    body = response_body("resp_abc", "m", req, TEXT, "length", USAGE, 3, None)
    assert (body["status"], body["incomplete_details"], body["completed_at"]) == (
        "incomplete", {"reason": "max_output_tokens"}, None)
    assert (body["instructions"], body["max_output_tokens"], body["metadata"], body["temperature"]) == (
        "Add.", 4, {"k": "v"}, 0.5)
    assert body["output"][0]["id"] == "msg_abc" and body["output"][0]["status"] == "incomplete"
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    done = response_body("resp_x", "m", request(), CALLS, "length", USAGE, 0, None)  # calls parsed: whole
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["completed_at"] == done["created_at"] and done["metadata"] == {}


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_response_stream_numbers_its_events_and_ends_with_the_response_itself(reason):
    body = response_body("resp_r", "m", request(), CALLS, reason, USAGE, 0, None)
    events = list(response_events(body))
    kinds = [e.split("\n", 1)[0].removeprefix("event: ") for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    payloads = data(events)
    assert [p["type"] for p in payloads] == kinds and [p["sequence_number"] for p in payloads] == list(range(13))
    assert payloads[0]["response"]["status"] == "in_progress" and payloads[0]["response"]["output"] == []
    assert payloads[4]["delta"] == "Adding." and payloads[9]["delta"] == '{"a": 2, "b": 3}'
    assert payloads[10]["name"] == "add" and payloads[-1]["response"] == body


def test_a_cut_text_reply_streams_as_response_incomplete():
    body = response_body("resp_t", "m", request(), TEXT, "length", USAGE, 0, None)
    assert list(response_events(body))[-1].startswith("event: response.incomplete\n")
