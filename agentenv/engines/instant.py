"""An engine that costs (almost) nothing: the rollout layer measured on its own.

:class:`InstantEngine` implements the :class:`~agentenv.engines.Engine` interface without a
model. Each turn returns as many tokens as a trace says (by default what the request's
``max_tokens`` asks: the trace workloads, ``agentenv.workload``, fix every turn's length
that way), or the turn lengths replayed from a real rollout file
(:meth:`InstantEngine.from_rollouts`), at once or at a configured aggregate rate
(``tok_s``). Every turn's ids and logprobs are slices of lists built once, so a turn costs a
few microseconds whatever its length, and the engine counts its own CPU time
(:attr:`InstantEngine.cpu_s`) so that a benchmark can subtract it: what is left is the
client's (reactor, scheduler, programs, tools, logs).

It keeps what the reactor reads from a real engine: a KV capacity (programs held in LRU
order; a program evicted past the capacity finds nothing cached on its next turn), prefix-cache
accounting in whole blocks, weight versions bumped by ``load_weights``, request priorities
(with a rate, the next request served is the most urgent one waiting) and abort.

    async with InstantEngine(tok_s=50_000) as engine:
        async with Reactor(engine, env, sandbox, config) as reactor:
            groups = await reactor.collect(tasks, 4)
    print(engine.cpu_s, engine.stats())
"""

from __future__ import annotations

import heapq
import json
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import anyio
import anyio.lowlevel

from .base import DEFAULT_PAGE_SIZE, Engine, Generation, SamplingParams, WeightSink


