"""The ``Engine`` interface declares everything the reactor, its programs and its scheduler
read from an engine, and the engines provide it: real engines, real reactors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import agentenv
from agentenv.engines.base import DEFAULT_PAGE_SIZE, Engine

PACKAGE = Path(agentenv.__file__).parent
READERS = ("reactor.py", "program.py", "scheduler.py")


def _engine_expr(node: ast.AST) -> bool:
    """``engine``, ``self.engine``, ``ctx.engine``, ...: an expression naming an engine."""
    return ((isinstance(node, ast.Name) and node.id == "engine")
            or (isinstance(node, ast.Attribute) and node.attr == "engine"))


def engine_reads(source: str) -> tuple[set[str], list[str]]:
    """The attributes ``source`` reads from an engine, and the ``getattr``/``hasattr`` calls on
    one (each read around the interface)."""
    names, around = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _engine_expr(node.value):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and node.args and _engine_expr(node.args[0])):
            around.append(ast.unparse(node))
    return names, around


def declared() -> set[str]:
    """What ``Engine`` declares: its annotated attributes and its public methods."""
    hints = {n for klass in Engine.__mro__ for n in getattr(klass, "__annotations__", {})}
    return {n for n in hints | set(dir(Engine)) if not n.startswith("_")}


def test_the_check_sees_reads_around_the_interface():
    names, around = engine_reads("def f(self, engine):\n    getattr(engine, 'page_size', 1)\n"
                                 "    self.engine.release('p')\n    engine.tokenizer\n")
    assert names == {"release", "tokenizer"}
    assert around == ["getattr(engine, 'page_size', 1)"]


def test_what_the_reactor_reads_from_an_engine_the_interface_declares():
    reads, around = set(), []
    for name in READERS:
        n, a = engine_reads((PACKAGE / name).read_text("utf-8"))
        reads |= n
        around += [f"{name}: {call}" for call in a]
    assert not around, "read through the Engine interface instead:\n" + "\n".join(around)
    # What the reactor is known to read (so the scan cannot pass by finding nothing).
    assert {"page_size", "kv_capacity_tokens", "tokenizer", "max_model_len", "generate_turn", "release"} <= reads
    assert reads <= declared(), f"read but not declared by Engine: {sorted(reads - declared())}"


def _reactor(engine: Engine):
    from agentenv import Reactor, RolloutConfig, make

    env = make("retool-math", extra_digits=0)
    return Reactor(engine, env, None, RolloutConfig(concurrency=4, scheduling="program"))


def test_an_embedded_engine_reports_its_page_size_and_sampling_and_the_reactor_uses_them(model_dir):
    from agentenv.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, temperature=0.7, top_p=0.9, top_k=5, page_size=32, kv_cache_tokens=4096)
    try:
        assert engine.page_size == 32 and engine.kv_capacity_tokens == 4096
        assert engine.sampling == (0.7, 0.9, 5)
        reactor = _reactor(engine)
        # One block size for the reuse statistics and the scheduler's KV accounting.
        assert reactor.stats.outcomes.block_size == reactor.scheduler.config.block_size == 32
        assert reactor.scheduler.config.kv_capacity == 4096
    finally:
        engine.close()


def test_an_engine_that_cannot_say_gets_the_interfaces_defaults_everywhere(tokenizer):
    """verl's server manager engine knows no block size, capacity or fixed sampling: the
    reactor's statistics and its scheduler both take the interface's one default."""
    pytest.importorskip("verl")
    from agentenv.integrations.verl import ServerManagerEngine

    engine = ServerManagerEngine(None, tokenizer, 1024, request_id="p")
    assert (engine.page_size, engine.kv_capacity_tokens, engine.sampling) == (DEFAULT_PAGE_SIZE, None, None)
    reactor = _reactor(engine)
    assert reactor.stats.outcomes.block_size == reactor.scheduler.config.block_size == DEFAULT_PAGE_SIZE
    assert reactor.scheduler.config.kv_capacity is None
