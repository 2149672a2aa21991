"""The embedded engine: transformers' continuous batching behind the Engine interface, on the
CPU or a CUDA GPU (``device``, auto by default: a GPU where torch sees one).

transformers (>= 5.16) ships a continuous-batching manager with a paged KV cache and
block-level prefix sharing: a background thread runs the model over whatever requests are in
flight, and a new request whose prompt starts with blocks already in the cache (the same
program's previous turn, or a shared system prompt) reuses them instead of prefilling.

What this wrapper adds:

* real cached-token counts: the manager does not report them, so we record the length of
  each request's prefix match at the one place it is computed (``search_prefix_match``);
* sampled-token logprobs of the distribution actually sampled from (after temperature and
  top-p: the manager applies the warpers before its softmax), one per token;
* finish reasons (a stop token vs. the token budget), cancellation -> ``cancel_request``;
* weight versions and in-place weight updates that pause the loop without dropping requests;
* a sleep mode (``sleep`` / ``wake_up``, :mod:`~agentenv.engines.embedded_sleep`): the KV cache
  freed and the weights offloaded (level 1) or released (level 2) while a trainer uses the device.

Sampling settings (temperature, top-p, top-k) are fixed per engine: the manager builds its
logits warpers once from the generation config. A request asking for other values is a
configuration error rather than a silent difference.

This needs an asyncio event loop (results come back through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import anyio
import torch

from ..devices import resolve_device
from ..errors import ConfigError, EngineError, ModelNotFoundError
from ..models import quiet_loading
from .base import (DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, Engine, Generation, SamplingParams, Sleepable,
                   WeightSink)
from .embedded_sleep import SLEEP_LEVELS, Slumber, fall_asleep, kv_cache_bytes, wake

log = logging.getLogger(__name__)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        import difflib

        from ..models import BUNDLED

        close = difflib.get_close_matches(str(path), list(BUNDLED), n=1, cutoff=0.6)
        hint = f". Did you mean {close[0]!r} (a bundled model)?" if close else \
            f" (the bundled models: {', '.join(BUNDLED)})" if os.sep not in str(path) else ""
        raise ModelNotFoundError(f"model directory not found: {p}{hint}")
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    return p


#: The transformers releases whose continuous batching (``page_size``, ``pause``, the output
#: router, the prefix-match search) this engine drives; pyproject.toml pins the same range.
TRANSFORMERS_RANGE = ((5, 19), (5, 20))


def require_transformers(version: str | None = None) -> None:
    """A clear error when the installed transformers is outside :data:`TRANSFORMERS_RANGE`
    (its continuous-batching internals move between releases: an older one fails deep inside
    with an unexpected keyword)."""
    import transformers

    found = version or transformers.__version__
    major_minor = tuple(int(x) for x in found.split(".")[:2])
    lo, hi = TRANSFORMERS_RANGE
    if not lo <= major_minor < hi:
        want = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
        raise ConfigError(f"the embedded engine needs transformers{want}, found {found}: "
                          f"pip install 'transformers{want}'")


class EmbeddedEngine(Sleepable, WeightSink, Engine):
    sleep_levels = SLEEP_LEVELS

    def __init__(
        self,
        model: str | Path,
        *,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        top_k: int = DEFAULT_TOP_K,
        max_model_len: int | None = None,
        page_size: int = 16,
        kv_cache_tokens: int = 65536,
        max_batch_tokens: int = 512,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        seed: int | None = None,
        device: str = "auto",
    ) -> None:
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

        require_transformers()
        path = check_model_dir(model)
        if seed is not None:
            torch.manual_seed(seed)
        self.model_path = path
        self.tokenizer = load_tokenizer(path)
        with quiet_loading():
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                              attn_implementation=attn_implementation)
        #: Where the model generates (``agentenv.devices``: auto is a CUDA GPU where torch sees one).
        self.device = resolve_device(device)
        self.model.to(self.device).eval()
        cfg = self.model.config
        self.max_model_len = int(max_model_len or getattr(cfg, "max_position_embeddings", 2048))
        self.sampling = (float(temperature), float(top_p), int(top_k))
        eos = self.tokenizer.eos_token_id
        gen_cfg = GenerationConfig(
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=top_p if top_p < 1.0 else None,
            top_k=top_k if top_k > 0 else None,
            max_new_tokens=256,
            eos_token_id=eos if eos is not None else -1,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        cb_cfg = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=max(8, kv_cache_tokens // page_size),
            max_batch_tokens=max_batch_tokens,
            return_logprobs=True,
            allow_block_sharing=True,
            use_cuda_graph=False,
        )
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
        self._mgr = self.model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
        # Create the batch processor here (the manager reuses it) so the prefix-match hook is
        # in place before the first request.
        self._mgr.batch_processor = self._mgr._create_batch_processor()
        self._cached: dict[str, int] = {}
        # The engine's own id for each request: the caller's id plus a sequence number, so a
        # request id reused while its cancelled namesake is still being removed (a resumed
        # program asking for the same turn again) is a new request, not a victim of that cancel.
        self._internal: dict[str, str] = {}
        self._seq = itertools.count()
        self._hook_prefix_match(self._mgr.batch_processor.cache)
        self._mgr.start()
        self._version = 0
        self._closed = False
        self._weights_lock = threading.Lock()
        self.page_size = page_size
        self.kv_capacity_tokens = cb_cfg.num_blocks * page_size
        self._slumber: Slumber | None = None  # while asleep
        self._woken: anyio.Event | None = None  # set by wake_up; requests submitted asleep wait on it
        self._unloaded: set[int] = set()  # ids of parameters a level-2 sleep left without weights

    # -- prefix-cache accounting -------------------------------------------------------------
    def _hook_prefix_match(self, cache: Any) -> None:
        original = cache.search_prefix_match
        cached = self._cached

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            n = original(request_id, prompt_ids)
            cached[request_id] = cached.get(request_id, 0) + n
            return n

        cache.search_prefix_match = search_prefix_match

    # -- Engine interface --------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    def _check_params(self, params: SamplingParams) -> None:
        want = (float(params.temperature), float(params.top_p), int(params.top_k))
        if want != self.sampling:
            raise ConfigError(
                f"the embedded engine samples with (temperature, top_p, top_k)={self.sampling} for every "
                f"request; this one asked for {want}. Create the engine with those settings."
            )

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        if self._woken is not None:  # asleep: wait for wake_up (or aclose)
            await self._woken.wait()
        room = self._room(prompt_ids)
        if not self._mgr.is_running():
            raise EngineError(f"the generation loop is not running: {self._mgr.background_thread_status.fatal_error}")
        self._check_params(params)
        max_tokens = min(params.max_tokens, room)
        version = self._version
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def on_result(out: Any) -> None:
            if out.is_finished() and not fut.done():
                fut.set_result(out)

        start = time.perf_counter()
        rid = self._internal[request_id] = f"{request_id}#{next(self._seq)}"
        self._mgr.register_result_handler(rid, on_result)
        stop_ids = list(dict.fromkeys(params.stop_token_ids)) or [-1]
        try:
            added = self._mgr.add_request(
                list(prompt_ids), request_id=rid, max_new_tokens=max_tokens, eos_token_id=stop_ids
            )
            if added is None:
                raise EngineError("the engine refused the request (it is stopping or failed)")
            out = await fut
        except BaseException:
            self._mgr.cancel_request(rid)
            with self._mgr.output_router._lock:
                self._mgr.output_router.result_handlers.pop(rid, None)
            self._cached.pop(rid, None)
            raise
        finally:
            if self._internal.get(request_id) == rid:
                del self._internal[request_id]
        cached = self._cached.pop(rid, 0)
        if out.error is not None:
            raise EngineError(f"generation failed: {out.error}")
        tokens = list(out.generated_tokens)
        logprobs = [float(x) for x in out.logprobs][: len(tokens)]
        if len(logprobs) != len(tokens):
            raise EngineError(f"engine returned {len(tokens)} tokens but {len(logprobs)} logprobs")
        stop_tok = tokens[-1] if tokens and tokens[-1] in params.stop_token_ids else None
        return Generation(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason="stop" if stop_tok is not None else "length",
            prompt_tokens=len(prompt_ids),
            cached_tokens=min(cached, len(prompt_ids)),
            weight_version=version,
            stop_token_id=stop_tok,
            latency_s=time.perf_counter() - start,
        )

    async def abort(self, request_id: str) -> None:
        rid = self._internal.get(request_id)
        if rid is not None:
            self._mgr.cancel_request(rid)

    def _load_weights_sync(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> int:
        params = self.model.state_dict(keep_vars=True)  # includes tied names (lm_head.weight)
        if self._slumber is not None and self._slumber.level == 2:
            raise EngineError("the engine sleeps at level 2 (no weights to load into): wake_up first")
        # Asleep, no generation thread runs: nothing to pause.
        paused = self._mgr.pause() if self._slumber is None else contextlib.nullcontext()
        with self._weights_lock, paused, torch.no_grad():
            for name, tensor in weights:
                wrapped = name.removesuffix(".weight") + ".base_layer.weight"
                if name not in params and wrapped in params:  # a base weight under a LoRA layer
                    name = wrapped
                if name not in params:
                    raise ConfigError(f"unknown parameter {name!r} in weight update")
                params[name].copy_(tensor.to(params[name].dtype))
                self._unloaded.discard(id(params[name]))
            # KV computed by the old weights must not serve new requests.
            bp = self._mgr.batch_processor
            if bp is not None:
                bp.cache.evict_cached_blocks()
            self._version = self._version + 1 if version is None else int(version)
        return self._version

    def _enable_lora_sync(self, spec: Any) -> None:
        from ..models.lora import inject_lora

        with self._weights_lock, self._mgr.pause():
            inject_lora(self.model, spec)  # B = 0: outputs unchanged until the first sync
            self.model.eval()

    async def enable_lora(self, spec: Any) -> None:
        """Inject a LoRA adapter (``agentenv.models.lora.LoraSpec``, also exported as
        ``agentenv.train.LoraSpec``) into the served model; later ``load_weights`` calls may
        then carry only the adapter's tensors."""
        await anyio.to_thread.run_sync(self._enable_lora_sync, spec)

    async def load_weights(self, weights, version: int | None = None) -> int:
        items = list(weights.items()) if isinstance(weights, dict) else list(weights)
        version = await anyio.to_thread.run_sync(self._load_weights_sync, items, version)
        if self._slumber is None and not self._unloaded:
            self._let_in()  # awake from a level-2 sleep, and every parameter has weights again
        return version

    # -- sleep mode --------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (the prefix cache's blocks with it) and, at ``level=1``, move the
        weights to host memory, or at ``level=2`` release them (see :meth:`Engine.sleep`). On
        CPU the weights are in host memory already: level 1 frees the KV cache only. Requests
        in flight finish first; later ones wait for :meth:`wake_up`. Asleep already: nothing
        happens."""
        if level not in SLEEP_LEVELS:
            raise ConfigError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
        if self._slumber is not None or self._closed:
            return
        waiting = self._woken is not None  # requests wait already (for a level-2 sleep's weights)
        if not waiting:
            self._woken = anyio.Event()
        try:
            self._slumber = await anyio.to_thread.run_sync(self._sleep_sync, level)
        except BaseException:
            if not waiting:
                self._let_in()
            raise

    def _sleep_sync(self, level: int) -> Slumber:
        with self._weights_lock:
            return fall_asleep(self._mgr, self.model, level)

    async def wake_up(self) -> None:
        """Allocate an empty KV cache, bring the level-1 weights back to their device, start the
        generation thread and let the waiting requests in. After a level-2 sleep the weights
        are allocated, uninitialised, and requests keep waiting until ``load_weights`` has
        installed every parameter."""
        if self._slumber is None:
            return
        with anyio.CancelScope(shield=True):  # half awake is no state to leave the engine in
            await anyio.to_thread.run_sync(self._wake_sync)
        if not self._unloaded:
            self._let_in()

    def _let_in(self) -> None:
        """Serve the requests that waited for the engine to wake (and, after a level-2 sleep,
        for its weights)."""
        woken, self._woken = self._woken, None
        if woken is not None:
            woken.set()

    def _wake_sync(self) -> None:
        with self._weights_lock:
            assert self._slumber is not None
            self._unloaded = wake(self._mgr, self.model, self._slumber)
            self._hook_prefix_match(self._mgr.batch_processor.cache)
            self._mgr.start()
            self._slumber = None

    async def is_sleeping(self) -> bool:
        return self._slumber is not None

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache's tensors hold now (0 while asleep)."""
        return kv_cache_bytes(self._mgr)

    def close(self) -> None:
        """Stop the generation thread (blocking). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._slumber is None:  # asleep, the thread is stopped already
            self._mgr.stop(block=True, timeout=30)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)
        if self._woken is not None:
            self._woken.set()  # requests waiting for a wake-up find the engine closed
