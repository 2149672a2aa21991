"""The one async interface every inference engine implements.

Tokens in, tokens out: ``generate`` takes prompt token ids and returns the sampled token
ids, the logprob the sampler gave each one (of the distribution it sampled from, i.e. after
temperature/top-p), why it stopped, and how many prompt tokens the prefix cache served.
The weight version is stamped on every generation; ``load_weights`` installs new weights
and bumps it (used by the trainer).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal

if TYPE_CHECKING:
    import torch  # type hints only

FinishReason = Literal["stop", "length", "abort"]


#: How tokens are sampled where nothing says otherwise, stated here once: the whole
#: distribution at temperature 1, no nucleus (top_p) or top-k cut (0: off).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    #: The request ends right after sampling one of these (and only these: EOS too must be
    #: listed to stop on it).
    stop_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    weight_version: int
    stop_token_id: int | None = None
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: Per-token versions, when a weight update landed while this request was running.
    token_versions: list[int] | None = None

    @property
    def versions(self) -> list[int]:
        return self.token_versions if self.token_versions is not None else [self.weight_version] * len(self.token_ids)


#: The KV block size an engine that cannot say reports: vLLM's default on GPUs.
DEFAULT_PAGE_SIZE = 16


class Engine(abc.ABC):
    """An inference engine: tokens in, tokens out (``generate``, ``generate_turn``, ``abort``,
    ``release``). Use as an async context manager; ``aclose`` is idempotent.

    Besides its methods, the reactor and its program scheduler read the attributes below;
    each engine sets the ones it knows and inherits the documented default for the rest.
    What a trainer needs besides is two further interfaces an engine may also implement:
    :class:`WeightSink` (new weights in, a LoRA adapter) and :class:`Sleepable` (give the
    device to a colocated trainer); :func:`weight_sink` and :func:`sleepable` check them where
    a run needs them, with an error naming the engine."""

    #: Context window in tokens (prompt + generated).
    max_model_len: int
    #: The tokenizer matching the model (a transformers tokenizer).
    tokenizer: Any
    #: The KV cache's block size in tokens. The prefix cache serves whole blocks only (the
    #: reactor's reuse statistics count eligible tokens in them) and the program scheduler
    #: counts each program's KV in them. ``DEFAULT_PAGE_SIZE`` when the engine cannot say.
    page_size: int = DEFAULT_PAGE_SIZE
    #: KV cache capacity in tokens (the program scheduler keeps its working set within it);
    #: None when the engine cannot say.
    kv_capacity_tokens: int | None = None
    #: The (temperature, top_p, top_k) the engine samples every request with, whatever the
    #: request's ``SamplingParams`` say (the embedded engine fixes them when it starts); None
    #: when each request is sampled with its own.
    sampling: tuple[float, float, int] | None = None
    _closed: bool = False

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    def _room(self, prompt_ids: list[int]) -> int:
        """Tokens left to generate after the prompt (what ``generate`` checks first): an
        ``EngineError`` when the engine is closed, ``PromptTooLongError`` when none are left."""
        from ..errors import EngineError, PromptTooLongError

        if self._closed:
            raise EngineError("engine is closed")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens leaves no room (max_model_len={self.max_model_len})"
            )
        return room

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        """Sample a continuation. Cancelling the caller aborts the request in the engine.

        ``priority``: lower is more urgent (the program scheduler passes the program's rank);
        engines with a priority queue (vLLM's ``scheduling_policy="priority"``) honour it.

        Raises ``PromptTooLongError`` when the prompt leaves no room to generate, and
        ``EngineError`` when the engine fails or is closed.
        """

    async def generate_turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                            *, priority: int = 0) -> Generation:
        """One turn of ``program``, whose every turn's prompt extends the last one's (prompt
        plus sampled ids plus the tokens spliced after them) until ``release(program)``.
        Engines that can keep the program's KV between turns do (vLLM: a streaming-input
        request); by default it is ``generate``."""
        return await self.generate(prompt_ids, params, request_id, priority=priority)

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    def release(self, program: str) -> None:
        """The program (the request-id prefix before ``-<turn>``) ended or was paused: the
        engine need not keep routing it to where its KV was. Optional."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _has(cls: type, names: tuple[str, ...]) -> bool:
    return all(any(n in klass.__dict__ for klass in cls.__mro__) for n in names)


class WeightSink(abc.ABC):
    """An engine whose weights a trainer replaces as it trains: the bundled trainer, the TRL
    adapter and ``agentenv.testing.push_weights`` need it (:func:`weight_sink`). An engine
    class with a ``load_weights`` is one whether or not it names this class among its bases
    (engines written before the interface was split are)."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        return True if cls is WeightSink and _has(other, ("load_weights",)) else NotImplemented

    @abc.abstractmethod
    async def load_weights(
        self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """Install new weights (in-flight requests keep going); return the new version."""

    async def enable_lora(self, spec: Any) -> None:
        """Serve a trainable LoRA adapter (``agentenv.models.lora.LoraSpec``, also exported as
        ``agentenv.train.LoraSpec``) so that ``load_weights`` can move only the adapter. Engines
        that cannot say so."""
        from ..errors import ConfigError

        raise ConfigError(f"{type(self).__name__} does not support LoRA weight sync; train without --lora-rank")


class Sleepable(abc.ABC):
    """An engine that gives its device memory to a colocated trainer between steps
    (``--mode colocated``, :func:`sleepable`); as :class:`WeightSink`, any engine class with
    all of its members is one."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        members = ("sleep", "wake_up", "is_sleeping", "sleep_levels")
        return True if cls is Sleepable and _has(other, members) else NotImplemented

    #: The ``sleep`` levels the engine implements.
    sleep_levels: tuple[int, ...] = ()

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None:
        """Give the device memory the engine holds to someone else (a trainer on the same
        devices), as vLLM's sleep mode does. The requests in flight finish first; a request
        submitted while asleep waits until :meth:`wake_up`.

        ``level=1``: free the KV cache (the prefix cache with it) and move the weights to host
        memory; ``wake_up`` brings them back as they were. ``level=2``: free the KV cache and
        discard the weights; after ``wake_up`` the engine serves nothing until ``load_weights``
        has installed every parameter again. An engine that keeps its weights in host memory
        (on CPU) frees what it can, which is its KV cache, and says so in its docstring."""

    @abc.abstractmethod
    async def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed (the KV cache, empty, and at level 1 the weights)
        and serve the requests that waited. Awake already: nothing happens."""

    @abc.abstractmethod
    async def is_sleeping(self) -> bool:
        """Whether the engine sleeps (between :meth:`sleep` and :meth:`wake_up`)."""


def weight_sink(engine: Engine, needs: str) -> WeightSink:
    """``engine`` as a :class:`WeightSink`; a ``ConfigError`` naming it and ``needs`` (what
    wanted its weights replaced) when it takes none."""
    from ..errors import ConfigError

    if not isinstance(engine, WeightSink):
        raise ConfigError(f"{needs} replaces the engine's weights as it trains, and {type(engine).__name__} "
                          "takes none (an inference-only engine); use the embedded, vllm or openai engine")
    return engine


def sleepable(engine: Engine, level: int, needs: str) -> Sleepable:
    """``engine`` as a :class:`Sleepable` that sleeps at ``level``; a ``ConfigError`` naming it,
    the levels it has and what to use instead when it does not."""
    from ..errors import ConfigError

    levels = engine.sleep_levels if isinstance(engine, Sleepable) else ()
    if level not in levels:
        can = f"sleeps at levels {levels}" if levels else "cannot sleep"
        raise ConfigError(f"{needs} needs an engine that sleeps at level {level}; "
                          f"{type(engine).__name__} {can} (use --mode sync or async)")
    return engine  # type: ignore[return-value]
