"""Run statistics: pure bookkeeping over finished trajectories (no I/O)."""

from __future__ import annotations

import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .trajectory import Trajectory


def resume_eligible(prev_prompt: int, prev_new: int, prompt: int, block_size: int = 1) -> int:
    """Prompt tokens of a resumed turn the engine could serve from its cache: the previous
    turn's prompt plus all but its last sampled token (whose KV was never computed), capped
    below the new prompt's length (one token is always computed), in whole blocks."""
    seen = min(prev_prompt + max(prev_new - 1, 0), prompt - 1)
    return (seen // block_size) * block_size


def resume_reuse(traj: Trajectory, block_size: int = 1) -> tuple[int, int]:
    """(cached, eligible) tokens over the *resumed* turns of one trajectory.

    A resumed turn's eligible prefix is what the engine had already computed KV for in the
    previous turn: that turn's prompt plus all but its last sampled token, rounded down to
    whole cache blocks (engines cache full blocks only).
    """
    cached = eligible = 0
    for prev, cur in zip(traj.turns, traj.turns[1:]):
        elig = resume_eligible(prev.prompt_tokens, prev.new_tokens, cur.prompt_tokens, block_size)
        eligible += elig
        cached += min(cur.cached_tokens, elig) if elig else 0
    return cached, eligible


@dataclass
class Outcomes:
    """What finished programs did, counted from their trajectories."""

    #: The engine's KV block size: a resumed turn's reusable prefix is counted in whole blocks.
    block_size: int = 1
    started: int = 0
    finished: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    programs_with_ok_tool_call: int = 0
    sampled_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    first_turn_cached: int = 0
    resume_cached: int = 0
    resume_eligible: int = 0
    reprefilled: int = 0
    reward_sum: float = 0.0
    rewarded: int = 0
    component_sums: Counter = field(default_factory=Counter)
    component_counts: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    #: An agent environment's gateway calls (``agentenv.gateway``): calls, extended, branched,
    #: answered from the journal, programs restarted on a replay mismatch, malformed calls.
    gateway: Counter = field(default_factory=Counter)

    def add(self, t: Trajectory) -> None:
        self.finished += 1
        g = t.metadata.get("gateway")
        if g:
            self.gateway.update({k: int(g.get(k, 0)) for k in ("calls", "extended", "branched", "replayed",
                                                                "restarts", "malformed_tool_calls")})
            self.gateway["programs"] += 1
        self.turns += len(t.turns)
        self.tool_calls += len(t.tool_calls)
        self.tool_errors += sum(c.status != "ok" for c in t.tool_calls)
        self.programs_with_ok_tool_call += any(c.status == "ok" for c in t.tool_calls)
        self.sampled_tokens += t.num_sampled_tokens
        self.prompt_tokens += sum(x.prompt_tokens for x in t.turns)
        self.cached_tokens += sum(x.cached_tokens for x in t.turns)
        if t.turns:
            self.first_turn_cached += t.turns[0].cached_tokens
        c, e = resume_reuse(t, self.block_size)
        self.resume_cached += c
        self.resume_eligible += e
        self.reprefilled += e - c
        self.count_reward(t)

    def count_reward(self, t: Trajectory, sign: int = 1) -> None:
        """Count ``t``'s reward, components and finish reason (``sign=-1``: take them back,
        before a group reward replaces them; ``add`` counts them once)."""
        if t.reward is not None:
            self.reward_sum += sign * t.reward
            self.rewarded += sign
        for name, value in t.reward_components.items():
            self.component_sums[name] += sign * value
            self.component_counts[name] += sign
            if not self.component_counts[name]:
                del self.component_counts[name], self.component_sums[name]
        self.finish_reasons[t.finish_reason] += sign
        if not self.finish_reasons[t.finish_reason]:
            del self.finish_reasons[t.finish_reason]

    @property
    def resume_reuse(self) -> float:
        return self.resume_cached / self.resume_eligible if self.resume_eligible else 0.0

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None


@dataclass
class Occupancy:
    """Engine occupancy over the run's wall time, integrated from the reactor's submit and
    return events, and its timeline."""

    #: Decode slots (the reactor's ``concurrency``); 0 when unknown.
    slots: int = 0
    in_flight: int = 0
    in_flight_area: float = 0.0
    idle_s: float = 0.0
    #: Time with fewer than half the decode slots busy (idle included): where a run starves
    #: the engine, typically its tail, when the programs left are fewer than the slots.
    under_half_s: float = 0.0
    #: Per ``bin_s`` second of the run: [sampled tokens (counted when their turn ends),
    #: request-seconds in flight], the timeline behind :meth:`full_and_tail`. At most
    #: ``max_bins`` of them: a longer run (a trainer's reactor lives for days) merges them in
    #: pairs and doubles ``bin_s``, so the timeline's memory stays bounded.
    bin_s: float = 1.0
    max_bins: int = 4096
    bins: list = field(default_factory=list)
    #: Tokens sampled in this run's turns so far (``Outcomes.sampled_tokens`` counts finished
    #: programs, a resumed one's earlier turns included): the live rate a progress bar shows.
    turn_tokens: int = 0
    t0: float = 0.0
    t1: float = 0.0
    _t_last: float = 0.0

    def start(self) -> None:
        self.t0 = self._t_last = time.perf_counter()

    def stop(self) -> None:
        self._advance()
        self.t1 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return (self.t1 or time.perf_counter()) - self.t0

    def _advance(self) -> None:
        now = time.perf_counter()
        if self._t_last:
            dt = now - self._t_last
            self.in_flight_area += self.in_flight * dt
            if self.in_flight == 0:
                self.idle_s += dt
            if 2 * self.in_flight < self.slots:
                self.under_half_s += dt
            t = self._t_last
            while t < now:  # the in-flight area, split at bin edges
                b, edge = self._bin(t)
                end = min(now, edge)
                b[1] += self.in_flight * (end - t)
                t = end if end > t else now
        self._t_last = now

    def _bin(self, t: float) -> tuple[list, float]:
        """The timeline's bin holding time ``t`` (``perf_counter``), and where it ends."""
        i = max(0, int((t - self.t0) / self.bin_s))
        while i >= self.max_bins:  # coarser: pairs merge, each bin twice as long
            self.bins = [[sum(b[0] for b in pair), sum(b[1] for b in pair)]
                         for pair in zip(self.bins[0::2], self.bins[1::2] + [[0, 0.0]])]
            self.bin_s *= 2
            i = int((t - self.t0) / self.bin_s)
        while len(self.bins) <= i:
            self.bins.append([0, 0.0])
        return self.bins[i], self.t0 + (i + 1) * self.bin_s

    def turn_sampled(self, n: int) -> None:
        """A turn ended with ``n`` sampled tokens (the timeline's token count)."""
        if self.t0 and not self.t1:
            self._bin(time.perf_counter())[0][0] += n
            self.turn_tokens += n

    def area(self) -> float:
        """The request-seconds in flight so far, up to now (integrated as :meth:`requests_changed`
        does: from the first request on, whether or not the run's clock was started)."""
        if not self.t1:
            self._advance()
        return self.in_flight_area

    def requests_changed(self, delta: int) -> None:
        """A request entered (+1) or left (-1) the engine."""
        if not self.t1:
            self._advance()
        self.in_flight += delta

    @property
    def mean_in_flight(self) -> float:
        return self.in_flight_area / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def under_half_fraction(self) -> float | None:
        """Share of the wall time with fewer than half the decode slots busy (None: slots unknown)."""
        if not self.slots:
            return None
        return self.under_half_s / self.elapsed if self.elapsed > 0 else 0.0

    def full_and_tail(self, full: float = 0.9) -> dict[str, float] | None:
        """Where a run's time goes, from its timeline: the seconds with at least ``full`` of
        the decode slots busy on average and the tokens sampled in them (the run's body), and
        the time and tokens after the last such second (its tail). None: slots unknown or
        the run not stopped."""
        if not self.slots or not self.t1 or not self.bins:
            return None
        n = len(self.bins) - 1  # the last bin is cut short by the run's end
        busy = [i for i in range(n) if self.bins[i][1] >= full * self.slots * self.bin_s]
        full_tokens = sum(self.bins[i][0] for i in busy)
        after = busy[-1] + 1 if busy else 0
        return {"full_s": len(busy) * self.bin_s, "full_tokens": full_tokens,
                "full_tok_s": full_tokens / (len(busy) * self.bin_s) if busy else 0.0,
                "tail_s": max(0.0, self.elapsed - after * self.bin_s),
                "tail_tokens": sum(b[0] for b in self.bins[after:])}


@dataclass
class Sessions:
    """The sandbox side: programs paused and restored for KV room, waits for a prepared
    session, and how long sessions took to start."""

    pauses: int = 0
    restores: int = 0
    session_waits: int = 0
    session_wait_s: float = 0.0
    #: Sandbox sessions started, and the seconds each took: all of them up to
    #: ``max_samples``, then a uniform sample of that many (reservoir), for the percentiles.
    session_starts: int = 0
    session_start_s: list = field(default_factory=list)
    max_samples: int = 10_000
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def session_started(self, seconds: float) -> None:
        """A sandbox session took ``seconds`` to start."""
        self.session_starts += 1
        if len(self.session_start_s) < self.max_samples:
            self.session_start_s.append(seconds)
        else:  # reservoir sampling: each start kept with the same chance
            j = self._rng.randrange(self.session_starts)
            if j < self.max_samples:
                self.session_start_s[j] = seconds

    # The former names (deprecated: "env" is the Environment), read-only.
    env_waits = property(lambda self: _former(self, "env_waits", "session_waits"))
    env_wait_s = property(lambda self: _former(self, "env_wait_s", "session_wait_s"))
    env_starts = property(lambda self: _former(self, "env_starts", "session_starts"))
    env_start_s = property(lambda self: _former(self, "env_start_s", "session_start_s"))


def _former(obj: object, old: str, new: str) -> Any:
    """``obj.<new>``, read under its former name ``old``, with a DeprecationWarning."""
    warnings.warn(f"{type(obj).__name__}.{old} is now {new}", DeprecationWarning, stacklevel=3)
    return getattr(obj, new)


#: The run summary's keys that were renamed ("env" is the Environment; these count sandbox
#: sessions), old -> new: :func:`current_summary` reads a summary written with the old ones.
FORMER_SUMMARY_KEYS = {"env_waits": "session_waits", "env_wait_s": "session_wait_s",
                       "env_starts": "session_starts", "env_start_p50_ms": "session_start_p50_ms",
                       "env_start_p90_ms": "session_start_p90_ms"}


def current_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """A run summary (:meth:`RunStats.summary`) under today's keys: one written with the former
    ones (:data:`FORMER_SUMMARY_KEYS`) has them renamed where they stand; a figure given under
    both names keeps its new name's value."""
    if not FORMER_SUMMARY_KEYS.keys() & summary.keys():
        return summary
    return {FORMER_SUMMARY_KEYS.get(k, k): summary.get(FORMER_SUMMARY_KEYS.get(k, k), v) for k, v in summary.items()}


class RunStats:
    """A run's statistics in three parts: :attr:`outcomes` (what finished programs did),
    :attr:`occupancy` (the engine's busy slots over time) and :attr:`sessions` (the sandbox
    side); :meth:`summary` is the table both run paths print. Pure bookkeeping, no I/O."""

    def __init__(self, *, block_size: int = 1, slots: int = 0, max_bins: int = 4096, max_samples: int = 10_000):
        self.outcomes = Outcomes(block_size=block_size)
        self.occupancy = Occupancy(slots=slots, max_bins=max_bins)
        self.sessions = Sessions(max_samples=max_samples)
        self.total = 0

    def start(self, total: int) -> None:
        self.total = total
        self.occupancy.start()

    def stop(self) -> None:
        self.occupancy.stop()

    def program_started(self) -> None:
        self.outcomes.started += 1

    def add(self, t: Trajectory) -> None:
        self.outcomes.add(t)

    @property
    def elapsed(self) -> float:
        return self.occupancy.elapsed

    @property
    def tokens_per_s(self) -> float:
        return self.outcomes.sampled_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def live_tokens_per_s(self) -> float:
        return self.occupancy.turn_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> dict[str, object]:
        o, e, s = self.outcomes, self.occupancy, self.sessions
        return {
            "programs": o.finished,
            "turns": o.turns,
            "tool_calls": o.tool_calls,
            "tool_errors": o.tool_errors,
            "programs_with_ok_tool_call": o.programs_with_ok_tool_call,
            "tokens_generated": o.sampled_tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "prefix_cache_hit_pct": round(100 * o.cached_tokens / o.prompt_tokens, 1) if o.prompt_tokens else 0.0,
            "resume_reuse_pct": round(100 * o.resume_reuse, 1),
            "reprefilled_tokens": o.reprefilled,
            "mean_requests_in_flight": round(e.mean_in_flight, 2),
            "engine_idle_pct": round(100 * e.idle_fraction, 1),
            "engine_under_half_pct": None if e.under_half_fraction is None else round(100 * e.under_half_fraction, 1),
            "pauses": s.pauses,
            "restores": s.restores,
            "session_waits": s.session_waits,
            "session_wait_s": round(s.session_wait_s, 2),
            "session_starts": s.session_starts,
            # A session prepared ahead is handed over in microseconds: kept to the microsecond.
            "session_start_p50_ms": _ms(s.session_start_s, 0.5, digits=3),
            "session_start_p90_ms": _ms(s.session_start_s, 0.9, digits=3),
            "mean_reward": None if o.mean_reward is None else round(o.mean_reward, 4),
            "reward_components": {k: round(v / o.component_counts[k], 4) for k, v in o.component_sums.items()},
            "finish_reasons": dict(o.finish_reasons),
            **({"gateway": dict(o.gateway)} if o.gateway else {}),
            "wall_s": round(self.elapsed, 2),
        }


def _ms(xs: list, q: float, digits: int = 1) -> float | None:
    """The ``q`` quantile of ``xs`` (seconds) in milliseconds, to ``digits`` decimals; None
    when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], digits)


def component_rows(components: dict[str, float], weights: dict[str, float] | None = None) -> list[tuple[str, Any]]:
    """The rows of the mean reward components, each marked with its weight where that is not
    1 (``mean tool_ran (weight 0)``: reported, not added to the reward), so that the
    components visibly add up to the mean reward."""
    def label(name: str) -> str:
        w = (weights or {}).get(name)
        return f"  mean {name}" if w is None or w == 1 else f"  mean {name} (weight {w:g})"

    return [(label(name), value) for name, value in sorted(components.items())]
