"""A rollout run to a JSONL file: what ``agentenv rollout`` and ``agentenv eval`` do once their
arguments are checked. One path for a run in this process and one on a Ray cluster: only
where the programs run differs (``agentenv.sources``: a :class:`~agentenv.sources.GroupSource`).
The run writes a trajectory per line as it is scored (a group at a time with a
``group_reward``: ``agentenv.writer``), keeps the event log beside the output
(``agentenv.journal``) so ``--resume`` continues a run, holds back what the engine failed on
for good, and ends with one summary table (``agentenv.summary``).

    job = RolloutJob.open(options, env)      # checked; the log opened
    result = await execute(job)              # or run(job) from synchronous code
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AgentEnvError

if TYPE_CHECKING:
    from .config import RolloutConfig, RolloutRunConfig
    from .engines.spec import EngineSpec
    from .env import Environment, Task
    from .journal import Journal, LogState
    from .judge import Judge
    from .sources import GroupSource


@dataclass
class RolloutJob:
    """A rollout run, checked and ready to go: its options, the environment, the model, the
    limits filled in from the environment, the tasks and the event log (with, on
    ``--resume``, what the log and the output say is left to do)."""

    options: RolloutRunConfig
    command: str  # "rollout" or "eval", for the header line
    env: Environment
    model: Path
    config: RolloutConfig
    tasks: list[Task]
    log: Journal
    resume: LogState | None
    t_start: float
    #: The model grading each answer (``--judge``), already in ``env``'s reward; None without one.
    judge: Judge | None = None
    #: The files this run creates (the output, the log) that were not there before it: a run
    #: that fails before it logs a program removes them (:meth:`discard_unstarted`).
    created: tuple[Path, ...] = ()
    #: The line saying the environment pins a tool format the model does not speak (None: it
    #: does not; an unpinned environment took the model's own).
    format_warning: str | None = None

    @property
    def out(self) -> Path:
        return self.options.output.out

    @property
    def group_size(self) -> int:
        return self.options.run.group_size

    @property
    def engine_spec(self) -> EngineSpec:
        """The engine to open: ``--engine`` serving the model, sampling as the config says."""
        from .engines.spec import EngineSpec

        e = self.options.engine
        return EngineSpec.sampling_as(self.config, e.engine, self.model, kwargs=e.engine_kwargs, base_urls=e.base_urls,
                                      seed=self.options.run.seed)

    @classmethod
    def open(cls, options: RolloutRunConfig, env: Environment, *, command: str = "rollout",
             t_start: float | None = None) -> "RolloutJob":
        """Check the model, take the tasks and open the event log; ``--resume`` refuses a log
        written with other settings (:func:`~agentenv.options.resume_settings`) at once."""
        from .engines.embedded import check_model_dir
        from .env import bind_tool_format
        from .models.native import default_model_for
        from .options import resume_settings

        model = Path(options.engine.model) if options.engine.model else default_model_for(env.tool_format)
        check_model_dir(model)  # with --engine openai: the tokenizer/chat template to use
        format_warning = bind_tool_format(env, model)  # before any prompt is written
        config = options.rollout.for_env(env)
        settings = resume_settings(options, env=env.id, model=str(model.resolve()), max_turns=config.max_turns,
                                   tool_timeout=config.tool_timeout)
        env, judge = with_judge(options, env, model)
        tasks = env.tasks(options.run.tasks, seed=options.run.seed)
        created = tuple(p for p in (options.output.out, Path(f"{options.output.out}.log")) if not p.exists())
        log, resume = open_log(options.output.out, settings, options.output.resume)
        return cls(options, command, env, model, config, tasks, log, resume,
                   time.perf_counter() if t_start is None else t_start, judge, created, format_warning)

    def abandon(self) -> None:
        """The run failed or was stopped: close its log (an error closing it is not reported:
        the first error is the one to report) and :meth:`discard_unstarted`; a second call
        finds nothing left to do."""
        with contextlib.suppress(AgentEnvError):
            self.log.close()
        self.discard_unstarted()

    def discard_unstarted(self) -> None:
        """After a failure before the log recorded a program (the engine or the sandbox did
        not start): remove the files this run created, so that a failed start leaves nothing
        behind. A file that was there before the run (a resumed one) stays, and so does an
        output that holds a line. The new log of an ``--overwrite`` that did not start is
        dropped, so the run it was to replace keeps its output and its log as they were."""
        self.log.discard()
        if self.log.records:
            return
        for path in self.created:
            with contextlib.suppress(OSError):
                if path != self.out or path.stat().st_size == 0:
                    path.unlink()


def with_judge(options: RolloutRunConfig, env: Environment, model: Path) -> tuple[Environment, Judge | None]:
    """``env`` with the ``--judge`` options' judge in its reward (``agentenv.judge.judged``)."""
    j = options.judge
    if not j.judge:
        return env, None
    from .errors import ConfigError
    from .judge import judge_from_spec, judged

    if options.cluster.cluster == "ray":
        raise ConfigError("--judge runs with --cluster none (the rollout workers make their own environments)")
    judge = judge_from_spec(j.judge, model=str(model), deadline=j.judge_deadline, concurrency=j.judge_concurrency)
    return judged(env, judge, weight=j.judge_weight, group=j.judge_group), judge


