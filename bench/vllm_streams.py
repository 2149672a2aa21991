"""vLLM's streaming-input requests against a new request per turn, side by side.

    python bench/vllm_streams.py [--programs 64 --turns 8 --turn-tokens 27 --tool-tokens 30 --rounds 3]

A closed loop of tool-calling programs on one vLLM engine (the bundled model): each program
samples ``--turn-tokens`` tokens, then appends ``--tool-tokens`` tokens (its "tool output"),
``--turns`` times. Two ways, alternating round by round on the same engine:

* ``request`` (``engine.sessions = False``): every turn is a new request whose prompt is the
  whole sequence so far; the prefix cache serves every *full* KV block, so each turn prefills
  its new tokens plus the part of the last block the cache does not keep;
* ``stream`` (``engine.sessions = True``, vLLM's word): one vLLM streaming-input request per
  program (``agentenv.engines.vllm_streams``): its KV stays allocated between turns, and a turn
  prefills only its new tokens (and the one sampled last), at the price of per-token deltas.

Both go through ``Engine.generate_turn`` and ``Engine.release``, as the reactor does.

Prints each round's tok/s for both, then ``stream_speedup: <median stream / median request>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.engines import SamplingParams, open_engine  # noqa: E402
from agentenv.models import default_model  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


def _ids(rnd: random.Random, n: int, vocab: int) -> list[int]:
    return [rnd.randrange(10, vocab) for _ in range(n)]


async def program(engine, p: int, args, seed: int, vocab: int) -> int:
    """One program's turns through ``Engine.generate_turn`` (a streaming-input request or a request
    per turn, as ``engine.sessions`` says), then ``release``."""
    rnd = random.Random(seed * 100_003 + p)
    ids = _ids(rnd, args.prompt_tokens, vocab)
    params = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0, stop_token_ids=())
    key = f"bench-{seed}-{p}"
    sampled = 0
    try:
        for turn in range(args.turns):
            g = await engine.generate_turn(key, ids, params, f"{key}-{turn}")
            ids += g.token_ids + _ids(rnd, args.tool_tokens, vocab)
            sampled += len(g.token_ids)
    finally:
        engine.release(key)
    return sampled


async def main_async(args) -> None:
    engine = await open_engine("vllm", str(default_model()), seed=0)
    vocab = min(len(engine.tokenizer), 200)
    rates: dict[str, list[float]] = {"request": [], "stream": []}
    async with engine:
        for rnd in range(args.rounds + 1):  # round 0 warms both paths up
            for mode in ("request", "stream"):
                engine.sessions = mode == "stream"
                counts: list[int] = []

                async def one(p: int) -> None:
                    counts.append(await program(engine, p, args, rnd, vocab))

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for p in range(args.programs):
                        tg.start_soon(one, p)
                rate = sum(counts) / (time.perf_counter() - t0)
                if rnd:
                    rates[mode].append(rate)
                    print(f"round {rnd} {mode:8s} {sum(counts)} tokens: {rate:.0f} tok/s", flush=True)
    req, ses = statistics.median(rates["request"]), statistics.median(rates["stream"])
    print(f"median: request {req:.0f} tok/s, stream {ses:.0f} tok/s")
    print(f"stream_speedup: {ses / req:.2f}")
    _report.write("vllm_streams", {"tok_s": rates, "median_request_tok_s": req, "median_stream_tok_s": ses,
                                   "stream_speedup": ses / req}, headline="stream_speedup", args=args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=109)
    p.add_argument("--turn-tokens", type=int, default=27)
    p.add_argument("--tool-tokens", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    anyio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
