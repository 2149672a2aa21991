"""How close a real rollout gets to its engine's decode limit (retool-math, the bundled model).

    python bench/rollout_limit.py [--engine vllm] [--tasks 64 --group-size 4 --concurrency 64]
                                  [--scheduling program fifo program:cold]

Does what ``agentenv rollout --env retool-math`` does (same config, the library API), once
per ``--scheduling`` policy on one engine, after a warm-up. Like the CLI, each run first
prepares the sandbox sessions its first programs take (``prepare_sessions``: the CLI does it
while the model loads; the bench prints both times). ``<policy>:cold`` skips that, so every
session starts beside the first turns, as before the CLI prepared them.

Right after each run, on the same engine, it measures pure decode: ``--concurrency``
closed-loop requests with that run's mean prompt length and mean turn length (no tools,
prefixes cached); the policy's ratio is to that (this VM's speed drifts over minutes, and the
model's turn lengths from run to run). Prints each policy's generated tok/s, mean requests in
flight, engine idle fraction, the share of the time with under half the decode slots busy
(the run's tail, mostly) and time waiting for sandbox sessions; then the longest program's own
path (its turns in the engine, as fast as they ran, plus its tools): the run cannot end sooner,
so the time the run's tokens take at pure decode over that path bounds the ratio whatever order
the slots go in. Last ``rollout_limit_ratio: <first policy tok/s / pure-decode tok/s>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.engines import open_engine  # noqa: E402
from agentenv.reactor import prepare_sessions  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

from scheduling import longest_path, pure_decode  # noqa: E402  (bench/scheduling.py)
import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def mean_lengths(groups) -> tuple[int, int]:
    turns = [x for g in groups for t in g.trajectories for x in t.turns]
    return round(statistics.mean(t.prompt_tokens for t in turns)), max(
        1, round(statistics.mean(t.new_tokens for t in turns))
    )


async def main_async(args) -> None:
    env = make("retool-math")
    t0 = time.perf_counter()
    engine = await open_engine(args.engine, str(default_model()), seed=args.seed)
    print(f"{args.engine} engine loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    async with engine:
        ratios, figures = [], {}
        for i, policy in enumerate(["warm-up"] + args.scheduling):
            name, _, cold = (policy if policy != "warm-up" else args.scheduling[0]).partition(":")
            cfg = RolloutConfig(max_turns=env.max_turns, max_new_tokens=384, concurrency=args.concurrency,
                                scheduling=name, tool_timeout=env.tool_timeout)
            tasks = env.tasks(args.tasks if policy != "warm-up" else 8, seed=args.seed + i)
            async with LocalSandbox() as sb, Reactor(engine, env, sb, cfg) as reactor:
                if not cold:
                    t0 = time.perf_counter()
                    n = await prepare_sessions(env, sb, cfg, len(tasks) * args.group_size, wait=True)
                    if policy != "warm-up":
                        print(f"{policy:12s} {n} sessions prepared in {time.perf_counter() - t0:.1f}s", flush=True)
                t0 = time.perf_counter()
                groups = await reactor.collect(tasks, args.group_size)
                wall = time.perf_counter() - t0
            if policy == "warm-up":
                continue
            s = reactor.stats
            d = s.summary()
            rate = s.outcomes.sampled_tokens / wall
            print(
                f"{policy:12s} {sum(len(g.trajectories) for g in groups)} programs in {wall:.1f}s: {rate:.0f} tok/s, "
                f"in flight {s.occupancy.mean_in_flight:.1f}, engine idle {100 * s.occupancy.idle_fraction:.1f}%, "
                f"under half the slots {100 * s.occupancy.under_half_fraction:.1f}%, session waits "
                f"{s.sessions.session_waits} ({s.sessions.session_wait_s:.1f}s), session start p50/p90 "
                f"{d['session_start_p50_ms']}/{d['session_start_p90_ms']} ms, "
                f"resume reuse {100 * s.outcomes.resume_reuse:.1f}%",
                flush=True,
            )
            # Right after each run (this VM's speed drifts over minutes), at that run's own mean
            # prompt and turn lengths (the model's turns vary from run to run, and tok/s with them).
            prompt, turn = mean_lengths(groups)
            await pure_decode(engine, prompt, turn, args.concurrency, 1.0)  # its prompts cached
            limit = await pure_decode(engine, prompt, turn, args.concurrency, 6.0)
            ratios.append((policy, rate / limit))
            figures[policy] = {"wall_s": wall, "tok_s": rate, "pure_decode_tok_s": limit, "ratio": rate / limit,
                               "in_flight": s.occupancy.mean_in_flight, "under_half": s.occupancy.under_half_fraction,
                               "session_waits": s.sessions.session_waits,
                               "session_start_p50_ms": d["session_start_p50_ms"]}
            print(f"{policy:12s} pure decode: {limit:.0f} tok/s ({args.concurrency} requests, prompt {prompt}, "
                  f"turn {turn} tokens); ratio {rate / limit:.2f}", flush=True)
            # The run cannot end before its longest program does: that program's own path (its
            # turns in the engine, as fast as they ran, and its tools) against the time the run's
            # tokens take at pure decode bounds the ratio whatever the order of slots.
            path, traj = longest_path(groups)
            work = s.outcomes.sampled_tokens / limit
            figures[policy] |= {"longest_path_s": path, "bound": work / path}
            print(f"{policy:12s} longest program: {path:.1f}s in the engine and on tools ({traj.num_sampled_tokens} "
                  f"tokens, {len(traj.turns)} turns; {wall - path:.1f}s of the run it was not on them); the run's "
                  f"tokens at pure decode: {work:.1f}s; bound {work / path:.2f}", flush=True)
        print(f"rollout_limit_ratio: {ratios[0][1]:.2f}")
        _report.write("rollout_limit", {**figures, "rollout_limit_ratio": ratios[0][1]},
                      headline="rollout_limit_ratio", args=args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="vllm", choices=["vllm", "embedded"])
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--scheduling", nargs="+", default=["program", "fifo", "program:cold"],
                   choices=[f"{p}{c}" for p in ("program", "fifo", "lockstep") for c in ("", ":cold")])
    p.add_argument("--seed", type=int, default=0)
    anyio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