def open_log(out: Path, settings: dict[str, Any], resume: bool) -> tuple[Journal, LogState | None]:
    """The run's event log, and for ``--resume`` what it (and ``out``) say is left to do."""
    from . import journal

    log = Path(f"{out}.log")
    if not resume:  # a log there (--overwrite) is replaced once the run has started, not before
        return journal.Journal.create(log, settings, staged=log.exists()), None
    if not log.exists() or log.stat().st_size == 0:
        raise AgentEnvError(nothing_to_resume(out, log))
    j, state = journal.Journal.resume(log, settings)
    if out.exists():
        finished, good = journal.finished_lines(out)
        with open(out, "r+b") as f:
            f.truncate(good)  # a torn last line is dropped; its program runs again
        state.done |= finished
        for key in finished:
            state.partial.pop(key, None)
    return j, state


def nothing_to_resume(out: Path, log: Path) -> str:
    """Why ``--resume --out out`` has nothing to resume (``log`` is missing or empty), saying
    what ``out`` is when it is no rollout output: a run's event log, an eval report, other."""
    if not out.exists():
        return f"nothing to resume: {out} does not exist (--resume continues the run that wrote it and {log})"
    if not out.is_file():
        return f"nothing to resume: {out} is not a file"
    with open(out, "rb") as f:
        text = f.read(1 << 20)
    head = text.split(b"\n", 1)[0]
    if out.name.endswith(".log") and head[8:9] == b" " and b'"e":"header"' in head:
        return (f"nothing to resume: {out} is a run's event log, not its output: resume with "
                f"--out {out.with_suffix('')}")
    first, whole = _json(head), _json(text)
    if isinstance(first, dict) and "input_ids" in first:
        return (f"nothing to resume: {out} holds rollouts but its event log {log} does not exist or is empty "
                "(a run is resumed from its log): pass --overwrite to run again")
    what = ("an eval report, not a run's rollouts" if isinstance(whole, dict) and "pass@k" in whole
            else "empty" if not text.strip() else "not a run's rollouts (JSON lines of trajectories)")
    return (f"nothing to resume: {out} is {what}, and {log} does not exist: give --out the rollouts file of "
            "the run to resume")


