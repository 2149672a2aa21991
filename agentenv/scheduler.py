"""The program scheduler: which programs run, decided without I/O.

A *program* (one rollout) alternates between decoding (a request in the engine) and acting
(on a tool). Scheduling requests one at a time, as a plain FIFO with a fixed concurrency
does, lets a program hold its slot while its sandbox starts and while its tool runs, so the
engine starves. This module makes the program the unit: it holds every program's state, its
token count (its KV footprint) and its GRPO group, and on each event decides

* which programs to **admit** (start their coroutine),
* whose **sandbox session to prepare** ahead of need (lookahead),
* which pending turns to **submit** to the engine,
* which programs to **pause** (hold their next turn back, let the engine's LRU take their
  KV) and which to **restore**.

It is pure and synchronous (the vLLM v1 scheduler is the model): the reactor feeds it events
and carries out its :class:`Decision`; tests and the discrete-event simulator
(:mod:`agentenv.simulator`) drive the very same code without an engine.

States::

    QUEUED ──admit──► READY ──submit──► DECODING ──turn_done──► ACTING ──want_turn──► READY
                        ▲                   │ (pause marked)        │ (pause)            │
                        └──── restore ── PAUSED ◄───────────────────┴────────────────────┘
    any admitted state ──finish──► DONE

Policies (:class:`SchedulingPolicy`):

* ``program`` (default): the working set of resumable programs (READY, DECODING, ACTING)
  is kept within the engine's KV capacity; programs are admitted while their footprint fits;
  under pressure whole programs are paused, acting ones first and shortest first (the
  re-prefill cost grows with length squared, ThunderAgent); paused programs are restored
  before new ones are admitted, those whose prefix is likely still cached first, then nearly
  complete GRPO groups, then older programs. Given the engine's costs
  (``SchedulerConfig.cost``, a :class:`CostModel`) and the driver's clock (:meth:`advance`),
  a program that wants the engine and does not fit takes the KV of programs on their tools
  that are expected to stay there longer than the break-even (the re-prefill against the
  throughput one more decode slot adds: :meth:`CostModel.hold_seconds`), longest on its tool
  first; without costs, acting programs keep their KV for their whole tool. ``max_requests`` caps requests in flight
  (the engine's decode slots); a program on a tool holds none. Sessions are prepared for
  admitted programs and ``session_lookahead`` queued ones; a program decodes before its
  session is ready and waits for it only when it calls a tool.
* ``fifo``: a per-request reactor: ``max_programs`` programs in flight, each holding its
  slot from session start to its end; no KV awareness.
* ``lockstep``: TRL-style: a batch of ``max_programs`` programs advances turn by turn; a
  turn is submitted only when every live program of the batch is ready for it, and then all
  of them at once (``max_requests`` does not apply: the engine gets the whole batch).

Among ready programs, decode slots go in the order their turns became ready (a FIFO of
turns, restored programs keeping their place): a program's wait for a slot is one queue's
worth per turn, whatever else is under way. Turns of programs that will want a session
not ready yet go after the others, so first turns follow the session preparations instead of
all running at once and then all waiting on session starts. Ordering by "most turns done
first" instead (with heavy-tailed turn counts a program that has taken many turns is likely
to take many more) puts a new program behind every program under way, so a long one that
arrives late starts last and forms the run's tail; the two orders are compared in the
simulator and side by side on vLLM (docs/benchmarks.md has the figures).

The code is in two layers: :class:`ProgramTable` keeps every program's state and the totals
over them (working set, requests in flight, admitted programs, preparations), updated on each
event; :class:`Scheduler` adds the policy that turns that state into a :class:`Decision`.
"""

from __future__ import annotations

import enum
import heapq
import math
import warnings
from dataclasses import dataclass, field
from typing import Hashable

from .costs import CostModel, ToolTimes


class SchedulingPolicy(str, enum.Enum):
    """Which programs run when (see the module docstring); the values are the CLI's
    ``--scheduling`` choices."""

    PROGRAM = "program"
    FIFO = "fifo"
    LOCKSTEP = "lockstep"


