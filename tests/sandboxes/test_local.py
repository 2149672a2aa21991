"""The first local sandbox: real worker processes, real timeouts, real crashes."""

import os

import anyio
import psutil
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local import LocalSandbox

from ..cancelling import left_behind
from ..waiting import DEADLINE_S, until, wait_for

pytestmark = pytest.mark.anyio


def gone(pid: int, wait: float = DEADLINE_S) -> bool:
    """Whether ``pid`` exits (or is a zombie) within ``wait`` seconds."""
    def exited() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        wait_for(exited, f"process {pid} exited", timeout=wait)
    except AssertionError:
        return False
    return True


async def test_state_persists_and_trailing_expression_is_shown():
    async with LocalSandbox() as sb:
        s = await sb.session()
        r = await s.run("x = 6 * 7\nprint('hi')\nx + 1")
        assert (r.status, r.stdout, r.value) == ("ok", "hi\n", "43")
        assert (await s.run("x")).value == "42"
        assert (await s.run("None")).value is None
        assert r.render() == "hi\n43"


async def test_exception_comes_back_as_short_traceback():
    async with LocalSandbox() as sb:
        s = await sb.session()
        r = await s.run("def f():\n    return 1/0\nf()")
        assert r.status == "error"
        assert "ZeroDivisionError" in r.error and "worker.py" not in r.error
        assert (await s.run("1 + 1")).value == "2"  # the session survives


async def test_timeout_interrupts_and_keeps_state():
    async with LocalSandbox(default_timeout=0.5) as sb:
        s = await sb.session()
        await s.run("keep = 'me'")
        r = await s.run("while True:\n    pass")
        assert r.status == "timeout" and not r.state_lost
        assert (await s.run("keep")).value == "'me'"


async def test_code_that_ignores_interrupts_is_killed_and_replaced():
    async with LocalSandbox(default_timeout=0.5, kill_grace=0.3) as sb:
        s = await sb.session()
        await s.run("keep = 1")
        pid = s.pid
        r = await s.run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass")
        assert r.status == "timeout" and r.state_lost
        assert gone(pid)
        r2 = await s.run("keep")
        assert r2.status == "error" and "NameError" in r2.error and r2.state_lost


async def test_crash_is_reported_and_the_session_continues():
    async with LocalSandbox() as sb:
        s = await sb.session()
        r = await s.run("import os; os._exit(3)")
        assert r.status == "crashed" and r.state_lost
        assert (await s.run("2 + 2")).value == "4"


async def test_output_is_capped():
    async with LocalSandbox(max_output=100) as sb:
        s = await sb.session()
        r = await s.run("print('a' * 100000)")
        assert r.truncated and len(r.stdout) == 100
        assert "[output truncated]" in r.render()


async def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("AGENTENV_SECRET_TOKEN", "hunter2")
    async with LocalSandbox() as sb:
        s = await sb.session()
        r = await s.run("import os\n'AGENTENV_SECRET_TOKEN' in os.environ, os.getcwd()")
        assert r.value.startswith("(False, ")
        assert r.value == "(False, '/tmp')"  # a private tmpfs as working directory


async def test_invalid_utf8_output_is_sanitised():
    async with LocalSandbox() as sb:
        s = await sb.session()
        r = await s.run("import sys\nprint(b'\\xff\\xfe'.decode('utf-8', 'surrogateescape'))")
        r.render().encode("utf-8")  # must not raise


async def test_setup_code_runs_first():
    async with LocalSandbox() as sb:
        s = await sb.session(setup_code="def helper(n):\n    return n * 2")
        assert (await s.run("helper(21)")).value == "42"


async def test_no_worker_survives_close():
    sb = LocalSandbox()
    sessions = [await sb.session() for _ in range(4)]
    pids = sb.worker_pids
    assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids)
    await sessions[0].aclose()
    await sb.aclose()
    await sb.aclose()  # idempotent
    me = psutil.Process(os.getpid())
    assert not {c.pid for c in me.children(recursive=True)} & set(pids)


