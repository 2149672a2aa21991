"""Scheduling policies side by side: lockstep vs per-request FIFO vs program-aware.

    python bench/scheduling.py [--engine vllm|embedded] [--tasks 32 --group-size 4 --concurrency 32]

One run, one engine per KV setting, the same trace workload (``agentenv.workload``: turn
counts, turn lengths, tool-output lengths and tool latencies fixed per program by the seed;
lengths enforced through max_tokens with no stop token) under three policies
(``RolloutConfig(scheduling=...)``):

* ``lockstep``: TRL-style: a batch of programs (as many as the program-aware policy admits:
  ``RolloutConfig.max_programs``) advances turn by turn, each turn's requests sent together;
* ``fifo``: today's reactor before the scheduler: ``concurrency`` programs in flight, each
  holding its slot from its sandbox session's start to its end;
* ``program``: the program-aware scheduler (KV-aware admission, pause/restore, sessions
  prepared ahead, ``concurrency`` decode slots, programs decoupled from them).

Twice: with the engine's default KV budget (the working set fits), and with a KV budget of
1/``--oversubscribe`` of what FIFO's ``concurrency`` programs hold (set through the engine's
own settings). For each KV setting the engine's pure-decode rate is measured in the same run:
``concurrency`` closed-loop requests of the workload's mean context and mean turn length
(fewer where the KV cannot hold that many: as many as it holds, since past that the loop
measures the engine preempting its own requests), prefixes cached, measured before the first
policy and again after each one; a policy's
reference is the mean of the two measurements around its run (the VM's speed drifts over a
long run). Per policy it prints wall time, generated tok/s, the ratio to that pure decode,
mean requests in flight, engine idle fraction, the share of the time under half the decode
slots (mostly the run's tail), resume prefix-cache reuse, re-prefilled tokens, pauses and
restores, and the longest program's own path (its turns' latency as they ran plus its tools:
the run cannot end sooner, so the run's tokens at pure decode over it bound the ratio whatever
the order of slots); then the speedups, and last ``limit_ratio: <program tok/s / pure-decode
tok/s>`` for the first KV setting (the working set fits).

The simulator (``agentenv.simulator``) then runs the same traces through the same scheduler,
its engine fitted in this run: decode rates at 1, 4, 16 and ``concurrency`` requests, at
twice the context (attention's share), and with nothing cached (prefill's price per token);
where the KV holds fewer than ``concurrency`` requests, the previous setting's engine (the
same model on the same machine) at the speed measured here, with this setting's KV and
prefill price;
sandbox sessions start at the rate measured while the engine decodes; per policy the
engine's speed is scaled to the pure decode measured around that policy's run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.engines import SamplingParams, open_engine  # noqa: E402
from agentenv.models import default_model  # noqa: E402
from agentenv.simulator import EngineModel, fit_engine, fit_prefill, simulate  # noqa: E402
from agentenv.workload import WorkloadSpec, workload  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)

POLICIES = ("lockstep", "fifo", "program")
#: "program-held": the program policy without the engine's costs (acting programs keep their
#: KV for their whole tool), to compare with the costed one side by side.
CHOICES = (*POLICIES, "program-held")


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4  # K and V, float32


async def pure_decode(engine, context: int, turn: int, concurrency: int, seconds: float, fresh: bool = False) -> float:
    """Closed loop: ``concurrency`` workers, each re-sending its own ``context``-token prompt
    (cached after the first request) for ``turn`` new tokens, until ``seconds`` have passed.
    ``fresh``: every request's prompt is new from its first block (nothing cached: each
    request prefills its whole prompt)."""
    tokens = [0]
    deadline = time.perf_counter() + seconds
    vocab = engine.tokenizer.convert_tokens_to_ids("x") or 1
    params = SamplingParams(max_tokens=turn, temperature=1.0, stop_token_ids=())

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            tail = [w % 200 + 3, w // 200 + 3] + ([i % 200 + 3, i // 200 + 3] if fresh else [5, 6])
            prompt = list(reversed([vocab] * (context - 4) + tail))  # distinct from the first block
            g = await engine.generate(prompt, params, f"decode-{w}-{i}")
            tokens[0] += len(g.token_ids)
            i += 1

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for w in range(concurrency):
            tg.start_soon(worker, w)
    return tokens[0] / (time.perf_counter() - t0)


def longest_path(groups) -> tuple[float, object]:
    """The longest program's own path and that program: its turns in the engine (as fast as
    they ran) plus its tools. The run cannot end before it, whatever the order of slots."""
    return max(((sum(x.latency_s for x in t.turns) + sum(c.duration_s for c in t.tool_calls), t)
                for g in groups for t in g.trajectories), key=lambda x: x[0])


async def session_start_rate(n: int = 32) -> float:
    """Isolated sandbox sessions started per second, ``n`` at once on a fresh pool."""
    async with LocalSandbox(prewarm=0) as sb:
        await (await sb.session()).aclose()  # the fork server is up
        t0 = time.perf_counter()
        sessions = []

        async def one() -> None:
            sessions.append(await sb.session())

        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(one)
        rate = n / (time.perf_counter() - t0)
        for x in sessions:
            await x.aclose()
    return rate


async def run_policy(engine, env, tasks, group_size: int, policy: str, concurrency: int,
                     max_programs: int | None = None, cost_model=None) -> dict:
    label, policy = policy, policy.removesuffix("-held")
    cost_model = None if label == "program-held" else cost_model
    cfg = RolloutConfig(scheduling=policy, concurrency=concurrency, max_turns=64, max_new_tokens=100_000,
                        max_tokens_per_turn=4096, tool_timeout=60.0, max_programs=max_programs)
    async with LocalSandbox() as sandbox, Reactor(engine, env, sandbox, cfg, cost_model=cost_model) as reactor:
        t0, c0 = time.perf_counter(), time.process_time()
        groups = await reactor.collect(tasks, group_size)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = reactor.stats
    n = sum(len(g.trajectories) for g in groups)
    bad = [t.finish_reason for g in groups for t in g.trajectories if t.finish_reason != "stop"]
    path, _ = longest_path(groups)
    return {
        "policy": label,
        "programs": n,
        "wall_s": wall,
        "tokens": s.outcomes.sampled_tokens,
        "tok_s": s.outcomes.sampled_tokens / wall,
        "in_flight": s.occupancy.mean_in_flight,
        "idle": s.occupancy.idle_fraction,
        "under_half": s.occupancy.under_half_fraction,
        "reuse": s.outcomes.resume_reuse,
        "reprefilled": s.outcomes.reprefilled,
        "pauses": s.sessions.pauses,
        "restores": s.sessions.restores,
        "not_stop": len(bad),
        "peak_ws": reactor.scheduler.peak_working_set,
        # Body and tail: the seconds with >= 90 % of the slots busy, and what follows the last.
        "full_and_tail": s.occupancy.full_and_tail(),
        "timeline": [[b[0], round(b[1], 2)] for b in s.occupancy.bins],
        "max_programs": reactor.scheduler.config.max_programs,
        # The engine's costs the reactor measured (its last fit, and how many it made).
        "cost_fit": (None if reactor.cost_fit is None or reactor.cost_fit.model is None
                     else {**dataclasses.asdict(reactor.cost_fit.model), "fits": reactor.cost_fit.fits}),
        "longest_path_s": path,
        # This process's CPU (reactor, sandbox client, engine client; vLLM's engine core is
        # another process) per generated token.
        "client_cpu_us_per_token": 1e6 * cpu / max(1, s.outcomes.sampled_tokens),
    }


async def one_setting(args, label: str, engine_kwargs: dict, traces, prior=None) -> dict:
    """One KV setting; ``prior``: the simulator engine fitted in the previous setting (the
    same model on the same machine), whose decode costs stand in where this one's KV is too
    small to measure them."""
    model = default_model()
    engine = await open_engine(args.engine, str(model), seed=args.seed, **engine_kwargs)
    progs = [p for g in traces for p in g]
    mean_turn = round(statistics.mean(t for p in progs for t in p.turn_tokens))
    # Mean context at the start of a turn, over all turns of all programs.
    ctx = []
    for p in progs:
        n = p.prompt_tokens
        for i, t in enumerate(p.turn_tokens):
            ctx.append(n)
            n += t + (p.tool_tokens[i] if i < len(p.tool_tokens) else 0)
    mean_ctx = round(statistics.mean(ctx))
    async with engine:
        cap = engine.kv_capacity_tokens
        c = args.concurrency

        def fits(batch: int, context: int = mean_ctx) -> bool:
            return cap is None or batch * (context + mean_turn) <= 0.9 * cap

        # Pure decode is measured with as many requests as the KV holds, at most `concurrency`:
        # past that the loop measures the engine preempting and re-prefilling its own requests.
        ref = c if fits(c) else max((b for b in range(1, c) if fits(b)), default=1)
        print(
            f"[{label}] engine={args.engine} kv_capacity={cap} tokens; mean context {mean_ctx}, mean turn {mean_turn}",
            flush=True,
        )
        await pure_decode(engine, mean_ctx, mean_turn, ref, 2.0)  # warm-up
        limit = await pure_decode(engine, mean_ctx, mean_turn, ref, args.decode_seconds)
        held = "" if ref == c else f"; the KV holds no more of the mean context at once, not {c}"
        print(f"[{label}] pure decode: {limit:.0f} tok/s ({ref} requests in flight{held})", flush=True)
        if args.simulate:
            # Calibrate the simulator's engine on this engine now, next to the pure-decode
            # measurement (the engine's speed drifts over a long run on a shared VM): decode
            # rates at a few batch sizes the KV holds, the reference one being the pure-decode
            # rate itself, so the simulated engine and the ratios share one reference.
            rates = {(b, mean_ctx): await pure_decode(engine, mean_ctx, mean_turn, b, 2.0)
                     for b in sorted({1, 4, 16} - {ref}) if fits(b)}
            rates[(ref, mean_ctx)] = limit
            # Prefill's price: the reference loop with nothing cached, against the cached one
            # (which reused all but the prompt's last, partial block).
            cold = await pure_decode(engine, mean_ctx, mean_turn, ref, 3.0, fresh=True)
            cached = (mean_ctx - 1) // engine.page_size * engine.page_size
            prefill = fit_prefill(limit, cold, mean_turn, cached)
            if fits(c, 2 * mean_ctx):
                # Attention's share: the same loop at twice the context.
                await pure_decode(engine, 2 * mean_ctx, mean_turn, c, 0.5)  # one round: their prompts cached
                rates[(c, 2 * mean_ctx)] = await pure_decode(engine, 2 * mean_ctx, mean_turn, c, 3.0)
            sim_engine = fit_engine(rates, kv_capacity=cap or 10**9, block_size=engine.page_size,
                                    prefill_per_token=prefill)
            if prior is not None and ref < c:
                # The KV holds too few requests to see the step's cost at `concurrency`, or
                # attention's share: the previous setting's engine (the same model on the same
                # machine, a larger KV), at the speed measured here, with this KV and the
                # prefill price measured here.
                sim_engine = dataclasses.replace(prior.slowed(prior.decode_rate(ref, mean_ctx) / limit),
                                                 kv_capacity=cap, block_size=engine.page_size,
                                                 prefill_per_token=prefill)
            # Sessions start while the engine decodes in every run, so their rate is measured so.
            async with anyio.create_task_group() as tg:
                tg.start_soon(pure_decode, engine, mean_ctx, mean_turn, ref, 3.0)
                starts = await session_start_rate()
            m = sim_engine
            print(f"[{label}] simulator engine: step {1e3 * m.step_base:.2f} ms + {1e3 * m.step_per_seq:.3f} ms x "
                  f"batch + {1e6 * m.step_per_ctx:.3f} us x context tokens, prefill {1e6 * m.prefill_per_token:.0f} "
                  f"us/token (fit to {', '.join(f'{b}x{n}: {r:.0f}' for (b, n), r in sorted(rates.items()))} "
                  f"tok/s); sandbox sessions start at {starts:.0f}/s while it decodes", flush=True)
        results, around = [], [limit]
        # The program policy weighs holding acting programs' KV against decode slots with the
        # engine's costs as the reactor measures them from the turns it serves, refitted as the
        # run goes (what `agentenv rollout` does); each run prints its last fit, beside the
        # calibration's above (the simulator's engine).
        cost = "measured"
        for policy in (args.policies if label == "kv-fits" else args.oversubscribed_policies):
            env = make("trace", **spec_kwargs(args))
            tasks = env.tasks(args.tasks, seed=args.seed)
            r = await run_policy(engine, env, tasks, args.group_size, policy, args.concurrency, args.max_programs,
                                 cost_model=cost)
            # Pure decode brackets every run: the reference is the mean of the measurements
            # just before and just after it (this VM's speed drifts within one long run).
            # One round first: the run's own prefixes have pushed the loop's prompts out of the cache.
            await pure_decode(engine, mean_ctx, mean_turn, ref, 0.5)
            around.append(await pure_decode(engine, mean_ctx, mean_turn, ref, args.decode_seconds))
            r["pure_decode_tok_s"] = (around[-2] + around[-1]) / 2
            r["ratio"] = r["tok_s"] / r["pure_decode_tok_s"]
            results.append(r)
            print(f"[{label}] {policy:9s} wall {r['wall_s']:6.1f}s  {r['tok_s']:7.0f} tok/s  ratio {r['ratio']:.2f} "
                  f"(pure decode {around[-2]:.0f} before, {around[-1]:.0f} after)  "
                  f"in flight {r['in_flight']:5.1f}  idle {100 * r['idle']:4.1f}%  under half the slots "
                  f"{100 * r['under_half']:4.1f}%  reuse {100 * r['reuse']:5.1f}%  "
                  f"re-prefilled {r['reprefilled']:6d}  pauses {r['pauses']:4d}  restores {r['restores']:4d}  "
                  f"peak working set {r['peak_ws']}  client CPU {r['client_cpu_us_per_token']:.0f} us/token",
                  flush=True)
            work = r["tokens"] / r["pure_decode_tok_s"]
            print(f"[{label}] {policy:9s} longest program: {r['longest_path_s']:.1f} s in the engine and on tools; "
                  f"the run's tokens at pure decode: {work:.1f} s; bound {work / r['longest_path_s']:.2f}", flush=True)
            cf = r["cost_fit"]
            if cf is not None:
                print(f"[{label}] {policy:9s} engine costs measured ({cf['fits']} fits): step "
                      f"{1e3 * cf['step_base']:.2f} ms + {1e3 * cf['step_per_seq']:.3f} ms x batch + "
                      f"{1e6 * cf['step_per_ctx']:.4f} us x batch x context, prefill "
                      f"{1e6 * cf['prefill_per_token']:.1f} us/token", flush=True)
            ft = r["full_and_tail"]
            if ft is not None:
                print(f"[{label}] {policy:9s} body: {ft['full_s']:.0f} s with >= 90% of the slots busy at "
                      f"{ft['full_tok_s']:.0f} tok/s ({ft['full_tok_s'] / r['pure_decode_tok_s']:.2f} of pure decode, "
                      f"{ft['full_tokens'] / max(1, r['tokens']):.0%} of the tokens); tail: {ft['tail_s']:.1f} s after "
                      f"the last such second, {ft['tail_tokens'] / max(1, r['tokens']):.0%} of the tokens; "
                      f"{max(0.0, r['wall_s'] - ft['full_s'] - ft['tail_s']):.0f} s less busy before it", flush=True)
        sim = []
        if args.simulate:
            # The same traces through the same scheduler, in simulated time.
            session_start_s = 2 / starts  # two CPUs start sessions
            for r in results:
                t = time.perf_counter()
                # The simulated engine runs at the speed the real one had around this run.
                m = sim_engine.slowed(limit / r["pure_decode_tok_s"])
                sr = simulate(progs, m, r["policy"].removesuffix("-held"), concurrency=args.concurrency,
                              group_size=args.group_size, max_programs=r["max_programs"],
                              session_start_s=session_start_s,
                              cost=r["policy"] != "program-held")
                err = sr.wall_s / r["wall_s"] - 1
                ratio = sr.tok_s / r["pure_decode_tok_s"]  # the model engine decodes that fast at `ref`
                sim.append({"policy": r["policy"], **sr.row(), "error": err, "ratio": ratio,
                            "sim_seconds": time.perf_counter() - t})
                print(
                    f"[{label}] simulated {r['policy']:9s} wall {sr.wall_s:6.1f}s (real {r['wall_s']:.1f}s, "
                    f"error {100 * err:+.1f}%)  {sr.tok_s:7.0f} tok/s  ratio {ratio:.2f}  in flight "
                    f"{sr.in_flight:5.1f}  reuse {100 * sr.reuse:5.1f}%  pauses {sr.pauses}",
                    flush=True,
                )
    return {
        "label": label,
        "kv_capacity": cap,
        "pure_decode_requests": ref,
        "pure_decode_tok_s": statistics.mean(around),
        "pure_decode_runs": around,
        "results": results,
        "simulated": sim,
        "simulator_engine": dataclasses.asdict(sim_engine) if args.simulate else None,
        "session_starts_per_s": starts if args.simulate else None,
    }


def spec_kwargs(args) -> dict:
    return {"profile": args.profile, "tool_median": args.tool_median, "mean_turns": args.mean_turns,
            "turn_tokens": args.turn_tokens, "tool_tokens": args.tool_tokens, "tool_cap": args.tool_cap,
            "sandbox": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="vllm", choices=["vllm", "embedded"])
    p.add_argument("--tasks", type=int, default=128)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--profile", default="lognormal", choices=["lognormal", "swe"])
    p.add_argument("--tool-median", type=float, default=0.5)
    p.add_argument("--mean-turns", type=float, default=5.0)
    p.add_argument("--tool-cap", type=float, default=5.0)
    p.add_argument("--turn-tokens", type=int, default=48)
    p.add_argument("--tool-tokens", type=int, default=24)
    p.add_argument("--max-programs", type=int, default=None, help="RolloutConfig.max_programs (default: its own)")
    p.add_argument("--oversubscribe", type=float, default=2.0, help="0: skip the small-KV setting")
    p.add_argument("--decode-seconds", type=float, default=6.0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=CHOICES)
    p.add_argument("--oversubscribed-policies", nargs="+", default=["fifo", "program"], choices=CHOICES,
                   help="policies run at the small KV budget (lockstep is slow and not the comparison there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-simulate", dest="simulate", action="store_false",
                   help="skip calibrating and running the discrete-event simulator on the same traces")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()

    spec = WorkloadSpec(**{k: v for k, v in spec_kwargs(args).items() if k != "sandbox"})
    traces = workload(spec, args.tasks, args.group_size, args.seed)
    progs = [t for g in traces for t in g]
    mean_total = statistics.mean(t.total_tokens for t in progs)
    print(f"workload: {len(progs)} programs, {args.profile} tools (median {args.tool_median}s), "
          f"turns mean {statistics.mean(t.turns for t in progs):.1f} max {max(t.turns for t in progs)}, "
          f"sampled tokens {sum(sum(t.turn_tokens) for t in progs)}, mean program {mean_total:.0f} tokens", flush=True)
    settings = [("kv-fits", {})]
    if args.oversubscribe > 0:
        small = int(args.concurrency * mean_total / args.oversubscribe)
        if args.engine == "vllm":
            per_tok = kv_bytes_per_token(default_model())
            settings.append((f"kv-{args.oversubscribe:g}x-oversubscribed", {"kv_cache_memory_bytes": small * per_tok}))
        else:
            settings.append((f"kv-{args.oversubscribe:g}x-oversubscribed", {"kv_cache_tokens": small}))

    async def run_all() -> list[dict]:
        out: list[dict] = []
        for label, kw in settings:
            prior = out[-1]["simulator_engine"] if out else None
            out.append(await one_setting(args, label, kw, traces,
                                         prior=EngineModel(**prior) if prior else None))
        return out

    out = anyio.run(run_all)
    for s in out:
        by = {r["policy"]: r for r in s["results"]}
        if "program" in by:
            for other in ("lockstep", "fifo", "program-held"):
                if other in by:
                    ratio = by[other]["wall_s"] / by["program"]["wall_s"]
                    print(f"[{s['label']}] program_vs_{other}: {ratio:.2f}x wall time")
            if "fifo" in by:
                f, g = by["fifo"]["reuse"], by["program"]["reuse"]
                print(f"[{s['label']}] resume reuse program {100 * g:.1f}% vs fifo {100 * f:.1f}% "
                      f"({g / f if f else float('inf'):.2f}x)")
            print(f"[{s['label']}] mean in flight: " + ", ".join(f"{k} {r['in_flight']:.1f}" for k, r in by.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "settings": out}, indent=1))
    first = {r["policy"]: r for r in out[0]["results"]}
    sim = {r["policy"]: r for r in out[0]["simulated"]}
    if "program" in sim:
        # The same schedule and traces with nothing but the engine on the CPUs: how far this
        # workload's shape (prefill of tool outputs, growing contexts, the last programs'
        # tools) lets the scheduler go at this engine speed, apart from the client's own cost.
        print(f"simulated program ratio (same traces, an engine model with the CPUs to itself): "
              f"{sim['program']['ratio']:.2f}")
    if "program" in first:
        print(f"limit_ratio: {first['program']['ratio']:.2f}")
        _report.write("scheduling", {"settings": out, "limit_ratio": first["program"]["ratio"]},
                      headline="limit_ratio", args=args)


if __name__ == "__main__":
    main()
