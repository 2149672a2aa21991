"""One bench, this checkout against another revision, interleaved on one machine.

    python bench/ab.py REV [--rounds 6] [--keep] -- bench/sandbox.py [ARGS...]

A 2-core VM's figures drift by more than the differences worth measuring, so two revisions
are compared only side by side: REV is checked out in a temporary git worktree, the bench
script and the bench helpers (``bench/_*.py``) of this checkout are copied into it, so that
both sides run the same measurement code against their own ``agentenv`` (the tree is first on
``PYTHONPATH``, for the processes the bench starts too), and the bench runs
``--rounds`` times on each side, alternating which side goes first. Each run writes its
figures to a scratch directory (``AGENTENV_BENCH_RESULTS``), never to ``bench/results``.

Prints a line per run (its headline figure), then for every numeric figure the mean on each
side, this checkout's mean over REV's, and each side's range over the rounds; last
``ab_ratio: <this / REV for the headline figure>``. The worktree is removed at the end
(``--keep`` keeps it and the runs' logs and figures, and prints where).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = "this"


def numbers(figures: dict, prefix: str = "") -> dict[str, float]:
    """The numeric figures of a bench's record, flattened to dotted keys."""
    out: dict[str, float] = {}
    for k, v in figures.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"ab: git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def run_once(tree: Path, script: str, args: list[str], out: Path) -> dict:
    """One run of the bench in ``tree``; its record. Exits with the run's log tail if it fails."""
    out.mkdir(parents=True)
    # The tree first on the path: its own agentenv, not the installed (editable) checkout's,
    # in the bench and in any process the bench starts.
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "AGENTENV_BENCH_RESULTS": str(out), "PYTHONPATH": path}
    with open(out / "log.txt", "w") as log:
        rc = subprocess.run([sys.executable, script, *args], cwd=tree, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    records = sorted(out.glob("*.json"))
    if rc != 0 or not records:
        tail = (out / "log.txt").read_text()[-3000:]
        sys.exit(f"ab: {script} in {tree} " + (f"exited {rc}" if rc else "wrote no figures") + f":\n{tail}")
    return json.loads(records[0].read_text())


def table(runs: dict[str, list[dict]], rev: str) -> list[str]:
    """Per figure: each side's mean, the ratio of the means, each side's range."""
    sides = {side: [numbers(r["figures"]) for r in recs] for side, recs in runs.items()}
    keys = [k for k in sides[THIS][0] if all(k in f for fs in sides.values() for f in fs)]
    width = max([len(k) for k in keys] + [6])
    ranges = f"{THIS + ' range':>21s}  {rev + ' range':>21s}"
    lines = [f"{'figure':{width}s}  {THIS:>10s}  {rev:>10s}  {'ratio':>6s}  {ranges}"]
    for k in keys:
        a, b = ([f[k] for f in sides[s]] for s in (THIS, rev))
        ma, mb = statistics.mean(a), statistics.mean(b)
        ratio = f"{ma / mb:6.3f}" if mb else "     -"
        spans = "  ".join(f"{f'{min(x):.4g} - {max(x):.4g}':>21s}" for x in (a, b))
        lines.append(f"{k:{width}s}  {ma:10.4g}  {mb:10.4g}  {ratio}  {spans}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="python bench/ab.py REV [--rounds N] [--keep] -- BENCH [ARGS...]")
    ap.add_argument("rev", help="the revision to compare this checkout with (a commit, tag or branch)")
    ap.add_argument("--rounds", type=int, default=6, help="runs on each side (default 6)")
    ap.add_argument("--keep", action="store_true", help="keep the worktree, the logs and the figures")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, bench = ap.parse_args(argv[:cut]), argv[cut + 1:]  # the bench's own options after --
    if not bench:
        ap.error("name the bench after --, e.g. -- bench/sandbox.py")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    script = Path(bench[0])
    here = (Path.cwd() / script).resolve()
    if not here.is_file() or here.parent != ROOT / "bench":
        ap.error(f"{bench[0]} is not a bench script of this checkout (bench/*.py)")
    rev = git("rev-parse", "--short", "--verify", f"{a.rev}^{{commit}}")

    scratch = Path(tempfile.mkdtemp(prefix="agentenv-ab-"))
    other = scratch / rev
    try:
        git("worktree", "add", "--detach", str(other), rev)
        (other / "bench").mkdir(exist_ok=True)  # a revision from before bench/ had it
        for helper in (ROOT / "bench").glob("_*.py"):
            shutil.copy2(helper, other / "bench" / helper.name)
        shutil.copy2(here, other / "bench" / here.name)
        trees = {THIS: ROOT, rev: other}
        runs: dict[str, list[dict]] = {THIS: [], rev: []}
        rel = f"bench/{here.name}"
        for i in range(a.rounds):
            order = list(trees) if i % 2 == 0 else list(trees)[::-1]
            for side in order:
                t = time.perf_counter()
                rec = run_once(trees[side], rel, bench[1:], scratch / "runs" / side / str(i + 1))
                runs[side].append(rec)
                head = rec["headline"]
                print(f"round {i + 1}/{a.rounds}  {side:>10s}  {head} {rec['figures'][head]}  "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
        print(f"\n{rel}, {a.rounds} rounds each side, interleaved (this checkout: {git('rev-parse', '--short', 'HEAD')}"
              f"{' with changes' if git('status', '--porcelain', '--', 'agentenv', 'bench') else ''}); "
              f"ratio = this / {rev}, of the means")
        print("\n".join(table(runs, rev)))
        head = runs[THIS][0]["headline"]
        means = [statistics.mean(numbers(r["figures"]).get(head, 0.0) for r in runs[side]) for side in (THIS, rev)]
        print(f"ab_ratio: {means[0] / means[1]:.3f}" if means[1] else "ab_ratio: -")
    finally:
        if a.keep:
            print(f"kept: the worktree {other} and the runs under {scratch / 'runs'} "
                  f"(git worktree remove --force {other})")
        else:
            if other.exists():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                               capture_output=True)
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
