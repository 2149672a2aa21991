"""Where a training run reports: :class:`RunLog` (each step's and each evaluation's row to its
JSONL file, the trackers, stdout and the caller) and :class:`StatusBar` (the CLI's live bar)."""

from __future__ import annotations

import sys

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import anyio

from .config import TrainConfig
from .metrics import MetricsLog, eval_line, step_line
from .rows import EvalRow, StepRow
from .tracking import Trackers, default_report_to

if TYPE_CHECKING:
    from .generation import Generation

#: Seconds between two refreshes of the status bar's generation figures.
STATUS_REFRESH_S = 0.5


class RunLog:
    """The rows of one attempt of a run: ``metrics.jsonl`` (and ``eval.jsonl`` when the run
    evaluates) under ``out``, the configured trackers, a line on stdout per row unless
    ``print_steps`` is False, ``on_step`` for each step's row, and the caller's ``rows`` and
    ``evals`` lists, which outlive the attempt. With ``resume_step`` the files keep their
    lines up to that step and the trackers continue their run. ``close`` closes them all."""

    def __init__(self, out: Path, cfg: TrainConfig, *, resume_step: int | None, rows: list[dict[str, Any]],
                 evals: list[dict[str, Any]], print_steps: bool = True,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.steps, self.rows, self.evals = cfg.optimiser.steps, rows, evals
        self.print_steps, self.on_step = print_steps, on_step
        self.metrics = MetricsLog(out / "metrics.jsonl", resume_step=resume_step)
        self.eval_log = MetricsLog(out / "eval.jsonl", resume_step=resume_step) if cfg.evaluation.eval_every else None
        try:
            report_to = cfg.tracking.report_to
            self.trackers = Trackers(default_report_to() if report_to is None else report_to, out, cfg.to_dict(),
                                     resume=resume_step is not None)
        except BaseException:
            self._close_files()
            raise

    def step(self, row: StepRow) -> dict[str, Any]:
        """Report one step's row; returns it as written."""
        d = row.to_dict()
        self.metrics.write(d)
        self.trackers.log(d, row.step)
        self.rows.append(d)
        if self.print_steps:
            print(step_line(d, self.steps), file=sys.stderr, flush=True)
        if self.on_step is not None:
            self.on_step(d)
        return d

    def evaluation(self, row: EvalRow) -> dict[str, Any]:
        """Report one held-out evaluation's row; returns it as written."""
        d = row.to_dict()
        if self.eval_log is None:
            raise RuntimeError("this run does not evaluate (eval_every=0): it has no eval.jsonl")
        self.eval_log.write(d)
        self.trackers.log(d, row.step, prefix="eval")
        self.evals.append(d)
        if self.print_steps:
            print(eval_line(d), file=sys.stderr, flush=True)
        return d

    def _close_files(self) -> None:
        self.metrics.close()
        if self.eval_log is not None:
            self.eval_log.close()

    def close(self) -> None:
        self._close_files()
        self.trackers.close()


class StatusBar:
    """A rich progress bar on stderr: the steps, and what generation is doing (``follow``).
    A no-op when not ``enabled``; step lines go to stdout either way. ``with StatusBar(...)``
    shows it for the block."""

    def __init__(self, enabled: bool, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from ..console import console

        self.enabled = enabled
        self._bar = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[info]}"), console=console(), disable=not enabled)
        self._task = self._bar.add_task("train", total=total, completed=done, info="starting")

    def __enter__(self) -> "StatusBar":
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def advance(self) -> None:
        """One more step done."""
        self._bar.advance(self._task)

    @property
    def done(self) -> int:
        """Steps done (the run's start counts those before it)."""
        return int(self._bar.tasks[0].completed)

    def show(self, generation: "Generation") -> None:
        """The weight version, the buffer's fill and the groups generating now."""
        self._bar.update(self._task, info=f"v{generation.version}  buffer {len(generation.buffer)}/{generation.batch} "
                         f"groups  {generation.generating} groups generating  "
                         f"{generation.reactor.stats.outcomes.sampled_tokens} tokens sampled")

    async def follow(self, generation: "Generation") -> None:
        """Refresh the generation figures until cancelled."""
        while True:
            self.show(generation)
            await anyio.sleep(STATUS_REFRESH_S)


__all__ = ["RunLog", "StatusBar"]
