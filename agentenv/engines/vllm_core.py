"""One vLLM ``AsyncLLM`` and its engine core's life: start, restarts, niceness, shutdown.

``VLLMCore`` holds the ``AsyncLLM`` that :class:`~agentenv.engines.vllm.VLLMEngine` sends its
requests to (its engine core runs in a child process) and owns everything that concerns that
process rather than a request:

* **Restarts.** A dead engine core (killed, crashed: vLLM's ``EngineDeadError``) is replaced
  by a new one, at most ``max_restarts`` times in the engine's life. Every call made through
  :meth:`VLLMCore.restarting` that finds the core dead waits for the one restart (however many
  calls saw it die) and is then made again on the new core. The new core is given what the
  dead one served before it takes over (``prime``: weights, weight version, adapters), and the
  engine forgets what lived only in the dead one (``reset``: streaming-input requests). Only when
  restarts are exhausted or the new core fails to start does the call raise ``EngineError``.
* **Calls that vLLM never answers.** A utility call (pause, ``collective_rpc``, ``add_lora``)
  sent just as the core died gets no answer, ever: :meth:`VLLMCore.call` watches the core's
  processes and ends such a call with ``EngineDeadError`` as its cause.
* **Niceness.** On CPU the engine core process runs at ``nice`` 10. It busy-polls between
  steps, and at equal priority whatever shares the machine waits for its slice, including
  kernel work that sandbox sessions wait on: a session's fork or exit waits for its template's
  anon_vma lock while a reclaim walk holding it is preempted, and a cgroup join for an RCU
  grace period. With vLLM decoding beside a churn of sessions, session starts took p99 1.6-9.1
  s at equal priority and 0.4 s with the engine core at nice 10 (docs/sandboxes.md, "Sandboxes
  beside the engine"). Its workers, which compute the model, keep their priority. A restarted core gets
  the same niceness.
* **Shutdown** that logs nothing for a clean close (see :func:`stop_output_handler`,
  :func:`shut_down`), and leaves no socket files behind (see :func:`own_rpc_dir`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Awaitable, Callable

import anyio
from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from ..errors import EngineError

log = logging.getLogger(__name__)


_RPC_PREFIX = "agentenv-vllm-"
_rpc_lock = threading.Lock()
_live: set[int] = set()  # the ids of this process's AsyncLLMs, started and not yet shut down


def _ours(path: str | None) -> bool:
    return bool(path) and os.path.basename(path).startswith(f"{_RPC_PREFIX}{os.getpid()}-")


def own_rpc_dir() -> str:
    """The directory this process's vLLM engines put their ZMQ sockets in: made for the first
    engine, removed when the last one is shut down (:func:`release_rpc_dir`) and when the
    process exits.

    vLLM names its ZMQ endpoints ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>`` (by default the temp
    dir), and the engine core and its workers are stopped rather than closed, so every engine
    leaves seven socket files there, a clean shutdown included. Here they land in one directory
    per process, named with its pid. vLLM's processes read the variable when they start (they
    inherit it), so it is set in ``os.environ``. A ``VLLM_RPC_BASE_PATH`` that the user set is
    theirs and kept; one inherited from another agentenv process is replaced, as that process
    removes its own. A process killed with SIGKILL leaves its directory (one, not seven files an
    engine).

    A socket's path is at most ``zmq.IPC_PATH_MAX_LEN`` bytes (107 on Linux): where the
    directory would make vLLM's names longer than that (a deep temp dir), vLLM's default is kept."""
    import zmq

    with _rpc_lock:
        current = os.environ.get("VLLM_RPC_BASE_PATH")
        if current and not os.path.basename(current).startswith(_RPC_PREFIX):
            return current
        if _ours(current):
            return current
        path = tempfile.mkdtemp(prefix=f"{_RPC_PREFIX}{os.getpid()}-")
        if len(os.fsencode(path)) + len("/") + 36 > getattr(zmq, "IPC_PATH_MAX_LEN", 107):  # vLLM's names: a uuid4
            os.rmdir(path)
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
            return tempfile.gettempdir()
        os.environ["VLLM_RPC_BASE_PATH"] = path
        atexit.register(_remove, path, os.getpid())
        return path


def release_rpc_dir(llm: Any) -> None:
    """``llm`` was shut down: with it the process's last engine, its socket directory is
    removed (and the variable unset: a process this one starts later, a ``vllm serve``, must
    not inherit a directory that is gone)."""
    with _rpc_lock:
        _live.discard(id(llm))
        current = os.environ.get("VLLM_RPC_BASE_PATH")
        if not _live and _ours(current):
            os.environ.pop("VLLM_RPC_BASE_PATH")
            shutil.rmtree(current, ignore_errors=True)


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a child forked after the directory was made
        shutil.rmtree(path, ignore_errors=True)


def _uses_ray(args: dict[str, Any]) -> bool:
    """Whether vLLM will start this engine's workers as Ray actors. It copies its ``VLLM_*``
    variables to them, on whichever node each lands, where this process's directory does not
    exist: such an engine keeps vLLM's default."""
    if "ray" in (args.get("distributed_executor_backend"), args.get("data_parallel_backend")):
        return True
    world = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    ray = sys.modules.get("ray")
    return world > 1 and args.get("distributed_executor_backend") is None and ray is not None and ray.is_initialized()