def _json(data: bytes) -> Any:
    """``data`` parsed as JSON, or None when it is not JSON."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def run(job: RolloutJob) -> int:
    """Run ``job`` in this process or (``--cluster ray``) on Ray workers; 1 when programs were
    held back because the engine failed for good, else 0."""
    from transformers.utils import logging as hf_logging

    from . import mainloop

    hf_logging.disable_progress_bar()  # no "Loading weights" bars between our own output
    return mainloop.run(execute, job).code


@dataclass
class RunResult:
    """How a run ended: its exit status (1: programs held back, or no trajectory scored: the
    reward failed for every one), the stats summary it reported and the lines it wrote."""

    code: int
    summary: dict[str, Any]
    written: int


def source_of(job: RolloutJob) -> GroupSource:
    """Where ``job``'s programs run: this process, or rollout workers on Ray."""
    from .sources import LocalGroups, RayGroups

    o = job.options
    if o.cluster.cluster == "ray":
        return RayGroups(job.env, o.env.env_kwargs, job.engine_spec, o.sandbox, job.config, job.log,
                         out=job.out, workers=o.cluster.workers, engines=o.cluster.engines,
                         engine_gpus=o.cluster.engine_gpus)
    # The programs left to run (a resumed run's done ones are not): the sessions worth preparing.
    left = {(t.id, i) for t in job.tasks for i in range(job.group_size)} - (job.resume.done if job.resume else set())
    return LocalGroups(job.env, job.engine_spec, o.sandbox, job.config, job.log,
                       programs=len(left), out=job.out, by_group=job.env.has_group_reward())


async def execute(job: RolloutJob, source: GroupSource | None = None) -> RunResult:
    """The run: a header line, the programs from ``source`` (default :func:`source_of`) written
    as they finish (``agentenv.writer``) under a progress bar, the summary table, and what was
    held back. The event log is closed and the environment too, whatever happens."""
    from .console import console as cli_console, phrases

    console = cli_console()  # rich on a terminal, plain unfolded lines anywhere else
    source = source or source_of(job)
    group = "k" if job.command == "eval" else "group"  # eval's group size is its --k
    console.print(phrases(console, f"[bold]agentenv[/] {job.command}:", f"env={job.env.id}", f"model={job.model}",
                          f"engine={job.engine_spec.kind}", f"format={_format_name(job.env)}",
                          f"tasks={len(job.tasks)} x {group} {job.group_size}",
                          *([source.where.strip()] if source.where.strip() else [])))
    if job.format_warning:
        console.print(f"[bold yellow]warning:[/] {job.format_warning}")
    try:
        async with source:
            if job.judge is not None:
                if getattr(source, "reactor", None) is not None:
                    job.judge.bind(source.reactor.engine)  # --judge policy: the run's own engine
                await job.judge.start()
            result = await _stream(job, source, console)
    except BaseException:
        job.abandon()
        raise
    else:
        job.log.close()
    finally:
        await job.env.aclose()
    return result


def resuming_line(done: int, partial: int, held: int) -> str:
    """What a resumed run says it continues: ``done`` lines in the output, ``partial``
    programs in flight, ``held`` finished ones waiting for their groups."""
    from .summary import counted

    return (f"resuming: {counted(done, 'trajectory', 'trajectories')} done, {partial} in flight continue from their "
            "last logged turn" + (f", {held} finished wait for their groups" if held else ""))


async def _stream(job: RolloutJob, source: GroupSource, console: Any) -> RunResult:
    import anyio
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .console import on_terminal
    from .writer import RunWriter

    resume, g = job.resume, job.group_size
    in_out = set(resume.done) if resume is not None else set()  # lines in the output already
    held = {k for k in (resume.held if resume is not None else ()) if k not in in_out}
    if resume is not None:
        console.print(resuming_line(len(in_out), len(resume.partial), len(held)))
    writer = RunWriter(job.out, job.log, by_group=job.env.has_group_reward(), in_out=in_out, already=held,
                       append=job.options.output.resume)
    progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console,
                        disable=not (job.options.output.progress and on_terminal(console)))

    def info() -> str:
        s = source.stats
        mr, rate = s.outcomes.mean_reward, s.live_tokens_per_s or s.tokens_per_s
        busy = s.occupancy
        return (f"{rate:.0f} tok/s  " + (f"{busy.in_flight} in flight  " if busy.slots else "")
                + f"reward {'-' if mr is None else f'{mr:.2f}'}")

    with progress, writer:
        job.log.commit()  # started: the output is this run's (the writer truncated it), and so is the log
        bar = progress.add_task("rollouts", total=len(job.tasks) * g - len(in_out | held), info="")

        async def tick() -> None:  # the rate moves while long programs are under way
            while True:
                await anyio.sleep(1.0)
                progress.update(bar, info=info())

        async with anyio.create_task_group() as ticker, source.results(job.tasks, g, resume) as results:
            ticker.start_soon(tick)
            async for item in results:
                progress.update(bar, advance=writer.take(item), info=info())  # the bar counts finished programs
            ticker.cancel_scope.cancel()
    return _report(job, source, writer, console)


