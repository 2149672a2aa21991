"""The bundled GRPO trainer.

Library use::

    from agentenv.train import TrainConfig, train
    summary = train(TrainConfig(env="retool-math", steps=40, mode="async"))

A :class:`TrainConfig` is composed by concern (``cfg.optimiser.lr``, ``cfg.staleness.mode``,
``cfg.env.env``; :mod:`agentenv.train.config` lists them); it is made from flat option names,
as above, or from the concerns themselves::

    from agentenv.train.config import OptimiserOptions, StalenessOptions
    cfg = TrainConfig(env="retool-math", optimiser=OptimiserOptions(steps=40, lr=1e-5),
                      staleness=StalenessOptions(mode="sync"))
    cfg.replace(lr=2e-5).optimiser.lr  # 2e-05

or ``agentenv train`` on the command line. The pure core (loss, advantages, batch collation,
rollout buffer, staleness gate) is importable on its own for external trainers.

The public names load on first use (PEP 562), so importing a light submodule such as
:mod:`agentenv.train.config` (the CLI's parser does) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name -> the submodule that defines it.
_LAZY = {
    "Batch": "batch", "collate": "batch",
    "RolloutBuffer": "buffer", "StalenessGate": "buffer",
    "TrainConfig": "config",
    "LossConfig": "loss", "group_advantages": "loss", "grpo_loss": "loss",
    "LoraSpec": "policy", "Policy": "policy",
    "RolloutProducer": "producer",
    "Trainer": "trainer", "latest_checkpoint": "trainer", "train": "trainer",
}

if TYPE_CHECKING:
    from .batch import Batch, collate
    from .buffer import RolloutBuffer, StalenessGate
    from .config import TrainConfig
    from .loss import LossConfig, group_advantages, grpo_loss
    from .policy import LoraSpec, Policy
    from .producer import RolloutProducer
    from .trainer import Trainer, latest_checkpoint, train


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Batch",
    "LoraSpec",
    "LossConfig",
    "Policy",
    "RolloutBuffer",
    "RolloutProducer",
    "StalenessGate",
    "TrainConfig",
    "Trainer",
    "collate",
    "group_advantages",
    "grpo_loss",
    "latest_checkpoint",
    "train",
]
