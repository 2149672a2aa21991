"""``EngineSpec`` opens the engine it names, with a bundled model's name as ``--model`` takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.engines.base import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, SamplingParams
from agentenv.engines.spec import EngineSpec
from agentenv.errors import ConfigError
from agentenv.models import BUNDLED

pytestmark = pytest.mark.anyio


async def test_a_bundled_models_name_opens_that_model_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder named tiny-hermes here
    engine = await EngineSpec("embedded", "tiny-hermes").open()
    try:
        assert Path(engine.model_path).resolve() == BUNDLED["tiny-hermes"].resolve()
        assert "<tool_call>" in engine.tokenizer.get_vocab()
    finally:
        await engine.aclose()


async def test_a_keyword_the_engine_does_not_take_names_the_ones_it_does():
    with pytest.raises(ConfigError, match="bad --engine-arg for the embedded engine.*takes"):
        await EngineSpec("embedded", "tiny-retool", {"no_such_setting": 1}).open()


def test_a_runs_sampling_settings_become_the_engines_in_one_place():
    from agentenv.config import RolloutConfig
    from agentenv.train.config import TrainConfig

    rollout = RolloutConfig(temperature=0.7, top_p=0.9, top_k=5)
    spec = EngineSpec.sampling_as(rollout, "embedded", "tiny-retool", kwargs={"page_size": 32}, seed=4)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.kwargs) == (0.7, 0.9, 5, 4, {"page_size": 32})
    # Training has no top_p or top_k: the engine samples the whole distribution it learns from.
    spec = EngineSpec.sampling_as(TrainConfig(temperature=0.5).rollout, "embedded", "tiny-retool")
    assert (spec.temperature, spec.top_p, spec.top_k) == (0.5, DEFAULT_TOP_P, DEFAULT_TOP_K)
    spec = EngineSpec.sampling_as({"temperature": 0.0}, "vllm", "m", base_urls=("http://a:1",))
    assert (spec.temperature, spec.top_p, spec.base_urls) == (0.0, DEFAULT_TOP_P, ["http://a:1"])


def test_each_sampling_default_is_the_one_engines_base_states():
    """Every place that takes a sampling setting defaults to ``engines.base``'s, not a literal
    of its own."""
    import inspect

    from agentenv.config import RolloutConfig
    from agentenv.engines import open_engine
    from agentenv.engines.actors import RayEngine
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.train.config import TrainConfig

    defaults = {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "top_k": DEFAULT_TOP_K}
    for made in (RolloutConfig(), EngineSpec("embedded", "m"), SamplingParams(max_tokens=1)):
        assert {k: getattr(made, k) for k in defaults} == defaults, type(made).__name__
    assert TrainConfig().rollout.temperature == DEFAULT_TEMPERATURE
    for function in (EmbeddedEngine.__init__, open_engine, RayEngine.start):
        params = inspect.signature(function).parameters
        assert {k: params[k].default for k in defaults if k in params} == {k: v for k, v in defaults.items()
                                                                             if k in params}, function.__qualname__
