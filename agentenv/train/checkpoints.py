"""The bundled trainer's checkpoints, and resuming from them.

``<out_dir>/checkpoints/step-NNNNNN/`` holds the policy and its optimiser (``Policy.save``),
``buffer.jsonl`` (the complete groups waiting in the buffer, whole, with their weight versions
and task indices) and ``state.json``, written last so that its presence marks the checkpoint
complete: the step, the run's config, the torch RNG state, and the task stream's position
(``tasks``: its next index, the tasks in flight, generated again on resume with their
programs continued from the saved prefixes, and how many groups were buffered). Each task in
flight's programs are a :class:`~agentenv.inflight.TaskSnapshot` in its saved form, which
names its version; :func:`agentenv.inflight.read_snapshot` reads it back, from any version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import inflight
from ..errors import ConfigError
from ..reactor import Group
from .config import TrainConfig, saved_settings
from .generation import GenerationState, StreamPosition, TaskStream


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir/checkpoints``, or None."""
    ckpts = sorted((Path(out_dir) / "checkpoints").glob("step-*"))
    done = [c for c in ckpts if (c / "state.json").exists()]  # state.json is written last
    return done[-1] if done else None


def _state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "state.json").read_text())


class Checkpoints:
    """The checkpoints of the run ``cfg`` writes under ``out``: where a run starts, saving one,
    and restoring the policy and generation from one."""

    def __init__(self, out: Path, cfg: TrainConfig) -> None:
        self.out, self.cfg = out, cfg

    def path(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:06d}"

    def resume_point(self) -> tuple[int, Path | None]:
        """The step a run starts after, and the checkpoint it resumes from: ``(0, None)``
        unless ``cfg.checkpoints.resume``. ConfigError when there is no checkpoint, or when it was written
        with other :attr:`TrainConfig.RESUME_KEYS` settings."""
        if not self.cfg.checkpoints.resume:
            return 0, None
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            raise ConfigError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
        state = _state(ckpt)
        saved, now = saved_settings(state["config"]), self.cfg.settings()
        for key in TrainConfig.RESUME_KEYS:
            if saved.get(key) != now[key]:
                raise ConfigError(f"--resume: {key} was {saved.get(key)!r} in {ckpt}, now {now[key]!r}")
        return int(state["step"]), ckpt

    def save(self, policy: Any, step: int, generation: GenerationState) -> Path:
        """The policy and optimiser after ``step``, and what generation had made of the task
        stream: the complete groups in the buffer, the tasks in flight (with their programs)
        and the stream's next position. Blocking: run it in a worker thread."""
        path = self.path(step)
        policy.save(path)
        with open(path / "buffer.jsonl", "w", encoding="utf-8") as f:
            for index, group in generation.buffered:
                f.write(json.dumps({"index": index, "trajectories": [t.to_dict() for t in group.trajectories]}) + "\n")
        tasks = {"next": generation.next, "in_flight": generation.in_flight, "buffered": len(generation.buffered),
                 "programs": {tid: s.to_dict() for tid, s in generation.programs.items()}}
        state = {"step": step, "version": step, "task_cursor": step * self.cfg.batch.groups_per_step,
                 "config": self.cfg.to_dict(), "torch_rng": torch.get_rng_state().tolist(), "tasks": tasks}
        (path / "state.json").write_text(json.dumps(state))  # last: marks the checkpoint complete
        return path

    @staticmethod
    def restore_rng(ckpt: Path) -> None:
        """The torch RNG state as the checkpoint saved it."""
        torch.set_rng_state(torch.tensor(_state(ckpt)["torch_rng"], dtype=torch.uint8))

    def restore_generation(self, ckpt: Path | None, start_step: int, stream: TaskStream
                           ) -> tuple[StreamPosition, list[tuple[int, Group]]]:
        """Where generation stands after ``ckpt`` (None: a fresh run at ``start_step``): the
        tasks to generate again first (those in flight at the checkpoint, with their saved
        programs), the stream onward, and the buffered groups it saved (with task indices)."""
        from ..trajectory import Trajectory

        position = StreamPosition(cursor=start_step * self.cfg.batch.groups_per_step)
        state = _state(ckpt) if ckpt is not None else {}
        if "tasks" not in state:  # a fresh run, or a checkpoint without generation's state
            return position, []
        tasks = state["tasks"]
        position.cursor, position.redo = tasks["next"], list(tasks["in_flight"])
        position.saved = {tid: inflight.read_snapshot(d) for tid, d in tasks.get("programs", {}).items()}
        assert ckpt is not None
        buf = ckpt / "buffer.jsonl"
        restored = []
        for line in (buf.read_text().splitlines() if buf.exists() else []):
            d = json.loads(line)
            trajectories = [Trajectory.from_dict(t) for t in d["trajectories"]]
            restored.append((d["index"], Group(stream.task(d["index"]), trajectories)))
        return position, restored


__all__ = ["Checkpoints", "latest_checkpoint"]
