"""The bundled GRPO trainer's pure core: loss, advantages, rollout buffer, staleness gate.

The asynchronous training loop, weight sync, checkpoints and the ``agentenv train`` command
are not built yet (issue 5).
"""

from .buffer import RolloutBuffer, StalenessGate
from .loss import LossConfig, group_advantages, grpo_loss

__all__ = ["LossConfig", "RolloutBuffer", "StalenessGate", "group_advantages", "grpo_loss"]
