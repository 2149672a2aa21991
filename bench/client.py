"""What one client process costs per generated token, with an engine that costs nothing.

    python bench/client.py [--quick] [--programs 64 1000 10000] [--turn-tokens 16 57 512]

The whole path of ``agentenv rollout`` (``agentenv.rollout_run.execute``: the reactor, the
program scheduler, the programs, tool-call parsing, a sandbox round trip per tool call on the
real local pool, the event log, the JSONL writer, the progress bar, the stats) runs a trace
workload (``agentenv.workload``: heavy-tailed turn counts, mean 6; every turn ``--turn-tokens``
long and ending in a tool call; tools take no time beyond their sandbox round trip) on
:class:`~agentenv.testing.InstantEngine`, whose own CPU time is subtracted. For every number
of concurrent programs (decode slots and admitted programs alike) and turn length it reports:

* ``tok/s`` and ``turns/s`` sustained by the client flat out (the engine unlimited), over the
  middle of the run (from 10 % to 90 % of its tokens);
* client CPU per generated token and per turn (this process's CPU time, every thread, less
  the engine's own);
* the latency from a turn's end to the program's next submission (p50/p99), with the engine
  paced at ``--paced-tok-s`` (flat out, every program waits behind every other one);

and for the headline setting (57-token turns, 1,000 programs) the client's CPU per token split
by part, from a profile (cProfile; each function's own time goes to its module's part, and
time in the standard library, C functions and third-party code to the part of its caller):
parse (decoding the turn and the tool format), scheduler, sandbox I/O, log, writer, stats,
progress, program and reactor, event loop. With more programs than the local pool holds
sessions for (``--max-sessions``), tool calls run without a sandbox round trip (said in the
row). Last ``client_us_per_token: X`` (the headline setting).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import RolloutConfig, make  # noqa: E402
from agentenv.config import OutputOptions, RolloutRunConfig, RunOptions  # noqa: E402
from agentenv.journal import Journal  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.rollout_run import RolloutJob, execute  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402
from agentenv.sources import LocalGroups  # noqa: E402
from agentenv.testing import InstantEngine  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)

HEADLINE = (1000, 57)


def trace_env(turn: int, sandbox: bool):
    # Every turn is ``turn`` tokens (a log-normal around 20x the cap, clipped to it); tools
    # take no time beyond their sandbox round trip; programs are not cut by a context limit.
    return make("trace", sandbox=sandbox, tool_median=0.0, turn_tokens=20 * turn, max_turn_tokens=turn,
                mean_turns=6.0, max_turns=30, max_total_tokens=10**6)


async def run_once(engine: InstantEngine, programs: int, total: int, turn: int, sandbox: LocalSandbox | None,
                   workdir: Path, seconds: float | None = None) -> dict:
    """One rollout run of ``total`` programs, ``programs`` at once, on the whole client path;
    its wall time, this process's CPU time, and the engine's token timeline."""
    env = trace_env(turn, sandbox is not None)
    cfg = RolloutConfig(concurrency=programs, max_programs=programs, max_turns=64, max_new_tokens=10**7,
                        max_tokens_per_turn=4096, tool_timeout=60.0, session_lookahead=16).for_env(env)
    group = 4 if total % 4 == 0 else 1
    options = RolloutRunConfig(run=RunOptions(tasks=total // group, group_size=group),
                               output=OutputOptions(out=workdir / "out.jsonl", progress=True), rollout=cfg)
    log = Journal.create(workdir / "out.jsonl.log", {"bench": "client"})
    job = RolloutJob(options, "rollout", env, default_model(), cfg, env.tasks(total // group), log, None,
                     time.perf_counter())
    # The engine and the sandbox pool given, left open; the sessions ready before the first request.
    source = LocalGroups(env, engine, sandbox, cfg, log, programs=total, out=job.out, by_group=False, wait=True)
    timeline: list[tuple[float, int, float]] = []

    async def sample() -> None:
        while True:
            timeline.append((time.perf_counter(), engine.generated, time.process_time() - engine.cpu_s))
            await anyio.sleep(0.1)

    g0, e0, gaps0, r0 = engine.generated, engine.cpu_s, len(engine.gaps), engine.requests
    t0, c0 = time.perf_counter(), time.process_time()
    async def stop_after(scope: anyio.CancelScope) -> None:
        # ``seconds`` from the first request (the sandbox sessions are prepared by then).
        while engine.requests == r0:
            await anyio.sleep(0.05)
        await anyio.sleep(seconds)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        with anyio.CancelScope() as run_scope:
            if seconds is not None:
                tg.start_soon(stop_after, run_scope)
            await execute(job, source)
        tg.cancel_scope.cancel()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0 - (engine.cpu_s - e0)
    timeline.append((time.perf_counter(), engine.generated, time.process_time() - engine.cpu_s))
    return {"wall_s": wall, "client_cpu_s": cpu, "tokens": engine.generated - g0, "turns": engine.requests - r0,
            "timeline": timeline, "gaps": engine.gaps[gaps0:], "engine_cpu_s": engine.cpu_s - e0}


class NothingMeasured(Exception):
    """A run left nothing to measure: it generated no tokens."""


def sustained(timeline: list[tuple[float, int, float]]) -> float:
    """Tokens per second from 10 % to 90 % of the run's tokens; :class:`NothingMeasured` when
    the run generated none (a rate of 0 would read as a figure)."""
    total = timeline[-1][1] - timeline[0][1] if timeline else 0
    if total <= 0:
        raise NothingMeasured(f"the run generated no tokens in {len(timeline)} samples of the engine's count, so it "
                              "has no sustained tok/s: its programs never reached the engine, or their turns are "
                              "0 tokens long (--turn-tokens)")
    lo = next(x for x in timeline if x[1] - timeline[0][1] >= 0.1 * total)
    hi = next(x for x in timeline if x[1] - timeline[0][1] >= 0.9 * total)
    return (hi[1] - lo[1]) / max(1e-9, hi[0] - lo[0])


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- the profile, by part ---------------------------------------------------------------------
#: (part, path fragments of the modules whose functions' own time is the part's). Functions
#: elsewhere (the standard library, C functions, other packages) count to their callers' part.
PARTS = [
    ("engine (subtracted)", ("agentenv/engines/instant.py",)),
    ("parse", ("agentenv/formats.py", "transformers/", "tokenizers/")),
    ("scheduler", ("agentenv/scheduler.py",)),
    ("sandbox I/O", ("agentenv/sandboxes/",)),
    ("log", ("agentenv/journal.py", "agentenv/inflight.py")),
    ("writer", ("agentenv/writer.py",)),
    ("stats", ("agentenv/stats.py", "agentenv/summary.py")),
    ("progress", ("rich/", "agentenv/rollout_run.py")),
    ("program and reactor", ("agentenv/program.py", "agentenv/reactor.py", "agentenv/sources.py", "agentenv/env.py",
                             "agentenv/tools.py", "agentenv/workload.py", "agentenv/trajectory.py")),
    ("event loop", ("asyncio/", "anyio/", "selectors.py", "uvloop/")),
]


def part_of(path: str) -> str | None:
    for part, frags in PARTS:
        if any(f in path for f in frags):
            return part
    return None


def split_by_part(stats: pstats.Stats) -> dict[str, float]:
    """Each function's own time, by part: a function outside the parts gives its time to its
    callers' parts in proportion to the time each caller spent in it."""
    raw = stats.stats  # type: ignore[attr-defined]
    memo: dict[tuple, dict[str, float]] = {}

    def shares(func: tuple, depth: int = 0) -> dict[str, float]:
        """Where ``func``'s time goes: {part: fraction}."""
        if func in memo:
            return memo[func]
        part = part_of(func[0].replace("\\", "/"))
        if part is not None:
            out = {part: 1.0}
        else:
            callers = raw[func][4] if func in raw else {}
            total = sum(v[3] for v in callers.values())
            out = {}
            if depth < 12 and total > 0:
                memo[func] = {"other": 1.0}  # a cycle resolves to "other"
                for caller, v in callers.items():
                    for k, f in shares(caller, depth + 1).items():
                        out[k] = out.get(k, 0.0) + f * v[3] / total
            out = out or {"other": 1.0}
        memo[func] = out
        return out

    parts: dict[str, float] = {}
    for func, (_, _, tt, _, _) in raw.items():
        for k, f in shares(func).items():
            parts[k] = parts.get(k, 0.0) + tt * f
    return parts