async def test_setup_runs_once_and_sessions_fork_the_prepared_state():
    setup = "import time, os\nPREPARED_AT = time.time()\nPREPARED_BY = os.getpid()"
    async with LocalSandbox(prewarm=0) as sb:
        a = await sb.session(setup_code=setup)
        b = await sb.session(setup_code=setup)
        ra, rb = await a.run("PREPARED_AT, PREPARED_BY"), await b.run("PREPARED_AT, PREPARED_BY")
        assert ra.status == "ok" and ra.value == rb.value  # one preparation, copied into both
        assert (await a.run("PREPARED_BY != os.getpid()")).value == "True"


async def test_a_burst_of_starts_for_a_new_setup_makes_at_most_spawn_servers_templates():
    # Starts that find the templates busy queue on them: one template per start would run the
    # setup code 48 times, one after another (~15 starts/s).
    setup = "import os\nPREPARED_BY = os.getpid()"  # the template's pid: one value per template
    async with LocalSandbox(prewarm=0, spawn_servers=2) as sb:
        base = psutil.Process(sb.server_pid)
        before = len(base.children())
        sessions = []

        async def start() -> None:
            sessions.append(await sb.session(setup_code=setup))

        async with anyio.create_task_group() as tg:
            for _ in range(48):
                tg.start_soon(start)
        templates = len(base.children()) - before
        assert 1 <= templates <= 2, f"{templates} templates for one setup"
        values = {(await s.run("PREPARED_BY")).value for s in sessions}
        assert len(values) == templates  # every session forked one of them
        for s in sessions:
            await s.aclose()


@pytest.mark.slow
async def test_a_setup_that_times_out_leaves_the_fork_server_answering_in_order():
    # Requests to a fork server are pipelined and answered in order: the answer to a request
    # whose caller gave up (here the template's setup ran past its timeout) must be dropped,
    # not handed to the next request.
    # The slow setup outlasts the timeout by far; the fast one is far inside it, on any machine.
    async with LocalSandbox(prewarm=0, setup_timeout=10.0) as sb:
        base = psutil.Process(sb.server_pid)
        with pytest.raises(TimeoutError):
            await sb.session(setup_code="import time\ntime.sleep(12)\nSLOW = 1")
        fast = await sb.session(setup_code="FAST = 2")
        assert (await fast.run("FAST")).value == "2"
        assert (await fast.run("'SLOW' in globals()")).value == "False"
        plain = await sb.session()
        assert (await plain.run("'FAST' in globals(), 'SLOW' in globals()")).value == "(False, False)"
        await fast.aclose()
        await plain.aclose()
        # The late template's control socket was closed on arrival: it exits.
        await until(lambda: len(base.children()) <= 2, "the late template exited")


async def test_max_workers_caps_live_sessions():
    async with LocalSandbox(prewarm=0, max_workers=2) as sb:
        a, b = await sb.session(), await sb.session()
        with anyio.move_on_after(0.5) as scope:
            await sb.session()
        assert scope.cancelled_caught
        await a.aclose()
        c = await sb.session()
        assert (await c.run("1")).value == "1"
        await b.aclose()


async def test_prepare_starts_sessions_ahead_and_session_hands_them_out():
    setup = "import os\nPREPARED_IN = os.getpid()"
    async with LocalSandbox(prewarm=0, max_workers=6) as sb:
        base = sb.starts  # the pool's own isolation probe at start
        assert await sb.prepare(setup, 4, wait=True) == 4
        assert sb.starts == base + 4 and len(sb.worker_pids) == 4
        prepared = set(sb.worker_pids)
        sessions = [await sb.session(setup) for _ in range(4)]
        assert sb.starts == base + 4 and {s.pid for s in sessions} == prepared  # no start: handed out
        assert (await sessions[0].run("x = 1\n'PREPARED_IN' in globals()")).value == "True"
        assert (await sessions[1].run("'x' in globals()")).value == "False"  # one worker each
        assert await sb.prepare(setup, 10, wait=True) == 2  # only into free capacity
        assert await sb.prepare(setup, 1, wait=True) == 0
        fifth = await sb.session(setup)
        assert fifth.pid not in prepared and sb.starts == base + 6
        for s in sessions:
            await s.aclose()
        await fifth.aclose()
    for pid in prepared:
        assert gone(pid)


