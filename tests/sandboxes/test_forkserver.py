"""The fork server (``forkserver.py``) as the host meets it: a real base server and its
templates, spoken to on their control channels, and real sessions. What is checked is what
the fork server itself decides: how a session's processes are laid out and named, the
scheduling policy they run under, that a session which cannot confine itself never runs
code, that a dead session is reaped at once, the sessions' environment, requests it cannot
serve, and an unisolated session's reaper and working directory."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict

import anyio
import psutil
import pytest

from agentenv.sandboxes.local import LocalSandbox
from agentenv.sandboxes.local.protocol import HEADER, VIOLATION

from ..waiting import DEADLINE_S, until
from .pools import fork_servers

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def servers():
    """One fork-server pool for the module; one template per setup, so a request on a
    template is followed by the next start on the same one."""
    async with fork_servers(spawn_servers=1) as pool:
        yield pool


def process(pid: int) -> psutil.Process | None:
    """``pid``'s process while it runs (None: gone already), to ask later whether it was reaped
    without taking a process that was given the pid since (a busy machine reuses pids) for it."""
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def reaped(proc: psutil.Process | None) -> bool:
    """Gone entirely: not even a zombie waiting for its parent."""
    return proc is None or not proc.is_running()


def exited(proc: psutil.Process | None) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        return reaped(proc) or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def call(stream, code: str, seq: int = 5) -> tuple[int, dict]:
    payload = json.dumps({"code": code, "max_output": 1000}).encode()
    await stream.send(HEADER.pack(len(payload), seq) + payload)
    data = b""
    with anyio.fail_after(DEADLINE_S):
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack(data[:HEADER.size])[0]:
            data += await stream.receive()
    n, got = HEADER.unpack(data[:HEADER.size])
    return got, json.loads(data[HEADER.size:HEADER.size + n])


async def test_a_session_is_a_named_fork_of_its_template_reaped_the_moment_it_ends(servers):
    w = await servers.spawn("SET_UP = 1")
    session = psutil.Process(w.pid)
    template = session.parent()
    await until(lambda: session.name() == "sbx-session", "the session named itself")  # as it confines itself
    assert template.name() == "sbx-template"
    assert template.parent().pid == servers.pid and psutil.Process(servers.pid).name() == "sbx-forkserver"
    with open(f"/proc/{w.pid}/status") as f:
        nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
    assert nspid == [str(w.pid), "1"]  # pid 1 of a pid namespace of its own
    servers.end(w)
    await w.stream.aclose()
    # Its template reaps it as it exits, with no request to wake it.
    await until(lambda: reaped(session), "the ended session reaped by its template")


async def test_sessions_start_with_the_templates_environment_only(servers):
    # Nothing of the host's (the pool's base server already has a clean one): set once in the
    # template, after its setup code, for every session forked from it.
    w = await servers.spawn("import os\nos.environ['SET_BY_SETUP'] = '1'")
    _, answer = await call(w.stream, "import os\nsorted(os.environ.items())")
    assert eval(answer["value"]) == sorted({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
                                            "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
                                            "OMP_NUM_THREADS": "1"}.items()), answer
    servers.end(w)
    await w.stream.aclose()


async def test_a_session_and_what_it_starts_run_under_sched_batch_its_servers_under_the_hosts_policy(servers):
    # Woken by its call or its thaw, a session must not preempt the host's event loop that woke
    # it: SCHED_BATCH, inherited by every process the code starts. The fork server and the
    # templates keep the host's policy (a session start is not delayed to a scheduler tick).
    w = await servers.spawn(None)
    code = ("import os, subprocess, sys\n"
            "child = subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'],"
            " capture_output=True, text=True).stdout\n"
            "(os.sched_getscheduler(0), int(child))")
    _, answer = await call(w.stream, code)
    template = psutil.Process(w.pid).parent()
    try:
        assert eval(answer["value"]) == (os.SCHED_BATCH, os.SCHED_BATCH), answer
        assert os.sched_getscheduler(w.pid) == os.SCHED_BATCH
        mine = os.sched_getscheduler(0)
        assert os.sched_getscheduler(template.pid) == os.sched_getscheduler(servers.pid) == mine != os.SCHED_BATCH
    finally:
        servers.end(w)
        await w.stream.aclose()


async def test_a_session_that_cannot_confine_itself_never_runs_code_and_says_why(servers):
    template = await servers._server_for(None)
    uid = servers._uids.acquire()
    limits = {**asdict(servers.limits), "uid": uid, "gid": uid}
    mine, theirs = socket.socketpair()
    try:
        # A cgroup outside the host's hierarchy: the session cannot join it.
        req = {"op": "spawn", "limits": limits, "isolate": True, "cgroups": ["/etc"], "max_output": 100}
        resp, fds = await template.request(req, [theirs.fileno()])
        theirs.close()
        assert set(resp) == {"pid", "reaper"} and len(fds) == 1  # it was forked
        unconfined = process(resp["pid"])
        stream = await anyio.abc.UNIXSocketStream.from_socket(mine)
        seq, answer = await call(stream, "open('/tmp/ran', 'w').close()\n'ran'")
        assert seq == VIOLATION and answer == {
            "violation": "the session could not be confined: OSError: cgroup /etc is outside /sys/fs/cgroup"}
        await until(lambda: reaped(unconfined), "the unconfined session exited and was reaped")
        await stream.aclose()
        os.close(fds[0])
    finally:
        servers._uids.release(uid, None)
    w = await servers.spawn(None)  # the template serves on
    seq, answer = await call(w.stream, "6 * 7", 9)
    assert (seq, answer["value"]) == (9, "42")
    servers.end(w)
    await w.stream.aclose()


async def test_a_request_the_server_cannot_serve_is_answered_with_an_error_and_it_serves_on(servers):
    template = await servers._server_for(None)
    resp, fds = await template.request({"op": "reboot"})
    assert resp == {"error": "unknown op 'reboot'"} and fds == []
    # A spawn that fails once its session socket is taken (here: no "isolate"; a fork or a
    # working directory that fails goes the same way) closes that socket once: a second close
    # would hit whatever has its number then, the next spawn's socket, and fail that spawn.
    mine, theirs = socket.socketpair()
    resp, fds = await template.request({"op": "spawn"}, [theirs.fileno()])
    theirs.close()
    mine.close()
    assert resp == {"error": "KeyError: 'isolate'"} and fds == []
    for _ in range(2):
        w = await servers.spawn(None)
        assert (await call(w.stream, "6 * 7"))[1]["value"] == "42"
        servers.end(w)
        await w.stream.aclose()


def test_a_host_gone_before_its_answer_ends_the_server_quietly():
    """The host stops (a SIGTERM'd run) while a request is being answered: the server's answer
    finds the channel closed and it exits, with nothing on the stderr it shares with the host's
    command (a traceback there was printed after the command's last line)."""
    import subprocess
    import sys

    from agentenv.sandboxes.local.servers import CLEAN_ENV, FORKSERVER

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-I", str(FORKSERVER), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=CLEAN_ENV, cwd="/", start_new_session=True)
    theirs.close()
    try:
        assert json.loads(mine.recv(1 << 16))["ok"]
        mine.send(json.dumps({"op": "reboot"}).encode())  # answered with an error...
        mine.close()  # ...to a host already gone
        _, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, err.decode()) == (0, "")


async def test_an_unisolated_session_is_a_reaper_and_its_worker_in_the_sessions_cgroups():
    async with LocalSandbox(prewarm=0, isolate=False) as sb:
        s = await sb.session()
        r = await s.run("import os\n(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], os.getppid())")
        workdir, home, tmpdir, reaper = eval(r.value)
        assert workdir == home == tmpdir  # its working directory is its home and its temporary directory
        assert psutil.Process(s.pid).ppid() == reaper  # the reaper is a fork of a template of the base server
        assert os.sched_getscheduler(s.pid) == os.SCHED_BATCH  # as an isolated session's worker
        assert psutil.Process(psutil.Process(reaper).ppid()).ppid() == sb.server_pid
        pids = next(d for d in s._cgroups if "/pids/" in d)
        with open(os.path.join(pids, "cgroup.procs")) as f:
            assert {s.pid, reaper} <= {int(p) for p in f.read().split()}
        worker, reaper_process = process(s.pid), process(reaper)
        await s.aclose()
        await until(lambda: reaped(reaper_process), "the reaper killed and reaped by the fork server")
        await until(lambda: exited(worker), "the worker killed with its session's cgroup")


@pytest.mark.parametrize("end", ["the session", "the pool"])
async def test_an_unisolated_sessions_working_directory_is_removed_when_it_ends(end):
    # The host ends an unisolated session by killing its reaper (which can then remove
    # nothing): its fork server removes the directory when it reaps the reaper, and closing the
    # pool removes the directory all its sessions' were made in.
    async with LocalSandbox(prewarm=0, isolate=False) as sb:
        s = await sb.session()
        workdir = (await s.run("import os\nopen('left', 'w').write('x')\nos.getcwd()")).value.strip("'")
        root = os.path.dirname(workdir)
        assert os.path.basename(root).startswith("agentenv-sbx-") and os.path.isfile(os.path.join(workdir, "left"))
        if end == "the session":
            await s.aclose()
            await until(lambda: not os.path.exists(workdir), f"{workdir} removed")
            assert os.path.isdir(root)  # the pool's, for its next session
    assert not os.path.exists(root)
