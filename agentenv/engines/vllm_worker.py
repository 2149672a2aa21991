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
        # vLLM's in-place reload: checkpoint-format names (q_proj, k_proj, ... are packed into
        # qkv_proj by the model's loader), re-runs the per-layer weight processing that
        # loading did (the CPU backend repacks linear weights, so a plain load_weights into the
        # processed parameters fails), and works under LoRA wrappers.
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        self._refresh_tied_heads()
        return len(weights)

    def _refresh_tied_heads(self) -> None:
        """A head tied to the embeddings shares their weight, but its kernel-side copy (the
        CPU backend prepacks it for GEMM) was built at load time: rebuild it, or a tied model
        keeps scoring with the old embeddings (vLLM's reload notes this limitation)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, ParallelLMHead) and method is not None:
                method.process_weights_after_loading(module)
