"""What bounds the program-aware policy's ratio to pure decode: the simulator, one cost removed at a time.

    python bench/scheduling.py --json run.json     # a real run: the engine fitted, the figures
    python bench/bounds.py --from run.json

Takes a ``bench/scheduling.py`` run's fitted engine, its session start rate and its trace
workload (the first KV setting), and simulates the program-aware policy on the same traces,
removing one cost after another (each row keeps the removals above it):

1. as fitted (the same simulation ``bench/scheduling.py`` printed);
2. sandbox sessions start at once;
3. prefill costs nothing (prompts and tool outputs);
4. every program is admitted at once (no ``max_programs`` cap);
5. tools take no time.

Each row prints the simulated wall time and its ratio to the pure decode measured around the
real program run. Where a row lifts the ratio, that cost bounded it; what is left after the
last row is the decode itself (the engine's rate at these contexts against the reference's).
The simulator leaves out the client's own CPU cost, so the real ratio sits below row 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.simulator import EngineModel, simulate  # noqa: E402
from agentenv.workload import WorkloadSpec, workload  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="the --json file of a bench/scheduling.py run (with its simulator)")
    args = p.parse_args()

    run = json.loads(args.source.read_text())
    a, setting = run["args"], run["settings"][0]
    if not setting.get("simulator_engine") or not setting.get("session_starts_per_s"):
        sys.exit(f"{args.source} has no fitted simulator engine or session start rate: run bench/scheduling.py "
                 "without --no-simulate (a version that saves session_starts_per_s)")
    real = {r["policy"]: r for r in setting["results"]}.get("program")
    if real is None:
        sys.exit(f"{args.source} has no program-aware run in its first KV setting")
    spec = WorkloadSpec(profile=a["profile"], tool_median=a["tool_median"], mean_turns=a["mean_turns"],
                        tool_cap=a["tool_cap"], turn_tokens=a["turn_tokens"], tool_tokens=a["tool_tokens"])
    traces = [t for g in workload(spec, a["tasks"], a["group_size"], a["seed"]) for t in g]
    pure = real["pure_decode_tok_s"]
    # As bench/scheduling.py does: the fitted engine, at the speed the real one had around this run.
    engine = EngineModel(**setting["simulator_engine"]).slowed(setting["pure_decode_runs"][0] / pure)
    session_start_s = 2 / setting["session_starts_per_s"]
    tokens = sum(sum(t.turn_tokens) for t in traces)
    print(f"{args.source}: {len(traces)} programs, {tokens} sampled tokens, {a['concurrency']} decode slots; real "
          f"program run {real['wall_s']:.1f} s, ratio {real['ratio']:.2f} against {pure:.0f} tok/s of pure decode")

    free_tools = [dataclasses.replace(t, tool_latency=tuple(0.0 for _ in t.tool_latency)) for t in traces]
    rows = [
        ("as fitted", traces, engine, session_start_s, real["max_programs"]),
        ("+ sessions start at once", traces, engine, 0.0, real["max_programs"]),
        ("+ prefill costs nothing", traces, dataclasses.replace(engine, prefill_per_token=0.0), 0.0,
         real["max_programs"]),
        ("+ every program admitted at once", traces, dataclasses.replace(engine, prefill_per_token=0.0), 0.0,
         len(traces)),
        ("+ tools take no time", free_tools, dataclasses.replace(engine, prefill_per_token=0.0), 0.0, len(traces)),
    ]
    figures = {}
    for label, tr, m, start_s, max_programs in rows:
        r = simulate(tr, m, "program", concurrency=a["concurrency"], group_size=a["group_size"],
                     max_programs=max_programs, session_start_s=start_s)
        print(f"{label:34s} wall {r.wall_s:6.1f} s  ratio {r.tokens / r.wall_s / pure:.2f}  "
              f"in flight {r.in_flight:5.1f}  idle {100 * r.idle:4.1f}%")
        figures[label] = {"wall_s": r.wall_s, "ratio": r.tokens / r.wall_s / pure, "in_flight": r.in_flight,
                          "idle": r.idle}
    _report.write("bounds", {"real_ratio": real["ratio"], "rows": figures,
                             "as_fitted_ratio": figures["as fitted"]["ratio"]}, headline="as_fitted_ratio", args=args)


if __name__ == "__main__":
    main()
