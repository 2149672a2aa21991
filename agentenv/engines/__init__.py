"""Inference engines behind one interface (``Engine``)."""

from .base import Engine, FinishReason, Generation, SamplingParams

__all__ = ["Engine", "FinishReason", "Generation", "SamplingParams", "create_engine", "open_engine"]


def create_engine(kind: str, model: str, **kwargs) -> Engine:
    from ..errors import ConfigError

    if kind == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model, **kwargs)
    raise ConfigError(f"unknown engine {kind!r} for create_engine; use EmbeddedEngine, "
                      "await VLLMEngine.create(...) or await OpenAIEngine.create(...)")


async def open_engine(kind: str, model: str, *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                      base_urls: list[str] | None = None, **kwargs) -> Engine:
    """Start an engine by name (what the CLI's ``--engine`` and the trainer use).

    ``embedded``: this process, CPU; ``vllm``: in-process AsyncLLM; ``openai``: HTTP servers at
    ``base_urls`` (``model`` is then the local directory holding the matching tokenizer).
    Extra keyword arguments go to the engine (``--engine-arg``)."""
    import anyio

    from ..errors import ConfigError

    try:
        if kind == "vllm":
            from .vllm import VLLMEngine

            return await VLLMEngine.create(str(model), seed=seed, **kwargs)
        if kind == "openai":
            from .openai import OpenAIEngine

            if not base_urls:
                raise ConfigError("--engine openai needs --base-url http://HOST:PORT")
            return await OpenAIEngine.create(base_urls, str(model), **kwargs)
        if kind != "embedded":
            raise ConfigError(f"unknown engine {kind!r}: embedded, vllm or openai")
        return await anyio.to_thread.run_sync(
            lambda: create_engine(kind, str(model), temperature=temperature, top_p=top_p, seed=seed, **kwargs))
    except TypeError as exc:  # a keyword the engine does not take
        raise ConfigError(f"bad --engine-arg for the {kind} engine: {exc}") from exc
