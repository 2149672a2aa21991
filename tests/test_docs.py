"""The documentation: the site builds strictly, the README stays a short guide, and the
benchmark figures on both are the ones the benches wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _load(path: Path, name: str):
    """A module from a file that is not on the import path (docs/, bench/)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


#: What a user's Environment subclass overrides or sets (docs/environments.md).
OVERRIDABLE = ("tasks", "reward", "prompt", "tools", "sandbox_setup", "on_turn", "plan_turn", "group_reward", "aclose")
CLASS_ATTRIBUTES = ("id", "tool_format", "max_turns", "tool_timeout", "system_prompt", "train_defaults")


def test_every_member_a_user_overrides_has_a_docstring_the_reference_shows():
    """mkdocstrings leaves out a member without a docstring (and ``#:`` comments are not
    docstrings to griffe): each overridable method and class attribute of ``Environment``,
    and each field of the types it returns, has one, read from the source as the site does."""
    import griffe

    module = griffe.load("agentenv.env", search_paths=[str(ROOT)], allow_inspection=False)
    env = module["Environment"]
    assert env.docstring and set(OVERRIDABLE) | set(CLASS_ATTRIBUTES) <= set(env.members)
    bare = [f"{cls}.{name}" for cls in ("Environment", "Task", "TurnAction", "TurnPlan")
            for name, member in module[cls].members.items() if not name.startswith("_") and not member.docstring]
    assert bare == [], f"members with no docstring (left out of the API reference): {bare}"


