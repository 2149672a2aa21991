"""Generate the benchmarks page and the README's headline table from the benches' own output.

    python docs/gen_benchmarks.py           # write docs/benchmarks.md and README's table
    python docs/gen_benchmarks.py --check   # exit 1 when either differs from what it would write

Every bench writes its figures to ``bench/results/<name>.json`` (``bench/_report.py``: the
figures, the machine and the versions). ``docs/benchmarks.in.md`` is the page's text: each
bench's method and the figures reported before it had a results file. Each
``<!-- results: NAME -->`` line in it becomes that bench's latest figures (or a line saying it
has none yet), and ``<!-- headlines -->`` the table of headline figures, which also replaces
what stands between ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->`` in README.md.
A headline comes from its bench's results file when there is one, else it is the figure
reported earlier, marked so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TEMPLATE = ROOT / "docs" / "benchmarks.in.md"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"

#: The benchmarks page's section for each bench (its heading's anchor).
SECTIONS = {
    "scheduling": "scheduling-policies", "bounds": "what-bounds-the-ratio",
    "simulate": "scheduling-at-gpu-scale-simulated", "simulate-kv200000": "scheduling-at-gpu-scale-simulated",
    "rollout_limit": "retool-math-against-the-decode-limit", "vllm_streams": "vllm-streaming-input-requests",
    "overhead": "reactor-overhead", "engines": "engines", "engine_priority": "engine-priority", "sandbox": "sandbox",
    "journal": "durability", "memory": "memory", "trainer": "async-against-sync-training", "cluster": "ray-cluster",
    "cluster-projection": "ray-cluster", "client": "client-process", "train_memory": "trainer-memory",
    "gpu": "on-a-gpu",
}


def _walls(f: dict) -> dict[str, float]:
    """Wall time per policy in a ``bench/scheduling.py`` run's first KV setting."""
    return {r["policy"]: r["wall_s"] for r in f["settings"][0]["results"]}


@dataclass(frozen=True)
class Headline:
    """One row of the headline table: what it measures, its bench, how to read the figure
    from that bench's results, and the figure reported before there was a results file."""

    what: str
    bench: str
    figure: Callable[[dict], str]
    reported: str


HEADLINES = [
    Headline(
        "program-aware scheduling vs lockstep / FIFO, wall time (512 trace programs, vLLM, 2 CPU cores)",
        "scheduling",
        lambda f: "{:.2f}x / {:.2f}x".format(
            _walls(f)["lockstep"] / _walls(f)["program"], _walls(f)["fifo"] / _walls(f)["program"]
        ),
        "1.80-4.04x / 1.10-1.76x (twelve runs)",
    ),
    Headline(
        "the same run's tok/s over the engine's pure decode (`limit_ratio`)",
        "scheduling",
        lambda f: f"{f['limit_ratio']:.2f}",
        "0.62-0.80 (twelve runs)",
    ),
    Headline(
        "program-aware vs lockstep at GPU scale (simulated: 10,000 programs, a 7B model on one H100)",
        "simulate",
        lambda f: f"{f['program_vs_lockstep']:.2f}x",
        "2.45x",
    ),
    Headline(
        "the same with the KV cut to 200k tokens: wall time vs FIFO; resume reuse vs FIFO's",
        "simulate-kv200000",
        lambda f: (
            f"{f['program_vs_fifo']:.2f}x; {100 * f['program']['reuse']:.1f} % vs {100 * f['fifo']['reuse']:.1f} %"
        ),
        "1.18x; 88.3 % vs 1.2 %",
    ),
    Headline(
        "retool-math's tok/s over pure decode, vLLM (`rollout_limit_ratio`)",
        "rollout_limit",
        lambda f: f"{f['rollout_limit_ratio']:.2f}",
        "0.52-0.58 (four runs)",
    ),
    Headline(
        "async vs sync GRPO training, wall time (slow tools and rewards; one torch thread each for the "
        "engine and the trainer)",
        "trainer",
        lambda f: f"{f['async_speedup']:.2f}x",
        "2.40x",
    ),
    Headline(
        "the same async run's share of its ideal overlap (per step, the longer of generation and training "
        "measured alone)",
        "trainer",
        lambda f: f"{f['ideal_overlap']:.2f}",
        "not measured",
    ),
    Headline(
        "vLLM vs the embedded engine, tok/s (32 requests, CPU)",
        "engines",
        lambda f: f"{f['vllm_vs_embedded_throughput']:.2f}x",
        "2.36x",
    ),
    Headline(
        "a sandbox call vs a fresh `python3` per call (concurrency 32)",
        "sandbox",
        lambda f: f"{f['sandbox_speedup']:.1f}x",
        "82.9x",
    ),
    Headline(
        "isolated sandbox session starts, 64 at once",
        "sandbox",
        lambda f: f"{f['starts_per_s_after_close']:.0f}/s ({f['starts_per_s_settled']:.0f}/s after teardown)",
        "343-360/s (idle 2-core VM)",
    ),
    Headline(
        "the event log's cost on rollout throughput",
        "journal",
        lambda f: f"{f['log_overhead_pct']:+.1f} %",
        "none measurable (noise +-15 %)",
    ),
    Headline(
        "RSS growth over a 10,000-program rollout",
        "memory",
        lambda f: f"{f['rss_growth_mb_per_1k_programs']:.2f} MiB per 1,000 programs",
        "-0.24 MiB per 1,000 programs",
    ),
    Headline(
        "client CPU per generated token, whole rollout path on the instant engine (1,000 programs, "
        "57-token turns, a tool call each)",
        "client",
        lambda f: (
            f"{f['client_us_per_token']:.1f} us"
            + (f" ({f['baseline_client_us_per_token']:.1f} before)" if "baseline_client_us_per_token" in f else "")
        ),
        "14.7 us (21.4 before)",
    ),
    Headline(
        "memory per idle program in the reactor", "overhead", lambda f: f"{f['idle_program_kb']:.1f} KB", "10.8 KB"
    ),
    Headline(
        "8 engines vs 1 on Ray, tok/s (simulated: a 7B model on one H100 each)",
        "cluster-projection",
        lambda f: f"{f['projected_scaling']:.2f}x",
        "6.83x",
    ),
]


