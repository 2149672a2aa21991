"""What the gateway costs: agent programs through HTTP beside the reactor's own programs.

    python bench/gateway.py [--programs 1000] [--calls 4] [--tokens 64] [--alone 100]

``--programs`` agent programs run at once (``agentenv.AgentEnvironment``), each a plain
``openai`` SDK loop of ``--calls`` chat completions through the gateway, every request
extending the previous one (its messages, the reply, a new user turn), on
:class:`~agentenv.testing.InstantEngine` (every reply ``--tokens`` tokens, no model). The same
number of native programs, ``--calls`` turns of ``--tokens`` each, run on the reactor's own
path for comparison. The HTTP path runs twice: agents on the ``openai`` SDK, and the same loop
posting JSON through ``httpx``, a client per program (the gateway without the SDK's own cost). For
each path it prints this process's CPU time per generated token (every thread, less the
engine's own CPU; the HTTP path's includes the agents' SDK clients, which run in this process
too), tokens per second, and for the HTTP path the latency of a call as the agent sees it (p50
/ p99: with the engine at no cost this is the gateway, the client and the event loop's queue of
every other program's work). A fourth run puts the agents in another process (an ``httpx``
client per program there, :class:`ElsewhereAgent`): this process then runs only the reactor and the
gateway, so its CPU per token is the gateway path's own cost, without any agent's
(``gateway_overhead_ratio_agents_elsewhere``). Then ``--alone`` agent programs run one at a
time: with nothing else waiting and the engine at no cost, a call's latency as the SDK sees it
is the gateway's, the client's and the reactor's (``call_ms_p99``). Last, the same agents run
against the gateway's own server with nothing behind it (:class:`BareGateway`, a fixed reply):
their CPU there is the HTTP stack's and their clients', the floor under any gateway
(``floor_ratio_*``: floor plus the native path, over the native path); a call's p99 through the
gateway less its p99 there, one program at a time, is what the gateway adds
(``gateway_added_ms_p99``).
The in-process and agents-elsewhere runs are made again with the garbage collector at Python's
own thresholds instead of the reactor's (``agentenv.reactor.GC_THRESHOLD``):
``collector_cpu_ratio`` is the CPU per token with Python's over that with the reactor's.
Last line: ``gateway_overhead_ratio: X``, HTTP (openai SDK agents in this process) µs/token over
in-process µs/token.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import ssl
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv import AgentEnvironment, Environment, Reactor, RolloutConfig, Task  # noqa: E402
from agentenv import reactor as reactor_module  # noqa: E402
from agentenv.gateway.replies import Reply  # noqa: E402
from agentenv.gateway.responses import completion_body  # noqa: E402
from agentenv.gateway.server import Gateway  # noqa: E402
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
        """The same loop over ``httpx`` posting JSON: the gateway's cost without the ``openai``
        SDK's own. Each program has its own client, as each program's SDK client is: one shared
        by a thousand programs holds a thousand connections, and httpcore's pool walks all of
        them at every request and release (pydantic/httpx2 PR 1169), which this would measure."""
        import httpx

        if self._http is None:  # one TLS context for all (a client loads the CA store when made)
            self._http = ssl.create_default_context()
        async with httpx.AsyncClient(timeout=600, verify=self._http) as http:
            return await self._raw_loop(http, task, client, model)

    async def _raw_loop(self, http, task, client, model):
        url, head = (
            f"{str(client.base_url).rstrip('/')}/chat/completions",
            {"Authorization": f"Bearer {client.api_key}"},
        )
        messages = [{"role": "user", "content": task.question}]
        for k in range(self.calls):
            t0 = time.perf_counter()
            r = (await http.post(url, headers=head, json={"model": model, "messages": messages,
                                                          "max_tokens": self.tokens})).json()
            self.latencies.append(time.perf_counter() - t0)
            messages += [r["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]
        return "done"

    async def reward(self, task, trajectory):
        return 0.0


class ElsewhereAgent(AgentEnvironment):
    """The same loop with the agents in another process (``--load-process``: an ``httpx``
    client per program there): each program hands its key to that process and waits for its calls to be
    done, so this process runs only the reactor and the gateway, as a rollout whose agents run
    in their own processes or containers does. Its CPU per token is the gateway path's own."""

    id = "bench-gateway-elsewhere"
    agent_timeout = 3600.0
    latencies: list[float] = []

    def __init__(self, calls: int, tokens: int) -> None:
        super().__init__()
        self.calls, self.tokens = calls, tokens
        self.max_turns = calls  # type: ignore[misc]
        self.stream: Any = None
        self.pending: dict[str, tuple[anyio.Event, list]] = {}
        self.lock = anyio.Lock()

    def tasks(self, n, seed=0):
        return [Task(f"b/{i}", "Say x.") for i in range(n)]

    async def agent(self, task, client, model):
        key, done = str(client.api_key), anyio.Event()
        self.pending[key] = (done, [])
        job = {"key": key, "url": f"{str(client.base_url).rstrip('/')}/chat/completions", "model": model,
               "question": task.question, "calls": self.calls, "tokens": self.tokens}
        async with self.lock:
            await self.stream.send((json.dumps(job) + "\n").encode())
        await done.wait()
        error, lat = self.pending.pop(key)[1]
        if error:
            raise RuntimeError(error)
        self.latencies.extend(lat)
        return "done"

    async def read_results(self, stream) -> None:
        buf = b""
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                r = json.loads(line)
                done, box = self.pending[r["key"]]
                box[:] = [r["error"], r["latencies"]]
                done.set()

    async def reward(self, task, trajectory):
        return 0.0