def test_site_builds_strictly_without_importing_torch(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or an API
    reference to a name that does not exist fails it. The API reference is read from the
    sources (griffe), so building it imports neither torch nor vLLM."""
    site = tmp_path / "site"
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('heavy modules loaded:', sorted(m for m in ('torch', 'vllm', "
             "'transformers')"
             " if m in sys.modules)))\n"
             f"sys.argv = ['mkdocs', 'build', '--strict', '--site-dir', {str(site)!r}]\n"
             "from mkdocs.__main__ import cli\n"
             "cli()\n")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    took = time.perf_counter() - t0
    assert r.returncode == 0, f"mkdocs build --strict failed after {took:.1f}s:\n{r.stdout}\n{r.stderr}"
    assert "heavy modules loaded: []" in r.stdout, r.stdout
    # The API reference rendered the docstrings, not empty pages.
    env_page = (site / "reference" / "env" / "index.html").read_text()
    assert "agentenv.env.Environment" in env_page and "The Environment base class users subclass" in env_page
    assert ":class:<code>" not in env_page and "<code>Task</code>" in env_page  # docs/hooks.py dropped the roles
    for member in (*OVERRIDABLE, *CLASS_ATTRIBUTES):  # what a user overrides is in the reference
        assert f'id="agentenv.env.Environment.{member}"' in env_page, member
    assert (site / "benchmarks" / "index.html").exists() and (site / "img" / "overview.png").exists()


def test_the_docs_extra_names_exactly_what_mkdocs_yml_needs():
    """``pip install -e '.[docs]' && mkdocs serve``: the ``docs`` extra holds the distributions
    that provide mkdocs.yml's theme, plugins and handlers (found through their entry points
    and modules, as mkdocs finds them), each needed, none missing; ``dev`` takes it whole."""
    import tomllib
    from importlib.metadata import entry_points, packages_distributions, requires

    import yaml
    from packaging.requirements import Requirement

    class Loose(yaml.SafeLoader):  # mkdocs.yml's !ENV / !relative tags are not read here
        pass

    Loose.add_multi_constructor("!", lambda loader, tag, node: None)
    site = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loose)
    plugins = {ep.name: ep.dist.name for ep in entry_points(group="mkdocs.plugins")}
    themes = {ep.name: ep.dist.name for ep in entry_points(group="mkdocs.themes")}
    modules = packages_distributions()
    needed = {themes[site["theme"]["name"]]}
    for entry in site["plugins"]:
        name = entry if isinstance(entry, str) else next(iter(entry))
        handlers = {} if isinstance(entry, str) else (entry[name] or {}).get("handlers", {})
        # A handler comes through the plugin's extra (mkdocstrings[python]: mkdocstrings-python).
        needed |= {f"{plugins[name]}[{h}]" for h in handlers} or {plugins[name]}
    needed.discard("mkdocs")  # the search plugin comes with mkdocs itself
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = [Requirement(r) for r in meta["docs"]]
    given = {r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") for r in named}
    assert needed == {"mkdocs-material", "mkdocstrings[python]"} and given == needed, (needed, given)
    # The markdown extensions come with them (pymdown-extensions is mkdocs-material's).
    under = {Requirement(r).name.lower() for d in ("mkdocs-material", "mkdocstrings") for r in requires(d) or ()}
    for ext in site["markdown_extensions"]:
        top = (ext if isinstance(ext, str) else next(iter(ext))).split(".")[0]
        if top not in ("admonition", "attr_list", "def_list", "footnotes", "tables", "toc"):  # Markdown's own
            assert {d.lower() for d in modules[top]} <= under, f"{ext}: {modules[top]} is not in the docs extra"
    assert "agentenv[docs]" in meta["dev"] and not [r for r in meta["dev"] if "mkdocs" in r]
    for page in (README, ROOT / "docs" / "install.md"):
        assert "pip install -e '.[docs]' && mkdocs serve" in page.read_text(), page


def test_readme_is_a_short_guide_with_a_contents_list():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; the guide keeps to 400 (the rest goes to docs/)"
    headings = [line[3:] for line in lines if line.startswith("## ")]
    assert headings and headings[0] == "Contents", "the first section is the contents list"
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)$", contents, re.M)
    assert anchors, "the contents list links to the sections"
    slugs = {_slug(h) for h in headings}
    assert [a for a in anchors if a not in slugs] == [], f"contents links with no heading; headings: {sorted(slugs)}"
    assert sorted(anchors) == sorted(_slug(h) for h in headings[1:]), "every section is in the contents list"


def test_readme_links_to_files_that_exist():
    text = README.read_text()
    targets = re.findall(r"\]\(((?!https?://|#)[^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README points into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_readme_test_command_is_the_one_ci_runs():
    ci = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "python -m pytest" in line)
    assert ci in README.read_text().splitlines(), "README's test command and .ci/run differ"


def test_benchmark_figures_are_the_ones_in_the_results_files():
    """docs/benchmarks.md and README's headline table are what docs/gen_benchmarks.py makes
    of bench/results/*.json now."""
    gen = _load(ROOT / "docs" / "gen_benchmarks.py", "gen_benchmarks")
    assert gen.main(["--check"]) == 0, "run: python docs/gen_benchmarks.py"


def test_the_cli_synopses_are_the_parsers(tmp_path, monkeypatch):
    """docs/cli.md's and docs/training.md's synopses are what docs/gen_cli.py makes of the CLI's
    parser now; a flag added to an options dataclass shows up in them when they are regenerated."""
    gen = _load(ROOT / "docs" / "gen_cli.py", "gen_cli")
    assert gen.main(["--check"]) == 0, "run: python docs/gen_cli.py"
    text = gen.synopsis("train")
    assert "  sandbox " in text and "[--sandbox-memory-mb N]" in text
    assert "[--report-to tensorboard|wandb|none]..." in text
    assert max(len(line) for line in text.splitlines()) <= gen.WIDTH
    page = tmp_path / "cli.md"
    page.write_text("before\n<!-- synopsis:eval:start -->\nold\n<!-- synopsis:eval:end -->\nafter\n")
    monkeypatch.setattr(gen, "PAGES", {"eval": page})
    assert gen.main(["--check"]) == 1 and "old" in page.read_text()
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert page.read_text().startswith("before\n<!-- synopsis:eval:start -->\n```\nagentenv eval\n")
    assert "[--k 4]" in page.read_text() and page.read_text().endswith("<!-- synopsis:eval:end -->\nafter\n")


def test_a_bench_result_reaches_the_page(tmp_path, monkeypatch):
    """bench/_report.write records the figures with the machine and versions; the generator
    shows them (the headline in bold) and turns its headline rows to the new figure."""
    report = _load(ROOT / "bench" / "_report.py", "bench_report")
    gen = _load(ROOT / "docs" / "gen_benchmarks.py", "gen_benchmarks")
    monkeypatch.setenv("AGENTENV_BENCH_RESULTS", str(tmp_path))
    path = report.write("sandbox", {"starts_per_s_after_close": 301.5, "starts_per_s_settled": 402.0,
                                    "calls": {"pool_c1": {"p50_ms": 0.41}}, "sandbox_speedup": 77.25},
                        headline="sandbox_speedup", args={"calls": 3200})
    record = json.loads(path.read_text())
    assert record["machine"]["cores"] == os.cpu_count() and record["machine"]["cpu"]
    assert record["versions"]["python"] and record["args"] == {"calls": 3200}
    results = gen.load_results(tmp_path)
    block = gen.results_block("sandbox", results["sandbox"])
    assert "| `sandbox_speedup` (headline) | **77.25** |" in block
    assert "| `calls.pool_c1.p50_ms` | 0.410 |" in block
    assert f"{os.cpu_count()} cores" in block
    table = gen.headline_table(results, "docs/benchmarks.md")
    assert "| 77.2x |" in table and "| 302/s (402/s after teardown) |" in table
    assert "[reported earlier](docs/benchmarks.md#scheduling-policies)" in table
    with pytest.raises(ValueError):
        report.write("sandbox", {"x": 1}, headline="missing")


def test_files_the_docs_name_exist():
    """Every `agentenv/...`, `tests/...`, `bench/...` or `examples/...` path the README and the
    pages name in code spans is a file or folder of the checkout (the module table in
    docs/architecture.md included), so a moved module cannot leave the docs pointing at
    nothing. A bench's results file is named before the bench has written it."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        m for page in pages for m in re.findall(r"`((?:agentenv|tests|bench|examples)/[\w./-]+)`", page.read_text())
    }
    assert len(named) > 50
    missing = sorted(
        p for p in named if not (ROOT / p).exists() and not p.startswith(("bench/results/", "tests/.artifacts/"))
    )
    assert missing == [], f"the docs name paths that do not exist: {missing}"


def test_the_readme_example_environment_passes_check_env_without_a_docstring_warning():
    from agentenv import check_env

    block = README.read_text().split("## Defining an environment", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(block.split("\nregister(", 1)[0], scope)  # the class, not registered (another test may have)
    report = check_env(scope["Multiply"]())
    assert [w for w in report.warnings if "docstring" in w] == []


def test_the_main_job_names_the_event_log_beside_its_output():
    """A new user meets `rollouts.jsonl.log` beside the output: the README's main job says
    what it is where the run is described, and the CLI page states the rule for the streams."""
    job = README.read_text().split("## The main job", 1)[1].split("\n## ", 1)[0]
    assert "`rollouts.jsonl.log`" in job and "--resume" in job
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert "data on stdout, people's text on stderr" in cli
