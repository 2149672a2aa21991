"""What the gateway costs: agent programs through HTTP beside the reactor's own programs.

    python bench/gateway.py [--programs 1000] [--calls 4] [--tokens 64]

``--programs`` agent programs run at once (``agentenv.AgentEnvironment``), each a plain
``openai`` SDK loop of ``--calls`` chat completions through the gateway, every request
extending the previous one (its messages, the reply, a new user turn), on
:class:`~agentenv.testing.InstantEngine` (every reply ``--tokens`` tokens, no model). The same
number of native programs, ``--calls`` turns of ``--tokens`` each, run on the reactor's own
path for comparison. The HTTP path runs twice: agents on the ``openai`` SDK, and the same loop
posting JSON over one shared ``httpx`` client (the gateway without the SDK's own cost). For
each path it prints this process's CPU time per generated token (every thread, less the
engine's own CPU; the HTTP path's includes the agents' SDK clients, which run in this process
too), tokens per second, and for the HTTP path the latency of a call as the agent sees it (p50
/ p99: with the engine at no cost this is the gateway, the client and the event loop's queue of
every other program's work). Last line: ``gateway_overhead_ratio: X``, HTTP (openai SDK agents)
µs/token over in-process µs/token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import AgentEnvironment, Environment, Reactor, RolloutConfig, Task  # noqa: E402
from agentenv.testing import InstantEngine  # noqa: E402


class Native(Environment):
    id = "bench-native"

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.max_turns = calls  # type: ignore[misc]

    def tasks(self, n, seed=0):
        return [Task(f"b/{i}", "Say x.") for i in range(n)]

    def tools(self):
        return []

    async def reward(self, task, trajectory):
        return 0.0


class HttpAgent(AgentEnvironment):
    id = "bench-gateway"
    agent_timeout = 3600.0  # a loaded machine's 1,000 programs take minutes: the bench measures, it does not time out
    latencies: list[float] = []

    def __init__(self, calls: int, tokens: int, raw: bool = False) -> None:
        super().__init__()
        self.calls, self.tokens, self.raw = calls, tokens, raw
        self.max_turns = calls  # type: ignore[misc]
        self._http = None

    def tasks(self, n, seed=0):
        return [Task(f"b/{i}", "Say x.") for i in range(n)]

    async def agent(self, task, client, model):
        if self.raw:
            return await self._raw(task, client, model)
        messages = [{"role": "user", "content": task.question}]
        for k in range(self.calls):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=self.tokens)
            self.latencies.append(time.perf_counter() - t0)
            messages += [r.choices[0].message, {"role": "user", "content": f"More {k}."}]
        return "done"

    async def _raw(self, task, client, model):
        """The same loop over one shared ``httpx`` client posting JSON: the gateway's cost
        without the ``openai`` SDK's own."""
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=2000),
                                           timeout=600)
        url, head = (
            f"{str(client.base_url).rstrip('/')}/chat/completions",
            {"Authorization": f"Bearer {client.api_key}"},
        )
        messages = [{"role": "user", "content": task.question}]
        for k in range(self.calls):
            t0 = time.perf_counter()
            r = (await self._http.post(url, headers=head, json={"model": model, "messages": messages,
                                                                "max_tokens": self.tokens})).json()
            self.latencies.append(time.perf_counter() - t0)
            messages += [r["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]
        return "done"

    async def reward(self, task, trajectory):
        return 0.0


_TOKENIZER: list = []


async def measure(env, programs: int, tokens: int) -> dict:
    engine = InstantEngine(_TOKENIZER[0] if _TOKENIZER else None, turn_tokens=tokens)
    _TOKENIZER[:] = [engine.tokenizer]
    config = RolloutConfig(max_new_tokens=10**6, max_tokens_per_turn=tokens, concurrency=max(1, programs // 8),
                           max_programs=programs)
    c0, t0 = time.process_time(), time.perf_counter()
    async with Reactor(engine, env, None, config) as reactor:
        groups = await reactor.collect(env.tasks(programs), 1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0 - engine.cpu_s
    trajs = [t for g in groups for t in g.trajectories]
    bad = [t.error for t in trajs if t.finish_reason not in ("stop", "max_turns", "length")]
    sampled = sum(t.num_sampled_tokens for t in trajs)
    return {"programs": len(trajs), "failed": len(bad), "first_error": bad[0] if bad else None, "tokens": sampled,
            "us_per_token": 1e6 * cpu / max(sampled, 1), "tok_s": sampled / wall, "wall_s": wall,
            "gateway": trajs[0].metadata.get("gateway") if trajs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    for env in (Native(a.calls), HttpAgent(a.calls, a.tokens), HttpAgent(a.calls, a.tokens, raw=True)):  # warm
        anyio.run(measure, env, 4, a.tokens)
    native = anyio.run(measure, Native(a.calls), a.programs, a.tokens)
    HttpAgent.latencies = []
    raw = anyio.run(measure, HttpAgent(a.calls, a.tokens, raw=True), a.programs, a.tokens)
    raw_lat, HttpAgent.latencies = sorted(HttpAgent.latencies), []
    http = anyio.run(measure, HttpAgent(a.calls, a.tokens), a.programs, a.tokens)
    lat = sorted(HttpAgent.latencies)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}  cpus: {os.cpu_count()}")
    for name, r in (("in-process", native), ("http httpx", raw), ("http openai", http)):
        print(
            f"{name:>10}: {r['programs']} programs ({r['failed']} failed), {r['tokens']} tokens in {r['wall_s']:.1f}s: "
            f"{r['us_per_token']:.2f} µs/token client CPU, {r['tok_s']:.0f} tok/s"
        )
    for name, r in (("http httpx", raw), ("http openai", http)):
        if r["first_error"]:
            print(f"{name} first failure: {r['first_error']}")
    for name, xs in (("httpx", raw_lat), ("openai", lat)):
        if xs:
            p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
            print(f"{name} call latency as the agent sees it: p50 {1e3 * statistics.median(xs):.1f} ms, "
                  f"p99 {1e3 * p99:.1f} ms ({len(xs)} calls)")
    print(f"gateway figures of one program: {http['gateway']}")
    print(f"gateway_overhead_ratio_httpx_client: {raw['us_per_token'] / native['us_per_token']:.2f}")
    print(f"gateway_overhead_ratio: {http['us_per_token'] / native['us_per_token']:.2f}")


if __name__ == "__main__":
    main()
