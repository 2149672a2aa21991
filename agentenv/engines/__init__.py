"""Inference engines behind one interface (``Engine``), and what a trainer needs of one besides:
``WeightSink`` (new weights in) and ``Sleepable`` (the device given to a colocated trainer)."""

from .base import (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Engine, FinishReason, Generation, SamplingParams, Sleepable,
                   WeightSink, sleepable, weight_sink)
from .spec import EngineSpec

__all__ = ["Engine", "EngineSpec", "FinishReason", "Generation", "SamplingParams", "Sleepable", "WeightSink",
           "create_engine", "open_engine", "sleepable", "weight_sink"]


def create_engine(kind: str, model: str, **kwargs) -> Engine:
    from ..errors import ConfigError

    if kind == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model, **kwargs)
    raise ConfigError(f"unknown engine {kind!r} for create_engine; use EmbeddedEngine, "
                      "await VLLMEngine.create(...) or await OpenAIEngine.create(...)")


async def open_engine(kind: str, model: str, *, temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P,
                      seed: int = 0,
                      base_urls: list[str] | None = None, **kwargs) -> Engine:
    """Start an engine by name: ``EngineSpec(kind, model, kwargs, ...).open()`` (see
    :class:`~agentenv.engines.spec.EngineSpec`). Extra keyword arguments go to the engine."""
    from .spec import EngineSpec

    sampling = {"temperature": temperature, "top_p": top_p}
    return await EngineSpec.sampling_as(sampling, kind, model, kwargs=kwargs, base_urls=base_urls, seed=seed).open()