async def start_llm(args: dict[str, Any]) -> Any:
    """A new ``AsyncLLM`` from ``AsyncEngineArgs(**args)``, started on a worker thread (the
    engine core process takes seconds to come up), its sockets in :func:`own_rpc_dir`."""
    if not _uses_ray(args):
        own_rpc_dir()
    else:
        with _rpc_lock:
            if _ours(os.environ.get("VLLM_RPC_BASE_PATH")):
                os.environ.pop("VLLM_RPC_BASE_PATH")  # the engines using it keep their sockets' names
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = await anyio.to_thread.run_sync(lambda: AsyncLLM.from_engine_args(AsyncEngineArgs(**args)))
    with _rpc_lock:
        _live.add(id(llm))
    return llm


class VLLMCore:
    """One ``AsyncLLM`` and its restarts (see the module doc).

    ``args``: the ``AsyncEngineArgs`` fields it was started from (a restart starts the new core
    from them; None: never restarted). ``prime(llm)``: gives a new core what the dead one
    served, before it takes over. ``reset()``: called right after a new core took over."""

    def __init__(
        self,
        llm: Any,
        args: dict[str, Any] | None,
        *,
        max_restarts: int = 3,
        nice: int = 0,
        prime: Callable[[Any], Awaitable[None]] | None = None,
        reset: Callable[[], None] | None = None,
    ) -> None:
        self.llm = llm
        self.args = args
        self.max_restarts = max_restarts
        #: Engine-core restarts so far (each one after vLLM reported the engine dead).
        self.restarts = 0
        #: Which core this is: 0 for the first, one more for each restart.
        self.incarnation = 0
        self._prime = prime
        self._reset = reset
        self._lock = anyio.Lock()
        #: Set once the engine is closing: a core that dies now is not restarted.
        self.closed = False
        self._nice = int(nice)
        #: The pids of the engine core processes (``nice`` applies to them), where found.
        self.engine_pids: list[int] = set_priority(llm, self._nice)

    @property
    def nice(self) -> int:
        """The niceness of the engine core's threads. Settable: raising it needs no privilege,
        lowering it again needs CAP_SYS_NICE (``PermissionError``)."""
        return self._nice

    @nice.setter
    def nice(self, value: int) -> None:
        self.engine_pids = set_priority(self.llm, int(value), force=True)
        self._nice = int(value)

    async def call(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call(llm)`` on the current core, a vLLM failure raised as ``EngineError`` whose
        cause tells :meth:`restarting` whether the core died. The call is watched, and ends
        with ``EngineDeadError`` when the core's process is gone (vLLM never answers a utility
        call sent just as its core died)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        llm, dead, result = self.llm, False, None
        failed: Exception | None = None

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal dead
            while not (dead := not core_alive(llm)):
                await anyio.sleep(0.5)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            try:
                result = await call(llm)
            except Exception as exc:  # noqa: BLE001 - kept out of the task group, which would wrap it in a group
                failed = exc
            finally:
                tg.cancel_scope.cancel()
        if isinstance(failed, EngineError):
            raise failed
        if failed is not None:  # engine failures surface as EngineError, vLLM's own error as the cause
            raise EngineError(f"vLLM {what} failed: {type(failed).__name__}: {failed}") from failed
        if dead:
            raise EngineError(f"vLLM {what} failed: the engine core died") from EngineDeadError()
        return result

    async def restarting(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await fn(*args)``; when it raises ``EngineError`` because the core died, restart
        the core (once, however many calls saw it die) and make the call again."""
        from vllm.v1.engine.exceptions import EngineDeadError

        while True:
            incarnation, llm = self.incarnation, self.llm
            try:
                return await fn(*args)
            except EngineError as exc:
                dead = isinstance(exc.__cause__, EngineDeadError) or getattr(llm, "errored", False)
                if not dead or self.closed:
                    raise
                await self._restart(incarnation, exc)

    async def _restart(self, incarnation: int, exc: EngineError) -> None:
        """Start a new engine core in place of the dead one ``incarnation``; raise ``exc`` when
        the restart budget is spent or the start fails."""
        async with self._lock:
            if self.incarnation != incarnation:
                return  # another call restarted it already
            if self.args is None or self.restarts >= self.max_restarts:
                raise EngineError(f"{exc}; the engine was restarted {self.restarts} times, no more") from exc.__cause__
            self.restarts += 1
            log.warning("the vLLM engine core died (%s); restarting it (%d of at most %d)",
                        exc, self.restarts, self.max_restarts)
            old = self.llm
            with anyio.CancelScope(shield=True):
                llm = await self._replacement(old, exc)
            self.llm = llm
            self.incarnation += 1
            if self._reset is not None:
                self._reset()
            del old  # dropped now, while the interpreter is whole (see ``close``)
            gc.collect()

    async def _replacement(self, old: Any, exc: EngineError) -> Any:
        """Shut the dead core down and start, prime and renice a new one (three tries)."""
        try:
            await anyio.to_thread.run_sync(shut_down, old)
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(3), wait=wait_exponential(1, max=10),
                                               reraise=True):
                with attempt:
                    llm = await start_llm(self.args or {})
            if self._prime is not None:
                await self._prime(llm)
            self.engine_pids = set_priority(llm, self._nice)
        except Exception as start_exc:  # noqa: BLE001
            raise EngineError(f"{exc}; restarting the engine failed: {type(start_exc).__name__}: "
                              f"{start_exc}") from start_exc
        return llm

    async def close(self) -> None:
        """Shut the engine core down (shielded; nothing may be in flight). Idempotent."""
        self.closed = True
        llm, self.llm = self.llm, None
        if llm is None:
            return
        with anyio.CancelScope(shield=True):
            await stop_output_handler(llm)
            await anyio.to_thread.run_sync(shut_down, llm)
        del llm
        gc.collect()


async def stop_output_handler(llm: Any) -> None:
    """Cancel ``AsyncLLM``'s output handler before its shutdown. vLLM stops the engine core
    first and cancels the handler only afterwards; in between, the handler (on this loop,
    which runs while the shutdown waits in a worker thread) finds the core gone and logs an
    ``EngineDeadError`` traceback for a clean close. Nothing is in flight by now."""
    task = getattr(llm, "output_handler", None)
    if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
        return
    task.cancel()
    await asyncio.wait({task})


def shut_down(llm: Any) -> None:
    """``llm.shutdown()``, once. vLLM's ``__del__`` calls it again, and when that runs only at
    interpreter exit (something still holds the engine: a stored traceback's frame is
    enough) it fails with a traceback ("Exception ignored in AsyncLLM.__del__")."""
    llm.shutdown()
    llm.shutdown = _nothing  # an instance attribute: __del__'s self.shutdown() finds it first
    release_rpc_dir(llm)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def core_processes(llm: Any) -> list[Any]:
    """The engine core processes ``llm`` started (``multiprocessing`` handles), if local."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def core_alive(llm: Any) -> bool:
    """False once vLLM has marked ``llm`` dead or one of its engine core processes has exited."""
    if getattr(llm, "errored", False):
        return False
    try:
        return all(p.is_alive() for p in core_processes(llm))
    except (AssertionError, ValueError):  # a handle of another process, or closed: cannot tell
        return True


def set_priority(llm: Any, nice: int, force: bool = False) -> list[int]:
    """Set ``nice`` on every thread of the engine core processes ``llm`` started (not their
    workers: they compute the model); returns their pids. Raising one's own processes'
    niceness needs no privilege. ``nice`` 0 changes nothing unless ``force``."""
    import psutil

    procs = []
    for proc in core_processes(llm):
        try:
            procs.append(psutil.Process(proc.pid))
        except psutil.NoSuchProcess:
            continue
    if not procs:
        log.debug("no local vLLM engine processes found (another executor?): their priority is left as is")
    for p in procs if nice or force else []:
        # Niceness is per thread on Linux and a new thread takes its creator's: a thread born
        # while the list is walked, of a creator not yet reniced, is caught by the next pass.
        for _ in range(5):
            try:
                missed = [t.id for t in p.threads() if _nice_of(t.id) not in (nice, None)]
            except psutil.NoSuchProcess:
                break
            for tid in missed:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            if not missed:
                break
    return [p.pid for p in procs]


def _nice_of(tid: int) -> int | None:
    """A thread's niceness, None once it has exited."""
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None
