"""A discrete-event simulator that runs the real program scheduler against a model engine.

The scheduler is :class:`agentenv.scheduler.Scheduler`, the very object the reactor drives;
here it is driven by simulated time instead of an event loop. What is simulated:

* **the engine**: continuous batching. Each decode step gives every running request one
  token and takes ``step_base + step_per_seq * batch + step_per_ctx * context_tokens``
  seconds; a request joining the batch first prefills its uncached prompt tokens
  (``prefill_per_token`` each). At most ``max_batch`` requests run; others wait (in
  priority order, like vLLM's ``scheduling_policy="priority"``).
* **a paged KV cache with LRU prefix caching**: ``kv_capacity`` tokens in blocks of
  ``block_size``. A running request holds its blocks; a finished request's full blocks stay
  cached (evictable) until space is needed, evicted least recently used first and from a
  sequence's tail first (as vLLM frees them), so a program's cached prefix is a block count.
  When the running requests outgrow memory, the youngest request is preempted (its blocks
  freed, recomputed later), as vLLM does.
* **tools and sandbox sessions**: tool latencies and output lengths from the trace; a
  session start costs ``session_start_s`` on one of ``session_workers`` sandbox CPUs.

To stay fast (10,000 programs in well under a minute), time advances in *macro steps*: the
batch is constant between events, so k decode steps are taken at once; block growth is
accounted for in aggregate (full blocks of the running tokens plus half a block per
request). Figures it reports are the reactor's: wall time, generated tok/s, mean requests in
flight, engine idle fraction, resume prefix-cache reuse, re-prefilled tokens, pauses,
restores, preemptions.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .costs import CostModel
from .scheduler import Scheduler, SchedulerConfig, SchedulingPolicy, State
from .stats import resume_eligible
from .workload import ProgramTrace


@dataclass(frozen=True, slots=True)
class EngineModel:
    step_base: float = 0.004  # seconds per decode step, fixed part
    step_per_seq: float = 0.0001  # per running request
    step_per_ctx: float = 0.0  # per token of context in the batch (attention reads)
    prefill_per_token: float = 0.00002  # per uncached prompt token
    kv_capacity: int = 131_072  # tokens
    block_size: int = 32
    max_batch: int = 256

    def slowed(self, factor: float) -> "EngineModel":
        """The same engine with every time cost multiplied by ``factor``."""
        return dataclasses.replace(self, step_base=self.step_base * factor, step_per_seq=self.step_per_seq * factor,
                                   step_per_ctx=self.step_per_ctx * factor,
                                   prefill_per_token=self.prefill_per_token * factor)

    def cost(self) -> CostModel:
        """This engine's costs, as the scheduler is given them."""
        return CostModel(self.step_base, self.step_per_seq, self.step_per_ctx, self.prefill_per_token)

    def decode_rate(self, batch: int, context: int) -> float:
        """Tokens per second with ``batch`` requests of ``context`` tokens each."""
        return batch / (self.step_base + self.step_per_seq * batch + self.step_per_ctx * batch * context)


# A 7B model on one H100 (bf16): about 6,300 tok/s aggregate at a full batch (seed 001);
# KV of Qwen2.5-7B (28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes = 57 KB per token) in
# ~60 GB left after weights and activations: ~1.05 M tokens.
H100_7B = EngineModel(step_base=0.012, step_per_seq=0.00011, step_per_ctx=1.5e-8, prefill_per_token=2.5e-5,
                      kv_capacity=1_050_000, block_size=16, max_batch=256)


@dataclass(slots=True)
class _Req:
    pid: int
    rid: int
    length: int  # tokens in the sequence (prompt + generated so far)
    new: int  # tokens still to generate
    prompt: int
    finish_step: int = 0
    live: bool = True