async def load_process(port: int) -> None:
    """The agents of :class:`ElsewhereAgent`: each job a program's loop of calls over its own
    ``httpx`` client (see ``HttpAgent._raw``); a line back per job with its calls' latencies (or
    its error)."""
    import httpx

    stream = await anyio.connect_tcp("127.0.0.1", port)
    tls = ssl.create_default_context()
    lock = anyio.Lock()

    async def run(job: dict) -> None:
        async with httpx.AsyncClient(timeout=3600, verify=tls) as http:
            await calls(http, job)

    async def calls(http, job: dict) -> None:
        lat, error = [], None
        messages = [{"role": "user", "content": job["question"]}]
        try:
            for k in range(job["calls"]):
                t0 = time.perf_counter()
                r = await http.post(job["url"], headers={"Authorization": f"Bearer {job['key']}"},
                                    json={"model": job["model"], "messages": messages, "max_tokens": job["tokens"]})
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]
        except Exception as exc:  # reported to the program, which fails with it
            error = f"{type(exc).__name__}: {exc}"
        async with lock:
            await stream.send((json.dumps({"key": job["key"], "latencies": lat, "error": error}) + "\n").encode())

    async with anyio.create_task_group() as tg:
        buf = b""
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                tg.start_soon(run, json.loads(line))


