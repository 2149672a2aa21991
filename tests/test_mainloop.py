"""Stopping a run. A SIGTERM to the CLI stops the running work (``mainloop.interrupt``): the
code it lands in runs on to its next ``await``, the work unwinds through its clean-up, and
``mainloop.run`` raises KeyboardInterrupt once the loop has closed, whether or not SIGINT was
ignored when the process started and whenever the signal comes. A run stopped before its first
record leaves no files, and a stop that hangs says where."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

from agentenv import mainloop
from agentenv.cli import _sigterm_as_ctrl_c

from .waiting import DEADLINE_S, ended, wait_for

# The CLI started with SIGINT ignored, as a job started with ``&`` from a script is (and as
# CI runners start theirs): Python then keeps SIGINT ignored and asyncio sets no Ctrl-C handler.
SIGINT_IGNORED = ["-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "os.execv(sys.executable, [sys.executable, '-m', 'agentenv.cli', *sys.argv[1:]])"]


def rollout(server: socket.socket, out: Path, model_dir: str, *args: str, sigint: str = "default",
            **popen) -> subprocess.Popen:
    """``agentenv rollout`` of one program on the openai engine, whose server is ``server``: one
    that takes connections and never answers, so a signal reaches the run before any program
    could start."""
    cli = ["-m", "agentenv.cli"] if sigint == "default" else SIGINT_IGNORED
    return subprocess.Popen(
        [sys.executable, *cli, "rollout", "--tasks", "1", "--group-size", "1", "--out", str(out), "--model", model_dir,
         "--no-progress", "--engine", "openai", "--base-url", f"http://127.0.0.1:{server.getsockname()[1]}", *args],
        text=True, **popen)


@pytest.fixture(params=["default", "ignored"])
def sigint(request):
    """SIGINT as Python sets it, or ignored (as it is in a job started with ``&`` from a
    script: asyncio's runner then installs no Ctrl-C handler)."""
    earlier = signal.getsignal(signal.SIGINT)
    if request.param == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield request.param
    signal.signal(signal.SIGINT, earlier)


def test_sigterm_lets_the_code_it_lands_in_run_on_and_the_work_unwind(sigint):
    seen: list[str] = []

    async def work() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, between two lines of plain code
            seen.append("the line after the signal")
            await anyio.sleep(DEADLINE_S)
            seen.append("slept")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0)  # a clean-up that awaits still runs
                seen.append("cleaned up")

    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(work)
    assert seen == ["the line after the signal", "cleaned up"]


def test_a_stop_asked_for_while_the_loop_closes_waits_for_it_to_close(sigint):
    """The signal comes after the work ended, while the loop runs its last callbacks: the stop
    is kept for after the loop, and every worker thread the run started is told to stop."""
    async def work() -> None:
        # Registered before anyio's own callback that stops its worker thread, so it runs first.
        asyncio.current_task().add_done_callback(lambda _: signal.raise_signal(signal.SIGTERM))
        await anyio.to_thread.run_sync(lambda: None)

    before = set(threading.enumerate())
    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(work)
    for thread in set(threading.enumerate()) - before:
        if thread.name == "AnyIO worker thread":
            thread.join(DEADLINE_S)
            assert not thread.is_alive(), "a worker thread of the run was never told to stop"


def test_a_second_sigterm_stops_harder_and_none_outside_a_run_is_stopped(sigint):
    async def stubborn() -> None:
        with anyio.CancelScope(shield=True):  # a stop that hangs: the second signal ends it
            signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(0)
            signal.raise_signal(signal.SIGTERM)
            await anyio.sleep(DEADLINE_S)

    with _sigterm_as_ctrl_c(), pytest.raises(KeyboardInterrupt):
        mainloop.run(stubborn)
    assert not mainloop.interrupt()  # no work runs now: nothing to stop


@pytest.mark.parametrize("when, sigint", [("connected", "default"), ("connected", "ignored"), ("starting", "ignored")])
def test_sigterm_before_the_first_record_leaves_no_files(tmp_path, model_dir, when, sigint):
    """SIGTERM stops a run as Ctrl-C does: one that had not logged a program yet removes the
    output and the log it created, whether or not SIGINT was ignored when it started, and
    whether the signal came once its engine asked the server for its models (``connected``) or
    as soon as its log existed, while it still started (``starting``)."""
    server = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, unanswered
    out = tmp_path / "r.jsonl"
    proc = rollout(server, out, model_dir, sigint=sigint, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    conn = None
    try:
        if when == "connected":
            server.settimeout(DEADLINE_S)
            conn, _ = server.accept()
            assert Path(f"{out}.log").exists()
        else:
            wait_for(lambda: Path(f"{out}.log").exists(), "the run's log", interval=0.001,
                     unless=lambda: proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        _, err = ended(proc, "the rollout stopped after SIGTERM")
    finally:
        if conn is not None:
            conn.close()
        server.close()
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err.strip().splitlines()[-1]) == (143, "agentenv: terminated"), err
    assert list(tmp_path.iterdir()) == []


def test_a_stop_that_hangs_after_sigterm_says_where_it_hangs(tmp_path, model_dir):
    """A run whose stop never ends (here its environment's ``aclose`` waits forever) writes,
    a while after SIGTERM, its threads' and its tasks' stacks to stderr: the log of whoever sent
    the signal names the hang."""
    (tmp_path / "stuck.py").write_text(
        "import anyio\nfrom agentenv.envs.retool_math import RetoolMathEnv\n\n\n"
        "class Stuck(RetoolMathEnv):\n    async def aclose(self):\n        await anyio.Event().wait()\n")
    server = socket.create_server(("127.0.0.1", 0))
    proc = rollout(server, tmp_path / "r.jsonl", model_dir, "--env", f"{tmp_path}/stuck.py:Stuck",
                   stderr=subprocess.PIPE, env={**os.environ, "AGENTENV_STOPPING_REPORT_S": "0.5"})
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        server.settimeout(DEADLINE_S)
        conn, _ = server.accept()
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any("in aclose" in line for line in err), "the report of where the stop hangs")
        conn.close()
    finally:
        server.close()
        proc.kill()
        proc.wait()
    text = "".join(err)
    assert "agentenv: still stopping 0.5 s after SIGTERM; its threads:" in text and "agentenv: its " in text
    assert 'stuck.py", line 7, in aclose' in text, text


def test_the_stopping_report_follows_a_task_into_the_context_manager_it_enters(capsys):
    """A task stuck in ``async with`` of an asynccontextmanager awaits the generator's step, which
    does not name the generator: the report goes on into it, down to what it awaits."""
    import asyncio
    import contextlib

    from agentenv.cli import _print_tasks

    @contextlib.asynccontextmanager
    async def opening():
        await asyncio.Event().wait()
        yield

    async def run() -> None:
        async with opening():
            pass

    async def report() -> None:
        task = asyncio.create_task(run(), name="opening-run")
        for _ in range(3):
            await asyncio.sleep(0)  # the task reaches its wait
        _print_tasks()
        task.cancel()

    asyncio.run(report())
    text = capsys.readouterr().err
    stuck = text[text.index("task opening-run:"):]
    assert "in run" in stuck and "in __aenter__" in stuck and "in opening" in stuck and "in wait" in stuck, text
