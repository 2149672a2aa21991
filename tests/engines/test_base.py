"""``agentenv.engines.base``: what the interface itself does (the defaults every engine
inherits, the checks before generating, closing as a context manager) and the trainer's two
interfaces apart from inference (``WeightSink``, ``Sleepable``) with their checks by name."""

from __future__ import annotations

import pytest

from agentenv.engines.base import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    Engine,
    Generation,
    SamplingParams,
    Sleepable,
    WeightSink,
    sleepable,
)
from agentenv.errors import ConfigError, EngineError, PromptTooLongError

pytestmark = pytest.mark.anyio


class Echo(Engine):
    """The smallest engine: it answers with the prompt's last token, and counts what it is asked."""

    max_model_len, tokenizer = 8, None

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], str, int]] = []
        self.closes = 0

    @property
    def weight_version(self) -> int:
        return 4

    async def generate(self, prompt_ids, params, request_id, *, priority=0):
        self._room(prompt_ids)
        self.asked.append((prompt_ids, request_id, priority))
        return Generation(prompt_ids[-1:], [-0.5], "stop", len(prompt_ids), 0, self.weight_version)

    async def abort(self, request_id):
        return None

    async def aclose(self):
        self.closes += 1
        self._closed = True


def test_sampling_defaults_and_versions_per_token():
    p = SamplingParams(max_tokens=3)
    assert (p.temperature, p.top_p, p.top_k, p.stop_token_ids) == (DEFAULT_TEMPERATURE, DEFAULT_TOP_P,
                                                                   DEFAULT_TOP_K, ())
    with pytest.raises(AttributeError):
        p.max_tokens = 4  # frozen: one request's settings cannot change under it
    gen = Generation([1, 2, 3], [-0.1] * 3, "length", 5, 0, weight_version=2)
    assert gen.versions == [2, 2, 2]  # the one version, once per token
    gen.token_versions = [1, 1, 2]  # an update landed mid-request
    assert gen.versions == [1, 1, 2]


async def test_an_engine_inherits_the_turn_a_closing_context_and_the_room_check():
    engine = Echo()
    assert (engine.page_size, engine.kv_capacity_tokens, engine.sampling) == (16, None, None)
    engine.release("p")  # optional: nothing to do by default
    async with engine as same:
        gen = await same.generate_turn("prog", [1, 2, 3], SamplingParams(4), "prog-0", priority=2)
        assert gen.token_ids == [3] and engine.asked == [([1, 2, 3], "prog-0", 2)]  # generate_turn is generate
        with pytest.raises(PromptTooLongError, match=r"prompt of 8 tokens leaves no room \(max_model_len=8\)"):
            await same.generate(list(range(8)), SamplingParams(4), "long")
        assert engine._room(list(range(5))) == 3
    assert engine.closes == 1
    with pytest.raises(EngineError, match="engine is closed"):
        await engine.generate([1], SamplingParams(4), "late")


async def test_an_engine_with_load_weights_is_a_weight_sink_that_says_it_has_no_lora():
    class Loads(Echo):
        async def load_weights(self, weights, version=None):
            return 1

    assert isinstance(Loads(), WeightSink) and not isinstance(Echo(), WeightSink)
    with pytest.raises(ConfigError, match="Loads does not support LoRA weight sync; train without --lora-rank"):
        await WeightSink.enable_lora(Loads(), None)


def test_a_sleepable_engine_is_refused_a_level_it_does_not_have():
    class Naps(Echo):
        sleep_levels = (1,)

        async def sleep(self, level=1): ...
        async def wake_up(self): ...
        async def is_sleeping(self): return False

    naps = Naps()
    assert isinstance(naps, Sleepable) and sleepable(naps, 1, "x") is naps
    with pytest.raises(ConfigError, match=r"--mode colocated needs an engine that sleeps at level 2; Naps sleeps at "
                                          r"levels \(1,\) \(use --mode sync or async\)"):
        sleepable(naps, 2, "--mode colocated")


def test_the_trainers_interfaces_are_apart_from_inference_and_checked_where_needed(tokenizer):
    """Inference is ``Engine``; replacing weights (``WeightSink``) and giving the device away
    (``Sleepable``) are separate interfaces, which the engines that have them implement and the
    trainer checks by name before it needs them."""
    pytest.importorskip("verl")
    from agentenv.engines import Sleepable, WeightSink, sleepable, weight_sink
    from agentenv.engines.actors import RayEngine
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.engines.instant import InstantEngine
    from agentenv.engines.openai import OpenAIEngine
    from agentenv.engines.vllm import VLLMEngine
    from agentenv.errors import ConfigError
    from agentenv.integrations.verl import ServerManagerEngine

    inference = {"generate", "generate_turn", "abort", "release", "aclose"}
    assert inference <= set(dir(Engine)) and not {"load_weights", "enable_lora", "sleep", "wake_up"} & set(dir(Engine))
    for kind in (EmbeddedEngine, VLLMEngine, OpenAIEngine, RayEngine, InstantEngine):
        assert issubclass(kind, WeightSink), kind
    assert [k.__name__ for k in (EmbeddedEngine, VLLMEngine, OpenAIEngine, RayEngine, InstantEngine)
            if issubclass(k, Sleepable)] == ["EmbeddedEngine", "VLLMEngine", "OpenAIEngine"]
    verl = ServerManagerEngine(None, tokenizer, 1024, request_id="p")
    with pytest.raises(ConfigError, match="agentenv train replaces the engine's weights as it trains, and "
                                          "ServerManagerEngine takes none"):
        weight_sink(verl, "agentenv train")
    with pytest.raises(ConfigError, match="ServerManagerEngine cannot sleep"):
        sleepable(verl, 1, "--mode colocated")
    instant = InstantEngine(tokenizer)
    assert weight_sink(instant, "x") is instant
    with pytest.raises(ConfigError, match="InstantEngine cannot sleep"):
        sleepable(instant, 2, "--mode colocated")


def test_an_engine_written_before_the_split_still_takes_weights(tokenizer):
    """A user's engine that subclasses ``Engine`` alone and has ``load_weights`` (as every engine
    had to before the split) is a ``WeightSink``; one without ``sleep`` is no ``Sleepable``."""
    from agentenv.engines import Sleepable, WeightSink, weight_sink
    from agentenv.engines.instant import InstantEngine

    class Mine(Engine):
        max_model_len, tokenizer, weight_version = 64, None, 0
        generate = abort = aclose = InstantEngine.generate

        async def load_weights(self, weights, version=None):
            return 1

    mine = Mine()
    assert isinstance(mine, WeightSink) and not isinstance(mine, Sleepable) and weight_sink(mine, "x") is mine
