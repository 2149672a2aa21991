"""A rollout run to a JSONL file: what ``agentenv rollout`` and ``agentenv eval`` do once their
arguments are checked. One machine (:func:`run`) or a Ray cluster (:func:`run_cluster`); each
writes a trajectory per line as it is scored (a group at a time with a ``group_reward``),
keeps the event log beside the output (``agentenv.journal``) so ``--resume`` continues a run,
holds back what the engine failed on for good, and ends with a summary table."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import AgentEnvError

if TYPE_CHECKING:
    from .config import RolloutConfig, RolloutRunConfig
    from .env import Environment, Task
    from .journal import Journal, LogState


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

    @property
    def out(self) -> Path:
        return self.options.output.out

    @property
    def group_size(self) -> int:
        return self.options.run.group_size

    @property
    def seed(self) -> int:
        return self.options.run.seed

    @classmethod
    def open(cls, options: RolloutRunConfig, env: Environment, *, command: str = "rollout",
             t_start: float | None = None) -> "RolloutJob":
        """Check the model, take the tasks and open the event log; ``--resume`` refuses a log
        written with other settings (:func:`~agentenv.options.resume_settings`) at once."""
        from .engines.embedded import check_model_dir
        from .models import default_model
        from .options import resume_settings

        model = Path(options.engine.model) if options.engine.model else default_model()
        check_model_dir(model)  # with --engine openai: the tokenizer/chat template to use
        config = options.rollout.for_env(env)
        settings = resume_settings(options, env=env.id, model=str(model.resolve()), max_turns=config.max_turns,
                                   tool_timeout=config.tool_timeout)
        tasks = env.tasks(options.run.tasks, seed=options.run.seed)
        log, resume = open_log(options.output.out, settings, options.output.resume)
        return cls(options, command, env, model, config, tasks, log, resume,
                   time.perf_counter() if t_start is None else t_start)


def open_log(out: Path, settings: dict[str, Any], resume: bool) -> tuple[Journal, LogState | None]:
    """The run's event log, and for ``--resume`` what it (and ``out``) say is left to do."""
    from . import journal

    log = Path(f"{out}.log")
    if not resume:
        return journal.Journal.create(log, settings), None
    if not log.exists() or log.stat().st_size == 0:
        raise AgentEnvError(f"nothing to resume: {log} does not exist or is empty")
    j, state = journal.Journal.resume(log, settings)
    if out.exists():
        finished, good = journal.finished_lines(out)
        with open(out, "r+b") as f:
            f.truncate(good)  # a torn last line is dropped; its program runs again
        state.done |= finished
        for key in finished:
            state.partial.pop(key, None)
    return j, state


def run(job: RolloutJob) -> int:
    """Run ``job`` in this process or (``--cluster ray``) on Ray workers; 1 when programs were
    held back because the engine failed for good, else 0."""
    import anyio
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars between our own output
    return anyio.run(run_cluster if job.options.cluster.cluster == "ray" else run_local, job)


def _open_out(out: Path, append: bool) -> Any:
    """The output, unbuffered: each line goes to the OS as it is written, so closing the file
    has nothing left to write (and cannot fail after a write error was reported)."""
    return open(out, "ab" if append else "wb", buffering=0)


def _has_group_reward(env: Any) -> bool:
    """Whether ``env`` rewards whole groups (overrides ``Environment.group_reward``)."""
    from .env import Environment

    return type(env).group_reward is not Environment.group_reward  # as the checker tests overrides


def _unfinished_groups(out: Path, done: set, tasks: list, group_size: int) -> dict[str, list]:
    """The trajectories in ``out`` of each task whose group is only partly there."""
    from . import journal
    from .trajectory import Trajectory

    ids = {t.id for t in tasks if 0 < sum((t.id, i) in done for i in range(group_size)) < group_size}
    return {tid: [Trajectory.from_dict(d) for d in lines] for tid, lines in journal.lines_of(out, ids).items()}


def _sort_group(new: list, by_group: bool) -> tuple[list, list, list]:
    """A complete group's trajectories that are not in the output yet: (to write, to hold in
    the log, failed). What the engine failed on for good is not a result: it is not written,
    and ``--resume`` continues it from its log records. With a group reward the group's other
    samples are held too (``held`` records keep them whole, not to be run again), so that
    every line of a group carries the reward of the whole group."""
    failed = [t for t in new if t.finish_reason == "error:engine"]
    ok = [t for t in new if t.finish_reason != "error:engine"]
    return ([], ok, failed) if failed and by_group else (ok, [], failed)