def _report(job: RolloutJob, source: GroupSource, writer: Any, console: Any) -> RunResult:
    """The summary table, a warning for failed rewards, and what was held back."""
    from .summary import counted, over_file, summary_rows, summary_table, weights

    summary = source.summary()
    if job.judge is not None:
        summary.update(job.judge.stats.summary(wall_s=summary.get("wall_s")))
    if job.resume is not None:  # the table describes the whole file, not only this invocation's part
        summary = over_file(summary, job.out, block_size=source.stats.outcomes.block_size)
    rows = summary_rows(summary, prepared=source.prepared, startup_s=time.perf_counter() - job.t_start,
                        startup=source.startup, extra=source.rows(), weights=weights(job.env))
    total = summary["programs"] if job.resume is not None else None
    console.print(summary_table(rows, writer.written, job.out, total=total))
    none_scored = writer.written > 0 and len(writer.reward_errors) == writer.written
    if writer.reward_errors:
        console.print(("[bold red]error:[/]" if none_scored else "[bold yellow]warning:[/]")
                      + f" the reward failed for {len(writer.reward_errors)} of "
                      f"{counted(writer.written, 'trajectory', 'trajectories')} (reward None, finish_reason "
                      f"error:reward); first error: {writer.reward_errors[0]}"
                      + ("; nothing was scored, so the run exits 1" if none_scored else ""))
    if job.judge is not None and (note := job.judge.stats.warning()):
        console.print(f"[bold yellow]warning:[/] {note}")
    if writer.held_back:
        waiting = writer.waiting
        console.print(f"[bold red]{counted(len(writer.held_back), 'program', 'programs')} stopped because the "
                      "engine failed[/] "
                      f"(first: {writer.held_back[0].error}); they are not in {job.out}"
                      + (f", nor are the {len(waiting)} finished samples of their groups, held in the log so "
                         "that each group is scored whole" if waiting else "")
                      + ". Run the same command with --resume to finish them from their last completed turn.")
    return RunResult(1 if writer.held_back or none_scored else 0, summary, writer.written)


def check_out(out: Path) -> None:
    """Refuse an --out that cannot be written, before anything slow is loaded. Nothing is
    created: a file that is there is opened to append (its contents untouched), and for one
    that is not, the folder is asked for an unnamed temporary file."""
    import tempfile

    if out.is_dir():
        raise AgentEnvError(f"--out {out} is a directory; give a file path, e.g. {out / 'rollouts.jsonl'}")
    if not out.parent.exists():
        raise AgentEnvError(f"output directory does not exist: {out.parent} (make it first: mkdir -p {out.parent})")
    if not out.parent.is_dir():
        raise AgentEnvError(f"--out {out}: {out.parent} is not a directory")
    for path in (out, Path(f"{out}.log")):
        try:
            if path.exists():
                open(path, "ab").close()
            else:
                tempfile.TemporaryFile(dir=path.parent).close()
        except OSError as exc:
            raise AgentEnvError(f"cannot write {path}: {exc.strerror or exc}") from None


def _format_name(env: Any) -> str:
    """The tool format the run's environment settled on (the model's own where it pins none)."""
    from .formats import get_format

    fmt = getattr(env, "tool_format", None)
    return "none" if fmt is None else get_format(fmt).name
