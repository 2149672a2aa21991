"""Escapes the third independent audit found (issue 35), one class per section, each with
cases of our own: every one must fail closed, leave the host and the sibling sessions
unchanged and the pool healthy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import anyio
import psutil
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local import LocalSandbox

from .hostile import (FORGE, FRAME, LIBC, LIMITS, SIBLING_CHECK, SIBLING_OK, SPIN, assert_host_unchanged, check_sibling,
                      host_state, hostile, private_uids, proc_path, sibling, sleep_tag, sleepers, spinners, syscall,
                      wait_for, x86_64)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


# -- 10. malformed answer frames (issue 35) ---------------------------------------------------
# Whatever the shape of a frame the code writes for its own call, the call is an error with
# the session killed (state lost), never an exception out of ``run()``.
DEEP = b"[" * 2048 + b"]" * 2048


def answer(**fields) -> bytes:
    base = {"status": "ok", "stdout": "", "stderr": "", "value": None, "error": None, "truncated": False}
    return json.dumps({**base, **fields}).encode()


MALFORMED_FRAMES = {
    "list": b"[1, 2, 3]",
    "number": b"42",
    "string": b'"ok"',
    "null": b"null",
    "true": b"true",
    "deep_list": DEEP,
    "deep_object": b'{"a":' * 2000 + b"1" + b"}" * 2000,
    "deep_in_a_field": b'{"status": "ok", "stdout": ' + DEEP + b"}",
    "not_utf8": b"\xff\xfe\xfa" * 50,
    "truncated_json": answer()[:-3],
    "empty": b"",
    "huge_int": b'{"status": "ok", "stdout": ' + b"9" * 5000 + b"}",
    "status_list": answer(status=["ok"]),
    "status_unknown": answer(status="fine"),
    "stdout_int": answer(stdout=7),
    "value_object": answer(value={"x": 1}),
    "error_list": answer(status="error", error=["boom"]),
    "truncated_string": answer(truncated="yes"),
    "nan_field": b'{"status": "ok", "stdout": NaN}',
}


@pytest.mark.parametrize("payload", list(MALFORMED_FRAMES.values()), ids=list(MALFORMED_FRAMES))
async def test_a_malformed_answer_frame_kills_the_session_and_is_an_error(sandbox, payload):
    r = await hostile(sandbox, FRAME + f"frame({payload!r})\n'genuine'", session_survives=False)
    assert r.status == "error" and r.state_lost and "SandboxError" in r.error and "malformed" in r.error, r


VIOLATIONS = {"list": b"[1]", "deep": DEEP, "reason_not_text": b'{"violation": [1, 2]}', "not_json": b"\x00" * 10}


@pytest.mark.parametrize("payload", list(VIOLATIONS.values()), ids=list(VIOLATIONS))
async def test_a_malformed_violation_frame_kills_the_session_and_is_an_error(sandbox, payload):
    r = await hostile(sandbox, FRAME + f"frame({payload!r}, -1)\n'genuine'", session_survives=False)
    assert r.status == "error" and r.state_lost and "malformed violation" in r.error, r


async def test_a_forged_violation_frame_is_an_error_with_its_reason_capped(sandbox):
    payload = json.dumps({"violation": "v" * 3000}).encode()
    r = await hostile(sandbox, FRAME + f"frame({payload!r}, -1)\n'genuine'", session_survives=False)
    assert r.status == "error" and r.state_lost and "v" * 300 in r.error and "v" * 301 not in r.error


# -- 11. signals only through pidfds, never to a pid the kernel may have reused (issue 35) ----
def reaped(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return True
    return False


def start_with_pid(pid: int) -> subprocess.Popen | None:
    """A host process (a group and session leader, as daemons are) that takes ``pid``, freed
    by a reaped worker: the kernel hands out the pid after ``ns_last_pid``. Another process
    on a busy machine may take it first: tried a few times."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