def load_results(directory: Path = RESULTS) -> dict[str, dict]:
    """Every results file in ``directory``, by bench name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if v is not None else "-"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
    if isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return ", ".join(_fmt(x) for x in v)
    if isinstance(v, list):
        return f"({len(v)} entries: see the JSON)"
    return str(v).replace("|", "\\|")


def _rows(figures: dict, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """``figures`` flattened to (dotted key, formatted value) rows, three levels deep at most."""
    out: list[tuple[str, str]] = []
    for k, v in figures.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth < 2:
            out += _rows(v, key + ".", depth + 1)
        elif isinstance(v, dict):
            out.append((key, "(see the JSON)"))
        else:
            out.append((key, _fmt(v)))
    return out


def results_block(name: str, record: dict | None, max_rows: int = 40) -> str:
    """The markdown for one bench's latest results (or for their absence)."""
    if record is None:
        return (f"*No results file yet (`bench/results/{name}.json`): the figures below were reported earlier, "
                "not regenerated.*")
    m, v = record["machine"], record["versions"]
    load = f", load {m['load_1m']}" if m.get("load_1m") is not None else ""
    stack = ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "transformers", "vllm", "ray") if v.get(k))
    head = (f"**Latest run** (`bench/results/{name}.json`): `{record['command']}` on {record['date'][:10]}, "
            f"{m['cpu']}, {m['cores']} cores{load}; {stack}; agentenv {v.get('agentenv') or 'unknown'}.")
    rows = _rows(record["figures"])
    shown = rows[:max_rows]
    lines = [head, "", "| figure | value |", "|---|---|"]
    lines += [f"| `{k}`{' (headline)' if k == record['headline'] else ''} | "
              f"{'**' + val + '**' if k == record['headline'] else val} |" for k, val in shown]
    if len(rows) > len(shown):
        lines.append(f"| ... | {len(rows) - len(shown)} more in the JSON |")
    return "\n".join(lines)


def headline_table(results: dict[str, dict], link: str) -> str:
    """The headline table; ``link`` is the benchmarks page's path from where the table stands."""
    lines = ["| what | figure | source |", "|---|---|---|"]
    for h in HEADLINES:
        anchor = f"{link}#{SECTIONS[h.bench]}"
        rec = results.get(h.bench)
        if rec is not None:
            load = rec["machine"].get("load_1m")
            value = h.figure(rec["figures"])
            source = f"[run of {rec['date'][:10]}]({anchor})" + (f", load {load}" if load is not None else "")
        else:
            value, source = h.reported, f"[reported earlier]({anchor})"
        lines.append(f"| {h.what} | {value} | {source} |")
    return "\n".join(lines)


def render_page(template: str, results: dict[str, dict]) -> str:
    """The benchmarks page: the template with its results and headline markers filled in."""
    def fill(match: re.Match) -> str:
        return results_block(match.group(1), results.get(match.group(1)))

    unknown = set(re.findall(r"<!-- results: ([\w.-]+) -->", template)) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"{TEMPLATE.name} names benches with no section in SECTIONS: {sorted(unknown)}")
    page = re.sub(r"<!-- results: ([\w.-]+) -->", fill, template)
    note = "<!-- Generated by docs/gen_benchmarks.py from docs/benchmarks.in.md and bench/results/*.json. -->\n"
    return note + page.replace("<!-- headlines -->", headline_table(results, ""))


def render_readme(readme: str, results: dict[str, dict]) -> str:
    """README.md with its headline table (between the markers) regenerated."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the {START} ... {END} markers for the headline table")
    before, rest = readme.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{headline_table(results, 'docs/benchmarks.md')}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is out of date")
    args = p.parse_args(argv)
    results = load_results()
    want = {PAGE: render_page(TEMPLATE.read_text(), results), README: render_readme(README.read_text(), results)}
    stale = [path for path, text in want.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python docs/gen_benchmarks.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(want[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
