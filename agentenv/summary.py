"""A rollout run's closing report: one table (:func:`summary_table`), the same for a run in this
process and one on Ray, from the run's stats (``RunStats.summary()``) and the rows only its
source has (a cluster's workers). A figure the source did not measure (a Ray driver does not
see its workers' engines) is not in the stats it gives, and its row is left out.

After ``--resume`` the table describes the whole output file: what the finished programs did
(:data:`OUTCOMES`: counts, tokens, rewards, finish reasons) is counted over every line of it
(:func:`over_file`), the title says how many lines this invocation wrote, and what only this
invocation measured (throughput, the engine, the sandboxes, the wall time) is labelled
"(this run)"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from .stats import component_rows, current_summary

#: The figures of a stats summary that describe the finished programs, that is the lines of
#: the output file; after a resume :func:`over_file` counts them over the whole file.
OUTCOMES = ("programs", "turns", "tool_calls", "tool_errors", "programs_with_ok_tool_call", "tokens_generated",
            "prompt_tokens", "cached_tokens", "prefix_cache_hit_pct", "resume_reuse_pct", "reprefilled_tokens",
            "mean_reward", "reward_components", "finish_reasons")


def over_file(s: dict[str, Any], out: Path, *, block_size: int = 1) -> dict[str, Any]:
    """``s`` (a resumed invocation's stats summary) with its :data:`OUTCOMES` counted over
    every line of ``out`` instead, and this invocation's own under ``"this_run"``.
    ``block_size``: the engine's KV block, as the run's stats count resumed turns' reuse."""
    from .stats import RunStats
    from .trajectory import Trajectory

    whole = RunStats(block_size=block_size)
    with open(out, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                whole.add(Trajectory.from_dict(json.loads(line)))
    figures = whole.summary()
    gateway = {"gateway": figures["gateway"]} if "gateway" in figures else {}  # an agent run's calls, over the file
    return {**s, **{k: figures[k] for k in OUTCOMES if k in s}, **gateway,
            "this_run": {k: s[k] for k in OUTCOMES if k in s}}


def weights(env: Any) -> dict[str, float]:
    """The weight of each reward component ``env`` scores with, where it says: its ``rubric``
    (a :class:`~agentenv.rewards.Rubric`, as the bundled environments and ``agentenv init``'s
    have), else none known."""
    parts = getattr(getattr(env, "rubric", None), "parts", None)
    try:
        return {str(name): float(w) for name, _, w in parts or ()}
    except (TypeError, ValueError):  # some other ``rubric``: its weights are not known
        return {}


def file_rows(out: Path, weights: dict[str, float] | None = None) -> list[tuple[str, Any]]:
    """The outcome rows (programs, turns, tool calls, tokens, rewards, finish reasons) counted
    over every line of ``out``: what a complete run's file holds, with nothing measured now.
    ``weights``: the reward components' (:func:`weights`)."""
    from .stats import RunStats
    from .trajectory import Trajectory

    whole = RunStats()
    with open(out, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                whole.add(Trajectory.from_dict(json.loads(line)))
    s = whole.summary()
    rows: list[tuple[str, Any]] = [(label, s[key]) for label, key in (
        *_outcome_labels(s), ("tokens generated", "tokens_generated")) if key in s]
    rows += gateway_rows(s.get("gateway"))
    rows.append(("mean reward", s["mean_reward"]))
    rows += component_rows(s["reward_components"], weights)
    rows.append(("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))))
    return rows


def _outcome_labels(s: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The labels of the programs' and tool calls' counts. An agent run's tool calls are the
    calls the gateway parsed from the model's replies and handed to the agent: whether the
    agent ran them is its own business, so they are not said to have run."""
    agent = bool(s.get("gateway"))
    return (("programs", "programs"), ("turns", "turns"),
            ("tool calls (parsed, handed to the agent)" if agent else "tool calls", "tool_calls"),
            ("tool errors", "tool_errors"),
            ("programs with a well-formed tool call" if agent else "programs with a tool call that ran",
             "programs_with_ok_tool_call"))


def gateway_rows(g: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The gateway's figures of an agent run (none for a run without agents)."""
    if not g:
        return []
    return [("gateway calls (extended / branched / from the journal)",
             f"{g.get('calls', 0)} ({g.get('extended', 0)} / {g.get('branched', 0)} / {g.get('replayed', 0)})"),
            ("agent programs restarted (replay mismatch) / malformed tool calls",
             f"{g.get('restarts', 0)} / {g.get('malformed_tool_calls', 0)}")]


def _duration(*ms: float | None) -> str:
    """Durations given in milliseconds, joined by `` / ``: in µs when all are under 1 ms (a
    session prepared ahead is handed over in microseconds), else in ms."""
    if all(m is not None and m < 1 for m in ms):
        return " / ".join(f"{1000 * m:.0f}" for m in ms) + " µs"  # type: ignore[operator]
    return " / ".join(f"{m:.1f}" if m is not None else "-" for m in ms) + " ms"


def summary_rows(s: dict[str, Any], *, prepared: int = 0, startup_s: float, startup: str,
                 extra: Iterable[tuple[str, Any]] = (), weights: dict[str, float] | None = None
                 ) -> list[tuple[str, Any]]:
    """The table's rows: ``s`` is a stats summary, ``prepared`` the sandbox sessions started
    while the model loaded, ``startup_s`` the run's whole time with its start-up (``startup``
    says what that was), ``extra`` the source's own rows (they come first). When ``s`` is a
    resumed run's over its whole file (:func:`over_file`), the tokens generated carry this
    invocation's share and the figures only this invocation measured say "(this run)".
    ``weights``: the reward components' (:func:`weights`), marked where not 1. A summary
    saved with the former session keys (``env_waits``...) reads the same (:func:`current_summary`)."""
    s = current_summary(s)
    mine = s.get("this_run")
    now = "" if mine is None else " (this run)"

    def has(*keys: str) -> bool:
        return all(s.get(k) is not None for k in keys)

    def value(key: str) -> Any:  # the tokens behind this run's tokens/s beside the file's
        return f"{s[key]} ({mine[key]} this run)" if mine is not None and key == "tokens_generated" else s[key]

    rows: list[tuple[str, Any]] = [*extra]
    rows += [(label, value(key)) for label, key in (
        *_outcome_labels(s), ("tokens generated", "tokens_generated"), (f"tokens/s{now}", "tokens_per_s")) if key in s]
    if has("resume_reuse_pct"):
        rows.append(("prefix-cache reuse (resumed turns)", f"{s['resume_reuse_pct']}%"))
    if has("prefix_cache_hit_pct"):
        rows.append(("prefix-cache hits (all prompt tokens)", f"{s['prefix_cache_hit_pct']}%"))
    if has("mean_requests_in_flight"):
        rows.append((f"engine occupancy (mean requests in flight){now}", s["mean_requests_in_flight"]))
    if has("engine_idle_pct"):
        rows.append((f"engine idle (no request in flight){now}", f"{s['engine_idle_pct']}%"))
    if has("engine_under_half_pct"):
        rows.append((f"engine under half its decode slots (the run's tail, mostly){now}",
                     f"{s['engine_under_half_pct']}%"))
    if has("pauses", "restores"):
        rows.append((f"pauses / restores (KV pressure){now}", f"{s['pauses']} / {s['restores']}"))
    if prepared:
        rows.append((f"sandbox sessions prepared ahead (model loading){now}", prepared))
    if s.get("session_starts"):
        rows.append((f"sandbox sessions (started, p50 / p90 start){now}",
                     f"{s['session_starts']}, {_duration(s['session_start_p50_ms'], s['session_start_p90_ms'])}"))
    if s.get("session_waits"):
        rows.append((f"programs that waited for their session{now}",
                     f"{s['session_waits']} ({s['session_wait_s']}s in all)"))
    if has("judge_calls"):
        failed = ", ".join(f"{k}={v}" for k, v in s["judge_failures"].items()) or "none"
        rows.append((f"judge (calls, cached, failures){now}", f"{s['judge_calls']}, {s['judge_cached']}, {failed}"))
        rows.append((f"judge latency per call (p50 / p99){now}", f"{s['judge_p50_ms']} / {s['judge_p99_ms']} ms"))
        if has("judge_share_pct"):
            rows.append((f"judge share of wall time (a call in flight){now}", f"{s['judge_share_pct']}%"))
    rows += gateway_rows(s.get("gateway"))
    rows.append(("mean reward", s["mean_reward"]))
    rows += component_rows(s["reward_components"], weights)
    rows.append(("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))))
    rows.append((f"wall time{now}", f"{s['wall_s']}s rollout, {startup_s:.1f}s with start-up ({startup})"))
    return rows


def counted(n: int, one: str, many: str) -> str:
    """``n`` things in words: ``counted(1, "trajectory", "trajectories")`` is ``"1 trajectory"``."""
    return f"{n} {one if n == 1 else many}"


def summary_table(rows: list[tuple[str, Any]], written: int, out: Path, *, total: int | None = None) -> Any:
    """The rows as a ``rich`` table titled with what was written where: ``written`` lines by
    this invocation, of ``total`` in the file after a resume."""
    from rich.table import Table

    if total is None:
        title = f"{counted(written, 'trajectory', 'trajectories')} -> {out}"
    else:
        title = (f"{counted(total, 'trajectory', 'trajectories')} ({written} this run, {total - written} from before "
                 f"the resume) -> {out}")
    t = Table(title=title, show_header=False)
    for k, v in rows:
        t.add_row(k, str(v))
    return t


__all__ = ["OUTCOMES", "counted", "over_file", "summary_rows", "summary_table"]