async def worker_vanishes(s, how: str) -> subprocess.Popen:
    """Make the session's worker die and be reaped by its fork server without the pool
    noticing, then give its pid to an unrelated host process (returned)."""
    pid = s.pid
    fd = os.pidfd_open(pid)  # the test's own handle, opened while the worker lives
    try:
        if how == "killed from outside":  # the OOM killer, an operator
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:  # its own code exits it from a thread (the result is whatever it is)
            await s.run("import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
                        "import time\ntime.sleep(5)", timeout=10)
        await wait_for(lambda: reaped(fd), "the dead worker reaped by its fork server")
    finally:
        os.close(fd)
    impostor = start_with_pid(pid)
    if impostor is None:
        pytest.skip("could not start a process with the freed pid (a busy machine)")
    return impostor


async def act(sandbox, s, what: str) -> None:
    if what == "close the session":
        await s.aclose()
    elif what == "call it again":
        r = await s.run("'again'", timeout=10)
        assert r.state_lost and (r.status == "crashed" or r.value == "'again'"), r
        await s.aclose()
    else:  # close the whole pool
        await sandbox.aclose()


@pytest.mark.parametrize("how", ["killed from outside", "exits itself"])
@pytest.mark.parametrize("what", ["close the session", "call it again", "close the pool"])
async def test_a_reused_pid_of_a_dead_worker_is_never_signalled(sandbox, how, what):
    before = host_state()
    async with LocalSandbox(limits=LIMITS, prewarm=0) as sb:
        s = await sb.session()
        assert (await s.run("x = 1")).status == "ok"
        impostor = await worker_vanishes(s, how)
        try:
            await act(sb, s, what)
            assert impostor.poll() is None, "the pool signalled a host process that took a dead worker's pid"
        finally:
            impostor.kill()
            impostor.wait()
    assert_host_unchanged(before)
    await check_sibling(sandbox)


@pytest.mark.parametrize("what", ["close the session", "call it again"])
async def test_a_reused_pid_is_never_signalled_by_an_unisolated_pool(sandbox, what):
    """Without namespaces a session is a reaper and a worker (two pids) in the session's cgroups."""
    async with LocalSandbox(limits=LIMITS, prewarm=0, isolate=False) as sb:
        s = await sb.session()
        impostor = await worker_vanishes(s, "killed from outside")
        try:
            await act(sb, s, what)
            assert impostor.poll() is None
        finally:
            impostor.kill()
            impostor.wait()
    await check_sibling(sandbox)


async def test_an_unisolated_session_is_killed_whole_by_its_cgroup(sandbox):
    """Its processes are no pid namespace that dies with the worker: the cgroup's kill takes
    every one (a setsid'd, double-forked sleeper too), with no pid read or signalled."""
    tag = sleep_tag(4343)
    async with LocalSandbox(limits=LIMITS, prewarm=0, isolate=False) as sb:
        s = await sb.session()
        r = await s.run(f"import subprocess\np = subprocess.Popen(['sh', '-c', 'sleep {tag} & wait'], "
                        "start_new_session=True)\np.pid")
        assert r.status == "ok"
        await wait_for(lambda: sleepers(tag), "the session's sleeper started")
        await s.aclose()
        await wait_for(lambda: not sleepers(tag), "every process of the closed session gone")
    await check_sibling(sandbox)


async def test_the_host_holds_no_inheritable_descriptor_of_a_session(sandbox):
    s = await sandbox.session()
    try:
        fds = [s._worker.pidfd, s._worker.stream._raw_socket.fileno()]
        assert all(not os.get_inheritable(fd) for fd in fds)
    finally:
        await s.aclose()