async def measure_elsewhere(env: ElsewhereAgent, programs: int, tokens: int, how: Any = None) -> dict:
    """``how`` (:func:`measure`, or :func:`measure_bare`) with the agents in a
    ``--load-process`` started for it."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        proc = await anyio.open_process([sys.executable, __file__, "--load-process", str(port)], stdout=None,
                                        stderr=None)
        accepted = anyio.Event()

        async def accept(stream) -> None:
            env.stream = stream
            accepted.set()
            await env.read_results(stream)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, accept)
                await accepted.wait()
                result = await (how or measure)(env, programs, tokens)
                tg.cancel_scope.cancel()
        finally:
            if env.stream is not None:
                await env.stream.aclose()
            await proc.wait()
    return result


_TOKENIZER: list = []


async def measure(env, programs: int, tokens: int, *, one_at_a_time: bool = False) -> dict:
    engine = InstantEngine(_TOKENIZER[0] if _TOKENIZER else None, turn_tokens=tokens)
    _TOKENIZER[:] = [engine.tokenizer]
    at_once = 1 if one_at_a_time else programs
    config = RolloutConfig(max_new_tokens=10**6, max_tokens_per_turn=tokens, concurrency=max(1, at_once // 8),
                           max_programs=at_once)
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


class BareGateway(Gateway):
    """The gateway's own server, routes and per-program clients with nothing behind them: a
    chat request's body is read as the gateway reads it and answered with one fixed completion
    of the bench's reply (``tokens`` filler tokens). Agents through it cost the HTTP stack and
    their own clients only: the floor under the gateway path, whatever the gateway does."""

    def __init__(self, tokenizer: Any, tokens: int) -> None:
        super().__init__("bare", tokenizer=tokenizer)
        text = tokenizer.decode([InstantEngine(tokenizer).filler] * tokens)
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        self.answer = completion_body("chatcmpl-bare", "bare", Reply(text), "length", usage, None)

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        self.requests += 1
        await self._body(request)
        return JSONResponse(self.answer)


async def measure_bare(env: HttpAgent | ElsewhereAgent, programs: int, tokens: int, *,
                       one_at_a_time: bool = False) -> dict:
    """``env``'s agents against a :class:`BareGateway`: this process's CPU per token (the
    agents' clients and the HTTP stack) and tokens per second, as :func:`measure` gives them."""
    gateway = BareGateway(_TOKENIZER[0], tokens)
    await gateway.start()
    limit = anyio.CapacityLimiter(1 if one_at_a_time else programs)

    async def one(task: Task) -> None:
        async with limit:
            await env.agent(task, gateway.client(f"bare-{task.id}", 600.0), gateway.model_name)

    try:
        c0, t0 = time.process_time(), time.perf_counter()
        with reactor_module.collector_tuned():  # as the agents of a reactor's run are
            async with anyio.create_task_group() as tg:
                for task in env.tasks(programs):
                    tg.start_soon(one, task)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await gateway.aclose()
    sampled = programs * env.calls * tokens
    return {"us_per_token": 1e6 * cpu / sampled, "tok_s": sampled / wall, "calls": gateway.requests}


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def latency_line(name: str, xs: list[float]) -> str:
    return (f"{name} call latency as the agent sees it: p50 {1e3 * statistics.median(xs):.1f} ms, "
            f"p99 {1e3 * p99(xs):.1f} ms ({len(xs)} calls)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--alone", type=int, default=100, help="programs run one at a time, for the latency a call "
                    "gains through the gateway when nothing else waits (default 100)")
    ap.add_argument("--load-process", type=int, metavar="PORT", help=argparse.SUPPRESS)  # ElsewhereAgent's agents
    a = ap.parse_args()
    if a.load_process:
        return anyio.run(load_process, a.load_process)
    for env in (Native(a.calls), HttpAgent(a.calls, a.tokens), HttpAgent(a.calls, a.tokens, raw=True)):  # warm
        anyio.run(measure, env, 4, a.tokens)
    anyio.run(measure_elsewhere, ElsewhereAgent(a.calls, a.tokens), 4, a.tokens)
    native = anyio.run(measure, Native(a.calls), a.programs, a.tokens)
    tuned, reactor_module.GC_THRESHOLD = reactor_module.GC_THRESHOLD, None  # the collector as Python sets it
    native_gc = anyio.run(measure, Native(a.calls), a.programs, a.tokens)
    away_gc = anyio.run(measure_elsewhere, ElsewhereAgent(a.calls, a.tokens), a.programs, a.tokens)
    reactor_module.GC_THRESHOLD = tuned
    ElsewhereAgent.latencies = []
    away = anyio.run(measure_elsewhere, ElsewhereAgent(a.calls, a.tokens), a.programs, a.tokens)
    away_lat, HttpAgent.latencies = list(ElsewhereAgent.latencies), []
    raw = anyio.run(measure, HttpAgent(a.calls, a.tokens, raw=True), a.programs, a.tokens)
    raw_lat, HttpAgent.latencies = list(HttpAgent.latencies), []
    http = anyio.run(measure, HttpAgent(a.calls, a.tokens), a.programs, a.tokens)
    http_lat, HttpAgent.latencies = list(HttpAgent.latencies), []
    alone = anyio.run(lambda: measure(HttpAgent(a.calls, a.tokens), a.alone, a.tokens, one_at_a_time=True))
    alone_lat, HttpAgent.latencies = list(HttpAgent.latencies), []
    bare_raw = anyio.run(measure_bare, HttpAgent(a.calls, a.tokens, raw=True), a.programs, a.tokens)
    bare_away = anyio.run(measure_elsewhere, ElsewhereAgent(a.calls, a.tokens), a.programs, a.tokens, measure_bare)
    bare_sdk = anyio.run(measure_bare, HttpAgent(a.calls, a.tokens), a.programs, a.tokens)
    HttpAgent.latencies = []
    anyio.run(lambda: measure_bare(HttpAgent(a.calls, a.tokens), a.alone, a.tokens, one_at_a_time=True))
    bare_lat = list(HttpAgent.latencies)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}  cpus: {os.cpu_count()}")
    runs = (("in-process", native), ("http, agents elsewhere", away), ("http httpx", raw), ("http openai", http))
    for name, r in runs:
        print(f"{name:>22}: {r['programs']} programs ({r['failed']} failed), {r['tokens']} tokens in "
              f"{r['wall_s']:.1f}s: {r['us_per_token']:.2f} µs/token client CPU, {r['tok_s']:.0f} tok/s")
    for name, r in runs[1:]:
        if r["first_error"]:
            print(f"{name} first failure: {r['first_error']}")
    for name, xs in (("elsewhere", away_lat), ("httpx", raw_lat), ("openai", http_lat),
                     ("openai, one program at a time", alone_lat),
                     ("openai, one program at a time, bare endpoint", bare_lat)):
        if xs:
            print(latency_line(name, xs))
    print(f"gateway's own CPU per call (agents elsewhere, {a.tokens} tokens a call): "
          f"{away['us_per_token'] * a.tokens / 1e3:.2f} ms; in-process program's per turn: "
          f"{native['us_per_token'] * a.tokens / 1e3:.2f} ms")
    native_us = native["us_per_token"]
    print(f"with the collector at Python's thresholds {gc.get_threshold()} (the reactor's first: {tuned}): "
          f"in-process {native_gc['us_per_token']:.2f} µs/token, agents elsewhere {away_gc['us_per_token']:.2f}")
    print(f"collector_cpu_ratio: {native_gc['us_per_token'] / native_us:.2f} in-process, "
          f"{away_gc['us_per_token'] / away['us_per_token']:.2f} agents elsewhere (Python's thresholds over the "
          "reactor's)")
    print(f"floor, the same server and clients with nothing behind them: httpx {bare_raw['us_per_token']:.2f} "
          f"µs/token, {bare_raw['tok_s']:.0f} tok/s; openai {bare_sdk['us_per_token']:.2f} µs/token, "
          f"{bare_sdk['tok_s']:.0f} tok/s")
    print(f"floor_ratio_agents_elsewhere: {(bare_away['us_per_token'] + native_us) / native_us:.2f} (the bare "
          f"server's own {bare_away['us_per_token']:.2f} µs/token, agents in another process)")
    print(f"floor_ratio_httpx_client: {(bare_raw['us_per_token'] + native_us) / native_us:.2f} "
          f"(the least an HTTP path with these agents in this process could cost: floor + native, over native)")
    print(f"floor_ratio_openai: {(bare_sdk['us_per_token'] + native_us) / native_us:.2f}")
    if alone_lat and bare_lat:
        print(f"call_ms_p99: {1e3 * p99(alone_lat):.2f} (one program at a time, the engine at no cost: the whole "
              f"call as the openai SDK sees it; against the bare endpoint {1e3 * p99(bare_lat):.2f})")
        print(f"gateway_added_ms_p99: {1e3 * (p99(alone_lat) - p99(bare_lat)):.2f} (the call's p99 through the "
              f"gateway less its p99 against the bare endpoint, same SDK client)")
    print(f"gateway figures of one program: {http['gateway']}")
    print(f"gateway_overhead_ratio_agents_elsewhere: {away['us_per_token'] / native['us_per_token']:.2f}")
    print(f"gateway_overhead_ratio_httpx_client: {raw['us_per_token'] / native['us_per_token']:.2f}")
    print(f"gateway_overhead_ratio: {http['us_per_token'] / native['us_per_token']:.2f}")


if __name__ == "__main__":
    main()