class State(enum.Enum):
    """Where a program is in its life (the module docstring draws the transitions)."""

    QUEUED = "queued"  # not admitted yet
    READY = "ready"  # admitted, a turn wanted, no request in the engine yet
    DECODING = "decoding"  # a request in the engine
    ACTING = "acting"  # on a tool (or between turns)
    PAUSED = "paused"  # out of the working set: its next turn is held back
    DONE = "done"


class SessionState(enum.Enum):
    """Where a program's sandbox session is."""

    NONE = "none"  # needs none, or not prepared yet
    PREPARING = "preparing"
    READY = "ready"


#: The former name of :class:`SessionState` (deprecated: "env" is the Environment).
EnvState = SessionState

RESIDENT = (State.READY, State.DECODING, State.ACTING)


@dataclass(slots=True)
class Program:
    """One program as the scheduler sees it: its state, length and what it waits for."""

    pid: int
    group: Hashable
    order: int  # arrival order: lower is older
    tokens: int  # sequence length so far: its KV footprint once computed
    needs_session: bool
    state: State = State.QUEUED
    session: SessionState = SessionState.NONE
    want: int = 0  # max tokens of the turn it waits to submit (its growth reserve)
    wanting: bool = False  # a turn is pending (set by want_turn, cleared by submit)
    pause_pending: bool = False  # decoding: pause when the turn returns
    turns: int = 0
    ready_seq: int = 0  # when its pending turn became ready (a counter): its place in the slot queue
    paused_clock: float = 0.0  # allocation clock when it was paused
    paused_slack: float = 0.0  # free KV right after its pause (what may be allocated before eviction)
    pauses: int = 0
    fp: int = 0  # footprint counted in the working set while resident
    acted_at: float = 0.0  # the driver's clock when its last turn returned (its tool began)
    fp_in: State = State.QUEUED  # the state its footprint is counted under


@dataclass(slots=True)
class Decision:
    """What the reactor must do now. Every list holds program ids, in priority order."""

    admit: list[int] = field(default_factory=list)
    prepare: list[int] = field(default_factory=list)
    submit: list[int] = field(default_factory=list)
    paused: list[int] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.admit or self.prepare or self.submit or self.paused or self.restored)


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's policy and the engine's and sandbox's limits it schedules within."""

    policy: SchedulingPolicy = SchedulingPolicy.PROGRAM
    #: The engine's KV capacity in tokens (None: unbounded, e.g. an engine that cannot say).
    kv_capacity: int | None = None
    #: KV block size in tokens (footprints are rounded up to whole blocks).
    block_size: int = 16
    #: Fraction of ``kv_capacity`` the working set may fill (room for growth and sharing).
    kv_watermark: float = 0.9
    #: Requests in flight at once (the engine's decode slots).
    max_requests: int = 64
    #: Programs admitted and not finished (paused ones included): bounds open sessions.
    max_programs: int = 256
    #: Queued programs whose sandbox session is prepared ahead of their admission.
    session_lookahead: int = 16
    #: Sandbox session preparations in flight at once.
    max_preparing: int = 8
    #: Default growth reserve per turn until turn lengths have been observed.
    turn_reserve: int = 256
    #: The engine's costs (program policy): under KV pressure an acting program's KV is held
    #: for :meth:`CostModel.hold_seconds` of its tool, then released to a program that wants
    #: the engine. None: held for the whole tool (a slot is never worth a re-prefill).
    cost: CostModel | None = None

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        if self.max_requests < 1 or self.max_programs < 1 or self.block_size < 1 or self.max_preparing < 1:
            raise ValueError("max_requests, max_programs, block_size and max_preparing must be >= 1")
        if not 0 < self.kv_watermark <= 1:
            raise ValueError("kv_watermark must be in (0, 1]")


