"""A lever not built yet: vLLM's streaming-input sessions against a new request per turn.

    python bench/vllm_sessions.py [--programs 64 --turns 8 --turn-tokens 27 --tool-tokens 30 --rounds 3]

A closed loop of tool-calling programs on one vLLM engine (the bundled model): each program
samples ``--turn-tokens`` tokens, then appends ``--tool-tokens`` tokens (its "tool output"),
``--turns`` times. Two ways, alternating round by round on the same engine:

* ``request``: what agentenv does today: every turn is a new request (``VLLMEngine.generate``)
  whose prompt is the whole sequence so far; the prefix cache serves every *full* KV block,
  so each turn prefills its new tokens plus the part of the last block the cache does not keep;
* ``session``: one vLLM request per program, fed its turns through an async generator of
  ``StreamingInput`` (vLLM >= 0.32): its KV stays allocated between turns, and a turn
  prefills only its new tokens. This mode calls ``AsyncLLM.generate`` directly (agentenv has
  no session API yet), with per-token deltas, which streaming input requires.

Prints each round's tok/s for both, then ``session_speedup: <median session / median request>``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.engines import SamplingParams, open_engine  # noqa: E402
from agentenv.models import default_model  # noqa: E402


def _ids(rnd: random.Random, n: int, vocab: int) -> list[int]:
    return [rnd.randrange(10, vocab) for _ in range(n)]


async def per_request(engine, p: int, args, seed: int, vocab: int) -> int:
    rnd = random.Random(seed * 100_003 + p)
    ids = _ids(rnd, args.prompt_tokens, vocab)
    params = SamplingParams(max_tokens=args.turn_tokens, temperature=1.0, stop_token_ids=())
    sampled = 0
    for turn in range(args.turns):
        g = await engine.generate(ids, params, f"req-{seed}-{p}-{turn}")
        ids += g.token_ids + _ids(rnd, args.tool_tokens, vocab)
        sampled += len(g.token_ids)
    return sampled


async def per_session(engine, p: int, args, seed: int, vocab: int) -> int:
    from vllm import SamplingParams as VSP
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def sp() -> VSP:
        s = VSP(max_tokens=args.turn_tokens, temperature=1.0, logprobs=0, ignore_eos=True, detokenize=False,
                skip_special_tokens=False)
        s.output_kind = RequestOutputKind.DELTA
        return s

    rnd = random.Random(seed * 100_003 + p)
    chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()

    async def inputs():
        while (chunk := await chunks.get()) is not None:
            yield StreamingInput(TokensPrompt(prompt_token_ids=chunk), sp())

    chunks.put_nowait(_ids(rnd, args.prompt_tokens, vocab))
    sampled = turns = 0
    async for out in engine.llm.generate(inputs(), sp(), f"ses-{seed}-{p}"):
        c = out.outputs[0]
        sampled += len(c.token_ids)
        if c.finish_reason is not None:  # the turn ended; the session waits for its next input
            turns += 1
            chunks.put_nowait(None if turns == args.turns else _ids(rnd, args.tool_tokens, vocab))
    if turns != args.turns:
        raise RuntimeError(f"session {p} ended after {turns} of {args.turns} turns")
    return sampled


async def main_async(args) -> None:
    engine = await open_engine("vllm", str(default_model()), seed=0)
    vocab = min(len(engine.tokenizer), 200)
    rates: dict[str, list[float]] = {"request": [], "session": []}
    async with engine:
        for rnd in range(args.rounds + 1):  # round 0 warms both paths up
            for mode, fn in (("request", per_request), ("session", per_session)):
                counts: list[int] = []

                async def one(p: int) -> None:
                    counts.append(await fn(engine, p, args, rnd, vocab))

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for p in range(args.programs):
                        tg.start_soon(one, p)
                rate = sum(counts) / (time.perf_counter() - t0)
                if rnd:
                    rates[mode].append(rate)
                    print(f"round {rnd} {mode:8s} {sum(counts)} tokens: {rate:.0f} tok/s", flush=True)
    req, ses = statistics.median(rates["request"]), statistics.median(rates["session"])
    print(f"median: request {req:.0f} tok/s, session {ses:.0f} tok/s")
    print(f"session_speedup: {ses / req:.2f}")


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
