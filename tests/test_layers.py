"""Imports point down the layers: the engines and sandboxes (the I/O layer under the reactor,
the trainer and the CLI) use only the shared modules below them, never what is built on top."""

from __future__ import annotations

import ast
from pathlib import Path

import agentenv

PACKAGE = Path(agentenv.__file__).parent
# What the engine and sandbox packages may import from agentenv besides themselves.
BELOW = {"agentenv.errors", "agentenv.extras", "agentenv.retry", "agentenv.models", "agentenv.models.lora",
         "agentenv.raycluster", "agentenv.devices"}


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every agentenv module that ``source`` (the module ``module``) imports, at the top or
    inside a function, relative imports resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("agentenv"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("agentenv"))
    return found


def above(layer: str, targets: set[str]) -> list[str]:
    return sorted(t for t in targets if not (t.startswith(f"agentenv.{layer}") or t in BELOW))


def test_engines_and_sandboxes_import_nothing_above_them():
    wrong = []
    for layer in ("engines", "sandboxes"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            init = path.name == "__init__.py"
            module = ".".join(parts[:-1] if init else parts)
            wrong += [f"{module} imports {t}" for t in above(layer, imports_of(path.read_text("utf-8"), module, init))]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_an_import_inside_a_method():
    """The import the rule was written for: the embedded engine once reached up into
    ``train.policy`` for LoRA, inside a method. Its replacement passes."""
    up = "class E:\n    def f(self):\n        from ..train.policy import inject_lora\n"
    down = "class E:\n    def f(self):\n        from ..models.lora import inject_lora\n"
    assert above("engines", imports_of(up, "agentenv.engines.embedded")) == ["agentenv.train.policy"]
    assert above("engines", imports_of(down, "agentenv.engines.embedded")) == []
    assert above("sandboxes", imports_of("from ... import reactor\n", "agentenv.sandboxes.local.cgroups")) == [
        "agentenv.reactor"]


#: The package's floors, bottom first: a module imports from its own floor or the floors below,
#: never above, at the top of the file, inside a function or under ``TYPE_CHECKING`` alike.
#: A name is a module or a package (a package's modules share its floor unless named here).
FLOORS: list[tuple[str, set[str]]] = [
    ("shared", {"errors", "extras", "retry", "console", "options", "devices", "raycluster", "scheduler", "costs",
                "literals", "trajectory", "formats", "stats", "evaluation", "_math_worker", "models", "mainloop"}),
    ("io", {"engines", "sandboxes"}),
    ("env", {"env", "tools", "program", "workload", "simulator", "summary", "journal", "inflight", "checker",
             "registry", "config", "judge", "rewards", "envs", "bridge", "testing", "agent", "mcp_tools"}),
    ("run", {"reactor", "runtime", "gateway", "writer", "sources", "cluster", "rollout_run", "integrations"}),
    ("train", {"train"}),
    ("top", {"", "cli", "listing", "view", "scaffold", "recipes"}),
]


def module_of(path: Path) -> tuple[str, bool]:
    """``path``'s dotted module name, and whether it is a package's ``__init__``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    init = path.name == "__init__.py"
    return ".".join(parts[:-1] if init else parts), init


def as_modules(names: set[str], module: str) -> set[str]:
    """``names`` ("agentenv.x.Name" where Name may be a module or a name in one) as the
    modules they are, ``module`` itself left out."""
    modules = set()
    for name in names:
        while name and not (PACKAGE.parent / Path(*name.split("."))).with_suffix(".py").exists() \
                and not (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").exists():
            name = name.rpartition(".")[0]
        if name and name != module:
            modules.add(name)
    return modules


def module_imports(path: Path) -> set[str]:
    """The agentenv modules ``path`` imports when it is imported: its top-level imports (a
    function's imports run later; ``if TYPE_CHECKING:`` blocks never run), resolved to modules."""
    module, init = module_of(path)
    tree = ast.parse(path.read_text("utf-8"))
    top = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    source = "\n".join(ast.unparse(n) for n in top if isinstance(n, (ast.Import, ast.ImportFrom, ast.If, ast.Try)))
    return as_modules(imports_of(source, module, init), module)


def all_imports(path: Path) -> set[str]:
    """Every agentenv module ``path`` names in an import: at the top, inside a function (a
    deferred import) or under ``TYPE_CHECKING``. A deferred import hides a dependency from
    the import-time graph, not from the design, so it counts the same."""
    module, init = module_of(path)
    return as_modules(imports_of(path.read_text("utf-8"), module, init), module)


def graph(reader) -> dict[str, set[str]]:
    return {module_of(path)[0]: reader(path) for path in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int | None:
    """The index in :data:`FLOORS` of ``module``'s floor: the one naming it or the nearest
    package above it; None where no floor names it."""
    name = module.removeprefix("agentenv").removeprefix(".")
    while True:
        for i, (_, names) in enumerate(FLOORS):
            if name in names:
                return i
        if not name:
            return None
        name = name.rpartition(".")[0]


def upward(imports: dict[str, set[str]]) -> list[str]:
    """Each import of ``imports`` (module -> modules) that goes to a floor above its module's."""
    return sorted(f"{m} ({FLOORS[floor_of(m)][0]}) imports {t} ({FLOORS[floor_of(t)][0]})"
                  for m, targets in imports.items() for t in targets if floor_of(t) > floor_of(m))


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``imports``: each group of modules that import each other, directly or
    through others (a strongly connected component of two or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(imports.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(imports):
        if node not in index:
            visit(node)
    return sorted(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports), one path per cycle found."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_module_imports_itself_through_others_at_import_time():
    """Import-time imports form no circle: each module can be understood (and imported) after
    the ones it imports."""
    imports = graph(module_imports)
    assert not cycles(imports), "\n".join(" -> ".join(c) for c in cycles(imports))


def test_no_circles_with_deferred_imports_counted():
    """Counting deferred and ``TYPE_CHECKING`` imports too, no modules import each other: a
    function-level import that closes a circle is a circle all the same."""
    assert circles(graph(all_imports)) == []


def test_every_module_is_on_a_floor_and_imports_only_its_floor_and_below():
    imports = graph(all_imports)
    assert [m for m in imports if floor_of(m) is None] == [], "name each new module's floor in FLOORS"
    assert upward(imports) == []


def test_the_floor_check_counts_a_deferred_import():
    """The upward imports this check was written for, each inside a function: an environment
    module reaching into the trainer's config, the judge into the writer."""
    listing = "def f():\n    from ..train.config import TrainConfig\n"
    judge = "def f(env):\n    from .writer import has_group_reward\n"
    found = {"agentenv.envs.listing": as_modules(imports_of(listing, "agentenv.envs.listing"), "agentenv.envs.listing"),
             "agentenv.judge": as_modules(imports_of(judge, "agentenv.judge"), "agentenv.judge")}
    assert upward(found) == ["agentenv.envs.listing (env) imports agentenv.train.config (train)",
                             "agentenv.judge (env) imports agentenv.writer (run)"]
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_viewer_is_the_top_floor():
    """``agentenv.view`` reads files and serves them; nothing in the package imports it but the
    CLI, which takes only its options and command (``view.command``, light at parse time)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        init = path.name == "__init__.py"
        module = ".".join(parts[:-1] if init else parts)
        if module.startswith("agentenv.view"):
            continue
        allowed = {"agentenv.view.command"} if module == "agentenv.cli" else set()
        wrong += [f"{module} imports {t}" for t in imports_of(path.read_text("utf-8"), module, init)
                  if t.startswith("agentenv.view") and t not in allowed]
    assert not wrong, "\n".join(wrong)


def test_the_gateway_sits_under_the_reactor():
    """``agentenv.gateway`` (the agent programs' OpenAI-compatible door) is used by the reactor
    and uses what is below it (engines, formats, trajectories, the program context); never the
    reactor, the trainer, the run or the CLI above it."""
    above_it = ("agentenv.reactor", "agentenv.train", "agentenv.cli", "agentenv.view", "agentenv.rollout_run",
                "agentenv.sources", "agentenv.cluster", "agentenv.writer")
    wrong = []
    for path in sorted((PACKAGE / "gateway").rglob("*.py")) + [PACKAGE / "agent.py"]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        init = path.name == "__init__.py"
        module = ".".join(parts[:-1] if init else parts)
        wrong += [f"{module} imports {t}" for t in imports_of(path.read_text("utf-8"), module, init)
                  if t.startswith(above_it)]
    assert not wrong, "\n".join(wrong)
