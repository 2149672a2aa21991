"""bench/ab.py: one bench run interleaved on this checkout and on another revision, each side
with its own code under test and the same measurement code, in a real git repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

#: A bench that measures the tree it runs in: ``marker.VALUE`` comes from the tree's root (on
#: the path only through ``PYTHONPATH``), and ``EXTRA`` from the script itself.
FIG = '''import sys
import _report
import marker
EXTRA = {extra}
print("speed", marker.VALUE)
_report.write("fig", {{"speed": marker.VALUE, "nested": {{"double": 2 * marker.VALUE}}, "extra": EXTRA,
                       "label": "text", "flag": True}}, headline="speed")
'''


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A checkout whose HEAD measures 1.0 and whose working tree (changed, not committed)
    measures 3.0 with a bench script that also reports a new figure."""
    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    shutil.copy2(BENCH / "ab.py", root / "bench" / "ab.py")
    shutil.copy2(BENCH / "_report.py", root / "bench" / "_report.py")
    (root / "marker.py").write_text("VALUE = 1.0\n")
    (root / "bench" / "fig.py").write_text(FIG.format(extra="0.0"))
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "one")
    (root / "marker.py").write_text("VALUE = 3.0\n")
    (root / "bench" / "fig.py").write_text(FIG.format(extra="5.0"))
    return root


def ab(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/ab.py", *args], cwd=repo, capture_output=True, text=True,
                          timeout=300)


def test_each_side_runs_its_own_code_with_this_checkouts_bench(repo):
    rev = git(repo, "rev-parse", "--short", "HEAD")
    done = ab(repo, "HEAD", "--rounds", "2", "--", "bench/fig.py")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # Interleaved, the order alternating: this checkout first, then the revision first.
    order = re.findall(r"round (\d)/2\s+(\S+)\s+speed", out)
    assert order == [("1", "this"), ("1", rev), ("2", rev), ("2", "this")]
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("speed", "nested", "extra"))}
    assert rows["speed"][:3] == ["3", "1", "3.000"]
    assert rows["nested.double"][:3] == ["6", "2", "3.000"]
    assert rows["extra"][:2] == ["5", "5"]  # the same measurement code on both sides
    assert "label" not in rows and "flag" not in rows  # only numbers are compared
    assert out.strip().endswith("ab_ratio: 3.000")
    # Nothing left behind: no worktree, no results in either tree.
    assert git(repo, "worktree", "list").count("\n") == 0
    assert not (repo / "bench" / "results").exists()


def test_a_bad_revision_or_bench_is_named(repo):
    done = ab(repo, "no-such-rev", "--", "bench/fig.py")
    assert done.returncode != 0 and "no-such-rev" in done.stderr
    done = ab(repo, "HEAD", "--", "bench/missing.py")
    assert done.returncode != 0 and "bench/missing.py is not a bench script" in done.stderr
    done = ab(repo, "HEAD")
    assert done.returncode != 0 and "name the bench after --" in done.stderr


def test_a_failing_run_shows_its_output_and_cleans_up(repo):
    (repo / "marker.py").write_text("raise SystemExit('marker broke')\n")
    done = ab(repo, "HEAD", "--rounds", "1", "--", "bench/fig.py")
    assert done.returncode != 0 and "marker broke" in done.stderr and "exited 1" in done.stderr
    assert git(repo, "worktree", "list").count("\n") == 0
