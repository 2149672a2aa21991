"""Inference engines behind one interface (``Engine``)."""

from .base import Engine, FinishReason, Generation, SamplingParams

__all__ = ["Engine", "FinishReason", "Generation", "SamplingParams", "create_engine"]


def create_engine(kind: str, model: str, **kwargs) -> Engine:
    from ..errors import ConfigError

    if kind == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model, **kwargs)
    raise ConfigError(f"unknown engine {kind!r} for create_engine; use EmbeddedEngine, "
                      "await VLLMEngine.create(...) or await OpenAIEngine.create(...)")
