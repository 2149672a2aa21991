"""The LoRA adapters a vLLM engine serves, and the trained adapter published as files.

vLLM loads an adapter from a PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``) and serves it to the requests that name it. ``LoraAdapters``
keeps the ``LoRARequest`` of every adapter registered so far (a restarted engine core is given
them all again) and, once the trainer enabled train-time LoRA, writes each new version of the
trained adapter as such a directory (``publish``), which the engine registers under a new name
and makes the default for new requests.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch  # type hints only


class LoraAdapters:
    """The adapters of one engine. ``enabled``: the engine was created with LoRA support;
    ``model_path``: the base model directory (named in each published adapter's config)."""

    def __init__(self, enabled: bool = False, model_path: str | Path | None = None) -> None:
        self.enabled = enabled
        self.model_path = model_path
        #: Every registered adapter's ``LoRARequest``, by name.
        self.requests: dict[str, Any] = {}
        #: The adapter that requests naming none use (the latest published one), if any.
        self.active: str | None = None
        self._spec: Any = None  # the trainer's LoraSpec, once ``enable`` was called
        self._dir: Path | None = None

    def request(self, name: str | None) -> Any:
        """The ``LoRARequest`` for ``name`` (None: no adapter)."""
        return self.requests[name] if name is not None else None

    def new_request(self, name: str, path: str | Path) -> Any:
        """A ``LoRARequest`` for the PEFT adapter directory ``path``, not yet registered."""
        from vllm.lora.request import LoRARequest

        if not Path(path, "adapter_config.json").is_file():
            raise ConfigError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
        return LoRARequest(name, len(self.requests) + 1, str(path))

    def enable(self, spec: Any) -> None:
        """Train-time LoRA with the trainer's ``LoraSpec``: adapter tensors are published
        from now on (into a directory of their own)."""
        if not self.enabled:
            raise ConfigError("create the vllm engine with enable_lora=True "
                              "(--engine-arg enable_lora=true --engine-arg max_lora_rank=R)")
        self._spec = spec
        self._dir = Path(tempfile.mkdtemp(prefix="agentenv-lora-"))

    def is_adapter(self, items: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether a weight update holds only the trained adapter's tensors (names holding
        ``lora_``) under train-time LoRA."""
        return self._spec is not None and bool(items) and all("lora_" in n for n, _ in items)

    def publish(self, tensors: dict[str, torch.Tensor], version: int) -> tuple[str, Path]:
        """Write version ``version`` of the trained adapter as a PEFT directory; return the
        name to register it under and the directory."""
        from safetensors.torch import save_file

        assert self._spec is not None and self._dir is not None, "enable() first"
        path = self._dir / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        config = self._spec.peft_config().to_dict()
        config["base_model_name_or_path"] = str(self.model_path)
        (path / "adapter_config.json").write_text(json.dumps(config, default=sorted))
        # PEFT's on-disk names: "base_model.model." + the module path, no adapter name.
        save_file({"base_model.model." + n.replace(".default", ""): t.detach().cpu().contiguous()
                   for n, t in tensors.items()}, str(path / "adapter_model.safetensors"))
        return f"agentenv-policy-v{version}", path

    def close(self) -> None:
        """Remove the published adapters' files (the engine is closed: nothing loads them again;
        until then a restarted core may)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
