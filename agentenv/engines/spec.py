"""Which engine to open: one typed value (:class:`EngineSpec`) that a rollout run, its Ray
rollout workers and the engine actors pass around, opened in one place (:meth:`EngineSpec.open`).

    spec = EngineSpec("vllm", "/models/qwen", {"max_model_len": 4096}, seed=3)
    async with await spec.open() as engine:
        ...
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .base import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P

if TYPE_CHECKING:
    from .base import Engine

KINDS = ("embedded", "vllm", "openai")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine by name, the model it serves and how it samples.

    ``embedded``: this process, CPU or a GPU (``device``; sampling settings are its defaults); ``vllm``: in-process
    AsyncLLM (``seed``; requests carry their sampling settings); ``openai``: a client of the
    servers at ``base_urls`` (``model`` is then the local directory holding the matching
    tokenizer). ``model`` may name a bundled model (``tiny-retool``, ``tiny-hermes``), as
    ``--model`` does. ``kwargs`` go to the engine's constructor (the CLI's ``--engine-arg``)."""

    kind: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    base_urls: list[str] | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    seed: int = 0

    @classmethod
    def sampling_as(cls, sampling: Any, kind: str, model: Any, *, kwargs: Mapping[str, Any] | None = None,
                    base_urls: Sequence[str] | None = None, seed: int = 0) -> "EngineSpec":
        """The engine ``kind`` serving ``model``, sampling as ``sampling`` says: a run's config
        (``RolloutConfig``, a ``TrainConfig``'s ``rollout``) or a mapping, read for ``temperature``, ``top_p`` and
        ``top_k``; one it lacks keeps the default (a training run has no ``top_p``: it samples the
        whole distribution it learns from). The one place a run's sampling settings become an
        engine's."""
        def get(name: str, default: Any) -> Any:
            found = sampling.get(name) if isinstance(sampling, Mapping) else getattr(sampling, name, None)
            return default if found is None else found

        return cls(kind, str(model), dict(kwargs or {}), list(base_urls) if base_urls else None,
                   temperature=get("temperature", DEFAULT_TEMPERATURE), top_p=get("top_p", DEFAULT_TOP_P),
                   top_k=get("top_k", DEFAULT_TOP_K), seed=seed)

    def replica(self, index: int) -> "EngineSpec":
        """Replica ``index`` of a set of engines: the same engine, sampling with seed ``seed + index``."""
        return replace(self, seed=self.seed + index)

    async def open(self) -> "Engine":
        """Start the engine; a setting it does not take is a :class:`~agentenv.errors.ConfigError`."""
        import anyio

        from ..errors import ConfigError
        from ..models import model_dir

        model = str(model_dir(self.model))
        try:
            if self.kind == "vllm":
                from .vllm import VLLMEngine

                return await VLLMEngine.create(model, seed=self.seed, **self.kwargs)
            if self.kind == "openai":
                from .openai import OpenAIEngine

                if not self.base_urls:
                    raise ConfigError("--engine openai needs --base-url http://HOST:PORT")
                return await OpenAIEngine.create(list(self.base_urls), model, **self.kwargs)
            if self.kind != "embedded":
                raise ConfigError(f"unknown engine {self.kind!r}: {', '.join(KINDS[:-1])} or {KINDS[-1]}")
            from .embedded import EmbeddedEngine

            sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
            return await anyio.to_thread.run_sync(lambda: EmbeddedEngine(model, **{**sampling, **self.kwargs}))
        except TypeError as exc:  # a keyword the engine does not take
            takes = f"; {engine_keys(self.kind)}" if "unexpected keyword" in str(exc) else ""
            raise ConfigError(f"bad --engine-arg for the {self.kind} engine: {exc}{takes}") from exc


def engine_keys(kind: str) -> str:
    """What ``--engine-arg`` takes for the engine ``kind``, in words: its constructor's
    keywords (those the run's own flags do not set), or where vLLM's are listed."""
    import inspect

    if kind == "vllm":
        return ("the vllm engine takes max_restarts, sessions, nice, weight_sync and any field of vLLM's "
                "AsyncEngineArgs (`vllm serve --help` lists them as flags: --max-num-seqs is max_num_seqs)")
    if kind == "openai":
        from .openai import OpenAIEngine as cls
    else:
        from .embedded import EmbeddedEngine as cls  # type: ignore[assignment]
    own = {"self", "model", "base_urls", "tokenizer", "temperature", "top_p", "top_k", "seed"}  # set by flags
    keys = [n for n, p in inspect.signature(cls.__init__).parameters.items()
            if n not in own and p.kind is p.KEYWORD_ONLY]
    return f"the {kind} engine takes {', '.join(keys)}"


__all__ = ["EngineSpec", "KINDS"]
