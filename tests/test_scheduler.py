"""The program scheduler, driven without an engine (it is pure: events in, decisions out)."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from agentenv.costs import CostModel
from agentenv.scheduler import (
    Decision,
    EnvState,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    SessionState,
    State,
)


def sched(**kw) -> Scheduler:
    kw.setdefault("block_size", 1)
    kw.setdefault("kv_watermark", 1.0)
    return Scheduler(SchedulerConfig(**kw))


def drive(s: Scheduler, programs: dict[int, list[tuple[int, int]]], rng: random.Random, check=None) -> dict:
    """Run programs to completion with random event order. ``programs[pid]`` is a list of
    (turn tokens, tool tokens). Returns counters; fails if anything gets stuck."""
    tokens = {pid: s.programs[pid].tokens for pid in programs}
    turn = {pid: 0 for pid in programs}
    running, acting = set(), set()
    steps = 0

    def apply(d):
        for pid in d.admit:
            s.want_turn(pid, tokens[pid], programs[pid][0][0])
        for pid in d.submit:
            running.add(pid)

    for pid in programs:
        pass
    apply(s.schedule())
    while not s.done:
        steps += 1
        assert steps < 100_000, "stuck"
        for pid in list(d_ for d_ in s.programs if s.programs[d_].session.value == "preparing"):
            if rng.random() < 0.5:
                s.session_ready(pid)
        choices = [("turn", p) for p in running] + [("tool", p) for p in acting]
        if not choices:
            d = s.schedule()
            apply(d)
            if check:
                check(s, d)
            if not (running or acting) and not d:
                # Only session preparation may be outstanding.
                assert any(p.session.value == "preparing" for p in s.programs.values()), "nothing can move"
            continue
        kind, pid = rng.choice(choices)
        if kind == "turn":
            running.discard(pid)
            n, _ = programs[pid][turn[pid]]
            tokens[pid] += n
            s.turn_done(pid, tokens[pid])
            acting.add(pid)
        else:
            acting.discard(pid)
            _, tool = programs[pid][turn[pid]]
            turn[pid] += 1
            if turn[pid] == len(programs[pid]):
                s.finish(pid)
            else:
                tokens[pid] += tool
                s.want_turn(pid, tokens[pid], programs[pid][turn[pid]][0])
        d = s.schedule()
        apply(d)
        if check:
            check(s, d)
    return {"steps": steps}


def random_programs(s: Scheduler, n: int, rng: random.Random, group_size: int = 4, needs_session: bool = False):
    progs = {}
    for pid in range(n):
        turns = [(rng.randint(8, 120), rng.randint(4, 60)) for _ in range(rng.randint(1, 8))]
        s.add(pid, rng.randint(20, 100), group=pid // group_size, needs_session=needs_session)
        progs[pid] = turns
    return progs


@pytest.mark.parametrize("seed", range(6))
def test_admission_never_exceeds_the_kv_budget_and_every_program_finishes(seed):
    rng = random.Random(seed)
    s = sched(kv_capacity=1500, max_requests=8, max_programs=64, turn_reserve=64)
    progs = random_programs(s, 60, rng)
    grew = []

    def check(s, d):
        marked = sum(s.programs[i].fp for i in s._marked)
        resident = [p for p in s.programs.values() if p.state in (State.READY, State.DECODING, State.ACTING)]
        if d.admit or d.restored:
            # What was let in fits (the sole resident program excepted: it must run).
            assert s.working_set - marked <= s.budget or len(resident) == 1
        assert s.in_flight <= 8
        assert s.in_flight == sum(p.state == State.DECODING for p in s.programs.values())
        grew.append(s.working_set)

    drive(s, progs, rng, check)
    assert all(p.state == State.DONE for p in s.programs.values())
    # The budget was tight: pressure happened; paused programs came back (or ended on their tool).
    assert s.pauses > 0 and 0 < s.restores <= s.pauses


def test_working_set_is_tracked_incrementally():
    rng = random.Random(7)
    s = sched(kv_capacity=900, max_requests=4, max_programs=30, block_size=16, turn_reserve=50)
    progs = random_programs(s, 30, rng)

    def check(s, d):
        resident = [p for p in s.programs.values() if p.state in (State.READY, State.DECODING, State.ACTING)]
        assert s.working_set == sum(s.footprint(p) for p in resident) or s._turn_count >= 8
        assert s.working_set == sum(p.fp for p in resident)

    drive(s, progs, rng, check)


def test_pause_order_acting_first_shortest_first_then_decoding_marked():
    s = sched(kv_capacity=1000, max_requests=8, max_programs=8, turn_reserve=10)
    for pid, n in enumerate([100, 200, 300, 250]):
        s.add(pid, n)
    d = s.schedule()
    assert d.admit == [0, 1, 2, 3]
    for pid in range(4):
        s.want_turn(pid, s.programs[pid].tokens, 10)
    d = s.schedule()
    assert d.submit == [0, 1, 2, 3]
    # 0, 1 and 2 return and act; 3 is still decoding. Then everyone grows past the budget.
    s.turn_done(0, 110)
    s.turn_done(1, 290)
    s.turn_done(2, 300)
    s.programs[3].tokens = 500  # a long turn in progress (its reserve is on top)
    s._touch(s.programs[3])
    assert s.working_set == 110 + 290 + 300 + 510
    d = s.schedule()
    # Acting programs go first, shortest first: 0 (110) alone brings 1210 down to 1100, then 1.
    assert d.paused == [0, 1]
    assert s.state(0) == State.PAUSED and s.state(3) == State.DECODING
    # Pressure from a decoding program: it is marked, and pauses when its turn returns.
    s.programs[3].tokens = 800
    s._touch(s.programs[3])
    d = s.schedule()
    assert d.paused == [2]
    s.programs[3].tokens = 1200
    s._touch(s.programs[3])
    d = s.schedule()
    assert d.paused == [] and not s.programs[3].pause_pending  # the last resident one always stays


def test_restore_order_cached_first_then_nearly_complete_groups_then_older():
    s = sched(kv_capacity=10_000, max_requests=8, max_programs=16)
    # Group "a" has 3 programs left, group "b" 1.
    for pid, g in enumerate("aaab"):
        s.add(pid, 100, group=g)
    s.schedule()
    for pid in range(4):
        p = s.programs[pid]
        p.state, p.wanting = State.PAUSED, True
        s._touch(p)
        p.paused_clock, p.paused_slack = 0, 0
    s._clock = 10  # everything was allocated over since the pauses: none is likely cached
    keys = sorted(s.programs.values(), key=s._restore_key)
    assert [p.pid for p in keys] == [3, 0, 1, 2]  # the nearly complete group first, then by age
    s.programs[2].paused_slack = 100  # 2 was paused with room to spare: its prefix is likely cached
    keys = sorted(s.programs.values(), key=s._restore_key)
    assert [p.pid for p in keys][0] == 2


def test_paused_programs_come_back_before_new_ones_are_admitted():
    s = sched(kv_capacity=300, max_requests=4, max_programs=10, turn_reserve=10)
    for pid in range(3):
        s.add(pid, 100)
    d = s.schedule()
    assert d.admit == [0, 1]  # 2 x (100 + 10) fits, a third does not
    for pid in (0, 1):
        s.want_turn(pid, 100, 10)
    s.schedule()
    s.turn_done(0, 110)
    s.turn_done(1, 110)
    s.want_turn(0, 250, 10)  # a big tool output: 0 now needs 260 of 300
    d = s.schedule()
    assert d.paused == [1] and d.submit == [0]  # the other acting program makes room
    s.want_turn(1, 120, 10)  # 1's tool returns while it is paused: it waits
    d = s.schedule()
    assert not d and s.state(1) == State.PAUSED and s.state(2) == State.QUEUED
    s.turn_done(0, 260)
    s.finish(0)
    d = s.schedule()
    # 1 comes back first; 2 (new) fits beside it (130 + 110 <= 300) and is admitted after it.
    assert d.restored == [1] and d.admit == [2] and d.submit == [1]
    assert s.working_set <= 300


def test_requests_in_flight_are_capped_by_decode_slots_not_programs():
    s = sched(kv_capacity=None, max_requests=3, max_programs=20)
    for pid in range(10):
        s.add(pid, 50)
    d = s.schedule()
    assert len(d.admit) == 10  # programs are not slots
    for pid in range(10):
        s.want_turn(pid, 50, 20)
    d = s.schedule()
    assert d.submit == [0, 1, 2] and s.in_flight == 3
    s.turn_done(1, 70)  # a program on its tool frees its slot at once
    d = s.schedule()
    assert d.submit == [3]


def one_slot_three_programs() -> Scheduler:
    """One decode slot, programs 0, 1 and 2 admitted, 0 wanting its first turn."""
    s = sched(kv_capacity=None, max_requests=1, max_programs=10)
    for pid in range(3):
        s.add(pid, 50)
    s.schedule()
    s.want_turn(0, 50, 20)
    return s


def test_a_withdrawn_turn_gives_its_slot_back_and_the_program_may_ask_again():
    # One slot: 0 has it, 1 waits. 1's caller goes away while it waits, then 0's after the
    # slot was granted but before the engine had the request. The slot goes to 2, and both may
    # ask again (wanting a turn while decoding would be refused).
    s = one_slot_three_programs()
    s.want_turn(1, 50, 20)
    assert s.schedule().submit == [0] and s.in_flight == 1
    s.withdraw_turn(1)
    assert (s.programs[1].state, s.programs[1].wanting) == (State.ACTING, False)
    s.withdraw_turn(0)
    assert s.programs[0].state == State.ACTING and s.in_flight == 0
    s.want_turn(2, 50, 20)
    assert s.schedule().submit == [2]
    s.turn_done(2, 70)
    s.want_turn(1, 50, 20)
    s.want_turn(0, 50, 20)
    assert s.schedule().submit == [1] and s.in_flight == 1
    s.withdraw_turn(2)  # not wanting a turn: nothing to withdraw
    assert s.programs[2].state == State.ACTING and s.in_flight == 1


def test_slots_go_to_turns_in_the_order_they_became_ready():
    # One slot, three programs. 0 decodes first; while it does, 1 and 2 become ready. When 0
    # comes back for its second turn it queues behind them: a program under way does not
    # starve the new ones (the earlier "most turns first" order ran 0's turn again here).
    s = one_slot_three_programs()
    assert s.schedule().submit == [0]
    s.want_turn(2, 50, 20)  # 2 is ready before 1
    s.want_turn(1, 50, 20)
    s.turn_done(0, 70)
    s.want_turn(0, 80, 20)
    order = []
    for _ in range(3):
        (pid,) = s.schedule().submit
        order.append(pid)
        s.turn_done(pid, s.programs[pid].tokens + 20)
    assert order == [2, 1, 0]


def test_turns_whose_session_is_not_ready_go_after_the_others():
    # Without this, every new program's first turn would run at once and all of them would
    # then wait on session starts together (retool-math: 0.29 of pure decode against 0.58).
    s = sched(kv_capacity=None, max_requests=1, max_programs=10, max_preparing=1, session_lookahead=0)
    for pid in range(3):
        s.add(pid, 50, needs_session=True)
    d = s.schedule()
    assert d.prepare == [0]  # one preparation at a time
    for pid in (2, 1, 0):  # 2 is ready first, 0 last
        s.want_turn(pid, 50, 20)
    s.session_ready(0)
    order = []
    for _ in range(3):
        (pid,) = s.schedule().submit
        order.append(pid)
        s.turn_done(pid, 70)
    assert order == [0, 2, 1]  # 0's session is ready; then the rest in the order they became ready


def test_sessions_are_prepared_ahead_within_the_lookahead():
    s = sched(kv_capacity=None, max_requests=2, max_programs=2, session_lookahead=3, max_preparing=4)
    for pid in range(8):
        s.add(pid, 10, needs_session=True)
    d = s.schedule()
    assert d.admit == [0, 1]
    assert d.prepare == [0, 1, 2, 3]  # admitted first, then the lookahead, capped by max_preparing
    s.want_turn(0, 10, 5)
    d = s.schedule()
    assert d.submit == [0]  # a program decodes before its session is ready
    s.session_ready(0)
    s.session_ready(2)
    d = s.schedule()
    assert d.prepare == [4]  # the lookahead window (2, 3, 4) is full again


def test_fifo_holds_the_slot_and_waits_for_the_session():
    s = sched(policy=SchedulingPolicy.FIFO, max_programs=2)
    for pid in range(4):
        s.add(pid, 10, needs_session=True)
    d = s.schedule()
    assert d.admit == [0, 1] and d.prepare == [0, 1]
    s.want_turn(0, 10, 5)
    assert s.schedule().submit == []  # the first turn waits for the session
    s.session_ready(0)
    assert s.schedule().submit == [0]
    s.turn_done(0, 15)
    assert s.schedule().admit == []  # acting: it still holds its slot
    s.finish(0)
    assert s.schedule().admit == [2]



def test_the_former_env_event_names_still_move_a_session_with_a_warning():
    """``env_ready`` and ``demand_env`` were ``session_ready`` and ``demand_session``: still
    taken (deprecated), with the same effect."""
    s = sched(kv_capacity=None, max_requests=2, max_programs=1, session_lookahead=0, max_preparing=4)
    s.add(0, 10, needs_session=True)
    s.add(1, 10, needs_session=True)
    s.schedule()
    with pytest.warns(DeprecationWarning, match="demand_session"):
        s.demand_env(1)
    assert s.programs[1].session == SessionState.PREPARING
    with pytest.warns(DeprecationWarning, match="session_ready"):
        s.env_ready(1)
    assert s.programs[1].session == SessionState.READY

def test_lockstep_moves_the_batch_together():
    s = sched(policy=SchedulingPolicy.LOCKSTEP, max_programs=3)
    for pid in range(5):
        s.add(pid, 10)
    d = s.schedule()
    assert d.admit == [0, 1, 2]
    s.want_turn(0, 10, 5)
    s.want_turn(1, 10, 5)
    assert s.schedule().submit == []
    s.want_turn(2, 10, 5)
    assert s.schedule().submit == [0, 1, 2]
    for pid in range(3):
        s.turn_done(pid, 15)
    s.want_turn(0, 20, 5)
    s.finish(1)
    assert s.schedule().submit == []  # 2 is still on its tool
    s.want_turn(2, 20, 5)
    assert s.schedule().submit == [0, 2]
    for pid in (0, 2):
        s.turn_done(pid, 25)
        s.finish(pid)
    assert s.schedule().admit == [3, 4]  # the next batch only when this one is done


def test_cancel_and_forget_keep_the_books_balanced():
    s = sched(kv_capacity=None, max_programs=1)
    s.add(0, 10, group="g")
    s.add(1, 10, group="g")
    s.schedule()
    s.cancel(1)
    assert s.queued == 0 and 1 not in s.programs
    s.want_turn(0, 10, 5)
    s.schedule()
    s.finish(0)
    s.forget(0)
    assert s.done and not s.programs and s.in_flight == 0 and s.working_set == 0


def test_config_is_validated():
    with pytest.raises(ValueError):
        SchedulerConfig(max_requests=0)
    with pytest.raises(ValueError):
        SchedulerConfig(kv_watermark=0)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="random")


# -- cost-aware holding under KV pressure --------------------------------------------------------
def acting_under_pressure(cost, max_requests=4, queued=1):
    """400 KV tokens: programs 0, 1 and 2 (110 each with their turn reserve) run; 0's and 1's
    turns return at t=0 and t=1 (they act), 2 still decodes; ``queued`` more wait, 110 each."""
    s = sched(kv_capacity=400, max_requests=max_requests, max_programs=16, turn_reserve=10, cost=cost)
    for pid in range(3 + queued):
        s.add(pid, 100)
    assert s.schedule(0.0).admit == [0, 1, 2]
    for pid in range(3):
        s.want_turn(pid, 100, 10)
    assert s.schedule(0.0).submit[:max_requests] == [0, 1, 2][:max_requests]
    s.turn_done(0, 110)
    s.advance(1.0)
    s.turn_done(1, 110)
    return s


DEAR = CostModel(step_base=0.01, step_per_seq=0.001, prefill_per_token=0.01)  # hold 2.42 s at 1 in flight
CHEAP = CostModel(step_base=0.01, step_per_seq=0.001, prefill_per_token=1e-4)  # hold 0.0242 s


def test_without_a_cost_model_acting_programs_keep_their_kv_for_their_whole_tool():
    s = acting_under_pressure(None)
    d = s.schedule(1000.0)
    assert not d.admit and not d.paused and s.state(3) == State.QUEUED


def test_kv_is_held_while_a_re_prefill_is_dearer_than_the_slot_then_released_longest_acting_first():
    s = acting_under_pressure(DEAR)
    assert DEAR.hold_seconds(1, 110, 110) == pytest.approx(2.42)
    d = s.schedule(2.0)  # 0 has acted 2 s, 1 has 1 s: both held
    assert not d.admit and not d.paused
    d = s.schedule(2.5)  # 0's hold ran out; releasing it alone makes room (440 - 110 <= 400)
    assert d.paused == [0] and d.admit == [3] and s.state(1) == State.ACTING
    assert s.working_set <= s.budget


def test_when_slots_are_dear_against_re_prefill_acting_kv_goes_to_a_waiting_program_at_once():
    s = acting_under_pressure(CHEAP)
    d = s.schedule(1.0)
    assert d.paused == [0] and d.admit == [3]
    # 0's tool returns: it is restored before anything new (4 more are queued behind it)
    # once 1's hold runs out too, 1 making room for it.
    s.want_turn(0, 120, 10)
    d = s.schedule(1.1)
    assert d.paused == [1] and d.restored == [0] and not d.admit


def test_a_resuming_program_gets_released_kv_before_a_new_one():
    s = acting_under_pressure(CHEAP, queued=2)
    s.schedule(1.0)  # 0 released to 3
    s.want_turn(0, 120, 10)  # 0's tool returns while 4 is still queued
    d = s.schedule(1.1)
    assert d.restored == [0] and 4 not in d.admit


def test_no_kv_is_released_while_every_decode_slot_is_taken():
    # One decode slot, and a turn waiting for it: another program would only wait too.
    s = sched(kv_capacity=400, max_requests=1, max_programs=16, turn_reserve=10, cost=CHEAP)
    for pid in range(4):
        s.add(pid, 100)
    assert s.schedule(0.0).admit == [0, 1, 2]
    for pid in range(3):
        s.want_turn(pid, 100, 10)
    assert s.schedule(0.0).submit == [0]
    s.turn_done(0, 110)
    assert s.schedule(0.0).submit == [1]  # 2 waits for the slot, 3 for KV
    d = s.schedule(100.0)
    assert not d.admit and not d.paused and s.state(0) == State.ACTING


@pytest.mark.parametrize("seed", range(3))
def test_cost_aware_holding_keeps_the_budget_and_every_program_finishes(seed):
    rng = random.Random(seed)
    s = sched(kv_capacity=1500, max_requests=8, max_programs=64, turn_reserve=64, cost=CHEAP)
    progs = random_programs(s, 60, rng)
    clock = iter(range(1, 10**6))

    def check(s, d):
        s.advance(next(clock) * 0.01)
        if d.admit or d.restored:
            resident = [p for p in s.programs.values() if p.state in (State.READY, State.DECODING, State.ACTING)]
            assert s._unmarked_working_set() <= s.budget or len(resident) == 1
        assert s.working_set == sum(s.working_set_of(st) for st in (State.READY, State.DECODING, State.ACTING))

    drive(s, progs, rng, check)
    assert all(p.state == State.DONE for p in s.programs.values()) and s.pauses > 0


# -- the heaps decide as a sort of every candidate would --------------------------------------
class Recorded(Scheduler):
    """The scheduler as it is, every decision it makes recorded (copied as it was made), and
    how often it rebuilt its ready heap (stale entries outnumbered live ones)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.decisions: list[tuple] = []
        self.rebuilds = 0

    def schedule(self, now: float | None = None) -> Decision:
        d = super().schedule(now)
        self.decisions.append(dataclasses.astuple(d))
        return d

    def _submit_in_order(self, room: int, d: Decision) -> None:
        heap = self._ready_heap
        super()._submit_in_order(room, d)
        self.rebuilds += self._ready_heap is not heap


