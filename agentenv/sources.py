"""Where a rollout run's results come from: this process's reactor (:class:`LocalGroups`) or
rollout workers on a Ray cluster (:class:`RayGroups`). Both are a :class:`GroupSource`: an
async context manager whose :meth:`~GroupSource.results` streams finished programs and
complete groups; the run around it (``agentenv.rollout_run``: the writer, resume, progress and
summary) is one and the same."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncContextManager, AsyncIterator, Protocol, Sequence

if TYPE_CHECKING:
    from .config import RolloutConfig, SandboxOptions
    from .engines.spec import EngineSpec
    from .env import Environment, Task
    from .journal import Journal, LogState
    from .reactor import Group
    from .runtime import EngineSource
    from .stats import RunStats
    from .trajectory import Trajectory

# What a Ray driver does not see: its workers' engines and sandboxes measure these.
WORKER_SIDE = ("mean_requests_in_flight", "engine_idle_pct", "engine_under_half_pct", "pauses", "restores",
               "session_waits", "session_wait_s", "session_starts", "session_start_p50_ms",
               "session_start_p90_ms")


class GroupSource(Protocol):
    """Where a run's programs run. Opened with ``async with`` (engine, sandbox or cluster)."""

    #: The header's words for where the run happens (e.g. ``" on Ray, 2 workers"``).
    where: str
    #: What the run's start-up covers, for the wall-time row.
    startup: str
    #: Sandbox sessions started while the model loaded.
    prepared: int

    async def __aenter__(self) -> "GroupSource": ...

    async def __aexit__(self, *exc: object) -> None: ...

    def results(self, tasks: Sequence[Task], group_size: int, resume: LogState | None
                ) -> AsyncContextManager[AsyncIterator[Trajectory | Group]]:
        """Run ``group_size`` programs of every task (``resume``: less what a log says is done,
        its partial programs continued); stream each finished program (a source may leave
        them to their group) and each complete group."""
        ...

    @property
    def stats(self) -> RunStats: ...

    def summary(self) -> dict[str, Any]:
        """The run's stats summary: the figures this source measured."""
        ...

    def rows(self) -> list[tuple[str, Any]]:
        """The summary table's rows only this source has."""
        ...


class LocalGroups:
    """The run in this process: a sandbox pool, an engine and a :class:`~agentenv.Reactor`,
    opened by :func:`~agentenv.runtime.open_runtime` (``engine`` and ``sandbox`` in any form it
    takes: a spec it opens, or one the caller holds open; ``wait``: the prepared sessions are
    ready before the engine opens)."""

    where = ""
    startup = "model, sandbox"

    def __init__(self, env: Environment, engine: EngineSource, sandbox: SandboxOptions | str | Any,
                 config: RolloutConfig, log: Journal,
                 *, programs: int, out: Path, by_group: bool, wait: bool = False) -> None:
        self.env, self.engine, self.sandbox, self.config, self.log = env, engine, sandbox, config, log
        self.programs, self.out, self.by_group, self.wait = programs, out, by_group, wait
        self.prepared = 0
        self.reactor: Any = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> "LocalGroups":
        from .runtime import open_runtime

        async with contextlib.AsyncExitStack() as stack:
            runtime = await stack.enter_async_context(open_runtime(
                self.env, self.engine, self.sandbox, self.config, programs=self.programs, journal=self.log,
                wait=self.wait))
            self.prepared, self.reactor = runtime.prepared, runtime.reactor
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @contextlib.asynccontextmanager
    async def results(self, tasks: Sequence[Task], group_size: int, resume: LogState | None
                      ) -> AsyncIterator[AsyncIterator[Trajectory | Group]]:
        if resume is not None and self.by_group:
            _regroup(resume, self.out, tasks, group_size)
        async with self.reactor.rollouts(tasks, group_size, resume=resume) as results:
            yield results

    @property
    def stats(self) -> RunStats:
        return self.reactor.stats

    def summary(self) -> dict[str, Any]:
        return self.reactor.stats.summary()

    def rows(self) -> list[tuple[str, Any]]:
        return []


def unfinished_groups(resume: LogState, out: Path, tasks: Sequence[Task], group_size: int) -> dict[str, list[dict]]:
    """Resume's regrouping, for every source: each group of ``tasks`` that is not whole in the
    output, with the samples of it that finished (its lines in the output, cut short mid-write,
    and its samples held back for their group's reward, in sample order), as trajectory dicts.
    Those samples do not run again; the group is scored whole once its other samples end."""
    from . import journal

    done = resume.done
    ids = {t.id for t in tasks if any((t.id, i) not in done for i in range(group_size))}
    finished = journal.lines_of(out, ids)
    for (tid, i), d in sorted(resume.held.items()):
        if (tid, i) not in done:
            finished.setdefault(tid, []).append(d)
    return finished


