"""The async trainer's ideal overlap: the wall a perfect overlap of generation and training
would take, from each stage's per-step times measured alone (pure arithmetic, no I/O).

Step ``i`` (1-based, ``n`` steps) has two stages, each measured with the other stage idle:

* ``gen[i]``: generation's share of batch ``i``: the time from batch ``i - 1`` becoming
  available (the run's start for ``i = 1``) to batch ``i`` becoming available, in a run that
  generates under the same admission rule and takes each batch the moment it is complete,
  without training;
* ``train[i]``: the optimiser step on batch ``i`` plus the weight sync that follows it, with
  no generation running.

A perfect overlap generates batch ``i + 1`` while batch ``i`` trains. Nothing can overlap the
first batch's generation (the pipeline's fill) nor the last step's training (its drain), so::

    ideal_wall = gen[1] + sum(max(gen[i], train[i - 1]) for i in 2..n) + train[n]

:func:`pipeline_wall` is the tighter bound of a generator that never waits and a trainer that
starts each step as soon as its batch is complete and the previous step is done (a two-stage
flow shop with an unbounded buffer): a batch generated faster than the step before it trained
lends its slack to a later, slower one. It is never above :func:`ideal_wall`.
"""

from __future__ import annotations

from typing import Sequence


def _check(gen: Sequence[float], train: Sequence[float]) -> None:
    if len(gen) != len(train) or not gen:
        raise ValueError(f"one generation and one training time per step: {len(gen)} and {len(train)}")
    if min(gen) < 0 or min(train) < 0:
        raise ValueError("stage times are durations: none may be negative")


def ideal_wall(gen: Sequence[float], train: Sequence[float]) -> float:
    """``gen[1] + sum(max(gen[i], train[i - 1]) for i in 2..n) + train[n]``: the per-step
    maximum of the two stages, plus the fill (the first generation) and the drain (the last
    step's training)."""
    _check(gen, train)
    return gen[0] + sum(max(g, t) for g, t in zip(gen[1:], train[:-1])) + train[-1]


def pipeline_wall(gen: Sequence[float], train: Sequence[float]) -> float:
    """The end of the last step when batch ``i`` is complete at ``gen[1] + ... + gen[i]``
    and step ``i`` starts once its batch is complete and step ``i - 1`` has ended."""
    _check(gen, train)
    ready = end = 0.0
    for g, t in zip(gen, train):
        ready += g
        end = max(ready, end) + t
    return end


def intervals(times: Sequence[float]) -> list[float]:
    """The durations between consecutive instants, the first from 0: batch availability
    times (seconds since the run's start) to per-step generation times."""
    if any(b < a for a, b in zip([0.0, *times], times)) or (times and times[0] < 0):
        raise ValueError("instants must be in order, from 0 on")
    return [b - a for a, b in zip([0.0, *times], times)]


__all__ = ["ideal_wall", "intervals", "pipeline_wall"]