# -- 12. host file activity is not observable (issue 35) --------------------------------------
# The system dirs are the host's own inodes, read-only: a watch on them would report the host's
# accesses as they happen. Every watch interface is refused.
@x86_64
@pytest.mark.parametrize("nr,args", [(253, ()), (294, (0,)), (294, (0o4000,)), (300, (0, 0)),
                                     (254, (3, b"/etc", 0xFFF))],
                         ids=["inotify_init", "inotify_init1", "inotify_init1_nonblock", "fanotify_init",
                              "inotify_add_watch"])
async def test_file_watch_syscalls_are_denied(sandbox, nr, args):
    r = await hostile(sandbox, syscall(nr, *args))
    assert r.value == "(-1, 1)"


@pytest.mark.parametrize("path", ["/etc", "/usr/bin", "/tmp"])
async def test_dnotify_on_a_directory_is_denied(sandbox, path):
    # fcntl(F_NOTIFY): a signal whenever a file in the directory is accessed or changed.
    code = (f"import fcntl, os\nfd = os.open({path!r}, os.O_RDONLY)\ntry:\n"
            "    fcntl.fcntl(fd, 1026, 0x80000000 | 0x3F)\n    out = 'WATCHING'\n"
            "except OSError as e:\n    out = e.errno\nout")
    r = await hostile(sandbox, code)
    assert r.value == "1", r


async def test_a_lease_on_a_host_file_is_denied(sandbox):
    code = ("import fcntl, os\nfd = os.open('/etc/hostname', os.O_RDONLY)\ntry:\n"
            "    fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)\n    out = 'LEASED'\nexcept OSError as e:\n    out = "
            "e.errno\nout")
    r = await hostile(sandbox, code)
    assert r.value == "1", r


async def test_host_file_reads_are_not_seen_by_a_session(sandbox):
    # The host reads and touches files under /etc while a session looks for any way to see it.
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nseen = []\n"
            "for call in (lambda: libc.inotify_init(), lambda: libc.inotify_init1(0)):\n"
            "    ctypes.set_errno(0)\n    seen.append((call(), ctypes.get_errno()))\nseen")
    s = await sandbox.session()
    try:
        r = await s.run(code)
        for _ in range(3):
            open("/etc/hostname").read()
            open("/etc/passwd").read()
        assert r.value == "[(-1, 1), (-1, 1)]", r
    finally:
        await s.aclose()
    await check_sibling(sandbox)


@x86_64
@pytest.mark.parametrize("nr,args", [(206, (65536, 0)), (206, (1, 0))], ids=["io_setup_all", "io_setup_one"])
async def test_linux_aio_a_machine_wide_quota_is_denied(sandbox, nr, args):
    r = await hostile(sandbox, LIBC + f"ctx = ctypes.c_ulong(0)\nctypes.set_errno(0)\n"
                                      f"(libc.syscall({nr}, {args[0]}, ctypes.byref(ctx)), ctypes.get_errno())")
    assert r.value == "(-1, 1)"


# -- 13. per-user kernel quotas are per session: a uid of its own (issue 35) -----------------
HOLD = """
import os, time
def hold(state):
    # Written whole, then renamed into place: the host polls for the name and reads it at once.
    with open('/tmp/ready.part', 'w') as f:
        f.write(repr(state))
    os.rename('/tmp/ready.part', '/tmp/ready')
    end = time.monotonic() + 60
    while not os.path.exists('/tmp/go') and time.monotonic() < end:
        time.sleep(0.01)
"""
PIPE_HOG = HOLD + """
import fcntl
def hog(report):
    held = []
    while True:
        try:
            r, w = os.pipe()
        except OSError:
            os.write(report, b'f')  # out of fds before the quota: not spent by this one
            return held
        held.append((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)
        except OSError:
            os.write(report, b's')  # EPERM: this uid's pipe pages are spent
            return held
status_r, status_w = os.pipe()
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        held = hog(status_w)
        while not os.path.exists('/tmp/go'):
            time.sleep(0.01)
        os._exit(0)
    kids.append(pid)
got = b''.join(os.read(status_r, 1) for _ in kids)
hold(b's' in got)
for pid in kids:
    os.waitpid(pid, 0)
b's' in got
"""
INFLIGHT_HOG = HOLD + """
import errno, socket
a, b = socket.socketpair()
a.setblocking(False)
sent, why = 0, None
while why is None:
    try:
        socket.send_fds(a, [b'x'], [b.fileno()])
        sent += 1
    except OSError as e:
        why = e.errno
hold((sent, why))
(sent, why)
"""