def _write_line(f: Any, traj: Any, out: Path, hint: str = "") -> None:
    """One trajectory as one JSONL line, written whole; a write error is one clear line (a
    line cut short by it is dropped by --resume)."""
    data = memoryview((json.dumps(traj.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))
    try:
        while data:
            data = data[f.write(data):]  # a raw write may take fewer bytes than given
    except OSError as exc:
        raise AgentEnvError(f"cannot write {out}: {exc.strerror or exc}{hint}") from None


async def run_cluster(job: RolloutJob) -> int:
    """``--cluster ray``: the same JSONL, from rollout workers on a Ray cluster. Its event log
    records the workers' snapshots (each program's completed turns) and each line written, so
    ``--resume`` continues every unfinished group: its finished lines are kept and its
    programs go on from their last logged turn."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from . import journal
    from .cluster import RayRollouts
    from .stats import RunStats

    env, env_args, model, config, tasks = job.env, job.options.env.env_kwargs, job.model, job.config, job.tasks
    console = Console(stderr=True)
    console.print(f"[bold]agentenv[/] {job.command}: env={env.id} model={model} engine={job.options.engine.engine} "
                  f"tasks={len(tasks)} x group {job.group_size} on Ray, {job.options.cluster.workers} workers"
                  + (f", {job.options.cluster.engines} engine actors" if job.options.cluster.engines else ""))
    log, resume = job.log, job.resume
    done = resume.done if resume is not None else set()
    todo = [t for t in tasks if any((t.id, i) not in done for i in range(job.group_size))]
    total = len(tasks) * job.group_size - len(done)
    saved: dict[str, Any] = {}
    if resume is not None:  # unfinished groups continue: their finished lines and their programs' logged turns
        ids = {t.id for t in todo}
        finished = journal.lines_of(job.out, ids)
        for (tid, i), d in sorted(resume.held.items()):  # finished, held back with its group (below)
            if (tid, i) not in done:
                finished.setdefault(tid, []).append(d)
        with_work = ids & ({tid for tid, _ in resume.partial} | set(finished))
        saved = {tid: journal.snapshot_of(resume, tid, finished.get(tid, [])) for tid in with_work}
        console.print(f"resuming: {len(done)} trajectories done; {len(todo)} tasks unfinished, {len(resume.partial)} "
                      "programs continue from their last logged turn")
    logged: dict[str, tuple[int, int, int]] = {}  # program -> how far its records in the log go
    stats, written = RunStats(), 0
    by_group, held_back, waiting, arrived = _has_group_reward(env), [], [], {}
    progress = Progress(TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console, disable=not job.options.output.progress)
    try:
        async with RayRollouts(env, workers=job.options.cluster.workers, env_args=env_args, engine=job.options.engine.engine, model=str(model),
                               engine_kwargs=job.options.engine.engine_kwargs, base_urls=job.options.engine.base_urls, sandbox=job.options.sandbox.sandbox,
                               config=config, seed=job.seed, engines=job.options.cluster.engines,
                               engine_options={"num_gpus": job.options.cluster.engine_gpus} if job.options.cluster.engine_gpus else None) as cluster:
            stats.start(total)
            with progress, _open_out(job.out, job.options.output.resume) as f:
                bar = progress.add_task("rollouts", total=total, info="")
                async for traj in cluster.rollouts(
                        todo, job.group_size, saved=saved,
                        on_snapshot=lambda tid, snap: journal.log_snapshot(log, snap, logged)):
                    # A group's trajectories come together, all of them: written as the local
                    # run writes them (_sort_group).
                    group = arrived.setdefault(traj.task_id, [])
                    group.append(traj)
                    if len(group) < job.group_size:
                        continue
                    del arrived[traj.task_id]
                    new = [t for t in group if (t.task_id, t.sample_index) not in done]  # not in the output yet
                    to_write, to_hold, failed = _sort_group(new, by_group)
                    held_back += failed
                    for t in new:
                        stats.add(t)  # the summary counts every finished program, as a local run's
                    for t in to_hold:
                        log.held(t)
                        waiting.append(t)
                    for t in to_write:
                        _write_line(f, t, job.out, "; the lines before this one are intact (--resume continues)")
                        log.done(t)
                        written += 1
                    progress.update(bar, advance=len(new), info=f"{stats.tokens_per_s:.0f} tok/s")
            stats.stop()
            s = stats.summary()
            t = Table(title=f"{written} trajectories -> {job.out}", show_header=False)
            engines = (("engine actors", f"{job.options.cluster.engines}, shared by the workers"),) if job.options.cluster.engines else ()
            for k, v in (("workers (pids)", ", ".join(map(str, cluster.pids))), *engines,
                         ("workers replaced / groups run again (from a snapshot)",
                          f"{cluster.replaced} / {cluster.rerun} ({cluster.continued})"),
                         ("tool calls", s["tool_calls"]), ("tokens generated", s["tokens_generated"]),
                         ("tokens/s", s["tokens_per_s"]), ("mean reward", s["mean_reward"]),
                         ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))),
                         ("wall time", f"{s['wall_s']}s rollout, {time.perf_counter() - job.t_start:.1f}s with "
                                       "start-up (cluster, workers)")):
                t.add_row(k, str(v))
            console.print(t)
        if held_back:
            _say_held_back(console, held_back, waiting, job.out)
            return 1
    finally:
        try:
            log.close()
        finally:
            await env.aclose()
    return 0


def check_out(out: Path) -> None:
    """Refuse an --out that cannot be written, before anything slow is loaded."""
    if out.is_dir():
        raise AgentEnvError(f"--out {out} is a directory; give a file path, e.g. {out / 'rollouts.jsonl'}")
    if not out.parent.exists():
        raise AgentEnvError(f"output directory does not exist: {out.parent}")
    if not out.parent.is_dir():
        raise AgentEnvError(f"--out {out}: {out.parent} is not a directory")
    for path in (out, Path(f"{out}.log")):
        try:
            open(path, "ab").close()  # created empty if missing; nothing written yet
        except OSError as exc:
            raise AgentEnvError(f"cannot write {path}: {exc.strerror or exc}") from None


async def run_local(job: RolloutJob) -> int:
    import anyio
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .checker import check_env
    from .engines import open_engine
    from .reactor import Group, Reactor, prepare_sessions
    from .trajectory import Trajectory
    from agentenv.sandboxes import default_sandbox

    env, model, config, tasks = job.env, job.model, job.config, job.tasks
    console = Console(stderr=True)
    console.print(f"[bold]agentenv[/] {job.command}: env={env.id} model={model} engine={job.options.engine.engine} "
                  f"tasks={len(tasks)} x group {job.group_size}")
    try:
        async with contextlib.AsyncExitStack() as stack:
            # The sandbox first: the sessions the first programs will take start while the model
            # loads, not beside the first turns (see ``prepare_sessions``).
            sandbox = await stack.enter_async_context(default_sandbox(job.options.sandbox.sandbox))
            prepared = await prepare_sessions(env, sandbox, config, len(tasks) * job.group_size)
            engine = await stack.enter_async_context(await open_engine(
                job.options.engine.engine, str(model), temperature=config.temperature, top_p=config.top_p, seed=job.seed,
                base_urls=job.options.engine.base_urls, **job.options.engine.engine_kwargs))
            check_env(env, tokenizer=engine.tokenizer)
            total = len(tasks) * job.group_size
            written, held_back, waiting, reward_errors = 0, [], [], []
            progress = Progress(
                TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"), console=console, disable=not job.options.output.progress,
            )
            log, resume = job.log, job.resume
            # An environment with a group reward rewards a group's samples only once the
            # whole group is done: their lines are written then, a group at a time (as a Ray
            # run writes them), so every line carries the reward the trainer would see.
            by_group = _has_group_reward(env)
            in_out = set(resume.done) if resume is not None else set()  # lines in --out already
            held: dict = {}
            if by_group and resume is not None:
                # A group cut short mid-write, or held back (below), is scored whole again:
                # with its lines in the output and its held samples, which do not run again.
                resume.finished = _unfinished_groups(job.out, in_out, tasks, job.group_size)
                held = {k: d for k, d in resume.held.items() if k not in in_out}
                for (tid, _), d in held.items():
                    resume.finished.setdefault(tid, []).append(Trajectory.from_dict(d))
                resume.done |= held.keys()
            if resume is not None:
                console.print(f"resuming: {len(in_out)} trajectories done, {len(resume.partial)} in flight "
                              f"continue from their last turn"
                              + (f", {len(held)} finished wait for their groups" if held else ""))
                total -= len(resume.done)
            async with Reactor(engine, env, sandbox, config, journal=log) as reactor:
                with progress, _open_out(job.out, job.options.output.resume) as f:
                    bar = progress.add_task("rollouts", total=total, info="")

                    def write(traj: Trajectory) -> None:
                        nonlocal written
                        if traj.finish_reason == "error:reward":
                            reward_errors.append(traj.error)
                        _write_line(f, traj, job.out, "; the lines before this one are intact (--resume continues)")
                        log.done(traj)
                        written += 1

                    def info() -> str:
                        s, mr = reactor.stats, reactor.stats.mean_reward
                        return (f"{s.live_tokens_per_s:.0f} tok/s  {s.in_flight} in flight  reward "
                                f"{'-' if mr is None else f'{mr:.2f}'}")

                    async def tick() -> None:  # the rate moves while long programs are under way
                        while True:
                            await anyio.sleep(1.0)
                            progress.update(bar, info=info())

                    async with anyio.create_task_group() as ticker, \
                            reactor.rollouts(tasks, job.group_size, resume=resume) as results:
                        ticker.start_soon(tick)
                        async for item in results:
                            if isinstance(item, Group):
                                if by_group:  # its failed samples were counted as they came, below
                                    new = [t for t in item.trajectories if (t.task_id, t.sample_index) not in in_out]
                                    to_write, to_hold, _ = _sort_group(new, by_group)
                                    for t in to_hold:
                                        log.held(t)
                                        waiting.append(t)
                                    for t in to_write:
                                        write(t)
                                continue
                            if item.finish_reason == "error:engine":
                                # The engine failed for good (restarts/reconnects exhausted): not a
                                # result. Its log records stay, so --resume continues it.
                                held_back.append(item)
                            elif not by_group:
                                write(item)
                            progress.update(bar, advance=1, info=info())  # the bar counts finished programs
                        ticker.cancel_scope.cancel()
                _summary(console, reactor.stats.summary(), job.out, written, time.perf_counter() - job.t_start,
                         prepared)
            if reward_errors:
                console.print(f"[bold yellow]warning:[/] the reward failed for {len(reward_errors)} of {written} "
                              "trajectories (reward None, finish_reason error:reward); first error: "
                              f"{reward_errors[0]}")
            if held_back:
                _say_held_back(console, held_back, waiting, job.out)
                job.log.close()
                return 1
    except BaseException:
        with contextlib.suppress(AgentEnvError):  # the first error is the one to report
            job.log.close()
        raise
    else:
        job.log.close()
    finally:
        await env.aclose()
    return 0


def _say_held_back(console: Any, held_back: list, waiting: list, out: Path) -> None:
    console.print(f"[bold red]{len(held_back)} programs stopped because the engine failed[/] "
                  f"(first: {held_back[0].error}); they are not in {out}"
                  + (f", nor are the {len(waiting)} finished samples of their groups, held in the log so "
                     "that each group is scored whole" if waiting else "")
                  + ". Run the same command with --resume to finish them from their last completed turn.")


def _summary(console: Any, s: dict, out: Path, written: int, total_s: float, prepared: int = 0) -> None:
    from rich.table import Table

    t = Table(title=f"{written} trajectories -> {out}", show_header=False)
    rows = [
        ("programs", s["programs"]),
        ("turns", s["turns"]),
        ("tool calls", s["tool_calls"]),
        ("tool errors", s["tool_errors"]),
        ("programs with a tool call that ran", s["programs_with_ok_tool_call"]),
        ("tokens generated", s["tokens_generated"]),
        ("tokens/s", s["tokens_per_s"]),
        ("prefix-cache reuse (resumed turns)", f"{s['resume_reuse_pct']}%"),
        ("prefix-cache hits (all prompt tokens)", f"{s['prefix_cache_hit_pct']}%"),
        ("engine occupancy (mean requests in flight)", s["mean_requests_in_flight"]),
        ("engine idle (no request in flight)", f"{s['engine_idle_pct']}%"),
        *((("engine under half its decode slots (the run's tail, mostly)", f"{s['engine_under_half_pct']}%"),)
          if s.get("engine_under_half_pct") is not None else ()),
        ("pauses / restores (KV pressure)", f"{s['pauses']} / {s['restores']}"),
        *((("sandbox sessions prepared ahead (model loading)", prepared),) if prepared else ()),
        *((("sandbox sessions (started, p50 / p90 start)",
            f"{s['env_starts']}, {s['env_start_p50_ms']} / {s['env_start_p90_ms']} ms"),) if s["env_starts"] else ()),
        *((("programs that waited for their session", f"{s['env_waits']} ({s['env_wait_s']}s in all)"),)
          if s["env_waits"] else ()),
        ("mean reward", s["mean_reward"]),
        *((f"  mean {name}", value) for name, value in sorted(s["reward_components"].items())),
        ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))),
        ("wall time", f"{s['wall_s']}s rollout, {total_s:.1f}s with start-up (model, sandbox)"),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