@dataclass
class SimResult:
    wall_s: float = 0.0
    tokens: int = 0
    in_flight_area: float = 0.0
    idle_s: float = 0.0
    resume_cached: int = 0
    resume_eligible: int = 0
    pauses: int = 0
    restores: int = 0
    preemptions: int = 0
    programs: int = 0
    peak_working_set: int = 0
    events: int = 0
    acting_kv_area: float = 0.0  # KV tokens counted for programs on their tools, x seconds
    wanting_kv_area: float = 0.0  # ... for programs decoding or ready to, x seconds
    refused_s: float = 0.0  # seconds with programs queued and decode slots free

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def in_flight(self) -> float:
        return self.in_flight_area / self.wall_s if self.wall_s else 0.0

    @property
    def idle(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s else 0.0

    @property
    def reuse(self) -> float:
        return self.resume_cached / self.resume_eligible if self.resume_eligible else 0.0

    @property
    def reprefilled(self) -> int:
        return self.resume_eligible - self.resume_cached

    @property
    def acting_kv(self) -> float:
        """Mean KV tokens the scheduler counted for programs on their tools."""
        return self.acting_kv_area / self.wall_s if self.wall_s else 0.0

    @property
    def wanting_kv(self) -> float:
        """Mean KV tokens it counted for programs decoding or ready to."""
        return self.wanting_kv_area / self.wall_s if self.wall_s else 0.0

    @property
    def refused(self) -> float:
        """Share of the time programs waited to be admitted while decode slots were free."""
        return self.refused_s / self.wall_s if self.wall_s else 0.0

    def row(self) -> dict:
        return {"wall_s": self.wall_s, "tok_s": self.tok_s, "in_flight": self.in_flight, "idle": self.idle,
                "reuse": self.reuse, "reprefilled": self.reprefilled, "pauses": self.pauses,
                "restores": self.restores, "preemptions": self.preemptions, "programs": self.programs,
                "acting_kv": self.acting_kv, "wanting_kv": self.wanting_kv, "refused": self.refused}


@dataclass
class _Prog:
    trace: ProgramTrace
    tokens: int
    turn: int = 0
    session_ready: bool = False
    waiting_session: bool = False
    last_prompt: int = -1
    last_new: int = 0


#: The simulator's former parameter names, old -> new (deprecated: "env" is the Environment;
#: these are the sandbox sessions'). Still taken, with a DeprecationWarning.
FORMER_PARAMETERS = {"needs_env": "needs_session", "env_start_s": "session_start_s",
                     "env_workers": "session_workers", "env_lookahead": "session_lookahead"}


def _current(where: str, former: dict[str, Any], **given: Any) -> dict[str, Any]:
    """``given`` (parameters by their names now, in order) with those passed under a former
    name (``former``, :data:`FORMER_PARAMETERS`) in their place, with one DeprecationWarning
    naming them; any other name is the TypeError Python raises for it."""
    for old in former:
        if FORMER_PARAMETERS.get(old) not in given:
            raise TypeError(f"{where}() got an unexpected keyword argument {old!r}")
    if former:
        renamed = ", ".join(f"{old}= is now {FORMER_PARAMETERS[old]}=" for old in former)
        warnings.warn(f"{where}(): {renamed}", DeprecationWarning, stacklevel=3)
    return given | {FORMER_PARAMETERS[old]: value for old, value in former.items()}


class Simulation:
    """One run: ``Simulation(traces, engine_model, scheduler_config).run()``."""

    def __init__(self, traces: Sequence[ProgramTrace], engine: EngineModel, config: SchedulerConfig, *,
                 needs_session: bool = True, session_start_s: float = 0.012, session_workers: int = 2,
                 group_size: int = 1, scheduler: Callable[[SchedulerConfig], Scheduler] = Scheduler,
                 **former: Any) -> None:
        needs_session, session_start_s, session_workers = _current(
            "Simulation", former, needs_session=needs_session, session_start_s=session_start_s,
            session_workers=session_workers).values()
        self.m = engine
        self.B = engine.block_size
        self.cap_blocks = engine.kv_capacity // engine.block_size
        self.sched = scheduler(config)
        self.progs = {i: _Prog(t, t.prompt_tokens) for i, t in enumerate(traces)}
        for i, t in enumerate(traces):
            self.sched.add(i, t.prompt_tokens, group=i // group_size, needs_session=needs_session)
        self.needs_session = needs_session
        self.session_start_s = session_start_s
        self.session_free_at = [0.0] * max(1, session_workers)
        self.now = 0.0
        self.step = 0
        self.events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, pid)
        self._seq = 0
        # Engine state.
        self.waiting: list[tuple[int, int, _Req]] = []  # (priority, seq, req)
        self.running: dict[int, _Req] = {}
        self.finishing: list[tuple[int, int]] = []  # (finish_step, rid)
        self.run_tokens = 0  # tokens held by running requests
        self.lru: OrderedDict[int, int] = OrderedDict()  # pid -> cached full blocks (not running)
        self.lru_blocks = 0
        self.pending_prefill = 0.0
        self.in_engine = 0  # requests submitted and not finished (waiting or running)
        self.res = SimResult(programs=len(traces))
        self._rid = 0
        self._t_acc = 0.0
        self._t_kv = 0.0
        self._kv_now = (0, 0, False)  # (acting KV, wanting KV, refusing) since _t_kv

    # -- events ------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, pid: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, pid))

    def _apply(self) -> None:
        self._account_kv()
        while True:
            d = self.sched.schedule(self.now)
            if not d:
                self._kv_now = (self.sched.working_set_of(State.ACTING),
                                self.sched.working_set_of(State.DECODING) + self.sched.working_set_of(State.READY),
                                self.sched.queued > 0 and self.in_engine < self.sched.config.max_requests)
                return
            self.res.pauses += len(d.paused)
            self.res.restores += len(d.restored)
            for pid in d.prepare:
                self._start_session(pid)
            for pid in d.admit:
                p = self.progs[pid]
                self.sched.want_turn(pid, p.tokens, p.trace.turn_tokens[0])
            for pid in d.submit:
                self._submit(pid)

    def _start_session(self, pid: int) -> None:
        i = min(range(len(self.session_free_at)), key=self.session_free_at.__getitem__)
        done = max(self.now, self.session_free_at[i]) + self.session_start_s
        self.session_free_at[i] = done
        self._at(done, "session", pid)

    def _submit(self, pid: int) -> None:
        p = self.progs[pid]
        self._rid += 1
        r = _Req(pid, self._rid, p.tokens, p.trace.turn_tokens[p.turn], p.tokens)
        self._account()
        self.in_engine += 1
        heapq.heappush(self.waiting, (self.sched.priority(pid), r.rid, r))

    def _account_kv(self) -> None:
        """Integrate what holds the KV, as the scheduler counts it, up to now."""
        dt = self.now - self._t_kv
        acting, wanting, refusing = self._kv_now
        self.res.acting_kv_area += acting * dt
        self.res.wanting_kv_area += wanting * dt
        self.res.refused_s += dt if refusing else 0.0
        self._t_kv = self.now

    def _account(self) -> None:
        """Integrate requests-in-flight up to now (called before every change)."""
        dt = self.now - self._t_acc
        self.res.in_flight_area += self.in_engine * dt
        if self.in_engine == 0:
            self.res.idle_s += dt
        self._t_acc = self.now

    # -- KV cache ----------------------------------------------------------------------------
    def _run_blocks(self, tokens: int | None = None, n: int | None = None) -> int:
        tokens = self.run_tokens if tokens is None else tokens
        n = len(self.running) if n is None else n
        return -(-tokens // self.B) + (n + 1) // 2

    def _free(self) -> int:
        """Blocks not held by running requests (cached ones included: evictable)."""
        return self.cap_blocks - self._run_blocks()

    def _evict_to_fit(self) -> None:
        over = self._run_blocks() + self.lru_blocks - self.cap_blocks
        while over > 0 and self.lru:
            pid, n = next(iter(self.lru.items()))
            take = min(n, over)
            over -= take
            self.lru_blocks -= take
            if take == n:
                del self.lru[pid]
            else:
                self.lru[pid] = n - take

    def _join(self, r: _Req) -> bool:
        """Move a waiting request into the batch if its blocks fit."""
        cached = self.lru.get(r.pid, 0)
        hit = min(cached, (r.length - 1) // self.B)
        n = len(self.running) + 1
        need = self._run_blocks(self.run_tokens + r.length + n, n)  # room for one more step, too
        if need > self.cap_blocks and self.running:
            return False
        if cached:
            del self.lru[r.pid]
            self.lru_blocks -= cached  # now held by the request (hit) or overwritten
        self.running[r.rid] = r
        self.run_tokens += r.length
        self._evict_to_fit()
        self.pending_prefill += (r.length - hit * self.B) * self.m.prefill_per_token
        r.finish_step = self.step + r.new
        heapq.heappush(self.finishing, (r.finish_step, r.rid))
        p = self.progs[r.pid]
        if p.last_prompt >= 0:  # a resumed turn: what had been computed before
            elig = resume_eligible(p.last_prompt, p.last_new, r.prompt, self.B)
            self.res.resume_eligible += elig
            self.res.resume_cached += min(hit * self.B, elig)
            p.last_prompt = -2  # counted once per turn (a preempted re-join does not count again)
        elif p.last_prompt == -1:
            p.last_prompt = -2
        return True

    def _preempt(self) -> None:
        """Out of blocks: the youngest running request gives its blocks back and waits."""
        r = max(self.running.values(), key=lambda q: (self.sched.priority(q.pid), q.rid))
        del self.running[r.rid]
        self.run_tokens -= r.length
        r.live = False
        self.res.preemptions += 1
        full = r.length // self.B
        self.lru[r.pid] = full
        self.lru_blocks += full
        self.lru.move_to_end(r.pid)
        self._evict_to_fit()
        r2 = _Req(r.pid, r.rid, r.length, r.finish_step - self.step, r.prompt)
        heapq.heappush(self.waiting, (-1, r2.rid, r2))  # first in line again

    def _finish(self, r: _Req) -> None:
        del self.running[r.rid]
        self.run_tokens -= r.length
        full = r.length // self.B
        self.lru[r.pid] = full
        self.lru_blocks += full
        self._evict_to_fit()
        self._account()
        self.in_engine -= 1
        pid, p = r.pid, self.progs[r.pid]
        n = p.trace.turn_tokens[p.turn]
        self.res.tokens += n
        p.last_prompt, p.last_new = r.prompt, n
        p.tokens += n
        self.sched.advance(self.now)
        self.sched.turn_done(pid, p.tokens)
        if p.turn == p.trace.turns - 1:
            self.sched.finish(pid)
            self.sched.forget(pid)  # its cached blocks stay in the LRU until evicted
        elif self.needs_session and not p.session_ready:
            p.waiting_session = True
            if self.sched.programs[pid].session.value == "none":  # not prepared ahead: start it now
                self.sched.demand_session(pid)
                self._start_session(pid)
        else:
            self._at(self.now + p.trace.tool_latency[p.turn], "tool", pid)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        self._t_acc = 0.0
        self._apply()
        while not self.sched.done or self.running or self.waiting:
            self.res.events += 1
            # Fill the batch.
            while self.waiting and len(self.running) < self.m.max_batch:
                _, _, r = self.waiting[0]
                if not self._join(r):
                    break
                heapq.heappop(self.waiting)
            while self.finishing and not (self.finishing[0][1] in self.running
                                          and self.running[self.finishing[0][1]].finish_step == self.finishing[0][0]):
                heapq.heappop(self.finishing)
            if self.running:
                b = len(self.running)
                dt = self.m.step_base + self.m.step_per_seq * b + self.m.step_per_ctx * self.run_tokens
                k = self.finishing[0][0] - self.step
                if self.events:
                    k = min(k, max(1, math.ceil((self.events[0][0] - self.now - self.pending_prefill) / dt)))
                room = (self.cap_blocks - (b + 1) // 2) * self.B - self.run_tokens
                k_mem = room // b
                if k_mem <= 0:
                    if b > 1:
                        self._preempt()
                        continue
                    k_mem = k  # a lone request runs regardless
                k = max(1, min(k, k_mem))
                self.now += self.pending_prefill + k * dt
                self.pending_prefill = 0.0
                self.step += k
                self.run_tokens += b * k
                for r in self.running.values():
                    r.length += k
                self._evict_to_fit()
                while self.finishing and self.finishing[0][0] <= self.step:
                    _, rid = heapq.heappop(self.finishing)
                    r = self.running.get(rid)
                    if r is not None and r.finish_step <= self.step:
                        self._finish(r)
            elif self.events:
                self.now = max(self.now, self.events[0][0])
            elif not self.waiting:
                self._apply()
                if not self.events and not self.waiting and not self.running and not self.sched.done:
                    raise RuntimeError("simulation stuck: the scheduler admits nothing and nothing runs")
                continue
            while self.events and self.events[0][0] <= self.now:
                _, _, kind, pid = heapq.heappop(self.events)
                self._event(kind, pid)
            self._apply()
        self._account()
        self._account_kv()
        self.res.wall_s = self.now
        self.res.peak_working_set = self.sched.peak_working_set
        return self.res

    def _event(self, kind: str, pid: int) -> None:
        p = self.progs.get(pid)
        if kind == "session":
            if pid in self.sched.programs:
                self.sched.session_ready(pid)
            if p is not None:
                p.session_ready = True
                if p.waiting_session:
                    p.waiting_session = False
                    self._at(self.now + p.trace.tool_latency[p.turn], "tool", pid)
        elif kind == "tool":
            assert p is not None
            p.tokens += p.trace.tool_tokens[p.turn]
            p.turn += 1
            self.sched.advance(self.now)
            self.sched.want_turn(pid, p.tokens, p.trace.turn_tokens[p.turn])


def simulate(traces: Sequence[ProgramTrace], engine: EngineModel, policy: str | SchedulingPolicy = "program", *,
             concurrency: int = 64, max_programs: int | None = None, group_size: int = 1,
             needs_session: bool = True, session_start_s: float = 0.012, session_lookahead: int = 16,
             session_workers: int = 2, cost: CostModel | None | bool = True,
             scheduler: Callable[[SchedulerConfig], Scheduler] = Scheduler, **former: Any) -> SimResult:
    """Run ``traces`` under ``policy`` with the reactor's own mapping of settings. ``cost``:
    the engine costs the scheduler is given (True: the model engine's own, as a fit of them
    would find; None or False: none, so acting programs' KV is held for their whole tool).
    ``needs_session``: the programs' tools run in a sandbox session, ``session_start_s`` long
    to start on one of ``session_workers`` CPUs, prepared ``session_lookahead`` ahead (the
    former ``env_*`` / ``needs_env`` names are still taken, deprecated). ``scheduler`` makes the
    scheduler from its config (a subclass, to study a variant on the same engine and traces)."""
    needs_session, session_start_s, session_lookahead, session_workers = _current(
        "simulate", former, needs_session=needs_session, session_start_s=session_start_s,
        session_lookahead=session_lookahead, session_workers=session_workers).values()
    policy = SchedulingPolicy(policy)
    cfg = SchedulerConfig(
        policy=policy,
        kv_capacity=engine.kv_capacity if policy == SchedulingPolicy.PROGRAM else None,
        block_size=engine.block_size,
        max_requests=concurrency,
        max_programs=concurrency if policy == SchedulingPolicy.FIFO else (max_programs or 8 * concurrency),
        session_lookahead=session_lookahead,
        turn_reserve=256,
        cost=engine.cost() if cost is True else (cost or None),
    )
    return Simulation(traces, engine, cfg, needs_session=needs_session, session_start_s=session_start_s,
                      session_workers=session_workers, group_size=group_size, scheduler=scheduler).run()


def fit_engine(rates: Mapping[tuple[int, int], float], *, kv_capacity: int, block_size: int,
               prefill_per_token: float = 2e-5, max_batch: int = 256) -> EngineModel:
    """Least-squares fit of the decode step time to measured decode rates.

    ``rates`` maps ``(batch, context)`` (requests running, context tokens each) to the tokens
    per second measured there. The model is ``step = step_base + step_per_seq x batch +
    step_per_ctx x batch x context``; with a single context the attention term cannot be told
    from the per-request one and is left at 0. Negative coefficients (noise) are dropped and
    the rest refitted, so the model never speeds up with more work.
    """
    if not rates:
        raise ValueError("fit_engine needs at least one measured rate")
    batch = np.array([b for b, _ in rates], dtype=float)
    context = np.array([c for _, c in rates], dtype=float)
    step = batch / np.array(list(rates.values()), dtype=float)  # seconds per step
    cols = {"base": np.ones_like(batch), "seq": batch, "ctx": batch * context}
    if len(set(context)) == 1:
        del cols["ctx"]
    while True:
        coef = dict(zip(cols, np.linalg.lstsq(np.column_stack(list(cols.values())), step, rcond=None)[0]))
        neg = [k for k in cols if k != "base" and coef[k] < 0]
        if not neg:
            break
        del cols[neg[0]]
    return EngineModel(step_base=max(float(coef["base"]), 1e-5), step_per_seq=float(coef.get("seq", 0.0)),
                       step_per_ctx=float(coef.get("ctx", 0.0)), prefill_per_token=prefill_per_token,
                       kv_capacity=kv_capacity, block_size=block_size, max_batch=max_batch)


def fit_prefill(warm: float, cold: float, turn: int, extra: int) -> float:
    """Seconds per prefilled token, from two closed loops that differ only in ``extra``
    uncached prompt tokens per request (``warm`` and ``cold``: their tokens per second; each
    request samples ``turn`` tokens). A step computes its requests' new prompt tokens before
    anyone's next token, so each request adds ``extra`` x the per-token cost to everyone's
    time: ``turn / cold = turn / warm + extra x cost``."""
    if extra <= 0 or warm <= 0 or cold <= 0:
        raise ValueError("fit_prefill needs positive rates and extra tokens")
    return max(0.0, turn * (1.0 / cold - 1.0 / warm) / extra)