class SortedReference(Recorded):
    """The reference for the scheduler's heaps: the same choices made the straightforward
    way, at every decision sorting all the unprepared programs by age and taking the
    ``room`` ready turns that come first in ``_submit_key`` order (the sort-based code of
    commit 164eee8's parent, as it reads there)."""

    def _prepare(self, d: Decision) -> None:
        cfg = self.config
        if cfg.policy != SchedulingPolicy.PROGRAM:
            for pid in d.admit:
                p = self.programs[pid]
                if p.needs_session and p.session == SessionState.NONE:
                    self._start_session(p)
                    d.prepare.append(pid)
            return
        if self.preparing >= cfg.max_preparing:
            return
        candidates = sorted((self.programs[i] for i in self._unprepared), key=lambda p: p.order)
        ahead = (self.programs[self._queue[i]] for i in range(self._head, min(len(self._queue),
                                                                             self._head + cfg.session_lookahead)))
        for p in (*candidates, *ahead):
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
            return
        ready = [self.programs[i] for i in self._ready]
        if cfg.policy == SchedulingPolicy.FIFO:
            go = [p for p in ready if not (p.needs_session and p.session != SessionState.READY and p.turns == 0)]
        elif cfg.policy == SchedulingPolicy.LOCKSTEP:
            if len(ready) != len(self._resident):
                return
            if any(p.needs_session and p.session != SessionState.READY and p.turns == 0 for p in ready):
                return
            go = ready
        else:
            go = heapq.nsmallest(room, ready, key=self._submit_key)
        if cfg.policy != SchedulingPolicy.PROGRAM:
            go.sort(key=self._submit_key)
        for p in go:
            self._submit_one(p, d)