class _Waiter:
    """A request waiting for the rate-limited engine: it is served when ``go`` is set."""

    __slots__ = ("priority", "seq", "tokens", "go", "dead", "aborted", "holding")

    def __init__(self, priority: int, seq: int, tokens: int) -> None:
        self.priority, self.seq, self.tokens = priority, seq, tokens
        self.go = anyio.Event()
        self.dead = self.aborted = False
        self.holding = False  # the engine is generating it (it passes the engine on when done)

    def __lt__(self, other: "_Waiter") -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class InstantEngine(WeightSink, Engine):
    """An engine without a model, for measuring the rest (see the module docstring).

    ``tokenizer``: the tokenizer programs use (default: the bundled model's). ``tok_s``:
    aggregate tokens per second the engine generates, one request at a time in priority order
    (None: unlimited; a turn returns at the next scheduling point). ``turn_tokens``: the most
    tokens a turn samples when no replayed lengths say (None: ``max_tokens``). ``lengths``:
    per-program turn lengths to replay (a program takes the next sequence the first time it is
    seen, cycling), a turn shorter than ``max_tokens`` ending on a stop token. ``reply``: the
    token ids a turn ends with (e.g. an encoded tool call; the rest of the turn is a filler
    token), so that a tool format parses what the engine returns."""

    def __init__(self, tokenizer: Any = None, *, tok_s: float | None = None, turn_tokens: int | None = None,
                 lengths: Iterable[Sequence[int]] | None = None, reply: Sequence[int] = (),
                 max_model_len: int = 32_768, kv_capacity_tokens: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, filler: int | None = None, logprob: float = -0.5) -> None:
        if tokenizer is None:
            from ..models import default_model
            from .embedded import load_tokenizer

            tokenizer = load_tokenizer(default_model())
        if tok_s is not None and tok_s <= 0:
            raise ValueError(f"tok_s must be positive or None, got {tok_s}")
        self.tokenizer, self.tok_s, self.turn_tokens = tokenizer, tok_s, turn_tokens
        self.max_model_len, self.kv_capacity_tokens, self.page_size = max_model_len, kv_capacity_tokens, page_size
        if filler is None:
            ids = tokenizer.encode(" x", add_special_tokens=False)
            filler = ids[-1] if ids else 0
        self.filler = filler
        self.reply = list(reply)
        # Every turn's ids are the tail of _body and its logprobs a slice of _logprobs: one
        # slice each, no per-token work in Python.
        self._body = [filler] * max_model_len + self.reply
        self._logprobs = [float(logprob)] * (max_model_len + len(self.reply))
        self._lengths = [list(x) for x in lengths] if lengths is not None else None
        self._plan: dict[str, list[int]] = {}  # program -> its replayed turn lengths
        self._version = 0
        self._kv: OrderedDict[str, int] = OrderedDict()  # program -> tokens of KV held, LRU first
        self._kv_used = 0
        self._prefixes: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()  # plain requests' sequences
        self._queue: list[_Waiter] = []
        self._waiting: dict[str, _Waiter] = {}
        self._busy = False
        self._free_at = 0.0  # when the rate-limited engine has generated what it was given
        self._seq = 0
        self._returned: dict[str, float] = {}  # program -> when its last turn returned
        #: Seconds of CPU this engine spent in its own methods (subtract it from the process's).
        self.cpu_s = 0.0
        #: For each turn after a program's first: seconds from the previous turn's return to
        #: this turn's submission (tools, the client's own work and any wait for a slot).
        self.gaps: list[float] = []
        self.requests = self.generated = self.evictions = self.cached = self.prompted = 0
        self.last_priority: int | None = None

    @classmethod
    def from_rollouts(cls, path: str | Path, tokenizer: Any = None, **kw: Any) -> "InstantEngine":
        """An engine replaying the turn lengths of a rollout JSONL (``agentenv rollout``'s
        output): each program it serves takes the next trajectory's turn lengths."""
        lengths = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                turns = json.loads(line).get("turns") or []
                if turns:
                    lengths.append([max(1, int(t["new_tokens"])) for t in turns])
        if not lengths:
            raise ValueError(f"{path} holds no trajectory with turns")
        return cls(tokenizer, lengths=lengths, **kw)

    @property
    def weight_version(self) -> int:
        return self._version

    def stats(self) -> dict[str, Any]:
        """What the engine served: requests, generated tokens, prompt and cached tokens,
        evictions past the KV capacity, its own CPU seconds."""
        return {"requests": self.requests, "generated": self.generated, "prompt_tokens": self.prompted,
                "cached_tokens": self.cached, "evictions": self.evictions, "cpu_s": self.cpu_s}

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> Generation:
        c0 = time.thread_time()
        gen = self._make(prompt_ids, params, None, self._room(prompt_ids))
        gen.cached_tokens = self._plain_cached(prompt_ids)
        self.cached += gen.cached_tokens
        self._remember(prompt_ids, gen.token_ids)
        self.cpu_s += time.thread_time() - c0
        return await self._serve(gen, request_id, priority)

    async def generate_turn(self, program: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                            *, priority: int = 0) -> Generation:
        c0 = time.thread_time()
        last = self._returned.pop(program, None)
        if last is not None:
            self.gaps.append(time.perf_counter() - last)
        gen = self._make(prompt_ids, params, program, self._room(prompt_ids))
        gen.cached_tokens = self._hold(program, len(prompt_ids), len(gen.token_ids))
        self.cached += gen.cached_tokens
        self.cpu_s += time.thread_time() - c0
        gen = await self._serve(gen, request_id, priority)
        t0 = time.thread_time()
        if gen.finish_reason != "abort":
            self._returned[program] = time.perf_counter()
        self.cpu_s += time.thread_time() - t0
        return gen

    def _make(self, prompt: list[int], params: SamplingParams, program: str | None, room: int) -> Generation:
        """The turn's generation: its length from the replayed plan or ``max_tokens``, cut at
        the first stop token it holds."""
        want = min(params.max_tokens, room)
        n = want
        if self._lengths is not None and program is not None:
            plan = self._plan.get(program)
            if plan is None:
                plan = self._plan[program] = list(reversed(self._lengths[len(self._plan) % len(self._lengths)]))
            n = min(want, plan.pop() if plan else want)
        elif self.turn_tokens is not None:
            n = min(want, self.turn_tokens)
        body = self._body
        ids = body[len(body) - n:] if n else []
        stop_id = None
        if params.stop_token_ids:
            cut, stop_id = self._stop_cut(params.stop_token_ids, n)
            if cut is not None:
                ids = ids[:cut]
            elif n < want:  # a turn shorter than its cap ends on a stop token
                ids = ids[:-1] + [params.stop_token_ids[0]] if ids else [params.stop_token_ids[0]]
                stop_id = params.stop_token_ids[0]
        n = len(ids)
        self.requests += 1
        self.generated += n
        self.prompted += len(prompt)
        finish = "stop" if stop_id is not None else "length"
        return Generation(ids, self._logprobs[:n], finish, len(prompt), 0, self._version, stop_id)

    def _stop_cut(self, stop: tuple[int, ...], n: int) -> tuple[int | None, int | None]:
        """Where a turn of ``n`` tokens (filler, then the tail of ``reply``) first holds one of
        ``stop``: the turn's length up to it and the stop id; (None, None) when it holds none."""
        reply = self.reply
        pad = n - len(reply)
        if pad > 0 and self.filler in stop:
            return 1, self.filler
        start = max(0, -pad)
        for j in range(start, len(reply)):
            if reply[j] in stop:
                return max(0, pad) + j - start + 1, reply[j]
        return None, None

    async def _serve(self, gen: Generation, request_id: str, priority: int) -> Generation:
        """Return ``gen`` at once (no rate), or once the engine has generated it at ``tok_s``
        after the more urgent requests waiting. The engine's clock advances by each request's
        tokens over ``tok_s`` from where the previous one ended, so late wake-ups do not lower
        the rate."""
        self.last_priority = priority
        if self.tok_s is None:
            await anyio.lowlevel.checkpoint()
            return gen
        t0 = time.perf_counter()
        w = _Waiter(priority, self._seq, len(gen.token_ids))
        self._seq += 1
        self._waiting[request_id] = w
        try:
            if self._busy:
                heapq.heappush(self._queue, w)
                await w.go.wait()
            else:
                self._busy = w.holding = True
                self._free_at = max(self._free_at, t0)
            if not w.aborted:
                self._free_at += w.tokens / self.tok_s
                w.go = anyio.Event()  # set by abort
                with anyio.move_on_after(self._free_at - time.perf_counter()):
                    await w.go.wait()
        finally:
            if self._waiting.get(request_id) is w:
                del self._waiting[request_id]
            w.dead = True
            if w.holding:
                self._next()
        gen.latency_s = time.perf_counter() - t0
        if w.aborted:
            return Generation([], [], "abort", gen.prompt_tokens, gen.cached_tokens, self._version)
        return gen

    def _next(self) -> None:
        """The engine is free: serve the most urgent request still waiting."""
        while self._queue:
            w = heapq.heappop(self._queue)
            if not w.dead:
                w.holding = True
                w.go.set()
                return
        self._busy = False

    # -- the KV cache ----------------------------------------------------------------------------
    def _hold(self, program: str, prompt: int, generated: int) -> int:
        """Cached tokens of a program's turn (whole blocks of what its last turn left), then
        hold its KV for this turn, evicting least recently used programs past the capacity."""
        held = self._kv.pop(program, 0)
        cached = min(held, prompt) // self.page_size * self.page_size
        now = prompt + generated
        self._kv[program] = now
        self._kv_used += now - held
        cap = self.kv_capacity_tokens
        while cap is not None and self._kv_used > cap and len(self._kv) > 1:
            _, tokens = self._kv.popitem(last=False)
            self._kv_used -= tokens
            self.evictions += 1
        return cached

    def _plain_cached(self, prompt: list[int]) -> int:
        """Cached tokens of a plain request: the longest common prefix, in whole blocks, with
        a recent request's sequence that began with the same block."""
        p = self.page_size
        seq = self._prefixes.get(tuple(prompt[:p])) if len(prompt) >= p else None
        if seq is None:
            return 0
        lo, hi = 0, min(len(seq), len(prompt))  # binary search on slice equality (compared in C)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if seq[:mid] == prompt[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo // p * p

    def _remember(self, prompt: list[int], out: list[int]) -> None:
        if len(prompt) >= self.page_size:
            key = tuple(prompt[:self.page_size])
            self._prefixes[key] = prompt + out
            self._prefixes.move_to_end(key)
            if len(self._prefixes) > 1024:
                self._prefixes.popitem(last=False)

    def release(self, program: str) -> None:
        """The program ended or was paused: its KV is evicted first, and its next turn (a
        resumed program's) starts a new gap."""
        if program in self._kv:
            self._kv.move_to_end(program, last=False)
        self._returned.pop(program, None)

    # -- the rest of the interface --------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        w = self._waiting.get(request_id)
        if w is not None:
            w.aborted = True
            w.go.set()

    async def load_weights(self, weights: Any, version: int | None = None) -> int:
        """Take the weights (nothing is loaded) and bump the version (or set ``version``)."""
        for _ in weights.items() if isinstance(weights, dict) else weights:
            pass
        self._version = self._version + 1 if version is None else version
        return self._version

    async def aclose(self) -> None:
        self._closed = True


__all__ = ["InstantEngine"]
