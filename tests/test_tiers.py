"""The test tree mirrors the package: ``tests/<dir>/test_<name>.py`` tests the module or
package ``<name>`` under ``agentenv/<dir>/``, so the tests of a module are found by its name.
A test file that checks a property across modules is listed here with what it covers.

The everyday tier (``pytest -m "not slow"``) keeps at least one test of every file, so every
module still runs with real parts; a file whose every test is slow is listed with the reason
and with where its module runs in the quick tier."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Test files that cover a property of several modules rather than one module.
CROSS_CUTTING = {
    "tests/test_durability.py": "rollouts killed and resumed: the CLI, the event log, the reactor, the sandbox pool",
    "tests/test_reactor_scheduling.py": "the reactor under each scheduling policy on the trace workload",
    "tests/test_imports.py": "what importing the package and parsing the CLI load",
    "tests/test_layers.py": "the import graph's floors",
    "tests/test_docs.py": "the documentation site against the package",
    "tests/test_sizes.py": "every function and class of the package fits the size limits",
    "tests/test_tiers.py": "this file",
    "tests/test_waiting.py": "tests/waiting.py, the tests' own helpers for waiting on a condition or a process",
    "tests/test_bench_client.py": "bench/client.py's figures (the benchmark lives outside the package)",
    "tests/test_bench_ab.py": "bench/ab.py, one bench interleaved on two revisions (the benchmarks live outside "
                              "the package)",
    "tests/test_bench_overlap.py": "bench/_overlap.py's ideal-overlap arithmetic (the benchmark lives outside the "
                                   "package)",
    "tests/engines/test_embedded_growth.py": "the embedded engine and transformers' continuous batching keep no "
                                             "state per request served",
    "tests/test_packaging.py": "how the package installs: no shadowing by a clone's folder, what a wheel holds, what "
                               "git ignores",
    "tests/engines/test_interface.py": "what the reactor reads from any engine (engines/base.py's interface)",
    "tests/sandboxes/test_hostile.py": "hostile code against the local sandbox",
    "tests/sandboxes/test_escapes.py": "the local sandbox's escape audits",
    "tests/sandboxes/test_escapes_third_audit.py": "the local sandbox's third escape audit",
    "tests/sandboxes/test_escapes_fourth_audit.py": "the local sandbox's fourth escape audit: host locks, page "
                                                    "cache, host identity, the syscall table",
    "tests/sandboxes/test_deadlines.py": "every host-side operation on a local session under the call's deadline "
                                         "(host, worker, frames, fork server)",
    "tests/view/test_words.py": "the viewer's words and colours in a real browser, against agentenv plot's colours",
    "tests/test_agent_frameworks.py": "unmodified agent frameworks (openai SDK, Agents SDK, LangGraph, a command) "
                                      "through the gateway",
    "tests/test_cuda.py": "the CUDA lines of docs/architecture.md on a CUDA device (pytest -m gpu; skipped "
                          "without one)",
}


def modules_under(folder: Path) -> set[str]:
    """Names of the modules and packages in ``folder`` and below."""
    names = set()
    for p in folder.rglob("*.py"):
        names.add(p.parent.name if p.name == "__init__.py" else p.stem)
    return names


def test_every_test_file_names_the_module_it_tests():
    orphans = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in CROSS_CUTTING:
            continue
        package = ROOT / "agentenv" / path.parent.relative_to(ROOT / "tests")
        if not package.is_dir() or path.stem.removeprefix("test_") not in modules_under(package):
            orphans.append(rel)
    assert not orphans, (f"{orphans} mirror no module under agentenv/ (name a test file after the module it tests, "
                         "or list it in CROSS_CUTTING with what it covers)")


def test_the_cross_cutting_files_exist():
    assert [f for f in CROSS_CUTTING if not (ROOT / f).is_file()] == []


#: Test files whose every test is slow, and why; their modules run in the quick tier elsewhere.
ALL_SLOW = {
    "tests/sandboxes/test_escapes.py": "escape audits that wait out limits; hostile code stays quick in "
                                       "test_hostile.py",
    "tests/sandboxes/test_escapes_third_audit.py": "as test_escapes.py",
    "tests/sandboxes/test_escapes_fourth_audit.py": "as test_escapes.py",
    "tests/view/test_words.py": "a browser over real runs; the viewer's quick tests are test_runs.py and "
                                "test_command.py",
    "tests/train/test_sharding.py": "two spawned torch processes; sharding.full runs in every Policy step "
                                    "(test_policy.py)",
}


def _is_slow(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


def quick_tests(path: Path) -> list[str]:
    """The test functions of a file that the quick tier runs (not marked slow, by decorator
    or by the module's ``pytestmark``)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if _is_slow(node.value):
                return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_") and not any(_is_slow(d) for d in n.decorator_list)]


def test_every_test_file_keeps_a_test_in_the_quick_tier():
    files = {path.relative_to(ROOT).as_posix(): path for path in (ROOT / "tests").rglob("test_*.py")}
    all_slow = sorted(rel for rel, path in files.items() if not quick_tests(path))
    assert all_slow == sorted(ALL_SLOW), ("each test file keeps a quick test (a small one with real parts), "
                                          f"or is listed in ALL_SLOW with its reason: {all_slow}")
