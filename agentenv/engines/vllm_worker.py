"""Runs inside vLLM's processes: weight updates in its workers (named by
``worker_extension_cls``), and a server middleware that names the engine behind each response.

Weights travel as one safetensors blob: vLLM's RPC serialiser does not round-trip tensors
nested in lists on every version, bytes always do.

A server that restarts reloads its checkpoint. With requests in flight the client sees the
connection drop and pushes its weights again; with none in flight it would not notice, and the
next requests would be served by the checkpoint's weights under the trained version's label.
So each worker process has an id (``agentenv_instance``; a restart makes new ones), a weight
push answers with it, and ``instance_header`` (``vllm serve --middleware
agentenv.engines.vllm_worker.instance_header``) puts the serving engine's id on every HTTP
response: a response from an engine the weights were not pushed to is discarded, the weights
are pushed, and the request is sent again (``engines/openai.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

#: The response header that names the engine (its workers' ids) that served a request.
INSTANCE_HEADER = "x-agentenv-instance"
log = logging.getLogger("vllm.agentenv")  # under vLLM's logger: the server's log shows it
_WORKER_ID = uuid.uuid4().hex  # this process's; only a worker's is ever reported
_served_by: str | None = None  # the API server's engine, as its workers name it ("" : no extension)
_ask_after = 0.0  # monotonic time before which a failed question is not asked again
#: How long after a failed question (other than "no such method") it is asked again.
RETRY_S = 2.0
_now = time.monotonic  # the clock the retry reads (a test moves its own)


def instance_id(results: list[Any]) -> str:
    """One engine's id from its workers' answers (one per tensor-parallel rank)."""
    return ",".join(sorted(str(r["instance"] if isinstance(r, dict) else r) for r in results))


async def instance_header(request: Any, call_next: Any) -> Any:
    """HTTP middleware for ``vllm serve --middleware``: every response carries
    ``x-agentenv-instance``, the id of the engine behind this server (its workers' ids, asked
    once per server process). Without the worker extension the header is left out. Any other
    failure to ask (the engine busy or failing for a moment) is not taken as an answer: the
    response goes without the header and the question is asked again on a response at least
    ``RETRY_S`` later, so one bad moment does not leave the server unnamed for good."""
    global _served_by, _ask_after
    response = await call_next(request)
    if _served_by is None and _now() >= _ask_after:
        try:
            _served_by = instance_id(await request.app.state.engine_client.collective_rpc("agentenv_instance"))
        except Exception as exc:  # noqa: BLE001 - answered below
            if _no_such_method(str(exc)):
                _served_by = ""  # no worker extension: nothing to report, ever
            else:
                _ask_after = _now() + RETRY_S
                log.warning("could not ask the engine for its id (asked again in %.0f s): %s", RETRY_S, exc)
    if _served_by:
        response.headers[INSTANCE_HEADER] = _served_by
    return response


def _no_such_method(message: str) -> bool:
    """vLLM's answer when the workers lack the method: a multiprocess executor's worker raises
    ``'CPUWorker' object has no attribute 'agentenv_instance'``, an in-process one
    ``Method 'agentenv_instance' is not implemented.``"""
    return "agentenv_instance" in message and ("has no attribute" in message or "is not implemented" in message)


class WeightSyncExtension:
    """Mixed into vLLM's worker. Host path: ``collective_rpc("agentenv_load_weights",
    args=(blob,))``. Weight-update group (``engines/weight_group.py``):
    ``agentenv_join_weight_group`` once, then ``agentenv_receive_weights`` per update, while
    the trainer broadcasts."""

    model_runner: Any
    _agentenv_group: Any = None
    _agentenv_backend = "gloo"

    def agentenv_instance(self) -> str:
        """This worker process's id: a restarted server's workers have new ones."""
        return _WORKER_ID

    def agentenv_load_weights(self, blob: bytes | str) -> dict[str, Any]:
        """Load the tensors; answers how many, and this worker's id (``agentenv_instance``)."""
        import base64

        from safetensors.torch import load

        if isinstance(blob, str):  # over HTTP (/collective_rpc takes JSON): base64
            blob = base64.b64decode(blob)
        weights = load(blob)
        self._agentenv_install(weights)
        return {"tensors": len(weights), "instance": _WORKER_ID}

    def agentenv_join_weight_group(self, host: str, port: int, world: int, backend: str,
                                   timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the trainer's weight-update group at ``host:port`` as rank 1 + this worker's
        rank (blocks until the trainer and every worker have joined). A group joined before is
        left first."""
        from .weight_group import join, leave

        if self._agentenv_group is not None:
            leave(self._agentenv_group)
            self._agentenv_group = None
        rank = 1 + int(getattr(self, "rank", 0))
        self._agentenv_group = join(host, int(port), rank, int(world), backend_name=backend, timeout_s=timeout_s)
        self._agentenv_backend = backend
        return {"rank": rank, "instance": _WORKER_ID}

    def agentenv_receive_weights(self, meta: list[Any]) -> dict[str, Any]:
        """Receive the tensors ``meta`` names (``weight_group.metadata``) from the trainer's
        broadcast and load them as ``agentenv_load_weights`` does."""
        from .weight_group import receive

        if self._agentenv_group is None:
            raise RuntimeError("agentenv: this worker is in no weight-update group (agentenv_join_weight_group)")
        device = "cpu" if self._agentenv_backend == "gloo" else self.model_runner.device
        weights = dict(receive(self._agentenv_group, [(n, d, list(s)) for n, d, s in meta], device))
        self._agentenv_install(weights)
        return {"tensors": len(weights), "instance": _WORKER_ID}

    def agentenv_leave_weight_group(self) -> bool:
        """Leave the weight-update group, if in one."""
        from .weight_group import leave

        group, self._agentenv_group = self._agentenv_group, None
        if group is not None:
            leave(group)
        return group is not None

    def agentenv_read_weights(self, names: list[str]) -> dict[str, list[Any]]:
        """For checks: the served parameters ``names`` (vLLM's own names, e.g.
        ``model.norm.weight``) as nested lists of float64 (exact for float32 and bfloat16)."""
        import torch

        params = dict(self.model_runner.get_model().named_parameters())
        return {n: params[n].detach().to("cpu", dtype=torch.float64).tolist() for n in names}

    def agentenv_weights_digest(self) -> dict[str, str]:
        """For checks: a SHA-256 of every served parameter's bytes, by vLLM's name (two
        engines serve the same weights exactly when their digests are equal)."""
        import hashlib

        import torch

        out = {}
        for name, p in self.model_runner.get_model().named_parameters():
            raw = p.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        return out

    def _agentenv_install(self, weights: dict[str, Any]) -> None:
        """Load checkpoint-format tensors in place. vLLM's in-place reload: checkpoint-format
        names (q_proj, k_proj, ... are packed into qkv_proj by the model's loader), re-runs the
        per-layer weight processing that loading did (the CPU backend repacks linear weights,
        so a plain load_weights into the processed parameters fails), and works under LoRA
        wrappers."""
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        self._refresh_tied_heads()

    def _refresh_tied_heads(self) -> None:
        """A head tied to the embeddings shares their weight, but its kernel-side copy (the
        CPU backend prepacks it for GEMM) was built at load time: rebuild it, or a tied model
        keeps scoring with the old embeddings (vLLM's reload notes this limitation)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, ParallelLMHead) and method is not None:
                method.process_weights_after_loading(module)
