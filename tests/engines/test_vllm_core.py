"""``agentenv.engines.vllm_core``: an ``AsyncLLM``'s engine core's life without starting vLLM.

The engine core processes are real child processes (with threads, as vLLM's are), found where
vLLM keeps their handles (``llm.engine_core.resources.engine_manager.processes``) on a
stand-in for ``AsyncLLM``; the stand-in has only what these functions read. A real restart
(a new ``AsyncLLM``) is tested on vLLM itself in test_vllm.py (slow)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from types import SimpleNamespace

import anyio
import psutil
import pytest

from agentenv.engines.vllm_core import VLLMCore, _uses_ray, core_alive, core_processes, own_rpc_dir, release_rpc_dir, \
    set_priority, shut_down, stop_output_handler
from agentenv.errors import EngineError

from ..waiting import wait_for

pytestmark = pytest.mark.anyio


def _busy(threads: int) -> None:
    """An engine core's stand-in process: a few threads, then it waits to be killed."""
    done = threading.Event()
    for _ in range(threads):
        threading.Thread(target=done.wait, daemon=True).start()
    done.wait()


class AsyncLLM:
    """What vllm_core reads of vLLM's ``AsyncLLM``: its engine core processes' handles,
    ``errored``, ``shutdown`` and ``output_handler``."""

    def __init__(self, processes: list) -> None:
        manager = SimpleNamespace(processes=processes)
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))
        self.errored = False
        self.shutdowns = 0
        self.output_handler = None

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def cores():
    """Two running engine-core processes of three threads each; killed at the end."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_busy, args=(2,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        wait_for(lambda p=p: len(psutil.Process(p.pid).threads()) == 3, "the core's threads run")
    yield procs
    for p in procs:
        if p._popen is not None and p.is_alive():
            p.kill()
            p.join()


def nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t.id) for t in psutil.Process(pid).threads()}


#: This process's niceness (the tests may run niced), which its children start with; raising
#: niceness needs no privilege, lowering it does, so the tests only raise it.
BASE = os.getpriority(os.PRIO_PROCESS, 0)


def test_core_processes_are_found_where_vllm_keeps_them_and_dead_when_one_exits(cores):
    llm = AsyncLLM(cores)
    assert core_processes(llm) == cores and core_alive(llm)
    assert core_processes(SimpleNamespace()) == [] and core_alive(SimpleNamespace())  # another executor: no handles
    llm.errored = True  # vLLM marked it dead
    assert not core_alive(llm)
    llm.errored = False
    cores[1].kill()
    cores[1].join()
    assert not core_alive(llm)
    cores[1].close()  # a closed handle cannot tell: the core is taken as alive, not restarted on a guess
    assert core_alive(AsyncLLM([cores[1]]))


@pytest.mark.skipif(BASE > 16, reason="no room to raise this process's niceness")
def test_every_thread_of_every_core_gets_the_niceness_and_zero_changes_nothing(cores):
    llm = AsyncLLM(cores)
    assert set_priority(llm, 0) == [p.pid for p in cores]
    assert all(nices(p.pid) == {BASE} for p in cores)
    assert set_priority(llm, BASE + 2) == [p.pid for p in cores]
    assert all(nices(p.pid) == {BASE + 2} for p in cores) and nices(os.getpid()) == {BASE}  # not this process
    assert set_priority(llm, 0) and all(nices(p.pid) == {BASE + 2} for p in cores)  # 0 leaves it
    assert set_priority(SimpleNamespace(), 5) == []


@pytest.mark.skipif(BASE > 16, reason="no room to raise this process's niceness")
def test_a_core_is_reniced_when_taken_and_when_its_niceness_is_set(cores):
    core = VLLMCore(AsyncLLM(cores), None, nice=BASE + 1)
    assert core.engine_pids == [p.pid for p in cores] and core.nice == BASE + 1
    assert all(nices(p.pid) == {BASE + 1} for p in cores)
    core.nice = BASE + 3
    assert core.nice == BASE + 3 and all(nices(p.pid) == {BASE + 3} for p in cores)


def test_shut_down_calls_shutdown_once_so_vllms_del_finds_nothing_to_do():
    llm = AsyncLLM([])
    shut_down(llm)
    llm.shutdown()  # what vLLM's __del__ does
    assert llm.shutdowns == 1


async def test_the_output_handler_is_cancelled_before_the_shutdown():
    llm = AsyncLLM([])
    await stop_output_handler(llm)  # none: nothing to do
    llm.output_handler = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    await stop_output_handler(llm)
    assert llm.output_handler.cancelled()
    await stop_output_handler(llm)  # done already: nothing to do


async def test_a_call_answers_or_fails_as_an_engine_error_and_one_the_dead_core_never_answers_ends():
    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineDeadError

    core = VLLMCore(AsyncLLM([]), None)

    async def pause(llm):
        return "paused"

    async def broken(llm):
        raise ValueError("bad request")

    assert await core.call("pause", pause) == "paused"
    with pytest.raises(EngineError, match="vLLM pause failed: ValueError: bad request") as caught:
        await core.call("pause", broken)
    assert isinstance(caught.value.__cause__, ValueError)

    async def ours(llm):
        raise EngineError("said by the engine")

    with pytest.raises(EngineError, match="^said by the engine$"):  # an EngineError passes as it is
        await core.call("pause", ours)

    async def unanswered(llm):
        llm.errored = True  # the core dies while the call waits
        await anyio.sleep_forever()

    with anyio.fail_after(60):
        with pytest.raises(EngineError, match="vLLM add_lora failed: the engine core died") as caught:
            await core.call("add_lora", unanswered)
    assert isinstance(caught.value.__cause__, EngineDeadError)


async def test_a_dead_core_is_not_restarted_without_its_arguments_budget_or_while_closing():
    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineDeadError

    llm = AsyncLLM([])
    reset = []
    core = VLLMCore(llm, None, reset=lambda: reset.append(True))
    calls = []

    async def dies():
        calls.append(1)
        raise EngineError("vLLM generate failed: the engine core died") from EngineDeadError()

    with pytest.raises(EngineError, match="the engine core died; the engine was restarted 0 times, no more"):
        await core.restarting(dies)
    assert calls == [1] and core.restarts == 0 and core.incarnation == 0 and reset == []

    core = VLLMCore(llm, {"model": "unused"}, max_restarts=0)
    with pytest.raises(EngineError, match="restarted 0 times, no more"):
        await core.restarting(dies)

    async def refused():
        raise EngineError("vLLM generate failed: ValueError: bad")

    core = VLLMCore(llm, {"model": "unused"})
    with pytest.raises(EngineError, match="^vLLM generate failed: ValueError: bad$"):  # alive: not restarted
        await core.restarting(refused)
    await core.close()
    assert core.closed and core.llm is None and llm.shutdowns == 1
    await core.close()  # idempotent
    assert llm.shutdowns == 1
    with pytest.raises(EngineError, match="^vLLM generate failed: the engine core died$"):  # closing: no restart
        await core.restarting(dies)
    assert core.restarts == 0


@pytest.fixture
def temp_dir(monkeypatch):
    """A short temp dir of the test's own for ``tempfile``, and no VLLM_RPC_BASE_PATH (restored
    after the test)."""
    import tempfile

    base = tempfile.mkdtemp(dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", base)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "")
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    yield base
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def test_vllms_sockets_go_to_one_directory_of_this_process(temp_dir):
    path = own_rpc_dir()
    assert os.path.isdir(path) and os.path.dirname(path) == temp_dir
    assert os.path.basename(path).startswith(f"agentenv-vllm-{os.getpid()}-")
    assert os.environ["VLLM_RPC_BASE_PATH"] == path  # what vLLM and its child processes read
    assert own_rpc_dir() == path  # one a process


def test_a_directory_inherited_from_another_process_is_replaced_and_the_users_own_kept(temp_dir, monkeypatch):
    parents = os.path.join(temp_dir, f"agentenv-vllm-{os.getpid() + 1}-abcdefgh")  # that process removes it
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", parents)
    path = own_rpc_dir()
    assert path != parents and os.path.basename(path).startswith(f"agentenv-vllm-{os.getpid()}-")
    users = os.path.join(temp_dir, "sockets")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", users)
    assert own_rpc_dir() == users and os.environ["VLLM_RPC_BASE_PATH"] == users


def test_a_temp_dir_too_deep_for_a_sockets_path_keeps_vllms_default(temp_dir, monkeypatch):
    """A Unix socket's path is at most 107 characters: vLLM's names (a uuid4, 36) in the
    directory would not fit, so vLLM names them in the temp dir, as it does by default."""
    import tempfile

    deep = os.path.join(temp_dir, "d" * (107 - len(temp_dir) - 40))
    os.mkdir(deep)
    monkeypatch.setattr(tempfile, "tempdir", deep)
    assert len(deep) + 1 + 36 <= 107  # vLLM's own names fit; the directory's would not
    assert own_rpc_dir() == deep
    assert "VLLM_RPC_BASE_PATH" not in os.environ and os.listdir(deep) == []


def test_the_directory_goes_with_the_last_engine_and_a_ray_engine_keeps_vllms_default(temp_dir, monkeypatch):
    from agentenv.engines import vllm_core

    path = own_rpc_dir()
    first, second = object(), object()  # two engines' AsyncLLMs, the process's only ones
    monkeypatch.setattr(vllm_core, "_live", {id(first), id(second)})
    release_rpc_dir(first)
    assert os.path.isdir(path) and os.environ["VLLM_RPC_BASE_PATH"] == path  # the second still runs
    release_rpc_dir(second)
    assert not os.path.exists(path) and "VLLM_RPC_BASE_PATH" not in os.environ
    again = own_rpc_dir()  # a later engine gets a new one
    assert os.path.isdir(again) and again != path
    # vLLM copies its variables to the Ray actors it starts, on nodes where the directory is not.
    assert _uses_ray({"distributed_executor_backend": "ray"}) and _uses_ray({"data_parallel_backend": "ray"})
    assert not _uses_ray({"tensor_parallel_size": 1}) and not _uses_ray({"distributed_executor_backend": "mp"})