# -- the grid ---------------------------------------------------------------------------------
async def setting(args, programs: int, turn: int, workdir: Path, profile: bool = False) -> dict:
    """One grid point: flat out (the throughput and CPU), then paced (the latency)."""
    total = max(programs, args.min_programs)
    use_sandbox = programs <= args.max_sessions
    row: dict = {"programs": programs, "turn_tokens": turn, "total_programs": total, "sandbox": use_sandbox}
    sandbox_cm = (LocalSandbox(max_workers=max(programs, 1) + 16, prewarm=0) if use_sandbox
                  else contextlib.nullcontext(None))
    async with sandbox_cm as sandbox:
        engine = InstantEngine(max_model_len=10**6)
        # CPU time of this thread (wall time would count the event loop's idle waits in epoll).
        prof = cProfile.Profile(time.thread_time) if profile else None
        if prof is not None:
            prof.enable()
        # The profiled run goes to its end: the profiler slows it, and the programs' ends (the
        # writer's lines) must be in it.
        r = await run_once(engine, programs, total, turn, sandbox, workdir,
                           seconds=None if profile else args.max_seconds)
        if prof is not None:
            prof.disable()
        row.update(tokens=r["tokens"], turns=r["turns"], wall_s=r["wall_s"], client_cpu_s=r["client_cpu_s"],
                   engine_cpu_s=r["engine_cpu_s"], tok_s=sustained(r["timeline"]),
                   run_tok_s=r["tokens"] / r["wall_s"], turns_s=r["turns"] / r["wall_s"] * sustained(r["timeline"])
                   / max(1e-9, r["tokens"] / r["wall_s"]),
                   us_per_token=1e6 * r["client_cpu_s"] / max(1, r["tokens"]),
                   us_per_turn=1e6 * r["client_cpu_s"] / max(1, r["turns"]))
        if prof is not None:
            parts = split_by_part(pstats.Stats(prof))
            engine_s = parts.pop("engine (subtracted)", 0.0)
            whole = sum(parts.values())
            # The profiler slows every function alike: the split is scaled to the unprofiled
            # run's client CPU (profile-free figures come from the run below).
            row["parts_share"] = {k: v / whole for k, v in sorted(parts.items(), key=lambda x: -x[1])}
            row["profile_engine_s"] = engine_s
        if args.paced_tok_s:
            paced = InstantEngine(max_model_len=10**6, tok_s=args.paced_tok_s)
            p = await run_once(paced, programs, total, turn, sandbox, workdir, seconds=args.paced_seconds)
            gaps = p["gaps"]
            row.update(paced_tok_s=args.paced_tok_s, gap_p50_ms=1e3 * pct(gaps, 0.5), gap_p99_ms=1e3 * pct(gaps, 0.99),
                       gaps=len(gaps))
    return row