#: (policy, KV capacity, tasks of 4, decode slots, most programs admitted, session start s)
SIMULATED = {
    "program-kv-pressure": ("program", 4096, 96, 16, None, 0.012),
    "program-no-pressure": ("program", 10**7, 96, 16, None, 0.012),
    # 2,000 programs admitted at once, waiting on slow session starts: the ready heap
    # gathers more stale entries than live ones and is rebuilt.
    "program-many-admitted": ("program", 10**7, 500, 64, 2000, 0.05),
    "fifo-kv-pressure": ("fifo", 4096, 96, 16, None, 0.012),
    "fifo-no-pressure": ("fifo", 10**7, 96, 16, None, 0.012),
    "lockstep-kv-pressure": ("lockstep", 4096, 96, 16, None, 0.012),
    "lockstep-no-pressure": ("lockstep", 10**7, 96, 16, None, 0.012),
}


@pytest.mark.parametrize("case", list(SIMULATED))
def test_the_heaps_make_the_decisions_a_sort_of_every_candidate_makes(case):
    """The simulator (``simulate``) runs a trace workload with the scheduler and with
    :class:`SortedReference` in its place: every decision, in order, and the figures agree."""
    from agentenv import simulator
    from agentenv.workload import WorkloadSpec, workload

    policy, kv_capacity, tasks, slots, max_programs, session_start_s = SIMULATED[case]
    traces = [p for g in workload(WorkloadSpec(mean_turns=4, tool_median=0.2), tasks, 4, seed=5) for p in g]
    engine = simulator.EngineModel(kv_capacity=kv_capacity, block_size=32)
    runs = {}
    for cls in (Recorded, SortedReference):
        made: list[Recorded] = []
        result = simulator.simulate(traces, engine, policy, concurrency=slots, max_programs=max_programs,
                                    group_size=4, session_lookahead=8, session_start_s=session_start_s,
                                    scheduler=lambda config, cls=cls: made.append(cls(config)) or made[-1])
        runs[cls] = (dataclasses.asdict(result), made[0])
    (mine, sched), (theirs, reference) = runs[Recorded], runs[SortedReference]
    assert len(sched.decisions) == len(reference.decisions) and sched.decisions == reference.decisions
    assert mine == theirs and mine["tokens"] == sum(sum(t.turn_tokens) for t in traces)
    # Decisions with a choice in them: several turns for the slots, several sessions to start.
    assert max(len(d[2]) for d in sched.decisions) > 1 and max(len(d[1]) for d in sched.decisions) > 1
    if case == "program-kv-pressure":
        assert mine["pauses"] > 0 and mine["restores"] > 0
    if case == "program-many-admitted":
        assert sched.rebuilds > 0


def test_the_former_name_of_session_state_still_imports():
    assert EnvState is SessionState  # "env" is the Environment; a program's sandbox session is its session


def test_with_tool_times_seen_a_program_expected_to_stay_on_its_tool_is_released_at_once():
    s = acting_under_pressure(DEAR)
    for _ in range(16):
        s.tool_times.add(60.0)  # tools last a minute: holding 2.42 s saves nothing
    d = s.schedule(1.0)
    assert d.paused == [0] and d.admit == [3]
    s = acting_under_pressure(DEAR)
    for _ in range(16):
        s.tool_times.add(0.5)  # tools end within a second, well within the break-even
    d = s.schedule(3.0)  # past the break-even, but none seen lasted this long: ski rental
    assert d.paused == [0] and d.admit == [3]
    s = acting_under_pressure(DEAR)
    for _ in range(16):
        s.tool_times.add(2.5)
    assert not s.schedule(2.0).paused  # 0.5 s left expected: held
