"""The one stream loop (``vllm_outputs.read_outputs``) over vLLM's own output types, as
``AsyncLLM.generate`` yields them: plain requests (final output, or deltas) and the turns of a
streaming-input request, with and without the engine core's weight-version labels."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan  # noqa: E402

from agentenv.engines.base import SamplingParams  # noqa: E402
from agentenv.engines.vllm_outputs import read_outputs, span_versions  # noqa: E402
from agentenv.errors import EngineError  # noqa: E402

pytestmark = pytest.mark.anyio


def output(tokens: list[int], finish: str | None = None, spans: list[tuple[str, int, int]] | None = None,
           cached: int = 0) -> RequestOutput:
    """A ``RequestOutput`` with ``tokens`` (each token's logprob is -token/10)."""
    c = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                         logprobs=[{t: Logprob(-t / 10)} for t in tokens], finish_reason=finish,
                         weight_versions=[WeightVersionSpan(*s) for s in spans] if spans else None)
    return RequestOutput("r", None, [1, 2, 3], None, [c], finished=finish is not None, num_cached_tokens=cached)


async def stream(*outs: RequestOutput):
    for out in outs:
        yield out


async def test_a_final_output_with_labels_gives_each_token_its_version():
    outs = await read_outputs(stream(output([5, 6, 7, 8], "length", [("3", 0, 2), ("4", 2, 4)], cached=2)),
                              version=3, pinned=False, labels=True, current=lambda: 99)
    assert outs.tokens == [5, 6, 7, 8] and outs.logprobs == pytest.approx([-0.5, -0.6, -0.7, -0.8])
    assert outs.versions == [3, 3, 4, 4]
    g = outs.generation(SamplingParams(max_tokens=4), prompt_tokens=3, cached=2, version=3, start=0.0)
    assert (g.finish_reason, g.weight_version, g.token_versions, g.cached_tokens) == ("length", 3, [3, 3, 4, 4], 2)


async def test_deltas_are_stamped_on_arrival_unless_the_adapter_pins_them():
    now = [1]

    async def deltas():
        yield output([5, 6])
        now[0] = 2  # a weight update lands between the deltas
        yield output([7], "stop")

    outs = await read_outputs(deltas(), version=1, pinned=False, labels=False, current=lambda: now[0])
    assert outs.tokens == [5, 6, 7] and outs.versions == [1, 1, 2]
    g = outs.generation(SamplingParams(max_tokens=8, stop_token_ids=(7,)), 3, 0, 1, 0.0)
    assert g.finish_reason == "stop" and g.stop_token_id == 7 and g.versions == [1, 1, 2]
    now[0] = 1
    pinned = await read_outputs(deltas(), version=1, pinned=True, labels=False, current=lambda: now[0])
    assert pinned.versions == [1, 1, 1]


async def test_a_streamed_turn_stops_at_its_finished_output_and_leaves_the_stream_open():
    outputs = stream(output([5]), output([6], "length"), output([7]), output([8], "stop"))
    first = await read_outputs(outputs, version=0, pinned=False, labels=False, current=lambda: 0, turn=True)
    assert first.tokens == [5, 6] and first.finish_reason == "length"
    second = await read_outputs(outputs, version=0, pinned=False, labels=False, current=lambda: 0, turn=True)
    assert second.tokens == [7, 8] and second.finish_reason == "stop"  # the same stream, read on


async def test_a_streamed_turns_labels_index_every_token_the_stream_sampled():
    # The stream sampled 3 tokens in earlier turns; the update landed at its 4th token.
    final = output([5, 6], "length", spans=[("0", 0, 3), ("1", 3, 5)])
    outs = await read_outputs(stream(final), version=0, pinned=False, labels=True, current=lambda: 1,
                              sampled=3, turn=True)
    assert outs.versions == [1, 1]


async def test_a_stream_that_ends_early_or_empty_is_an_engine_error():
    with pytest.raises(EngineError, match="ended the streaming-input request before the turn did"):
        await read_outputs(stream(output([5])), version=0, pinned=False, labels=False, current=lambda: 0, turn=True)
    with pytest.raises(EngineError, match="no output"):
        await read_outputs(stream(), version=0, pinned=False, labels=False, current=lambda: 0)
    bad = output([5, 6])
    bad.outputs[0].logprobs = bad.outputs[0].logprobs[:1]
    with pytest.raises(EngineError, match="without one logprob each"):
        await read_outputs(stream(bad), version=0, pinned=False, labels=False, current=lambda: 0)
    # A plain request aborted from outside ends with no finish reason: an abort, not an error.
    aborted = await read_outputs(stream(output([5])), version=0, pinned=False, labels=False, current=lambda: 0)
    assert aborted.generation(SamplingParams(max_tokens=4), 3, 0, 0, 0.0).finish_reason == "abort"


def test_span_versions_skip_labels_agentenv_did_not_set():
    spans = [WeightVersionSpan("default", 0, 2), WeightVersionSpan("5", 2, 9)]
    assert span_versions(spans, 4, 4) == [4, 4, 5, 5]
    assert span_versions(None, 2, 7) == [7, 7]