async def while_held(sandbox, code: str):
    """Run ``code`` in a session until it holds what it took (it writes /tmp/ready), check a
    sibling session meanwhile, then let it finish (the host writes /tmp/go into its /tmp)."""
    s = await sandbox.session()
    try:
        async with anyio.create_task_group() as tg:
            out = {}

            async def run():
                out["r"] = await s.run(code, timeout=90)

            tg.start_soon(run)
            await wait_for(lambda: os.path.exists(proc_path(s.pid, "/tmp/ready")), "the hog holds its quota",
                           timeout=60)
            state = open(proc_path(s.pid, "/tmp/ready")).read()
            try:
                await check_sibling(sandbox)
                other = await sandbox.session()
                try:
                    r = await other.run(SIBLING_CHECK.replace("sibling_token", "'sibling'"), timeout=10)
                    assert r.value == SIBLING_OK, r
                finally:
                    await other.aclose()
            finally:
                open(proc_path(s.pid, "/tmp/go"), "w").close()
        return state, out["r"]
    finally:
        await s.aclose()


async def test_a_session_that_spends_its_uids_pipe_pages_leaves_others_theirs(sandbox):
    state, r = await while_held(sandbox, PIPE_HOG)
    assert state == "True" and r.value == "True", (state, r)  # it did spend them: a per-user limit hit


async def test_a_session_with_fds_in_flight_leaves_others_room(sandbox):
    state, r = await while_held(sandbox, INFLIGHT_HOG)
    sent, why = eval(state)
    assert why in (109, 11) and sent <= LIMITS.nofile + 1, state  # ETOOMANYREFS at its own nofile


async def test_posix_message_queues_are_off(sandbox):
    code = (LIBC + "import resource\nctypes.set_errno(0)\n"
            "q = libc.mq_open(b'/agentenv-q', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
            "(q, ctypes.get_errno(), resource.getrlimit(resource.RLIMIT_MSGQUEUE))")
    r = await hostile(sandbox, code)
    assert r.value == "(-1, 24, (0, 0))", r  # EMFILE: no queue bytes at all


async def test_pending_signals_are_capped_per_session(sandbox):
    # sigqueue(): kill() of a real-time signal may exceed the limit (SI_USER), a queued one may not.
    # A handler: pid 1 of a namespace is sent no signal it would take the default action for.
    code = (LIBC + "import signal\nsig = signal.SIGRTMIN + 2\nsignal.signal(sig, lambda *a: None)\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, [sig])\nn, err = 0, None\n"
            "while n < 100000:\n    ctypes.set_errno(0)\n    if libc.sigqueue(os.getpid(), sig, ctypes.c_void_p(0)):\n"
            "        err = ctypes.get_errno()\n        break\n    n += 1\n(n, err)")
    r = await hostile(sandbox, code)
    n, err = eval(r.value)
    assert err == 11 and n <= 1024, r  # EAGAIN at the session's own RLIMIT_SIGPENDING


async def test_session_rlimits_for_per_user_counts(sandbox):
    code = ("import resource as r\n[r.getrlimit(x)[0] for x in (r.RLIMIT_NPROC, r.RLIMIT_MSGQUEUE, "
            "r.RLIMIT_SIGPENDING, "
            "r.RLIMIT_MEMLOCK)]")
    r = await hostile(sandbox, code)
    assert r.value == repr([LIMITS.pids, 0, 1024, 0])