def print_row(r: dict) -> None:
    print(f"{r['programs']:6d} programs  {r['turn_tokens']:4d}-token turns  "
          f"{'local pool' if r['sandbox'] else 'no sandbox'}  {r['tok_s']:8.0f} tok/s  {r['turns_s']:6.0f} turns/s  "
          f"client {r['us_per_token']:6.1f} us/token  {r['us_per_turn']:7.0f} us/turn  "
          + (f"gap p50/p99 {r['gap_p50_ms']:.2f}/{r['gap_p99_ms']:.2f} ms (engine at {r['paced_tok_s']:.0f} tok/s)"
             if "gap_p50_ms" in r else ""), flush=True)
    if "parts_share" in r:
        us = r["us_per_token"]
        print("    by part (us/token): " + ", ".join(f"{k} {us * v:.1f}" for k, v in r["parts_share"].items()),
              flush=True)


async def main_async(args) -> None:
    # The progress bar draws as on a terminal (into /dev/null), as it costs in a real run.
    os.environ.setdefault("TTY_COMPATIBLE", "1")
    os.environ.setdefault("TTY_INTERACTIVE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as null:
        for programs in args.programs:
            for turn in args.turn_tokens:
                headline = (programs, turn) == HEADLINE
                real_err, sys.stderr = sys.stderr, null
                try:
                    r = await setting(args, programs, turn, Path(tmp))
                    if headline and args.profile:
                        prof = await setting(args, programs, turn, Path(tmp), profile=True)
                        r["parts_share"] = prof["parts_share"]
                finally:
                    sys.stderr = real_err
                rows.append(r)
                print_row(r)
    head = next((r for r in rows if (r["programs"], r["turn_tokens"]) == HEADLINE), rows[0])
    figures = {"rows": rows, "headline_setting": {"programs": head["programs"], "turn_tokens": head["turn_tokens"]},
               "max_tok_s": max(r["tok_s"] for r in rows), "client_us_per_token": head["us_per_token"]}
    if args.baseline is not None:
        figures["baseline_client_us_per_token"] = args.baseline
        print(f"before: {args.baseline:.1f} us/token; now {head['us_per_token']:.1f} us/token")
    print(f"event loop: {'uvloop' if args.uvloop else 'asyncio'}")
    print(f"client_us_per_token: {head['us_per_token']:.1f}")
    _report.write("client", figures, headline="client_us_per_token", args=args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, nargs="+", default=[64, 1000, 10000])
    p.add_argument("--turn-tokens", type=int, nargs="+", default=[16, 57, 512])
    p.add_argument("--quick", action="store_true",
                   help="the headline setting and the 10,000-program latency only (57-token turns)")
    p.add_argument("--min-programs", type=int, default=256, help="programs per run at least (64 at once: 256)")
    p.add_argument("--max-sessions", type=int, default=1000,
                   help="most sandbox sessions at once; with more programs, tools run without the sandbox")
    p.add_argument("--paced-tok-s", type=float, default=20_000.0,
                   help="the engine's rate for the latency runs (0: skip them)")
    p.add_argument("--paced-seconds", type=float, default=6.0)
    p.add_argument("--max-seconds", type=float, default=30.0,
                   help="a flat-out run stops this long after its first request (the figures cover what ran)")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop (pip install uvloop)")
    p.add_argument("--baseline", type=float, default=None,
                   help="the headline figure measured before a change, printed beside this one and recorded")
    args = p.parse_args()
    if args.quick:
        args.programs, args.turn_tokens = [1000, 10000], [57]
    try:
        anyio.run(main_async, args, backend_options={"use_uvloop": True} if args.uvloop else {})
    except NothingMeasured as exc:
        sys.exit(f"bench/client.py: {exc}")


if __name__ == "__main__":
    main()
