"""An OpenAI-compatible HTTP engine (vLLM's server), token ids in and out.

Uses ``/v1/completions`` with a token-id ``prompt`` and vLLM's ``return_token_ids``: the
standard, stable endpoint every vLLM server exposes (the newer token-only
``/inference/v1/generate`` is not on every version), which gives the sampled ids verbatim,
``logprobs=0`` gives each sampled token's logprob, ``stop_token_ids`` end a turn at the
tool-call tag, and ``usage.prompt_tokens_details.cached_tokens`` reports the prefix-cache hit
(start the server with ``--enable-prompt-tokens-details``; and with
``--logprobs-mode processed_logprobs`` so logprobs are of the sampling distribution).

* Several server URLs, routed by ``routing.Router``: a program sticks to the replica that
  holds its prefix (request ids are ``<program>-<turn>``). A new program, or one whose KV was
  released (``release``: it finished or the scheduler paused it), goes to the replica with
  the most free KV: each server's capacity is read from its ``/metrics``
  (``vllm:cache_config_info``), and what our programs hold there is their last known length.
  Without metrics: the fewest requests in flight. ``kv_capacity_tokens`` is the sum over
  replicas.
* tenacity retries timeouts, 429 and 5xx with exponential backoff (``retries`` attempts), and
  keeps retrying a server it cannot connect to (down, restarting) for ``reconnect_s`` seconds:
  a restarted server's programs go on from their last completed turn. A server that came
  back gets the weights pushed to it so far again (a restart reloads the checkpoint) before
  any request is sent to it. One that restarted while nothing was in flight is caught by the
  engine id on its responses (``--middleware agentenv.engines.vllm_worker.instance_header``):
  a response from an engine the weights were not pushed to is discarded, the weights are
  pushed, and the request is sent again. Without the middleware that case is not detected
  (a warning says so once weights have been pushed).
* Weight updates (optional) go through vLLM's dev endpoint ``/collective_rpc`` (server
  started with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--worker-extension-cls agentenv.engines.vllm_worker.WeightSyncExtension``), over a
  weight-update group with the server's workers where one forms (``weight_group``: with
  ``--cluster ray``, rank 0 of the trainer broadcasts the weights itself); the prefix cache is
  salted with the weight version, as in the in-process vLLM engine.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import anyio

from ..errors import ConfigError, EngineError, PromptTooLongError
from ..retry import retry_async
from .base import Engine, Generation, SamplingParams, WeightSink
from .routing import Router
from .vllm_sleep import Sleeper
from .vllm_worker import INSTANCE_HEADER, instance_id
from .weight_group import GroupLink, HeldWeights, fetched, kept, local_address

if TYPE_CHECKING:
    import torch  # type hints only

log = logging.getLogger(__name__)


class _Restarted(EngineError):
    """A response came from an engine the weights were not pushed to: it was restarted and
    serves its checkpoint. Retried after the weights are pushed again."""


def _unreachable(exc: BaseException) -> bool:
    """The server is down or restarting (refused, reset mid-request), not merely slow."""
    import httpx
    import openai

    if isinstance(exc, (openai.APITimeoutError, httpx.TimeoutException)):
        return False
    return isinstance(exc, (openai.APIConnectionError, httpx.TransportError))


def _retryable(exc: BaseException) -> bool:
    import openai

    if _unreachable(exc) or isinstance(exc, _Restarted):
        return True

    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                        openai.InternalServerError)):
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


def _address_for(url: str) -> str:
    """This machine's address as the server at ``url`` reaches it (where its workers find the
    weight-update group); loopback when the server cannot be routed to (its group then fails
    to form and the host path is taken)."""
    from urllib.parse import urlparse

    try:
        return local_address(urlparse(url).hostname or "")
    except OSError:
        return "127.0.0.1"


class OpenAIEngine(Sleeper, WeightSink, Engine):
    def __init__(
        self,
        base_urls: str | list[str],
        tokenizer: str,
        *,
        model: str | None = None,
        max_model_len: int = 2048,
        api_key: str = "EMPTY",
        retries: int = 5,
        reconnect_s: float = 120.0,
        timeout: float = 600.0,
        sticky_programs: int = 100_000,
        block_size: int = 16,
        priority: bool = False,
        weight_sync: str = "auto",
    ) -> None:
        from ..extras import require

        require("openai", "httpx", extra="openai", what="the openai engine")  # one hint for both
        import openai
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigError("give at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.clients = [openai.AsyncOpenAI(base_url=f"{u}/v1" if not u.endswith("/v1") else u, api_key=api_key,
                                           max_retries=0, timeout=timeout) for u in self.urls]
        from .embedded import load_tokenizer  # here: the embedded engine's module imports torch

        self.tokenizer = load_tokenizer(tokenizer)
        self.model = model
        self.max_model_len = max_model_len
        self.page_size = block_size  # the server's KV block size (reuse statistics only)
        self.retries = retries
        self.reconnect_s = reconnect_s
        self._pushed: dict[str, Any] = {}  # every weight update so far (for a restarted server): ``kept``
        self._lost = [False] * len(self.urls)  # a server we lost the connection to
        #: Per server: how often it was found again after it was lost (restarted, or a request
        #: to it was refused or reset) and was sent every weight update so far from here.
        self.resyncs = [0] * len(self.urls)
        self._instance: list[str | None] = [None] * len(self.urls)  # the engine each push reached
        self._unidentified_warned = False
        self._resync = [anyio.Lock() for _ in self.urls]
        #: Per server: weights over a weight-update group with its workers, or through the host
        #: (``weight_group``; ``weight_sync``: auto, group or host).
        self.weight_groups = [GroupLink(weight_sync, name=u, host=_address_for(u)) for u in self.urls]
        #: Send each request's priority (the server must run ``--scheduling-policy priority``;
        #: vLLM rejects a non-zero priority otherwise).
        self.priority = priority
        self.router = Router(len(self.urls), sticky=sticky_programs)  # capacities from /metrics at create()
        self._version = 0
        self._update_lock = anyio.Lock()
        self._closed = False

    @classmethod
    async def create(cls, base_urls: str | list[str], tokenizer: str, **kwargs: Any) -> "OpenAIEngine":
        """Connect, and read the served model's name and context length from ``/v1/models``."""
        eng = cls(base_urls, tokenizer, **kwargs)
        try:
            models = await eng._retry(eng.clients[0].models.list, reconnect=False)  # down at start: say so
        except Exception as exc:  # noqa: BLE001
            hint = (" (is a server running there? start one with `vllm serve MODEL --port PORT`, or give the "
                    "--base-url of one that runs)") if _unreachable(exc) else ""
            raise EngineError(f"cannot reach {eng.urls[0]}: {type(exc).__name__}: {exc}{hint}") from exc
        first = models.data[0]
        eng.model = eng.model or first.id
        eng.max_model_len = int((first.model_extra or {}).get("max_model_len") or eng.max_model_len)
        caps = [await eng._read_capacity(u) for u in eng.urls]
        if all(c is not None for c in caps):
            eng.router.capacity = caps  # type: ignore[assignment]
            eng.kv_capacity_tokens = sum(caps)  # type: ignore[arg-type]
        return eng

    async def _read_capacity(self, url: str) -> int | None:
        """KV capacity in tokens from a vLLM server's Prometheus metrics (None if absent)."""
        import re

        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                text = (await http.get(f"{url.removesuffix('/v1')}/metrics")).text
        except Exception:  # noqa: BLE001 - metrics are optional
            return None
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                try:
                    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                except (KeyError, ValueError):
                    return None
        return None

    def release(self, program: str) -> None:
        """The program's KV is not needed any more (it ended, or was paused): its next request
        may go to the replica with the most room."""
        self.router.release(program)

    @property
    def weight_version(self) -> int:
        return self._version

    async def _retry(self, fn: Any, *args: Any, server: int = 0, reconnect: bool = True, **kwargs: Any) -> Any:
        async def call() -> Any:
            if self._lost[server] and self._pushed:  # it came back (or is back soon): resync
                async with self._resync[server]:  # once, however many requests found it gone
                    if self._lost[server]:
                        self.resyncs[server] += 1
                        await self._push(server)
            self._lost[server] = False
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                self._lost[server] = self._lost[server] or _unreachable(exc)
                raise

        return await retry_async(call, attempts=self.retries, transient=_retryable,
                                 unreachable=_unreachable if reconnect else None, reconnect_s=self.reconnect_s)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        await self._until_awake()  # the servers sleep, or lack weights after a level-2 sleep
        room = self._room(prompt_ids)
        async with self._update_lock:
            version = self._version
        idx = self.router.route(request_id, len(prompt_ids) + min(params.max_tokens, room))
        self.router.inflight[idx] += 1
        start = time.perf_counter()
        try:
            resp = await self._retry(
                self._complete,
                idx,
                server=idx,
                model=self.model,
                prompt=list(prompt_ids),
                max_tokens=min(params.max_tokens, room),
                temperature=params.temperature,
                top_p=params.top_p,
                logprobs=0,
                extra_body={
                    "return_token_ids": True,
                    "stop_token_ids": list(params.stop_token_ids),
                    "ignore_eos": True,  # stop only at the stop ids named (EOS is named by the reactor)
                    "top_k": params.top_k if params.top_k > 0 else -1,
                    "skip_special_tokens": False,
                    "cache_salt": f"v{version}",
                    **({"priority": priority} if self.priority else {}),
                },
            )
        except Exception as exc:  # noqa: BLE001
            import openai

            if isinstance(exc, openai.BadRequestError) and "context" in str(exc).lower():
                raise PromptTooLongError(str(exc)) from exc
            raise EngineError(f"{self.urls[idx]}: {type(exc).__name__}: {exc}") from exc
        finally:
            self.router.inflight[idx] -= 1
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        tokens = extra.get("token_ids")
        if tokens is None:
            raise EngineError("the server did not return token ids (needs vLLM >= 0.10.2, return_token_ids)")
        logprobs = [float(x) for x in (choice.logprobs.token_logprobs if choice.logprobs else [])]
        if len(logprobs) != len(tokens):
            raise EngineError(f"server returned {len(tokens)} tokens but {len(logprobs)} logprobs")
        details = getattr(resp.usage, "prompt_tokens_details", None) if resp.usage else None
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        reason = {"stop": "stop", "length": "length"}.get(choice.finish_reason or "", "abort")
        stop_tok = tokens[-1] if reason == "stop" and tokens and tokens[-1] in params.stop_token_ids else None
        return Generation(list(tokens), logprobs, reason, len(prompt_ids), cached, version, stop_tok,  # type: ignore[arg-type]
                          time.perf_counter() - start, {"server": self.urls[idx]})

    async def _complete(self, idx: int, **kwargs: Any) -> Any:
        """One completion from server ``idx``, checked to come from the engine our weights are on."""
        pushed_to = self._instance[idx]  # as the request leaves: a push after it may be too late for it
        raw = await self.clients[idx].completions.with_raw_response.create(**kwargs)
        if pushed_to is not None:  # weights were pushed before it was sent (else any engine has the checkpoint)
            served_by = raw.headers.get(INSTANCE_HEADER)
            if served_by is None:
                if not self._unidentified_warned:
                    self._unidentified_warned = True
                    log.warning("%s does not name its engine on responses: if it restarts while no request is "
                                "in flight, it will serve its checkpoint's weights unnoticed (start it with "
                                "--middleware agentenv.engines.vllm_worker.instance_header)", self.urls[idx])
            elif served_by != pushed_to:
                if self._instance[idx] == pushed_to:
                    self._lost[idx] = True  # not pushed again since: the retry does it first
                raise _Restarted(f"{self.urls[idx]} was restarted (engine {served_by}, weights pushed to "
                                 f"{pushed_to}): sent again once the weights are there")
        return raw.parse()

    async def abort(self, request_id: str) -> None:
        """Cancelling the caller closes the HTTP request, which makes vLLM abort it."""

    async def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                           version: int | None = None) -> int:
        """Send the weights to every server: over its weight-update group where that is formed
        (``weight_group``), else serialised. Held weights (``weight_group.HeldWeights``: rank 0
        of a Ray trainer's) are broadcast by their holder into one server's workers, this
        process only coordinating; with several servers they are fetched and sent from here
        (the holder is in one weight-update group at a time, and each server has its own)."""
        self._check_awake()
        if isinstance(weights, HeldWeights) and len(self.urls) > 1:
            weights = weights.tensors()
        update = kept(weights)  # host copies, or the holder's handle
        sent = weights if isinstance(weights, HeldWeights) else update
        async with self._update_lock:
            for i in range(len(self.urls)):
                await self._retry(self._push, i, sent, server=i)
            self._pushed.update(update)  # kept for a server that restarts (it reloads its checkpoint)
            self._version = self._version + 1 if version is None else int(version)
        self._weights_installed()
        return self._version

    async def _dev_call(self, method: str, path: str) -> list[Any]:
        """``path`` on every server (vLLM's development endpoints: ``VLLM_SERVER_DEV_MODE=1``);
        their JSON answers."""
        import httpx

        out = []
        async with httpx.AsyncClient(timeout=600) as http:
            for url in self.urls:
                r = await http.request(method, f"{url.removesuffix('/v1')}{path}")
                if r.status_code != 200:
                    raise EngineError(f"{url}{path} failed ({r.status_code}): {r.text[:300]} (start the server "
                                      "with VLLM_SERVER_DEV_MODE=1; on GPUs with --enable-sleep-mode)")
                out.append(r.json())
        return out

    async def _fall_asleep(self, level: int) -> None:
        await self._dev_call("POST", f"/sleep?level={level}&mode=wait")

    async def _awaken(self) -> None:
        await self._dev_call("POST", "/wake_up")

    async def is_sleeping(self) -> bool:
        """Whether the servers sleep, as their ``/is_sleeping`` says (any of them)."""
        return any(a.get("is_sleeping") for a in await self._dev_call("GET", "/is_sleeping"))

    async def _push(self, idx: int, delta: dict[str, torch.Tensor] | HeldWeights | None = None) -> None:
        """Push ``delta`` (None: every tensor pushed so far) to server ``idx``. A server whose
        engine changed since its last push (restarted: it has only its checkpoint) gets
        everything pushed so far with it (held tensors fetched, and sent from here)."""
        before = self._instance[idx]
        if delta is None:  # the server was lost: its workers (and their group) may be new ones
            self.weight_groups[idx].drop()
        now = await self._post_weights(idx, fetched(self._pushed) if delta is None else delta)
        if delta is not None and self._pushed and now != before:
            everything = {**self._pushed, **(delta if isinstance(delta, dict) else kept(delta))}
            now = await self._post_weights(idx, fetched(everything))
        self._instance[idx] = now

    async def _post_weights(self, idx: int, tensors: dict[str, torch.Tensor] | HeldWeights) -> str:
        """One update of server ``idx``: over its weight-update group where that is formed
        (``weight_group``; held weights are broadcast by their holder, the group formed with
        it), else ``agentenv_load_weights`` with the tensors serialised (held ones fetched);
        returns the id of the engine that loaded them."""
        link = self.weight_groups[idx]
        if await link.ready(lambda: self._workers(idx), lambda *a: self._rpc(idx, "agentenv_join_weight_group", *a),
                            tensors):
            results = await link.update(tensors, lambda meta: self._rpc(idx, "agentenv_receive_weights", meta))
            if results is not None:
                return instance_id(results)
        link.check()  # weight_sync=group: the group's failure is raised, not served around
        from safetensors.torch import save

        blob = save({n: t.contiguous() for n, t in fetched(tensors).items()})
        return instance_id(await self._rpc(idx, "agentenv_load_weights", base64.b64encode(blob).decode()))

    async def _workers(self, idx: int) -> int:
        """How many workers (tensor-parallel ranks) server ``idx``'s engine has."""
        return len(await self._rpc(idx, "agentenv_instance"))

    async def _rpc(self, idx: int, method: str, *args: Any) -> list[Any]:
        """``method`` of agentenv's worker extension on every worker of server ``idx`` (vLLM's
        dev endpoint ``/collective_rpc``); the workers' answers."""
        import httpx

        url = self.urls[idx]
        async with httpx.AsyncClient(timeout=600) as http:
            r = await http.post(
                f"{url.removesuffix('/v1')}/collective_rpc", json={"method": method, "args": list(args)}
            )
        if r.status_code != 200:
            raise EngineError(f"{url}/collective_rpc ({method}) failed ({r.status_code}): {r.text[:300]} "
                              "(start the server with VLLM_SERVER_DEV_MODE=1 and the agentenv worker extension)")
        return list(r.json()["results"])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self.weight_groups:
            link.close()
        for c in self.clients:
            await c.close()
