"""The bundled GRPO trainer.

Library use::

    from agentenv.train import TrainConfig, train
    summary = train(TrainConfig(env="retool-math", steps=40, mode="async"))

or ``agentenv train`` on the command line. The pure core (loss, advantages, batch collation,
rollout buffer, staleness gate) is importable on its own for external trainers.
"""

from .batch import Batch, collate
from .buffer import RolloutBuffer, StalenessGate
from .loss import LossConfig, group_advantages, grpo_loss
from .policy import LoraSpec, Policy
from .producer import RolloutProducer
from .trainer import TrainConfig, Trainer, latest_checkpoint, train

__all__ = ["Batch", "LoraSpec", "LossConfig", "Policy", "RolloutBuffer", "RolloutProducer", "StalenessGate", "TrainConfig",
           "Trainer", "collate", "group_advantages", "grpo_loss", "latest_checkpoint", "train"]
