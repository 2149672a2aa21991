"""The bookkeeping of vLLM streaming-input requests (``vllm_streams.InputStreams``): which
turn continues which stream, what it is fed, eviction and closing. Pure Python: the engine
side (token-exactness against a request per turn) is in ``test_vllm.py``."""

from __future__ import annotations

import pytest

from agentenv.engines.vllm_streams import InputStreams

pytestmark = pytest.mark.anyio


def test_a_turn_that_extends_the_sequence_continues_the_stream_fed_only_its_new_tokens():
    streams = InputStreams(4)
    s, chunk, fresh = streams.for_turn("p", [1, 2, 3], version=0, lora=None, incarnation=0)
    assert fresh and chunk == [1, 2, 3] and streams.opened == 1
    s.busy = True
    streams.end_turn(s, [1, 2, 3], [7, 8], "stop")
    assert not s.busy and s.seq == [1, 2, 3, 7, 8] and s.sampled == 2
    # vLLM dropped the last sampled token (8): it leads the next chunk.
    again, chunk, fresh = streams.for_turn("p", [1, 2, 3, 7, 8, 9, 9], version=0, lora=None, incarnation=0)
    assert again is s and not fresh and chunk == [8, 9, 9] and streams.continued == 1


@pytest.mark.parametrize("change", [
    {"prompt": [1, 2, 4, 7, 8]},  # does not extend the sequence
    {"version": 1},  # new weights: old KV must not be reused
    {"lora": "adapter"},
    {"incarnation": 1},  # a restarted engine core holds none of it
])
def test_anything_else_opens_a_new_stream_fed_the_whole_prompt(change):
    streams = InputStreams(4)
    s, _, _ = streams.for_turn("p", [1, 2, 3], version=0, lora=None, incarnation=0)
    streams.end_turn(s, [1, 2, 3], [7, 8], "length")
    prompt = change.get("prompt", [1, 2, 3, 7, 8, 5])
    new, chunk, fresh = streams.for_turn("p", prompt, version=change.get("version", 0), lora=change.get("lora"),
                                         incarnation=change.get("incarnation", 0))
    assert fresh and new is not s and chunk == prompt and new.request_id != s.request_id
    assert streams.get("p") is new and streams.continued == 0


def test_a_busy_stream_is_not_continued():
    streams = InputStreams(4)
    s, _, _ = streams.for_turn("p", [1], version=0, lora=None, incarnation=0)
    streams.end_turn(s, [1], [2], "stop")
    s.busy = True
    new, _, fresh = streams.for_turn("p", [1, 2, 3], version=0, lora=None, incarnation=0)
    assert fresh and new is not s


async def test_past_the_limit_the_least_recently_used_idle_stream_is_closed_and_busy_ones_never():
    streams = InputStreams(2)
    a, _, _ = streams.for_turn("a", [1], 0, None, 0)
    b, _, _ = streams.for_turn("b", [1], 0, None, 0)
    streams.end_turn(a, [1], [2], "stop")
    streams.end_turn(b, [1], [2], "stop")
    streams.touch(a)  # b is now the least recently used
    c, _, _ = streams.for_turn("c", [1], 0, None, 0)
    assert list(streams.open) == ["a", "c"] and streams.evicted == 1
    assert await b.inputs.get() is None  # its input stream ended: vLLM finishes its request
    a.busy = c.busy = True
    assert streams.for_turn("d", [1], 0, None, 0) == (None, [], True)  # all mid-turn, no room
    await streams.reap()


def test_a_turn_that_did_not_end_at_a_stop_or_the_length_closes_its_stream():
    streams = InputStreams(2)
    s, _, _ = streams.for_turn("p", [1], 0, None, 0)
    streams.end_turn(s, [1], [2], "abort")
    assert streams.get("p") is None


async def test_reap_closes_the_output_streams_of_ended_streams():
    closed = []

    async def outputs():
        try:
            yield "out"
            yield "never read"
        finally:
            closed.append(True)

    streams = InputStreams(2)
    s, _, _ = streams.for_turn("p", [1], 0, None, 0)
    s.outputs = outputs()
    assert await s.outputs.__anext__() == "out"
    streams.close("p")
    assert not closed and not streams.open
    await streams.reap()
    assert closed == [True]


def test_streams_off_means_no_stream_is_opened():
    assert InputStreams(0).for_turn("p", [1], 0, None, 0) == (None, [], True)


def test_the_former_module_name_still_imports_the_same_names_with_a_warning(monkeypatch):
    """``agentenv.engines.vllm_sessions`` was this module's name ("session" is a sandbox
    session's word now): it still imports, deprecated, with the same objects."""
    import importlib
    import sys

    from agentenv.engines import vllm_streams

    monkeypatch.delitem(sys.modules, "agentenv.engines.vllm_sessions", raising=False)
    with pytest.warns(DeprecationWarning, match="vllm_streams"):
        former = importlib.import_module("agentenv.engines.vllm_sessions")
    assert former.InputStreams is InputStreams and former.feed is vllm_streams.feed
    assert former.session_limit is vllm_streams.stream_limit
