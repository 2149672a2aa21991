"""Engines as Ray actors: ``EngineActor`` serves one engine (embedded, vLLM on its GPU, or a
client of OpenAI-compatible servers) in its own process; ``RayEngine`` is the ``Engine`` every
rollout worker (or the trainer) uses to reach a set of them.

    engine = await RayEngine.start("vllm", model, replicas=4, options={"num_gpus": 1})
    async with engine, Reactor(engine, env, sandbox, config) as reactor:
        ...

* **Placement by KV room.** Requests are routed by ``routing.Router``: a program stays on the
  replica that holds its prefix; a new or restored (paused, then released) program goes to the
  replica with the most free KV. Each actor counts the tokens held by *every* client's
  programs and reports it with each reply; before placing a new program a client asks every
  actor (at most every ``refresh_s`` seconds). So rollout workers sharing the engines place
  new and restored programs by the global picture, and memory stays balanced across replicas.
* **Shares.** ``kv_capacity_tokens`` is the replicas' total times ``share``: with N rollout
  workers as clients, each worker's program scheduler keeps its working set within 1/N of it.
* **Faults.** Engine actors are started with ``max_restarts``: one that dies is restarted by
  Ray. A request in flight on it is sent again (the whole turn, re-prefilled) to another
  replica, nothing of it having been recorded, and new programs avoid the replica until it is
  back. A restarted actor has its starting weights: every request carries the client's weight
  version, an actor behind it refuses the request, and the client installs the weights it has
  pushed so far (and the LoRA adapter) on it first, so no turn is sampled with weights other
  than the ones it is stamped with.
* **Weights** go to every actor through the object store (one ``ray.put``).
* Cancelling a request (``generate``'s caller) cancels the actor's call, which aborts the
  request in its engine.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import AgentEnvError, ConfigError, EngineError, PromptTooLongError
from ..raycluster import actor_options, died_errors, ray_module
from .base import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Engine, Generation, SamplingParams, WeightSink
from .routing import Router
from .spec import EngineSpec

if TYPE_CHECKING:
    import torch  # type hints only

_ERRORS = {"PromptTooLongError": PromptTooLongError, "ConfigError": ConfigError}


class EngineActor:
    """The Ray actor (wrapped by ``ray.remote`` in :meth:`RayEngine.start`). The engine is opened
    by the first call, so an actor Ray restarts serves again with no one starting it."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.engine: Engine | None = None
        self._opening: asyncio.Lock | None = None
        self._tokens: OrderedDict[str, int] = OrderedDict()  # program -> its last known length
        self._held = 0
        self.served = 0  # requests answered by this incarnation

    async def _engine(self) -> Engine:
        if self.engine is None:
            self._opening = self._opening or asyncio.Lock()
            async with self._opening:
                if self.engine is None:
                    self.engine = await self.spec.open()
        return self.engine

    async def info(self) -> dict[str, Any]:
        engine = await self._engine()
        return {"pid": os.getpid(), "max_model_len": engine.max_model_len,
                "kv_capacity_tokens": engine.kv_capacity_tokens, "weight_version": engine.weight_version,
                "page_size": engine.page_size, "sampling": engine.sampling, "held": self._held,
                "served": self.served}

    def _hold(self, program: str, tokens: int) -> None:
        self._held += tokens - self._tokens.pop(program, 0)
        self._tokens[program] = tokens
        if len(self._tokens) > 100_000:  # a client that never releases: forget the oldest
            self._held -= self._tokens.popitem(last=False)[1]

    async def generate(self, prompt_ids: list[int], params: dict[str, Any], request_id: str, priority: int,
                       min_version: int) -> dict[str, Any]:
        """A :class:`Generation` as a dict, with ``held`` (this actor's KV held by every
        client's programs); or ``{"error": ...}`` (the client raises it, or resyncs when stale)."""
        engine = await self._engine()
        if engine.weight_version < min_version:
            return {"error": "stale", "weight_version": engine.weight_version}
        sp = SamplingParams(**{**params, "stop_token_ids": tuple(params["stop_token_ids"])})
        self._hold(request_id.rsplit("-", 1)[0],
                   len(prompt_ids) + min(sp.max_tokens, max(0, engine.max_model_len - len(prompt_ids))))
        try:
            g = await engine.generate(prompt_ids, sp, request_id, priority=priority)
        except AgentEnvError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        self.served += 1
        return {**asdict(g), "held": self._held, "pid": os.getpid()}

    async def abort(self, request_id: str) -> None:
        await (await self._engine()).abort(request_id)

    async def release(self, program: str) -> None:
        self._held -= self._tokens.pop(program, 0)
        if self.engine is not None:
            self.engine.release(program)

    async def load(self) -> int:
        return self._held

    async def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        return await (await self._engine()).load_weights(weights, version=version)

    async def enable_lora(self, spec: Any) -> None:
        await (await self._engine()).enable_lora(spec)

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.aclose()