async def test_live_sessions_have_distinct_uids_from_the_range(sandbox):
    sessions = [await sandbox.session() for _ in range(6)]
    try:
        uids = [eval((await s.run("import os\n(os.getuid(), os.getgid())")).value) for s in sessions]
        assert all(u == g == s.uid for (u, g), s in zip(uids, sessions))
        assert len({u for u, _ in uids}) == 6 and all(LIMITS.uid <= u < LIMITS.uid + LIMITS.uids for u, _ in uids)
        assert (await sibling(sandbox)).uid not in {u for u, _ in uids}
    finally:
        for s in sessions:
            await s.aclose()
    await check_sibling(sandbox)


async def test_no_host_process_runs_as_a_session_uid(sandbox):
    s = await sandbox.session()
    try:
        await s.run("import subprocess\np = subprocess.Popen(['sleep', '4747'])")
        inside = [p.pid for p in psutil.process_iter() if _try_uid(p) == s.uid]
        assert s.pid in inside and all(_in_session(pid, s.pid) for pid in inside)
    finally:
        await s.aclose()
    await check_sibling(sandbox)


def _try_uid(p):
    try:
        return p.uids().real
    except psutil.Error:
        return None


def _in_session(pid: int, worker: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{worker}/ns/pid") or pid == worker
    except OSError:
        return True  # gone meanwhile


async def test_a_pool_out_of_uids_refuses_a_start_and_recovers():
    from dataclasses import replace

    async with LocalSandbox(limits=replace(LIMITS, uid=private_uids(1), uids=2), prewarm=0) as sb:
        a = await sb.session()
        b = await sb.session()
        with pytest.raises(SandboxError, match="every sandbox uid"):
            await sb.session()
        await a.aclose()
        fd = os.pidfd_open(b.pid)
        await b.aclose()
        await wait_for(lambda: reaped(fd), "the closed session's worker reaped")
        os.close(fd)
        c = await sb.session()
        assert (await c.run("6 * 7")).value == "42"
        await c.aclose()


# -- 14. nothing runs between calls (issue 35) ------------------------------------------------
# The call's sweep kills what runs at its end; what starts after it (a signal handler, a
# thread, a timer) would run while the session idles. The session is frozen from the moment
# the host has its answer until the next call.
def v2_dir(s) -> Path:
    return next(Path(d) for d in s._cgroups if "/unified/" in d or Path(d, "cgroup.freeze").exists())


def is_frozen(s) -> bool:
    return "frozen 1" in (v2_dir(s) / "cgroup.events").read_text()


def cpu_usec(s, kind: str = "usage_usec") -> int:
    """CPU the session's processes used. A frozen process still spends microseconds in the
    kernel when a signal arrives (and goes back to sleep without running any code): while
    idle it may grow by that, where code running for the window would add ~IDLE seconds."""
    return int(dict(line.split() for line in (v2_dir(s) / "cpu.stat").read_text().splitlines())[kind])


def _status(p: psutil.Process) -> str | None:
    try:
        return p.status()
    except psutil.Error:
        return None


IDLE = 0.5  # the idle window watched: ten times the hostile code's own delay (0.05 s)
LATER = {
    "sigalrm handler": "import signal, subprocess\nsignal.signal(signal.SIGALRM, lambda *a: subprocess.Popen(SPIN))\n"
                       "signal.setitimer(signal.ITIMER_REAL, 0.05)",
    "thread": "import threading, time, subprocess\n"
              "threading.Thread(target=lambda: (time.sleep(0.05), subprocess.Popen(SPIN)), daemon=True).start()",
    "timer": "import threading, subprocess\nthreading.Timer(0.05, lambda: subprocess.Popen(SPIN)).start()",
    "setsid grandchild from a thread": "import os, threading, time\ndef later():\n    time.sleep(0.05)\n"
                                       "    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
                                       "            os.execvp(SPIN[0], SPIN)\n        os._exit(0)\n"
                                       "threading.Thread(target=later, daemon=True).start()",
    "forking loop": "import os, threading, time\ndef loop():\n    while True:\n        time.sleep(0.01)\n"
                    "        if os.fork() == 0:\n            os.execvp(SPIN[0], SPIN)\n"
                    "threading.Thread(target=loop, daemon=True).start()",
    "spinning thread": "import threading\ndef spin():\n    while True:\n        pass\n"
                       "threading.Thread(target=spin, daemon=True).start()",
    "interval timer": "import signal, os\ncount = [0]\ndef tick(*a):\n    count[0] += 1\n"
                      "signal.signal(signal.SIGALRM, tick)\nsignal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)",
}


@pytest.mark.parametrize("code", list(LATER.values()), ids=list(LATER))
async def test_nothing_runs_while_a_session_idles(sandbox, code):
    s = await sandbox.session()
    try:
        r = await s.run(f"SPIN = {SPIN}\n" + code)
        assert r.status == "ok", r
        await wait_for(lambda: is_frozen(s), "the idle session frozen")
        used, procs = cpu_usec(s), set((v2_dir(s) / "cgroup.procs").read_text().split())
        await anyio.sleep(IDLE)  # a window in which the code would act: slower machines only narrow it
        assert cpu_usec(s) - used < 2000 and is_frozen(s), "the session ran between calls"
        # (one killed by the call's sweep may still have been leaving: fewer is fine, none new)
        assert set((v2_dir(s) / "cgroup.procs").read_text().split()) <= procs, "a process started between calls"
        assert not [p for p in spinners() if _status(p) == psutil.STATUS_RUNNING]
        # thawed for its call (its spinners compete with it), then frozen again
        assert (await s.run("6 * 7", timeout=60)).value == "42"
        await wait_for(lambda: is_frozen(s), "frozen again after the next call")
    finally:
        await s.aclose()
    await wait_for(lambda: not spinners(), "no spinner outlives the session")
    await check_sibling(sandbox)


async def test_nothing_is_written_on_the_channel_between_calls(sandbox):
    s = await sandbox.session()
    try:
        code = (
            FORGE
            + "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), forge(seq + 1))).start()"
        )
        assert (await s.run(code)).status == "ok"
        await wait_for(lambda: is_frozen(s), "the idle session frozen")
        await anyio.sleep(IDLE)
        sock = s._worker.stream._raw_socket
        with pytest.raises(BlockingIOError):
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    finally:
        await s.aclose()


async def test_a_frozen_session_closes_at_once_and_takes_everything_with_it(sandbox):
    s = await sandbox.session()
    r = await s.run(f"import subprocess\nps = [subprocess.Popen({SPIN}) for _ in range(3)]\nlen(ps)")
    assert r.value == "3"  # the sweep killed them; a thread starts new ones after it
    r = await s.run(f"SPIN = {SPIN}\n" + LATER["forking loop"])
    await wait_for(lambda: is_frozen(s), "the idle session frozen")
    procs = (v2_dir(s) / "cgroup.procs")
    await s.aclose()
    await wait_for(lambda: not procs.exists() or not procs.read_text().split(), "every process of the session gone")
    await wait_for(lambda: not spinners(), "no spinner left")
    await check_sibling(sandbox)


async def test_sessions_allowed_background_processes_are_not_frozen():
    from dataclasses import replace

    async with LocalSandbox(limits=replace(LIMITS, background=True), prewarm=0) as sb:
        s = await sb.session()
        await s.run("import threading\nticks = [0]\ndef spin():\n    while True:\n        ticks[0] += 1\n"
                    "threading.Thread(target=spin, daemon=True).start()")
        first = cpu_usec(s)
        await wait_for(lambda: cpu_usec(s) > first + 20000, "its thread kept running between calls")
        assert not is_frozen(s)
        await s.aclose()
