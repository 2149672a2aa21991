"""What the program scheduler weighs: the engine's costs and how long tools last.

:class:`CostModel` is the engine's costs as data (a decode step's time against the requests in
flight and their context, a prefilled token's price) and the break-even they give for holding
an acting program's KV; :class:`CostFit` fits one from the turns the engine serves;
:class:`ToolTimes` keeps recent tool durations and from them a tool's expected time left. All
three are pure: the driver (the reactor, the simulator) measures and feeds them, and hands the
model to :class:`~agentenv.scheduler.Scheduler`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """The engine's costs as the scheduler weighs them (data, fitted from measured step times
    by whoever drives the scheduler): a decode step with ``n`` requests of ``ctx`` context
    tokens each takes ``step_base + step_per_seq x n + step_per_ctx x n x ctx`` seconds, and a
    prompt token not in the prefix cache costs ``prefill_per_token`` seconds of the engine's
    time (the batch waits for it)."""

    step_base: float
    step_per_seq: float = 0.0
    step_per_ctx: float = 0.0
    prefill_per_token: float = 0.0

    def rate(self, n: int, ctx: float) -> float:
        """Tokens per second the engine samples with ``n`` requests of ``ctx`` tokens."""
        return n / (self.step_base + self.step_per_seq * n + self.step_per_ctx * n * ctx) if n > 0 else 0.0

    def slot_gain(self, n: int, ctx: float) -> float:
        """The share of the engine's work one more request in flight adds at ``n``: a second
        of it saves ``1 - rate(n) / rate(n + 1)`` seconds (all of it when nothing decodes)."""
        return 1.0 - self.rate(n, ctx) / self.rate(n + 1, ctx)

    def hold_seconds(self, n: int, ctx: float, need: int) -> float:
        """How long an acting program's KV is worth holding against a program that needs
        ``need`` tokens to run, with ``n`` requests wanting the engine: the break-even.
        Holding KV that ``need`` would fill loses ``slot_gain`` seconds a second for each
        ``need`` tokens held; releasing it costs re-prefilling those tokens if its tool
        outlasts its cached blocks. Both scale with the program's length, so the break-even
        does not depend on it: ``prefill_per_token x need / slot_gain``. A program expected
        to stay on its tool longer than that is worth releasing; not knowing how long tools
        last, holding it that long and no longer (ski rental) costs at most twice the better
        choice."""
        gain = self.slot_gain(n, ctx)
        return math.inf if gain <= 0 else self.prefill_per_token * need / gain


class ToolTimes:
    """The durations of recent tools (on the driver's clock, from a turn's return to the
    program's next turn), and from them how much longer a tool already ``elapsed`` long is
    expected to last (its mean residual life). With heavy-tailed tools that grows with the
    time already spent: a program long on its tool is likely to stay there."""

    def __init__(self, keep: int = 512, refresh: int = 32, least: int = 16) -> None:
        self._recent: deque[float] = deque(maxlen=keep)
        self._refresh, self._least = refresh, least
        self._new = 0
        self._sorted: list[float] = []
        self._tail: list[float] = [0.0]  # _tail[i]: the sum of _sorted[i:]

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._new += 1

    def __len__(self) -> int:
        return len(self._recent)

    def remaining(self, elapsed: float) -> float | None:
        """Expected seconds left on a tool ``elapsed`` long; None when fewer than ``least``
        tools were seen, or none of them lasted that long."""
        if len(self._recent) < self._least:
            return None
        if self._new >= self._refresh or len(self._sorted) < self._least:  # re-sorted now and then
            self._sorted, self._new = sorted(self._recent), 0
            self._tail = [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                self._tail[i] = self._tail[i + 1] + self._sorted[i]
        i = bisect.bisect_right(self._sorted, elapsed)
        longer = len(self._sorted) - i
        return None if longer == 0 else self._tail[i] / longer - elapsed


class CostFit:
    """The engine's :class:`CostModel`, fitted from the turns it serves and refitted as the run
    goes (measurements in, a model out: the driver measures, the scheduler is given the model).

    Each turn is one row: its seconds in the engine ``t``, the tokens it sampled ``k``, the
    requests in flight on average meanwhile ``n``, its context ``ctx`` and the uncached prompt
    tokens the engine prefilled meanwhile ``u`` (everyone's: a step computes them before anyone's
    next token). Least squares over the last ``keep`` rows, refitted every ``refit`` rows, of
    ``t = k (step_base + step_per_seq n + step_per_ctx n ctx) + prefill_per_token u``. A negative
    coefficient (noise, or a term the rows cannot tell apart) is dropped and the rest refitted,
    so the model never speeds up with more work. No model before ``least`` rows, and none that
    has no price for a prefilled token: rows that cannot tell it (little or no prefill in them)
    would say re-prefill is free, and every program on a tool would give its KV up at once; the
    previous model (or none: programs keep their KV) stands until they can."""

    def __init__(self, keep: int = 512, refit: int = 32, least: int = 32) -> None:
        self._rows: deque[tuple[float, float, float, float, float]] = deque(maxlen=keep)
        self._refit, self._least = refit, least
        self._new = 0
        #: The latest fit (None until ``least`` rows were seen).
        self.model: CostModel | None = None
        #: How many times the model was fitted.
        self.fits = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, seconds: float, tokens: int, in_flight: float, context: float, prefilled: float) -> bool:
        """One turn's row; True when it made a new fit (then read :attr:`model`). A turn that
        sampled nothing (aborted) or took no time says nothing about a step: skipped."""
        if tokens <= 0 or seconds <= 0:
            return False
        self._rows.append((seconds, float(tokens), max(in_flight, 1.0), max(context, 0.0), max(prefilled, 0.0)))
        self._new += 1
        if len(self._rows) < self._least or (self.model is not None and self._new < self._refit):
            return False
        self._new = 0
        model = self._fit()
        if model.prefill_per_token <= 0:
            return False
        self.model = model
        self.fits += 1
        return True

    def _fit(self) -> CostModel:
        import numpy as np  # here: the scheduler's import stays light

        t, k, n, ctx, u = (np.array(c) for c in zip(*self._rows))
        cols = {"base": k, "seq": k * n, "ctx": k * n * ctx, "prefill": u}
        while True:
            x = np.column_stack(list(cols.values()))
            scale = np.linalg.norm(x, axis=0)
            scale[scale == 0] = 1.0  # columns this far apart in size are solved scaled
            coef = dict(zip(cols, np.linalg.lstsq(x / scale, t, rcond=None)[0] / scale))
            neg = [c for c in cols if c != "base" and coef[c] < 0]
            if not neg:
                break
            del cols[min(neg, key=lambda c: coef[c])]
        return CostModel(step_base=max(float(coef["base"]), 1e-6), step_per_seq=float(coef.get("seq", 0.0)),
                         step_per_ctx=float(coef.get("ctx", 0.0)), prefill_per_token=float(coef.get("prefill", 0.0)))