class RayEngine(WeightSink, Engine):
    """An :class:`Engine` over engine actors (see the module doc). :meth:`start` starts them and
    the engine owns them (``aclose`` stops them); :meth:`connect` is a client of actors
    someone else owns (each rollout worker's view of the driver's engines)."""

    def __init__(self, actors: list[Any], infos: list[dict[str, Any]], model: str, *, share: float = 1.0,
                 reconnect_s: float = 300.0, refresh_s: float = 1.0, owned: bool = False) -> None:
        from .embedded import load_tokenizer

        if not actors or len(actors) != len(infos):
            raise ConfigError("RayEngine needs at least one engine actor and its info")
        self.ray = ray_module()
        self.actors = list(actors)
        self.tokenizer = load_tokenizer(model)
        self.max_model_len = min(int(i["max_model_len"]) for i in infos)
        caps = [i["kv_capacity_tokens"] for i in infos]
        known = all(c is not None for c in caps)
        self.router = Router(len(actors), [int(c) for c in caps] if known else None)
        for idx, info in enumerate(infos):
            self.router.report(idx, int(info.get("held", 0)))
        self.kv_capacity_tokens = int(sum(caps) * share) if known else None
        self.page_size = max(int(i["page_size"]) for i in infos)  # the coarsest replica's blocks
        if infos[0]["sampling"] is not None:
            self.sampling = tuple(infos[0]["sampling"])  # type: ignore[assignment]
        self.pids = [i["pid"] for i in infos]
        self.reconnect_s = reconnect_s
        self.refresh_s = refresh_s
        self._refreshed = time.monotonic()  # the infos just read carry every actor's load
        self._refreshing = False
        self.failures = 0  # calls that found their actor dead or restarting
        self.resyncs = 0  # restarted actors given the weights again
        self._owned = owned
        self._version = max(int(i["weight_version"]) for i in infos)
        self._pushed: dict[str, torch.Tensor] = {}  # every weight update so far (for a restarted actor)
        self._lora: Any = None
        self._update_lock = asyncio.Lock()
        self._resync_locks = [asyncio.Lock() for _ in actors]
        self._died = died_errors()
        self._closed = False

    @classmethod
    async def start(cls, kind: str, model: str, *, replicas: int = 2, options: dict[str, Any] | None = None,
                    temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P, seed: int = 0,
                    base_urls: list[str] | None = None,
                    max_restarts: int = 3, **engine_kwargs: Any) -> "RayEngine":
        """Start ``replicas`` engine actors of ``kind`` (each ``options``: e.g. ``{"num_gpus": 1}``
        for vLLM) on the connected Ray cluster; replica ``i`` samples with seed ``seed + i``."""
        spec = EngineSpec.sampling_as({"temperature": temperature, "top_p": top_p}, kind, model, kwargs=engine_kwargs,
                                      base_urls=base_urls, seed=seed)
        return await cls.launch(spec, replicas=replicas, options=options, max_restarts=max_restarts)

    @classmethod
    async def launch(cls, spec: EngineSpec, *, replicas: int = 2, options: dict[str, Any] | None = None,
                     max_restarts: int = 3) -> "RayEngine":
        """:meth:`start` for an :class:`~agentenv.engines.spec.EngineSpec`."""
        actors = start_actors(spec, replicas=replicas, options=options, max_restarts=max_restarts)
        try:
            return await cls.connect(actors, spec.model, owned=True)
        except BaseException:
            for a in actors:
                ray_module().kill(a, no_restart=True)
            raise

    @classmethod
    async def connect(cls, actors: list[Any], model: str, *, share: float = 1.0, owned: bool = False,
                      reconnect_s: float = 300.0, refresh_s: float = 1.0) -> "RayEngine":
        try:
            infos = await asyncio.gather(*(a.info.remote() for a in actors))
        except Exception as exc:  # noqa: BLE001 - the engine could not open in its actor
            raise EngineError(f"an engine actor failed to start: {exc}") from exc
        return cls(actors, list(infos), model, share=share, owned=owned, reconnect_s=reconnect_s, refresh_s=refresh_s)

    @property
    def weight_version(self) -> int:
        return self._version

    async def _call(self, ref: Any) -> Any:
        try:
            return await ref
        except asyncio.CancelledError:
            self.ray.cancel(ref)  # the actor's coroutine is cancelled: its engine aborts the request
            raise

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        room = self._room(prompt_ids)
        async with self._update_lock:  # not while new weights are being installed
            version = self._version
        need = version if self._pushed else 0
        if self.router.where(Router.program_of(request_id)) is None:
            await self._refresh()
        deadline, resyncs = time.monotonic() + self.reconnect_s, 0
        while True:
            idx = self.router.route(request_id, len(prompt_ids) + min(params.max_tokens, room))
            self.router.inflight[idx] += 1
            start = time.perf_counter()
            try:
                reply = await self._call(self.actors[idx].generate.remote(
                    list(prompt_ids), asdict(params), request_id, priority, need))
                if reply.get("error") == "stale":  # a restarted actor: give it the weights, then ask again
                    resyncs += 1
                    if resyncs > 3:
                        raise EngineError(f"engine actor {idx} still serves weight version {reply['weight_version']} "
                                          f"after installing version {need} on it {resyncs - 1} times")
                    await self._resync(idx, need)
                    continue
            except self._died as exc:
                self.failures += 1
                self.router.down(idx)
                if time.monotonic() > deadline:
                    raise EngineError(f"engine actor {idx} is gone and none took its request in "
                                      f"{self.reconnect_s:.0f} s: {exc}") from exc
                await asyncio.sleep(0.2)
                continue  # the turn again, routed afresh (nothing of it was recorded)
            except Exception as exc:  # noqa: BLE001 - a failure inside the actor's method
                raise EngineError(f"engine actor {idx}: {type(exc).__name__}: {exc}") from exc
            finally:
                self.router.inflight[idx] -= 1
            error = reply.get("error")
            if error is not None:
                raise _ERRORS.get(error, EngineError)(f"engine actor {idx}: {reply['message']}")
            self.router.report(idx, int(reply.pop("held")))
            reply.pop("pid")
            g = Generation(**reply)
            g.latency_s = time.perf_counter() - start
            g.extra = {**g.extra, "replica": idx}
            return g

    async def _refresh(self) -> None:
        """Every actor's load (all clients' programs), if the last look is ``refresh_s`` old and
        no other request is already looking; a dead actor is left for ``generate`` to find."""
        if self._refreshing or time.monotonic() - self._refreshed < self.refresh_s:
            return
        self._refreshing = True
        try:
            loads = await asyncio.gather(*(self._call(a.load.remote()) for a in self.actors), return_exceptions=True)
        finally:
            self._refreshing = False
        self._refreshed = time.monotonic()
        for idx, held in enumerate(loads):
            if isinstance(held, int):
                self.router.report(idx, held)

    async def _resync(self, idx: int, version: int) -> None:
        async with self._resync_locks[idx]:  # one resync, however many requests found it stale
            actor = self.actors[idx]
            if (await self._call(actor.info.remote()))["weight_version"] >= version:
                return
            if self._lora is not None:
                await self._call(actor.enable_lora.remote(self._lora))
            await self._call(actor.load_weights.remote(self.ray.put(self._pushed), self._version))
            self.resyncs += 1

    async def abort(self, request_id: str) -> None:
        """Cancelling ``generate``'s caller cancels the actor's call, which aborts the request."""

    def release(self, program: str) -> None:
        idx = self.router.where(program)
        self.router.release(program)
        if idx is not None and not self._closed:
            self.actors[idx].release.remote(program)  # no reply needed

    async def enable_lora(self, spec: Any) -> None:
        await asyncio.gather(*(self._call(a.enable_lora.remote(spec)) for a in self.actors))
        self._lora = spec

    async def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                           version: int | None = None) -> int:
        items = weights.items() if isinstance(weights, dict) else weights
        host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in items}
        async with self._update_lock:
            new = self._version + 1 if version is None else int(version)
            ref = self.ray.put(host)  # once, read by every actor
            self._pushed.update(host)  # kept for an actor that restarts
            await asyncio.gather(*(self._push(i, ref, new) for i in range(len(self.actors))))
            self._version = new
        return new

    async def _push(self, idx: int, ref: Any, version: int) -> None:
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                await self._call(self.actors[idx].load_weights.remote(ref, version))
                return
            except self._died as exc:  # restarting: it gets everything pushed so far
                self.failures += 1
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"engine actor {idx} did not come back in {self.reconnect_s:.0f} s: {exc}"
                    ) from exc
                await asyncio.sleep(0.5)
                ref = self.ray.put(self._pushed)
                if self._lora is not None:
                    try:
                        await self._call(self.actors[idx].enable_lora.remote(self._lora))
                    except self._died:
                        continue

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned:
            await stop_actors(self.actors)


def start_actors(spec: EngineSpec, *, replicas: int = 2, options: dict[str, Any] | None = None,
                 max_restarts: int = 3) -> list[Any]:
    """``replicas`` engine actors of ``spec`` (not yet opened: their first call opens the
    engine); replica ``i`` samples with seed ``spec.seed + i``."""
    ray = ray_module()
    if replicas < 1:
        raise ConfigError(f"engine replicas must be >= 1, got {replicas}")
    cls = ray.remote(EngineActor).options(**actor_options(options, num_cpus=1, max_restarts=max_restarts))
    return [cls.remote(spec.replica(i)) for i in range(replicas)]


async def stop_actors(actors: list[Any]) -> None:
    """Close each actor's engine (10 s at most), then end the actor for good."""
    ray = ray_module()
    for a in actors:
        try:
            await asyncio.wait_for(a.stop.remote(), 10)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
            pass
        ray.kill(a, no_restart=True)


__all__ = ["EngineActor", "RayEngine", "start_actors", "stop_actors"]
