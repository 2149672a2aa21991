"""Imports point down the layers: the engines and sandboxes (the I/O layer under the reactor,
the trainer and the CLI) use only the shared modules below them, never what is built on top."""

from __future__ import annotations

import ast
from pathlib import Path

import agentenv

PACKAGE = Path(agentenv.__file__).parent
# What the engine and sandbox packages may import from agentenv besides themselves.
BELOW = {"agentenv.errors", "agentenv.retry", "agentenv.models", "agentenv.models.lora", "agentenv.raycluster"}


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