class ProgramTable:
    """Every program's state and the totals the policy reads, kept without a policy.

    The event methods (:meth:`add`, :meth:`want_turn`, :meth:`turn_done`, :meth:`session_ready`,
    :meth:`finish`, :meth:`cancel`, :meth:`demand_session`, :meth:`forget`) move a program between
    states; each keeps the totals (working set, requests in flight, admitted programs,
    preparations) and the index sets (resident, ready, paused) current, so a decision never
    scans every program (the simulator drives 10k of them)."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.programs: dict[int, Program] = {}
        self._queue: list[int] = []  # QUEUED pids in arrival order (consumed from _head)
        self._head = 0
        self._arrivals = 0
        self._group_left: dict[Hashable, int] = {}
        self.in_flight = 0  # requests in the engine
        self.admitted = 0  # admitted, not done (paused included)
        self.preparing = 0
        self._resident: set[int] = set()
        self._ready: set[int] = set()  # resident, READY and wanting a turn
        self._paused: set[int] = set()
        self._ws = 0  # working set: sum of resident footprints
        self._ws_by = dict.fromkeys(State, 0)  # the working set by state (what holds the KV)
        self.now = 0.0  # the driver's clock, in seconds (see advance)
        self._acting_heap: list[tuple[float, int]] = []  # (acted_at, pid) of acting programs, stale ones skipped
        self.tool_times = ToolTimes()
        self._marked: set[int] = set()  # decoding programs that pause when their turn returns
        self._unprepared: set[int] = set()  # admitted programs whose session is not started
        self._unprepared_heap: list[tuple[int, int]] = []  # (order, pid) of _unprepared, stale ones skipped
        # (waits for its session, ready_seq, pid) of the ready programs, in submission
        # order (the program policy's): entries that no longer match their program are skipped.
        self._ready_heap: list[tuple[bool, int, int]] = []
        self._clock = 0.0  # tokens allocated so far (for "is a paused prefix still cached")
        self._turn_tokens = 0  # observed turn lengths, for the growth reserve
        self._turn_count = 0
        self._turn_seq = 0  # turns that became ready so far: the slot queue's order
        self.pauses = 0
        self.restores = 0
        self.peak_working_set = 0

    # -- footprints -------------------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        b = self.config.block_size
        return -(-max(tokens, 0) // b) * b

    def reserve(self, p: Program) -> int:
        """Tokens a pending or running turn may still add: its max_tokens, capped by 1.5 x the
        mean observed turn length (``turn_reserve`` until 8 turns were seen)."""
        if not (p.wanting or p.state == State.DECODING):
            return 0
        return min(p.want, self._reserve_estimate())

    def _reserve_estimate(self) -> int:
        if self._turn_count >= 8:
            mean = self._turn_tokens / self._turn_count
            return min(self.config.turn_reserve, max(self.config.block_size, math.ceil(1.5 * mean)))
        return self.config.turn_reserve

    def footprint(self, p: Program) -> int:
        """KV tokens ``p`` holds while resident: its length plus its turn reserve, in whole blocks."""
        return self._blocks(p.tokens + self.reserve(p))

    @property
    def working_set(self) -> int:
        """KV tokens the resumable programs need (READY, DECODING, ACTING)."""
        return self._ws

    def working_set_of(self, state: State) -> int:
        """The part of the working set held by programs in ``state`` (ACTING: KV kept for
        programs on their tools, which no decode slot uses meanwhile)."""
        return self._ws_by[state]

    def _unmarked_working_set(self) -> int:
        """The working set without the programs marked to pause when their turn returns."""
        return self._ws - sum(self.programs[i].fp for i in self._marked)

    def _touch(self, p: Program) -> None:
        """Re-count a program after its state or length changed."""
        resident = p.state in RESIDENT
        fp = self.footprint(p) if resident else 0
        if resident != (p.pid in self._resident):
            (self._resident.add if resident else self._resident.discard)(p.pid)
        self._ws += fp - p.fp
        self._ws_by[p.fp_in] -= p.fp
        self._ws_by[p.state] += fp
        p.fp, p.fp_in = fp, p.state
        if resident and p.state == State.READY and p.wanting:
            self._ready.add(p.pid)
            if self.config.policy == SchedulingPolicy.PROGRAM:
                heapq.heappush(self._ready_heap, (self._session_wait(p), p.ready_seq, p.pid))
        else:
            self._ready.discard(p.pid)
        if p.state == State.PAUSED:
            self._paused.add(p.pid)
        else:
            self._paused.discard(p.pid)

    # -- events ------------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """The driver's clock (seconds, monotonic) reads ``now``: how long programs have been
        on their tools is measured on it. A driver that never calls it holds every acting
        program's KV for its whole tool, as without a cost model."""
        self.now = max(self.now, now)

    def add(self, pid: int, prompt_tokens: int, group: Hashable = None, needs_session: bool = False) -> None:
        """Queue a program ``prompt_tokens`` long, a sample of GRPO group ``group``;
        ``needs_session``: it will want a sandbox session."""
        if pid in self.programs:
            raise ValueError(f"program {pid} already added")
        self.programs[pid] = Program(pid, group, self._arrivals, prompt_tokens, needs_session)
        self._arrivals += 1
        self._queue.append(pid)
        self._group_left[group] = self._group_left.get(group, 0) + 1

    def want_turn(self, pid: int, tokens: int, max_tokens: int) -> None:
        """The program (now ``tokens`` long) wants to decode up to ``max_tokens`` more."""
        p = self.programs[pid]
        if p.state not in (State.READY, State.ACTING, State.PAUSED):
            raise ValueError(f"program {pid} wants a turn while {p.state.value}")
        self._clock += max(0, tokens - p.tokens)
        if p.turns and not p.wanting:  # its tool ended
            self.tool_times.add(self.now - p.acted_at)
        p.tokens, p.want, p.wanting = tokens, max_tokens, True
        p.ready_seq, self._turn_seq = self._turn_seq, self._turn_seq + 1
        if p.state == State.ACTING:
            p.state = State.READY
        self._touch(p)

    def turn_done(self, pid: int, tokens: int) -> None:
        """The engine returned the program's turn; it is now ``tokens`` long (and acting)."""
        p = self.programs[pid]
        if p.state != State.DECODING:
            raise ValueError(f"turn_done for program {pid} while {p.state.value}")
        self._turn_tokens += max(0, tokens - p.tokens)
        self._turn_count += 1
        self._clock += max(0, tokens - p.tokens)
        p.tokens, p.turns, p.acted_at = tokens, p.turns + 1, self.now
        self.in_flight -= 1
        if p.pause_pending:
            p.pause_pending = False
            self._marked.discard(pid)
            self._pause(p)
        else:
            self._now_acting(p)

    def withdraw_turn(self, pid: int) -> None:
        """The turn asked for is not wanted (its caller, a gateway client, gave up before the engine
        had it): acting again, as before ``want_turn``; a submitted turn comes back empty."""
        p = self.programs.get(pid)
        if p is None or not (p.wanting or p.state == State.DECODING):
            return
        if p.state == State.DECODING:
            return self.turn_done(pid, p.tokens)
        p.wanting = False
        if p.state == State.READY:  # a paused one stays paused, wanting nothing
            p.acted_at = self.now
            self._now_acting(p)

    def _now_acting(self, p: Program) -> None:
        p.state = State.ACTING
        self._touch(p)
        if self.config.policy == SchedulingPolicy.PROGRAM:
            heapq.heappush(self._acting_heap, (p.acted_at, p.pid))
            if len(self._acting_heap) > 4 * len(self._resident) + 1024:  # mostly stale: rebuild
                self._acting_heap = [(q.acted_at, q.pid) for q in map(self.programs.get, self._resident)
                                     if q.state == State.ACTING]
                heapq.heapify(self._acting_heap)

    def session_ready(self, pid: int) -> None:
        """The program's session is prepared, or its preparation failed: either way it
        waits no more (a failure meets the program when it first needs the session)."""
        p = self.programs[pid]
        if p.session == SessionState.PREPARING:
            self.preparing -= 1
        p.session = SessionState.READY
        if pid in self._ready and self.config.policy == SchedulingPolicy.PROGRAM:
            heapq.heappush(self._ready_heap, (False, p.ready_seq, pid))  # its turn no longer goes last

    def finish(self, pid: int) -> None:
        """The program ended (from any admitted state; a second call does nothing)."""
        p = self.programs[pid]
        if p.state == State.DONE:
            return
        if p.state == State.DECODING:
            self.in_flight -= 1
        if p.state == State.QUEUED:
            raise ValueError(f"program {pid} finished before it was admitted")
        if p.session == SessionState.PREPARING:
            self.preparing -= 1
        p.state, p.wanting, p.pause_pending = State.DONE, False, False
        self._marked.discard(pid)
        self._unprepared.discard(pid)
        self._touch(p)
        self.admitted -= 1
        self._group_left[p.group] -= 1

    def cancel(self, pid: int) -> None:
        """Withdraw a program that was never admitted (its caller went away)."""
        p = self.programs[pid]
        if p.state != State.QUEUED:
            raise ValueError(f"program {pid} is {p.state.value}, not queued")
        if p.session == SessionState.PREPARING:
            self.preparing -= 1
        self._queue.remove(pid) if pid in self._queue[self._head:] else None
        self._group_left[p.group] -= 1
        del self.programs[pid]

    def demand_session(self, pid: int) -> None:
        """The program needs its session now and none is being prepared: start it (it
        counts against ``max_preparing`` like any other)."""
        p = self.programs[pid]
        if p.session == SessionState.NONE:
            self._start_session(p)

    def env_ready(self, pid: int) -> None:
        """The former name of :meth:`session_ready` (deprecated: "env" is the Environment)."""
        warnings.warn("Scheduler.env_ready is now session_ready", DeprecationWarning, stacklevel=2)
        self.session_ready(pid)

    def demand_env(self, pid: int) -> None:
        """The former name of :meth:`demand_session` (deprecated: "env" is the Environment)."""
        warnings.warn("Scheduler.demand_env is now demand_session", DeprecationWarning, stacklevel=2)
        self.demand_session(pid)

    def forget(self, pid: int) -> None:
        """Drop a finished program's record (bounded memory over long runs)."""
        p = self.programs.get(pid)
        if p is not None and p.state == State.DONE:
            del self.programs[pid]
            if self._group_left.get(p.group) == 0:
                del self._group_left[p.group]

    # -- queries -----------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Programs added and not admitted yet."""
        return len(self._queue) - self._head

    @property
    def done(self) -> bool:
        """Nothing queued and nothing admitted is left."""
        return self.queued == 0 and self.admitted == 0

    def state(self, pid: int) -> State:
        return self.programs[pid].state

    def priority(self, pid: int) -> int:
        """Engine request priority (lower runs first): older programs first."""
        return self.programs[pid].order

    def likely_cached(self, p: Program) -> bool:
        """Whether a paused program's prefix is probably still in the engine's cache: less has
        been allocated since its pause than was free then (the engine evicts LRU blocks only
        once free ones run out)."""
        return self._clock - p.paused_clock <= p.paused_slack

    # -- transitions the policy makes --------------------------------------------------------
    def _pop(self) -> Program:
        pid = self._queue[self._head]
        self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._queue):
            del self._queue[: self._head]
            self._head = 0
        return self.programs[pid]

    def _admit(self, p: Program, d: Decision) -> None:
        p.state = State.READY
        self.admitted += 1
        self._touch(p)
        if p.needs_session and p.session == SessionState.NONE:
            self._unprepared.add(p.pid)
            heapq.heappush(self._unprepared_heap, (p.order, p.pid))
        self._clock += p.tokens
        d.admit.append(p.pid)

    def _pause(self, p: Program) -> None:
        p.state = State.PAUSED
        p.pauses += 1
        self.pauses += 1
        self._touch(p)
        p.paused_clock = self._clock
        p.paused_slack = max(0.0, (self.config.kv_capacity or 0) - self.working_set)

    def _restore(self, p: Program, d: Decision) -> None:
        p.state = State.READY
        self._touch(p)
        self.restores += 1
        d.restored.append(p.pid)

    def _start_session(self, p: Program) -> None:
        p.session = SessionState.PREPARING
        self.preparing += 1
        self._unprepared.discard(p.pid)

    def _submit_one(self, p: Program, d: Decision) -> None:
        p.state, p.wanting = State.DECODING, False
        self._touch(p)
        self.in_flight += 1
        d.submit.append(p.pid)


