"""A rollout run's closing report: one table (:func:`summary_table`), the same for a run in this
process and one on Ray, from the run's stats (``RunStats.summary()``) and the rows only its
source has (a cluster's workers). A figure the source did not measure (a Ray driver does not
see its workers' engines) is not in the stats it gives, and its row is left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable


def summary_rows(s: dict[str, Any], *, prepared: int = 0, startup_s: float, startup: str,
                 extra: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """The table's rows: ``s`` is a stats summary, ``prepared`` the sandbox sessions started
    while the model loaded, ``startup_s`` the run's whole time with its start-up (``startup``
    says what that was), ``extra`` the source's own rows (they come first)."""

    def has(*keys: str) -> bool:
        return all(s.get(k) is not None for k in keys)

    rows: list[tuple[str, Any]] = [*extra]
    rows += [(label, s[key]) for label, key in (
        ("programs", "programs"), ("turns", "turns"), ("tool calls", "tool_calls"), ("tool errors", "tool_errors"),
        ("programs with a tool call that ran", "programs_with_ok_tool_call"),
        ("tokens generated", "tokens_generated"), ("tokens/s", "tokens_per_s")) if key in s]
    if has("resume_reuse_pct"):
        rows.append(("prefix-cache reuse (resumed turns)", f"{s['resume_reuse_pct']}%"))
    if has("prefix_cache_hit_pct"):
        rows.append(("prefix-cache hits (all prompt tokens)", f"{s['prefix_cache_hit_pct']}%"))
    if has("mean_requests_in_flight"):
        rows.append(("engine occupancy (mean requests in flight)", s["mean_requests_in_flight"]))
    if has("engine_idle_pct"):
        rows.append(("engine idle (no request in flight)", f"{s['engine_idle_pct']}%"))
    if has("engine_under_half_pct"):
        rows.append(("engine under half its decode slots (the run's tail, mostly)", f"{s['engine_under_half_pct']}%"))
    if has("pauses", "restores"):
        rows.append(("pauses / restores (KV pressure)", f"{s['pauses']} / {s['restores']}"))
    if prepared:
        rows.append(("sandbox sessions prepared ahead (model loading)", prepared))
    if s.get("env_starts"):
        rows.append(("sandbox sessions (started, p50 / p90 start)",
                     f"{s['env_starts']}, {s['env_start_p50_ms']} / {s['env_start_p90_ms']} ms"))
    if s.get("env_waits"):
        rows.append(("programs that waited for their session", f"{s['env_waits']} ({s['env_wait_s']}s in all)"))
    if has("judge_calls"):
        failed = ", ".join(f"{k}={v}" for k, v in s["judge_failures"].items()) or "none"
        rows.append(("judge (calls, cached, failures)", f"{s['judge_calls']}, {s['judge_cached']}, {failed}"))
        rows.append(("judge latency per call (p50 / p99)", f"{s['judge_p50_ms']} / {s['judge_p99_ms']} ms"))
        if has("judge_share_pct"):
            rows.append(("judge share of wall time (a call in flight)", f"{s['judge_share_pct']}%"))
    rows.append(("mean reward", s["mean_reward"]))
    rows += [(f"  mean {name}", value) for name, value in sorted(s["reward_components"].items())]
    rows.append(("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items()))))
    rows.append(("wall time", f"{s['wall_s']}s rollout, {startup_s:.1f}s with start-up ({startup})"))
    return rows


def summary_table(rows: list[tuple[str, Any]], written: int, out: Path) -> Any:
    """The rows as a ``rich`` table titled with what was written where."""
    from rich.table import Table

    t = Table(title=f"{written} trajectories -> {out}", show_header=False)
    for k, v in rows:
        t.add_row(k, str(v))
    return t


__all__ = ["summary_rows", "summary_table"]
