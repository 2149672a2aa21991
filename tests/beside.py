"""A second, independent run of the fast tier beside the suite (``pytest --beside``).

Users run the suite on laptops with other work open and on shared CI runners, often a second
run of this same suite among that work. ``--beside`` makes that load on purpose: a copy of
the checkout in a temporary directory runs ``pytest -m "not slow"`` again and again until the
run that started it ends. The copy has its own ``TMPDIR``, pytest base temp and artifacts, so
the two runs share nothing but the machine (the kernel, its cgroups, uids and ports), which is
what a test must cope with.

The loop runs detached (not a descendant of the pytest that started it, so tests that count
their own process tree do not see it) in a new session, and ends when its owner is gone or
asks it to stop. Each finished round's closing line goes to ``rounds.txt`` beside its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Never copied: the virtualenv and build outputs (the copy runs on this interpreter).
SKIP = {".venv", ".git", "__pycache__", ".pytest_cache", ".artifacts", "site", "build", "runs", ".gpu-deps"}


def _files(src: Path) -> list[Path]:
    """What git tracks and does not ignore (the working tree as it is, uncommitted edits in);
    every file below ``src`` but the skipped folders where git is not at hand."""
    try:
        out = subprocess.run(["git", "-C", str(src), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True)
        return [Path(p) for p in out.stdout.decode().split("\0") if p and (src / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(src) for p in src.rglob("*")
                if p.is_file() and not SKIP & set(p.relative_to(src).parts)]


class Beside:
    """The handle the suite holds on the loop beside it."""

    def __init__(self, root: Path, pid: int) -> None:
        self.root = root
        self.pid = pid
        self.log_path = root / "beside.log"

    @classmethod
    def start(cls) -> "Beside":
        root = Path(tempfile.mkdtemp(prefix="agentenv-beside-"))
        copy = root / "repo"
        for rel in _files(ROOT):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
        # Detached: sh puts the loop in the background and exits, so the loop's parent is not
        # this process; setsid gives it a process group of its own to end as one.
        out = subprocess.run(
            ["sh", "-c", 'setsid "$0" "$1" "$2" "$3" >/dev/null 2>&1 & echo $!',
             sys.executable, __file__, str(os.getpid()), str(root)],
            capture_output=True, text=True, check=True)
        return cls(root, int(out.stdout))

    def stop(self) -> None:
        """End the loop and the round in flight; keep the log and the rounds, remove the rest."""
        (self.root / "stop").touch()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        for path in sorted(self.root.iterdir()):
            if path.is_dir():
                cut = path / "round.log"
                if cut.exists():  # the round the stop cut short: its progress so far
                    with open(self.log_path, "ab") as log:
                        log.write(f"=== {path.name} (cut short by the end of the run)\n".encode() + cut.read_bytes())
                shutil.rmtree(path, ignore_errors=True)

    def outcomes(self) -> list[str]:
        rounds = self.root / "rounds.txt"
        done = rounds.read_text().splitlines() if rounds.exists() else []
        return [f"rounds finished beside this run: {len(done)} (log: {self.log_path})", *done]


def _loop(owner: int, root: Path) -> None:
    copy, n = root / "repo", 0
    env = dict(os.environ, AGENTENV_BESIDE="1", PYTHONPATH=str(copy), PYTHONUNBUFFERED="1")
    # The main run's PYTEST_ADDOPTS (--beside, --busy-cores) are its own: the run beside takes
    # only its own options, or each round would spin cores of its own on top of the main run's.
    env.pop("PYTEST_ADDOPTS", None)
    while not (root / "stop").exists():
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            return
        n += 1
        tmp = root / f"tmp{n}"
        tmp.mkdir()
        t0 = time.monotonic()
        # Streamed to the log as it runs: a round the stop cuts short still shows its progress.
        round_log = tmp / "round.log"
        with open(round_log, "wb") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider",
                 "--basetemp", str(tmp / "pytest")],
                cwd=copy, env=dict(env, TMPDIR=str(tmp)), stdout=out, stderr=subprocess.STDOUT)
        text = round_log.read_bytes()
        with open(root / "beside.log", "ab") as log:
            log.write(f"=== round {n}\n".encode() + text)
        lines = [ln for ln in text.decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip("= ") if lines else "no output"
        if not (root / "stop").exists():  # a round cut short by the stop is not an outcome
            with open(root / "rounds.txt", "a") as f:
                f.write(f"round {n}: exit {proc.returncode} in {time.monotonic() - t0:.0f} s: {last}\n")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _loop(int(sys.argv[1]), Path(sys.argv[2]))