def _regroup(resume: LogState, out: Path, tasks: Sequence[Task], group_size: int) -> None:
    """The reactor's view of :func:`unfinished_groups`: ``resume.finished`` holds them as
    trajectories and ``resume.done`` names the held samples, which do not run again."""
    from .trajectory import Trajectory

    finished = unfinished_groups(resume, out, tasks, group_size)
    resume.done |= {k for k in resume.held if k not in resume.done}
    resume.finished = {tid: [Trajectory.from_dict(d) for d in lines] for tid, lines in finished.items()}


class RayGroups:
    """The run on rollout workers on a Ray cluster (:class:`~agentenv.cluster.RayRollouts`):
    groups come back whole; the event log records the workers' snapshots of their programs,
    so ``--resume`` continues every unfinished group from its programs' last logged turns."""

    startup = "cluster, workers"

    def __init__(self, env: Environment, env_args: dict[str, Any], engine: EngineSpec, sandbox: SandboxOptions | str,
                 config: RolloutConfig, log: Journal, *, out: Path, workers: int, engines: int = 0,
                 engine_gpus: float = 0.0) -> None:
        from .stats import RunStats

        self.env, self.env_args, self.engine_spec, self.sandbox_kind = env, env_args, engine, sandbox
        self.config, self.log, self.out = config, log, out
        self.workers, self.engines, self.engine_gpus = workers, engines, engine_gpus
        self.where = f" on Ray, {workers} workers" + (f", {engines} engine actors" if engines else "")
        self.cluster: Any = None
        self._stats = RunStats()  # the driver's: what the trajectories say

    @property
    def prepared(self) -> int:
        return self.cluster.prepared if self.cluster is not None else 0

    async def __aenter__(self) -> "RayGroups":
        from .cluster import RayRollouts

        self.cluster = RayRollouts(
            self.env, workers=self.workers, env_args=self.env_args, engine=self.engine_spec, sandbox=self.sandbox_kind,
            config=self.config, engines=self.engines,
            engine_options={"num_gpus": self.engine_gpus} if self.engine_gpus else None)
        await self.cluster.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cluster.aclose()

    @contextlib.asynccontextmanager
    async def results(self, tasks: Sequence[Task], group_size: int, resume: LogState | None
                      ) -> AsyncIterator[AsyncIterator[Trajectory | Group]]:
        from . import inflight

        done = set(resume.done) if resume is not None else set()
        todo = [t for t in tasks if any((t.id, i) not in done for i in range(group_size))]
        saved: dict[str, Any] = {}
        if resume is not None:  # unfinished groups continue: their finished lines and their programs' logged turns
            ids = {t.id for t in todo}
            finished = unfinished_groups(resume, self.out, todo, group_size)
            with_work = ids & ({tid for tid, _ in resume.partial} | set(finished))
            saved = {tid: inflight.snapshot_of(resume, tid, finished.get(tid, [])) for tid in with_work}
        already = done | set(resume.held if resume is not None else ())
        logged: dict[str, tuple[Any, ...]] = {}  # program -> how far its records in the log go

        async def groups(received: AsyncIterator[Group]) -> AsyncIterator[Group]:
            async for group in received:
                for t in group.trajectories:
                    if (t.task_id, t.sample_index) not in already:
                        self._stats.add(t)  # the summary counts every program run, as a local run's
                yield group

        self._stats.start(len(tasks) * group_size - len(done))
        try:
            async with self.cluster.rollouts(
                    todo, group_size, saved=saved,
                    on_snapshot=lambda tid, snap: inflight.log_snapshot(self.log, snap, logged)) as received:
                yield groups(received)
        finally:
            self._stats.stop()

    @property
    def stats(self) -> RunStats:
        return self._stats

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self._stats.summary().items() if k not in WORKER_SIDE}

    def rows(self) -> list[tuple[str, Any]]:
        c = self.cluster
        engines = (("engine actors", f"{self.engines}, shared by the workers"),) if self.engines else ()
        return [("workers (pids)", ", ".join(map(str, c.pids))), *engines,
                ("workers replaced / groups run again (from a snapshot)", f"{c.replaced} / {c.rerun} ({c.continued})")]


__all__ = ["GroupSource", "LocalGroups", "RayGroups", "WORKER_SIDE", "unfinished_groups"]
