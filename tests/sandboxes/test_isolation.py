"""The isolation primitives (``isolation.py``) as a real session sees them: a namespace of each
kind of its own, the read-only view the template built (its ``/dev``, ``/proc`` masks, the
kept Python installation) with a private ``/tmp`` and ``/dev/shm`` of the limits' sizes, an
unprivileged uid with no capability and both seccomp filters loaded, and every rlimit the
limits set. Expected values come from the module's own constants and the pool's ``Limits``."""

from __future__ import annotations

import os
import resource

import pytest

from agentenv.sandboxes.local import isolation

from .hostile import LIBC, LIMITS

pytestmark = pytest.mark.anyio
KINDS = ("mnt", "net", "pid", "ipc", "uts", "cgroup")


async def run(sandbox, code: str) -> tuple[int, object]:
    """The uid of a fresh session and the value of ``code`` run there."""
    s = await sandbox.session()
    sandbox.spawned.add(s.pid)
    try:
        r = await s.run(code, timeout=30)
        assert r.status == "ok", r
        return s.uid, eval(r.value)
    finally:
        await s.aclose()


async def test_a_session_has_a_namespace_of_each_kind_of_its_own(sandbox):
    s = await sandbox.session()
    try:
        assert (await s.run("import socket\nsocket.gethostname()")).value == "'sandbox'"
        theirs = {k: os.readlink(f"/proc/{s.pid}/ns/{k}") for k in KINDS}
    finally:
        await s.aclose()
    mine = {k: os.readlink(f"/proc/self/ns/{k}") for k in KINDS}
    assert not [k for k in KINDS if theirs[k] == mine[k]], (theirs, mine)


async def test_the_view_is_read_only_but_a_private_tmp_and_dev_shm_of_the_limits_sizes(sandbox):
    code = (
        "import os, sys\n"
        "size = lambda p: os.statvfs(p).f_blocks * os.statvfs(p).f_frsize >> 20\n"
        "ro = lambda p: bool(os.statvfs(p).f_flag & os.ST_RDONLY)\n"
        "proc = [l.split()[5].split(',')[0] for l in open('/proc/self/mountinfo') if l.split()[4] == '/proc']\n"
        f"masks = [open(p, 'rb').read(16) for p in {isolation.PROC_MASKS_PRESENT!r}]\n"
        f"hidden = [open(p, 'rb').read(16) for p in {isolation.HIDE_FILES!r} if os.path.exists(p)]\n"
        "(ro('/'), ro('/usr'), ro(sys.executable), ro('/tmp'), ro('/dev/shm'), size('/tmp'), size('/dev/shm'),\n"
        " sorted(os.listdir('/dev')), proc[-1], masks, hidden, os.listdir('/sys/fs/cgroup'),\n"
        " os.access(sys.executable, os.X_OK))"
    )
    _, got = await run(sandbox, code)
    hidden = [p for p in isolation.HIDE_FILES if os.path.isfile(p)]  # the session's /etc is the host's, read-only
    devices = sorted([*isolation.DEVICES, *isolation.DEV_LINKS, "shm"])
    assert got == (True, True, True, False, False, LIMITS.tmp_mb, LIMITS.shm_mb, devices, "ro",
                   [b""] * len(isolation.PROC_MASKS_PRESENT), [b""] * len(hidden), [], True), got


async def test_a_session_runs_as_its_own_uid_with_no_capability_and_both_filters_loaded(sandbox):
    code = (LIBC + "st = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
            "st = {k: v.strip() for k, v in st.items()}\n"
            "(os.getresuid(), os.getresgid(), os.getgroups(), [st[k] for k in ('CapInh', 'CapPrm', 'CapEff', "
            "'CapBnd', 'CapAmb')], st['NoNewPrivs'], st['Seccomp'], st.get('Seccomp_filters'), "
            "libc.prctl(27, 0, 0, 0, 0), os.stat('/proc/self').st_uid)")
    uid, (uids, gids, groups, caps, nnp, mode, filters, securebits, owner) = await run(sandbox, code)
    assert uids == (uid,) * 3 and gids == (uid,) * 3 and groups == []
    assert LIMITS.uid <= uid < LIMITS.uid + LIMITS.uids
    assert caps == ["0000000000000000"] * 5 and nnp == "1" and mode == "2"
    assert filters in (None, "2")  # the allow-list and the argument filter (older kernels do not say)
    assert securebits == isolation.SECUREBITS
    assert owner == uid  # dumpable again after the uid change: its own /proc/self is its own


async def test_each_process_of_a_session_has_every_rlimit_its_limits_set(sandbox):
    names = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_NPROC",
             "RLIMIT_MSGQUEUE", "RLIMIT_SIGPENDING", "RLIMIT_MEMLOCK")
    read = f"import resource\nprint([resource.getrlimit(getattr(resource, n)) for n in {names!r}])"
    code = ("import resource, subprocess, sys\n"
            f"child = subprocess.run([sys.executable, '-c', {read!r}], capture_output=True, text=True).stdout\n"
            "mine = [resource.getrlimit(getattr(resource, n)) for n in " + repr(names) + "]\n(mine, eval(child))")
    _, (mine, child) = await run(sandbox, code)
    mb = 1 << 20
    expected = [LIMITS.memory_mb * mb, LIMITS.cpu_s, LIMITS.fsize_mb * mb, LIMITS.nofile, 0, LIMITS.pids, 0,
                isolation.SIGPENDING, 0]
    assert [soft for soft, _ in mine] == [hard for _, hard in mine] == expected, mine
    assert mine == child  # inherited by every process it starts
    assert resource.getrlimit(resource.RLIMIT_NOFILE) != (LIMITS.nofile,) * 2  # the host's are its own
