"""The rollout buffer between generation and training, and staleness control (pure, no I/O).

* :class:`StalenessGate` (admission control, as in AReaL): a new program may start only if it
  can be consumed within ``max_staleness`` weight versions. With ``batch`` groups per step,
  after version ``v`` the trainer will have consumed ``v * batch`` groups, so the number of
  groups started (consumed + queued + running) may not exceed ``(v + max_staleness + 1) *
  batch``.
* :class:`RolloutBuffer`: bounded; accepts *complete* GRPO groups only (every trajectory
  scored, or its reward failure recorded); hands out batches oldest first; drops a group whose oldest sampled token is
  more than ``max_staleness`` versions behind (the safety net); records the staleness of every
  consumed token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..reactor import Group


@dataclass
class StalenessGate:
    batch: int  # groups per optimiser step
    max_staleness: int
    started: int = 0

    def can_start(self, version: int) -> bool:
        return self.started < (version + self.max_staleness + 1) * self.batch

    def start(self, version: int) -> bool:
        if not self.can_start(version):
            return False
        self.started += 1
        return True


def _oldest_version(group: Group) -> int:
    versions = [v for t in group.trajectories for s in t.segments if s.kind == "model" for v in s.weight_versions]
    return min(versions) if versions else -1


@dataclass
class RolloutBuffer:
    capacity: int
    max_staleness: int
    _groups: list = field(default_factory=list)  # (oldest sampled version, group), arrival order
    dropped: int = 0
    staleness: Counter = field(default_factory=Counter)  # consumed tokens by (version now - version)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def full(self) -> bool:
        return len(self._groups) >= self.capacity

    def put(self, group: Group) -> None:
        # A reward that failed is recorded data (reward None, ``error`` set; the batch gives it
        # no gradient); a reward that was never computed means the group is not complete.
        if not group.trajectories or any(t.reward is None and not t.error for t in group.trajectories):
            raise ValueError("only complete groups with every reward scored enter the buffer")
        if self.full:
            raise OverflowError(f"buffer full ({self.capacity} groups): wait for the trainer")
        self._groups.append((_oldest_version(group), group))

    @property
    def groups(self) -> list[Group]:
        """What it holds, in arrival order (a checkpoint saves them)."""
        return [g for _, g in self._groups]

    def take(self, n: int, version: int) -> list[Group] | None:
        """``n`` groups usable at ``version`` (oldest first), or None if not enough yet."""
        fresh = [(v, g) for v, g in self._groups if version - v <= self.max_staleness]
        self.dropped += len(self._groups) - len(fresh)
        self._groups = fresh
        if len(fresh) < n:
            return None
        # Oldest weights first (stable: arrival order among equals), so a straggler that
        # finished late is used before it goes stale rather than dropped.
        fresh = sorted(fresh, key=lambda vg: vg[0])
        batch, self._groups = [g for _, g in fresh[:n]], fresh[n:]
        for g in batch:
            for t in g.trajectories:
                for s in t.segments:
                    if s.kind == "model":
                        self.staleness.update(version - v for v in s.weight_versions)
        return batch
