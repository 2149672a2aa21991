"""Runs inside vLLM's worker processes (named by ``worker_extension_cls``): weight updates.

Weights travel as one safetensors blob: vLLM's RPC serialiser does not round-trip tensors
nested in lists on every version, bytes always do.
"""

from __future__ import annotations

from typing import Any


class WeightSyncExtension:
    """Mixed into vLLM's worker; ``collective_rpc("agentenv_load_weights", args=(blob,))``."""

    model_runner: Any

    def agentenv_load_weights(self, blob: bytes | str) -> int:
        import base64

        from safetensors.torch import load

        if isinstance(blob, str):  # over HTTP (/collective_rpc takes JSON): base64
            blob = base64.b64decode(blob)
        weights = load(blob)
        self.model_runner.model.load_weights(weights=list(weights.items()))
        return len(weights)