async def test_prepare_in_the_background_and_a_failing_setup():
    async with LocalSandbox(prewarm=0) as sb:
        assert await sb.prepare(None, 3) == 3  # returns at once; the pool's task group starts them
        await until(lambda: len(sb.worker_pids) >= 3, "three sessions prepared in the background")
        idle = list(sb.worker_pids)
        assert await sb.prepare("raise ValueError('no such helper')", 2, wait=True) == 0
        with pytest.raises(SandboxError, match="no such helper"):
            await sb.session("raise ValueError('no such helper')")
        assert sorted(sb.worker_pids) == sorted(idle)
    for pid in idle:  # unused prepared sessions close with the pool
        assert gone(pid)


async def test_refuses_to_run_weaker_than_asked(monkeypatch, tmp_path):
    import agentenv.sandboxes.local

    monkeypatch.setattr(agentenv.sandboxes.local, "CGROUP_V1", tmp_path)  # a host without cgroup v1
    with pytest.raises(SandboxError, match="allow_unisolated"):
        async with LocalSandbox():
            pass
    with pytest.warns(UserWarning, match="WEAKER isolation: no writable cgroup v1 pids/memory/cpu"):
        async with LocalSandbox(allow_unisolated=True, prewarm=0) as sb:
            s = await sb.session()
            assert (await s.run("import os\nos.getpid()")).value == "1"  # namespaces still apply


def test_workers_die_with_their_parent(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import anyio, sys\n"
        "from agentenv.sandboxes.local import LocalSandbox\n"
        "async def main():\n"
        "    sb = LocalSandbox(prewarm=0)\n"
        "    s = await sb.session()\n"
        "    await s.run('1')\n"
        "    print(s.pid, sb.server_pid, flush=True)\n"
        "    await anyio.sleep(60)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    worker, server = map(int, proc.stdout.readline().split())
    assert psutil.pid_exists(worker) and psutil.pid_exists(server)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone(server) and gone(worker)


async def test_a_full_pool_hands_over_prewarmed_sessions_instead_of_deadlocking():
    async with LocalSandbox(max_workers=3, prewarm=2) as sb:
        # The pool's own prewarm fills two of the three slots.
        await until(lambda: len(sb.ready_pids) == 2, "two sessions prewarmed")
        held = []
        with anyio.fail_after(DEADLINE_S):
            # Five sessions through a three-slot pool: each takes a ready one or a free slot,
            # a different setup evicts a prewarmed session, and a caller that finds the pool
            # full waits until one is closed.
            held.append(await sb.session())
            held.append(await sb.session("x = 1"))
            held.append(await sb.session())
            async with anyio.create_task_group() as tg:
                got = []

                async def take():
                    got.append(await sb.session())

                tg.start_soon(take)
                await anyio.sleep(0.3)
                assert not got  # full: it waits
                await held.pop().aclose()
            held += got
        assert len(sb.worker_pids) <= 3
        assert (await held[1].run("x")).value == "1"
        for s in held:
            await s.aclose()


@pytest.mark.parametrize("setup, why", [("import os\nos._exit(3)", "exited with status 3"),
                                        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                                         "killed by SIGKILL")])
async def test_a_setup_that_kills_its_process_is_a_setup_error_and_the_server_lives_on(setup, why):
    # The template's death is the setup's error, not the fork server's: the server is healthy
    # and is neither restarted nor reported gone.
    async with LocalSandbox(prewarm=0) as sb:
        server = sb.server_pid
        with pytest.raises(SandboxError, match=f"environment setup code failed: .*{why}"):
            await sb.session(setup_code=setup)
        assert sb.server_pid == server and sb.restarts == 0
        s = await sb.session(setup_code="OK = 1")
        assert (await s.run("OK")).value == "1"
        await s.aclose()


