"""The ``agentenv`` command line.

    agentenv rollout --env retool-math --tasks 32 --group-size 4 --out rollouts.jsonl
    agentenv envs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import AgentEnvError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive(kind: type):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agentenv", description="Token-exact async rollouts for tool-calling models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("rollout", help="run rollouts and write trajectories as JSONL")
    r.add_argument("--env", default="retool-math", help="environment id or module:Class (default retool-math)")
    r.add_argument("--tasks", type=_positive(int), default=32, help="number of tasks (default 32)")
    r.add_argument("--group-size", type=_positive(int), default=4, help="samples per task, a GRPO group (default 4)")
    r.add_argument("--out", type=Path, default=Path("rollouts.jsonl"), help="output JSONL file")
    r.add_argument("--model", default=None, help="local Hugging Face model directory (default: bundled tiny model)")
    r.add_argument("--engine", default="embedded", choices=["embedded", "vllm", "openai"],
                   help="embedded (CPU, default), vllm (in-process AsyncLLM), openai (HTTP server)")
    r.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine setting, repeatable (e.g. block_size=32, kv_cache_memory_bytes=268435456, "
                        "tensor_parallel_size=2, max_model_len=4096); VALUE is parsed as JSON when it can be")
    r.add_argument("--base-url", action="append", default=None,
                   help="server URL for --engine openai (repeat for several replicas)")
    r.add_argument("--sandbox", default="local", choices=["local", "e2b"],
                   help="tool sandbox: the isolated local pool (default) or E2B (E2B_API_KEY)")
    r.add_argument("--concurrency", type=_positive(int), default=32, help="programs in flight (default 32)")
    r.add_argument("--max-turns", type=_positive(int), default=None, help="model turns per program (default: env's)")
    r.add_argument("--max-new-tokens", type=_positive(int), default=384, help="sampled tokens per program")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0, help="task and sampling seed (default 0)")
    r.add_argument("--tool-timeout", type=_positive(float), default=None, help="seconds per tool call")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

    sub.add_parser("envs", help="list registered environments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "envs":
            return _envs()
        if args.command == "rollout":
            return _rollout(args)
    except AgentEnvError as exc:
        sys.stderr.write(f"agentenv: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("agentenv: interrupted\n")
        return 130
    return 0


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


def _envs() -> int:
    from .registry import registered

    for name, where in registered().items():
        print(f"{name}\t{where}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import anyio

    from .config import RolloutConfig
    from .engines.embedded import check_model_dir
    from .models import default_model
    from .registry import make

    env = make(args.env)
    model = Path(args.model) if args.model else default_model()
    check_model_dir(model)  # with --engine openai: the tokenizer/chat template to use
    if args.engine == "openai" and not args.base_url:
        raise AgentEnvError("--engine openai needs --base-url http://HOST:PORT")
    args.engine_kwargs = _engine_args(args.engine_arg)
    config = RolloutConfig(
        max_turns=args.max_turns or env.max_turns,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        tool_timeout=args.tool_timeout or env.tool_timeout,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    if args.sandbox == "e2b" and not (os.environ.get("E2B_API_KEY") or os.environ.get("E2B_DEBUG")):
        raise AgentEnvError("--sandbox e2b needs E2B_API_KEY in the environment")
    if args.out.parent and not args.out.parent.exists():
        raise AgentEnvError(f"output directory does not exist: {args.out.parent}")
    tasks = env.tasks(args.tasks, seed=args.seed)
    return anyio.run(_run, env, model, config, tasks, args)


async def _run(env: Any, model: Path, config: Any, tasks: list, args: argparse.Namespace) -> int:
    import anyio
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .checker import check_env
    from .engines import create_engine
    from .reactor import Reactor
    from .trajectory import Trajectory
    from sandboxes import default_sandbox

    console = Console(stderr=True)
    console.print(f"[bold]agentenv[/] rollout: env={env.id} model={model} engine={args.engine} "
                  f"tasks={len(tasks)} x group {args.group_size}")
    try:
        if args.engine == "vllm":
            from .engines.vllm import VLLMEngine

            engine = await VLLMEngine.create(str(model), seed=args.seed, **args.engine_kwargs)
        elif args.engine == "openai":
            from .engines.openai import OpenAIEngine

            engine = await OpenAIEngine.create(args.base_url, str(model), **args.engine_kwargs)
        else:
            engine = await anyio.to_thread.run_sync(
                lambda: create_engine(args.engine, str(model), temperature=config.temperature, top_p=config.top_p,
                                      seed=args.seed, **args.engine_kwargs)
            )
    except TypeError as exc:  # an --engine-arg the engine does not take
        raise AgentEnvError(f"bad --engine-arg for the {args.engine} engine: {exc}") from exc
    check_env(env, tokenizer=engine.tokenizer)
    total = len(tasks) * args.group_size
    written = 0
    progress = Progress(
        TextColumn("rollouts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), console=console, disable=args.no_progress,
    )
    try:
        async with engine, default_sandbox(args.sandbox) as sandbox, Reactor(engine, env, sandbox, config) as reactor:
            with progress, args.out.open("w", encoding="utf-8") as f:
                bar = progress.add_task("rollouts", total=total, info="")
                async with reactor.rollouts(tasks, args.group_size) as results:
                    async for item in results:
                        if isinstance(item, Trajectory):
                            f.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")
                            f.flush()
                            written += 1
                            s = reactor.stats
                            mr = s.mean_reward
                            progress.update(bar, advance=1, info=f"{s.tokens_per_s:.0f} tok/s  reward "
                                            f"{'-' if mr is None else f'{mr:.2f}'}")
            _summary(console, reactor.stats.summary(), args.out, written)
    finally:
        await env.aclose()
    return 0


def _summary(console: Any, s: dict, out: Path, written: int) -> None:
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
        ("mean reward", s["mean_reward"]),
        ("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))),
        ("wall time", f"{s['wall_s']}s"),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
