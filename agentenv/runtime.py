"""What a run's programs run on, opened in one order: :func:`open_runtime`.

    async with open_runtime(env, EngineSpec("embedded", model), "local", config, programs=64) as rt:
        async with rt.reactor.rollouts(tasks, group_size=4) as results:
            ...

The order is the point. The sandbox opens first and the sessions the first programs will take
start in it (``reactor.prepare_sessions``) while the engine loads, instead of competing with
the first turns for the CPU; then the engine; then the environment is checked against the
engine's tokenizer (``checker.check_env``: a broken env fails before any program runs); then
the :class:`~agentenv.Reactor` that drives them. Everything it opened closes in reverse.

A rollout run in this process (``sources.LocalGroups``), a rollout worker on Ray
(``cluster.RolloutWorker``: the same runtime, in an actor's process), the trainer and the
benches open their runtime here. What each passes in differs only in what it already holds:

* ``engine``: an :class:`~agentenv.engines.spec.EngineSpec` (opened here, closed at the end),
  an async callable that starts one (engine actors on Ray: ``RayEngine.connect`` or
  ``RayEngine.launch``; closed at the end too), or an engine already open (the caller's: left
  open);
* ``sandbox``: a :class:`~agentenv.config.SandboxOptions` or its kind (opened here, closed at
  the end), or a sandbox already open (the caller's: left open).
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Union

from .config import RolloutConfig, SandboxOptions, open_sandbox
from .engines.spec import EngineSpec

if TYPE_CHECKING:
    from .engines.base import Engine
    from .env import Environment
    from .reactor import Reactor

#: Where a runtime's engine comes from: a spec, a starter (engine actors), or an open engine.
EngineSource = Union[EngineSpec, Callable[[], Awaitable["Engine"]], "Engine"]


@dataclass(frozen=True)
class Runtime:
    """An open runtime: the sandbox, the engine and the reactor over both, for one environment."""

    sandbox: Any
    engine: Engine
    reactor: Reactor
    #: Sandbox sessions started while the engine loaded.
    prepared: int

    @property
    def config(self) -> RolloutConfig:
        """The settings the reactor runs with (the env's limits filled in)."""
        return self.reactor.config


@asynccontextmanager
async def open_runtime(env: Environment, engine: EngineSource, sandbox: SandboxOptions | str | Any,
                       config: RolloutConfig, *, programs: int | None = None, journal: Any = None,
                       wait: bool = False) -> AsyncIterator[Runtime]:
    """Open ``sandbox``, start the sessions at most ``programs`` first programs will take
    (``wait``: until they are ready), open ``engine``, check ``env`` against its tokenizer and
    yield the :class:`Runtime` with a reactor running ``config``, whose programs' turns go to
    ``journal`` (a rollout run's event log, or the in-flight programs a worker or a trainer
    checkpoint snapshots). See the module doc for what ``engine`` and ``sandbox`` may be."""
    from .checker import check_env
    from .reactor import Reactor, prepare_sessions

    async with AsyncExitStack() as stack:
        if isinstance(sandbox, (str, SandboxOptions)):
            sandbox = await stack.enter_async_context(open_sandbox(sandbox))
        prepared = await prepare_sessions(env, sandbox, config, programs, wait=wait)
        if isinstance(engine, EngineSpec):
            engine = await stack.enter_async_context(await engine.open())
        elif callable(engine):
            engine = await stack.enter_async_context(await engine())
        check_env(env, tokenizer=engine.tokenizer)
        reactor = await stack.enter_async_context(Reactor(engine, env, sandbox, config, journal=journal))
        yield Runtime(sandbox, engine, reactor, prepared)


__all__ = ["EngineSource", "Runtime", "open_runtime"]
