"""Inference engines behind one interface (``Engine``)."""

from .base import Engine, FinishReason, Generation, SamplingParams
from .spec import EngineSpec

__all__ = ["Engine", "EngineSpec", "FinishReason", "Generation", "SamplingParams", "create_engine", "open_engine"]


def create_engine(kind: str, model: str, **kwargs) -> Engine:
    from ..errors import ConfigError

    if kind == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model, **kwargs)
    raise ConfigError(f"unknown engine {kind!r} for create_engine; use EmbeddedEngine, "
                      "await VLLMEngine.create(...) or await OpenAIEngine.create(...)")


async def open_engine(kind: str, model: str, *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                      base_urls: list[str] | None = None, **kwargs) -> Engine:
    """Start an engine by name: ``EngineSpec(kind, model, kwargs, ...).open()`` (see
    :class:`~agentenv.engines.spec.EngineSpec`). Extra keyword arguments go to the engine."""
    from .spec import EngineSpec

    return await EngineSpec(kind, str(model), kwargs, base_urls, temperature=temperature, top_p=top_p,
                            seed=seed).open()
