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


def module_imports(path: Path) -> set[str]:
    """The agentenv modules ``path`` imports when it is imported: its top-level imports (a
    function's imports run later; ``if TYPE_CHECKING:`` blocks never run), resolved to modules."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    init = path.name == "__init__.py"
    module = ".".join(parts[:-1] if init else parts)
    tree = ast.parse(path.read_text("utf-8"))
    top = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    source = "\n".join(ast.unparse(n) for n in top if isinstance(n, (ast.Import, ast.ImportFrom, ast.If, ast.Try)))
    names = imports_of(source, module, init)
    modules = set()
    for name in names:  # "agentenv.x.Name" -> "agentenv.x" where Name is not a module
        while name and not (PACKAGE.parent / Path(*name.split("."))).with_suffix(".py").exists() \
                and not (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").exists():
            name = name.rpartition(".")[0]
        if name and name != module:
            modules.add(name)
    return modules


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
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        graph[module] = module_imports(path)
    assert not cycles(graph), "\n".join(" -> ".join(c) for c in cycles(graph))


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
