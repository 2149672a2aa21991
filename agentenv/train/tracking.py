"""Experiment tracking: every step's metrics (and held-out evaluations) to TensorBoard and/or
Weights & Biases, besides ``metrics.jsonl``.

    agentenv train ... --report-to tensorboard          # RUN/tensorboard; tensorboard --logdir RUN
    agentenv train ... --report-to wandb                # project $WANDB_PROJECT (default agentenv)

Numbers are logged as scalars under their metrics.jsonl names (``train/reward_mean``,
``train/loss``, ``eval/pass@1``, ...); lists and dicts stay in metrics.jsonl only. W&B honours
its own environment variables (``WANDB_MODE=offline`` writes under RUN/wandb without an
account); a resumed run continues the same W&B run.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..extras import require

CHOICES = ("tensorboard", "wandb", "none")


def default_report_to() -> list[str]:
    """TensorBoard when it is installed, else nothing."""
    return ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []


def scalars(row: dict[str, Any], prefix: str) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "version")}


class _TensorBoard:
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out: Path, config: dict[str, Any], resume: bool) -> None:
        import wandb

        id_file = out / "wandb_id"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "agentenv"), dir=str(out), id=run_id,
                              name=out.name, config=config, resume="allow")
        self.dir = Path(self.run.dir).parent

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers a run reports to; ``log`` fans out to each."""

    def __init__(self, names: Iterable[str], out: Path, config: dict[str, Any], resume: bool = False) -> None:
        names = [n for n in dict.fromkeys(names) if n != "none"]
        for n in names:
            if n not in CHOICES:
                raise ConfigError(f"report_to: unknown tracker {n!r}; choose from {', '.join(CHOICES)}")
            require(n, extra="tracking", what=f"--report-to {n}")
        out.mkdir(parents=True, exist_ok=True)
        self.names = names
        self._all: list[Any] = []
        try:
            for n in names:
                self._all.append(_TensorBoard(out) if n == "tensorboard" else _WandB(out, config, resume))
        except BaseException:
            self.close()
            raise

    @property
    def dirs(self) -> dict[str, Path]:
        return dict(zip(self.names, (t.dir for t in self._all)))

    def log(self, row: dict[str, Any], step: int, prefix: str = "train") -> None:
        values = scalars(row, prefix)
        for t in self._all:
            t.log(values, step)

    def close(self) -> None:
        for t in self._all:
            t.close()
        self._all = []