@pytest.mark.parametrize("allow_unisolated", [False, True])
async def test_a_fork_server_that_dies_during_the_isolation_check_is_a_clear_error(allow_unisolated):
    # The check's own start is not retried on a new server (that server was never checked),
    # and a crash must never read as a host without isolation either, so allow_unisolated does
    # not turn it into an unisolated pool.
    class DiesAtTheCheck(LocalSandbox):
        async def _probe(self) -> None:
            proc = psutil.Process(self.server_pid)
            proc.kill()
            proc.wait(10)
            await super()._probe()

    sb = DiesAtTheCheck(allow_unisolated=allow_unisolated)
    with pytest.raises(SandboxError, match="fork server died during its first session start"):
        await sb.start()
    assert sb.isolate
    with pytest.raises(SandboxError, match="closed"):
        await sb.session()
    fresh = LocalSandbox()
    async with fresh:
        s = await fresh.session()
        assert (await s.run("1 + 1")).value == "2"
        await s.aclose()


async def test_no_session_is_handed_out_before_the_isolation_check_completes():
    # A start cancelled during the check leaves the pool unchecked: the next session() runs
    # the check again before it hands anything out.
    class CancelledCheck(LocalSandbox):
        checks = 0
        scope: anyio.CancelScope

        async def _probe(self) -> None:
            self.checks += 1
            if self.checks == 1:
                self.scope.cancel()
                await anyio.lowlevel.checkpoint()
            await super()._probe()

    sb = CancelledCheck(prewarm=0)
    try:
        with anyio.CancelScope() as sb.scope:
            await sb.session()
        assert sb.scope.cancelled_caught and sb.checks == 1 and sb.worker_pids == []
        s = await sb.session()
        assert sb.checks == 2 and (await s.run("import os\nos.getpid()")).value == "1"
    finally:
        await sb.aclose()


async def test_code_starved_of_cpu_at_its_deadline_gets_its_grace_in_cpu_and_keeps_its_state():
    """A session capped at 1 % of a CPU is interrupted at its deadline and needs two graces' CPU
    (10 ms) to unwind: a kill grace of wall time (0.5 s: 5 ms of CPU) would kill it; graces it
    spends waiting for the CPU are followed by more (GRACE_STRETCH: 4, 20 ms of CPU), so it
    unwinds and keeps its state. A session that sleeps through its grace (a stalled reader) gets
    no more: test_deadlines. The unwinding's work is sized to this machine's speed (a fixed sum
    took 10 ms on one VM and 21 ms on another, past the four graces)."""
    import time

    from agentenv.sandboxes.local.limits import Limits
    from agentenv.sandboxes.local.sessions import GRACE_STRETCH

    def cpu_s(n: int) -> float:
        t = time.process_time()
        sum(range(n))
        return time.process_time() - t

    per_1e5 = min(cpu_s(10**5) for _ in range(5))
    n = int(10**5 * 2 * 0.5 * 0.01 / per_1e5)  # two graces of 0.5 s at 1 % of a CPU
    code = f"try:\n    while True:\n        pass\nexcept KeyboardInterrupt:\n    unwound = sum(range({n}))"
    async with LocalSandbox(limits=Limits(cpus=0.01), max_workers=1, kill_grace=0.5) as sb:
        s = await sb.session()
        await s.run("x = 41", timeout=30)
        if s._cpu() is None:
            pytest.skip("no cgroup v2 cpu.stat/cpu.pressure for the session on this host")
        r = await s.run(code, timeout=1)
        assert (r.status, r.state_lost) == ("timeout", False), r
        assert 1 + 0.5 < r.duration_s < 1 + GRACE_STRETCH * 0.5 + 1, r  # it needed more than one grace
        assert (await s.run("x + 1", timeout=30)).value == "42"


def test_a_start_cancelled_at_any_point_leaves_no_fork_server_behind():
    """A run cancelled while its sandbox starts (the fork server spawning, saying hello, the
    isolation probe) closes the sandbox: no fork server is left running, or unreaped (before,
    a start cancelled after the spawn left it running: 11 of 13 here)."""
    start = "async with LocalSandbox(prewarm=0):\n        await anyio.sleep_forever()"
    assert left_behind("from agentenv.sandboxes.local import LocalSandbox", start, range(1, 40, 3)) == 0