class Scheduler(ProgramTable):
    """Pure program scheduler. Call the event methods, then :meth:`schedule`."""

    @property
    def budget(self) -> float:
        """KV tokens the working set may fill: ``kv_capacity x kv_watermark`` (unbounded
        without a capacity)."""
        cap = self.config.kv_capacity
        return math.inf if cap is None else cap * self.config.kv_watermark

    def schedule(self, now: float | None = None) -> Decision:
        """Decide what the reactor does now, from the state the events left (``now``: the
        driver's clock, as :meth:`advance`)."""
        if now is not None:
            self.advance(now)
        d = Decision()
        policy = self.config.policy
        if policy == SchedulingPolicy.PROGRAM:
            self._relieve_pressure(d)
            self._restore_and_admit(d)
        elif policy == SchedulingPolicy.FIFO or self.admitted == 0:
            # fifo fills every free program slot; lockstep admits a batch once the last is done
            while self.queued and self.admitted < self.config.max_programs:
                self._admit(self._pop(), d)
        self._prepare(d)
        self._submit(d)
        self.peak_working_set = max(self.peak_working_set, self._ws)
        return d

    def _relieve_pressure(self, d: Decision) -> None:
        # Programs already marked leave the working set when their turn returns.
        used = self._unmarked_working_set()
        if used <= self.budget:
            return
        # Pause order: acting programs first, then ready ones not yet submitted, each shortest
        # first; decoding ones cannot be interrupted: they are marked and pause on return.
        # One program always stays (no starvation).
        progs = [self.programs[i] for i in self._resident]
        acting = sorted((p for p in progs if p.state == State.ACTING), key=lambda p: (p.tokens, -p.order))
        ready = sorted((p for p in progs if p.state == State.READY), key=lambda p: (p.tokens, -p.order))
        decoding = sorted((p for p in progs if p.state == State.DECODING and not p.pause_pending),
                          key=lambda p: (p.tokens, -p.order))
        resident = len(progs)
        for p in acting + ready + decoding:
            if used <= self.budget or resident <= 1:
                break
            used -= self.footprint(p)
            resident -= 1
            if p.state == State.DECODING:
                p.pause_pending = True
                self._marked.add(p.pid)
            else:
                self._pause(p)
                d.paused.append(p.pid)

    def _outlasts(self, elapsed: float, hold: float) -> bool:
        """Whether a program ``elapsed`` on its tool is worth releasing at break-even
        ``hold``: its expected time left there (from the tools seen) exceeds it, or, with
        too few seen, it has been there that long already (ski rental)."""
        left = self.tool_times.remaining(elapsed)
        return elapsed >= hold if left is None else left > hold

    def _restore_key(self, p: Program) -> tuple:
        return (not self.likely_cached(p), self._group_left.get(p.group, 0), p.order)

    def _restore_and_admit(self, d: Decision) -> None:
        used = self._unmarked_working_set()
        # Paused programs that want their next turn come before anything new.
        waiting = sorted((self.programs[i] for i in self._paused if self.programs[i].wanting), key=self._restore_key)
        for p in waiting:
            need = self.footprint(p)
            if used + need > self.budget and self._resident:
                used = self._release_held(need, used, d)
                if used + need > self.budget and self._resident:
                    return  # strict priority: nothing new jumps ahead of a paused program
            self._restore(p, d)
            used += need
        while self.queued and self.admitted < self.config.max_programs:
            p = self.programs[self._queue[self._head]]
            need = self._blocks(p.tokens + self._reserve_estimate())
            if used + need > self.budget and self._resident:
                used = self._release_held(need, used, d)
                if used + need > self.budget and self._resident:
                    return
            self._admit(self._pop(), d)
            used += need

    def _release_held(self, need: int, used: int, d: Decision) -> int:
        """With the engine's costs known, pause acting programs worth releasing (those longest
        on their tools first: with heavy-tailed tools they are the likeliest to stay there)
        until ``need`` more tokens fit; returns the working set then. A slot's worth is the
        throughput one more request adds; when every decode slot is taken it is nothing."""
        cost, heap = self.config.cost, self._acting_heap
        if cost is None or not heap:
            return used
        n = self.in_flight + len(self._ready)  # requests that want the engine now
        if n >= self.config.max_requests:
            return used
        wanting = self._ws_by[State.DECODING] + self._ws_by[State.READY]
        hold = cost.hold_seconds(n, wanting / n if n else 0.0, need)
        while heap and used + need > self.budget:
            at, pid = heap[0]
            p = self.programs.get(pid)
            if p is None or p.state != State.ACTING or p.acted_at != at:
                heapq.heappop(heap)  # stale: it left its tool, or was paused
                continue
            if not self._outlasts(self.now - at, hold):
                break  # the others have been on their tools for less time still
            heapq.heappop(heap)
            used -= p.fp
            self._pause(p)
            d.paused.append(pid)
        return used

    def _prepare(self, d: Decision) -> None:
        cfg = self.config
        if cfg.policy != SchedulingPolicy.PROGRAM:
            # fifo/lockstep: a session is started when its program is admitted.
            for pid in d.admit:
                p = self.programs[pid]
                if p.needs_session and p.session == SessionState.NONE:
                    self._start_session(p)
                    d.prepare.append(pid)
            return
        # Admitted programs first (they may call a tool soon), then the lookahead.
        if self.preparing >= cfg.max_preparing:
            return
        heap = self._unprepared_heap
        while heap and self.preparing < cfg.max_preparing:  # oldest first, without a sort
            _, pid = heapq.heappop(heap)
            if pid in self._unprepared:
                p = self.programs[pid]
                if p.needs_session and p.session == SessionState.NONE:
                    self._start_session(p)
                    d.prepare.append(pid)
                else:
                    self._unprepared.discard(pid)
        ahead = (self.programs[self._queue[i]] for i in range(self._head, min(len(self._queue),
                                                                             self._head + cfg.session_lookahead)))
        for p in ahead:
            if self.preparing >= cfg.max_preparing:
                return
            if p.needs_session and p.session == SessionState.NONE:
                self._start_session(p)
                d.prepare.append(p.pid)

    def _submit(self, d: Decision) -> None:
        cfg = self.config
        if not self._ready:
            return
        room = cfg.max_requests - self.in_flight
        if cfg.policy == SchedulingPolicy.PROGRAM and room <= 0:
            return  # every decode slot is taken: most events arrive so, nothing to sort
        if cfg.policy == SchedulingPolicy.PROGRAM:
            self._submit_in_order(room, d)
            return
        ready = [self.programs[i] for i in self._ready]
        if cfg.policy == SchedulingPolicy.FIFO:
            # The slot is the program's: its first turn waits for its session.
            go = [p for p in ready if not (p.needs_session and p.session != SessionState.READY and p.turns == 0)]
        elif cfg.policy == SchedulingPolicy.LOCKSTEP:
            if len(ready) != len(self._resident):
                return  # the batch moves together
            if any(p.needs_session and p.session != SessionState.READY and p.turns == 0 for p in ready):
                return
            go = ready
        go.sort(key=self._submit_key)
        for p in go:
            self._submit_one(p, d)

    def _submit_in_order(self, room: int, d: Decision) -> None:
        """Submit up to ``room`` ready turns in :meth:`_submit_key` order, from the ready heap
        (each event costs a few heap operations, however many programs there are)."""
        heap = self._ready_heap
        while heap and room > 0:
            wait, seq, pid = heapq.heappop(heap)
            p = self.programs.get(pid)
            if p is None or pid not in self._ready or p.ready_seq != seq or self._session_wait(p) != wait:
                continue  # stale: submitted, paused, or its key changed (a newer entry holds it)
            self._submit_one(p, d)
            room -= 1
        if len(heap) > 4 * len(self._ready) + 1024:  # stale entries outnumber live ones: rebuild
            self._ready_heap = [(self._session_wait(p), p.ready_seq, p.pid)
                                for p in map(self.programs.get, self._ready)]
            heapq.heapify(self._ready_heap)

    @staticmethod
    def _session_wait(p: Program) -> bool:
        """Whether ``p`` will want a session that is not ready yet."""
        return p.needs_session and p.session != SessionState.READY

    def _submit_key(self, p: Program) -> tuple:
        if self.config.policy != SchedulingPolicy.PROGRAM:
            return (p.order,)
        # A turn whose program will want a session that is not ready yet goes after the
        # others: otherwise every new program's first turn runs at once and then all of them
        # wait on session starts together; this way first turns follow the preparations.
        return (self._session_wait(p), p.ready_seq)
