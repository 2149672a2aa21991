"""Helpers for the hostile-code suites: run code in a fresh session of a real pool, then check
that the host is unchanged, the session still works, a sibling session is unaffected and the
pool still serves."""

from __future__ import annotations

import fcntl
import glob
import os
import platform
import socket
import tempfile

import psutil
import pytest

from agentenv.sandboxes.local import Limits
from agentenv.sandboxes.local.uids import _lock_file

from ..waiting import until

LIMITS = Limits(memory_mb=512, cpu_s=20, fsize_mb=8, nofile=128, pids=32, tmp_mb=16, shm_mb=4)
SECRET = "AGENTENV_TEST_SECRET"
# On the host: must never be written by sandboxed code (named for this run: a second run of the
# suite beside this one checks its own).
MARK = f"/tmp/agentenv-hostile-mark-{os.getpid()}"
# Host kernel settings a session could try to change (a writable /proc/sys would let it).
SYSCTLS = ("kernel/core_pattern", "kernel/pid_max", "vm/panic_on_oom", "kernel/hostname", "kernel/domainname",
           "kernel/modprobe", "kernel/sysrq", "vm/overcommit_memory", "kernel/printk", "vm/max_map_count",
           "kernel/randomize_va_space", "net/core/somaxconn", "user/max_user_namespaces")
x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers are x86_64's")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


#: The source name of the mounts the suite's own tests make on the host (tests/test_durability.py's
#: small tmpfs): another run of the suite on the machine may mount one while this one checks the
#: host, wherever its temporary directory lies.
TEST_MOUNT = "agentenv-test-tmpfs"


def host_mounts() -> list[str]:
    """The host's mount table, less the mounts the suite's tests make themselves (``TEST_MOUNT``,
    this run's or another's): every other mount counts."""
    def ours(line: str) -> bool:
        after = line.split(" - ", 1)[1].split() if " - " in line else []
        return len(after) >= 2 and after[1] == TEST_MOUNT
    return [line for line in (_read("/proc/self/mountinfo") or "").splitlines() if not ours(line)]


def host_state() -> dict:
    """What hostile code must never change on the host."""
    return {
        "sysctl": {name: _read(f"/proc/sys/{name}") for name in SYSCTLS},
        "loop devices": sorted((p, _read(p)) for p in glob.glob("/sys/block/loop*/loop/backing_file")),
        "mounts": host_mounts(),
        "hostname": socket.gethostname(),
        "mark": os.path.exists(MARK),
        "dev": sorted(os.listdir("/dev")),
    }


def host_changes(before: dict, after: dict) -> dict:
    """What differs between two ``host_state`` readings, per key: the entries gone and added for
    a list, else the two values."""
    changes = {}
    for key in before.keys() | after.keys():
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            changes[key] = {"gone": [x for x in a if x not in b], "added": [x for x in b if x not in a]}
        elif isinstance(a, dict) and isinstance(b, dict):
            changes[key] = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        else:
            changes[key] = (a, b)
    return changes


def assert_host_unchanged(before: dict) -> None:
    changes = host_changes(before, host_state())
    assert not changes, f"hostile code changed the host: {changes}"


# What a sibling session checks after every hostile case: its state is intact, and the
# per-user kernel quotas a session could exhaust for others still serve it (pipe buffer
# pages, fds in flight on a unix socket, processes).
SIBLING_CHECK = """
import fcntl, os, socket, subprocess
r, w = os.pipe()
big = fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: fails with EPERM once the user's pages are spent
a, b = socket.socketpair()
socket.send_fds(a, [b'x'], [r, w])
got = socket.recv_fds(b, 1, 2)[1]
for fd in (r, w, *got):
    os.close(fd)
(sibling_token, big, len(got), subprocess.run(['true']).returncode)
"""
SIBLING_OK = "('sibling', 1048576, 2, 0)"


async def sibling(sandbox):
    """The module's long-lived sibling session (made at first use)."""
    s = getattr(sandbox, "sibling", None)
    if s is None:
        s = sandbox.sibling = await sandbox.session()
        sandbox.spawned.add(s.pid)
        assert (await s.run("sibling_token = 'sibling'")).status == "ok"
    return s


async def check_sibling(sandbox) -> None:
    s = await sibling(sandbox)
    r = await s.run(SIBLING_CHECK, timeout=10)
    assert r.value == SIBLING_OK and not r.state_lost, f"a sibling session was affected: {r}"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def hostile(sandbox, code: str, timeout: float = 10.0, *, session_survives: bool = True):
    """Run ``code`` in a fresh session; check the host is unchanged, and that the session (or,
    when the code got it killed, its replacement) and the pool still work."""
    before = host_state()
    await sibling(sandbox)
    s = await sandbox.session()
    sandbox.spawned.add(s.pid)
    try:
        res = await s.run(code, timeout=timeout)
        if s.pid:
            sandbox.spawned.add(s.pid)
        after = await s.run("6 * 7", timeout=5)
        if not session_survives and after.status == "error" and after.state_lost:
            after = await s.run("6 * 7", timeout=5)  # the broken session was replaced
        assert after.value == "42", f"session unusable after hostile code: {after}"
    finally:
        await s.aclose()
    fresh = await sandbox.session()
    try:
        assert (await fresh.run("1 + 1")).value == "2", "pool unhealthy after hostile code"
    finally:
        await fresh.aclose()
    assert_host_unchanged(before)
    assert psutil.Process(os.getpid()).is_running()
    await check_sibling(sandbox)
    return res


# Code that writes one frame of its choosing on the session socket, numbered for the call that
# runs it (``frame(payload: bytes, n=None)``; ``n=-1``: the VIOLATION number).
FRAME = """import sys, os, struct
_f, seq = sys._getframe(), None
while _f is not None:
    if _f.f_code.co_name == 'serve' and 'seq' in _f.f_locals:
        seq = _f.f_locals['seq']
    _f = _f.f_back
def frame(payload, n=None):
    n = seq if n is None else (2**64 - 1 if n == -1 else n)
    for fd in range(3, 32):
        try:
            os.write(fd, struct.pack('>IQ', len(payload), n) + payload)
        except OSError:
            pass
"""


# The blocks of 128 uids, near the top of the sandbox's range, that the uid tests use: each test
# process on the machine holds one, a byte-range lock past every uid in the sandbox's own uid
# lock file (the one file every process on the machine shares, whatever its TMPDIR; locked
# through the process's one descriptor of it, as closing any other would drop its uid locks).
_BLOCKS_AT, _BLOCK, _BLOCK_COUNT = 1 << 40, 128, 125
_block: int | None = None  # the block this process holds


def _free(fd: int, start: int, length: int) -> bool:
    """Whether no other process holds a lock in the range (this process holds none there)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start, os.SEEK_SET)
    except OSError:
        return False
    fcntl.lockf(fd, fcntl.LOCK_UN, length, start, os.SEEK_SET)
    return True


def _own_block() -> int:
    """This process's block: the first whose lock it takes and whose uids no other process
    holds (a run of another version of the suite, or a pool, may use them without the lock)."""
    global _block
    if _block is None:
        fd = _lock_file()
        for block in range(_BLOCK_COUNT):
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _BLOCKS_AT + block, os.SEEK_SET)
            except OSError:
                continue  # another test process holds it
            if _free(fd, LIMITS.uid + 48_000 + block * _BLOCK, _BLOCK):
                _block = block
                break
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, _BLOCKS_AT + block, os.SEEK_SET)
        else:
            raise RuntimeError(f"all {_BLOCK_COUNT} test uid blocks are held by other test processes")
    return _block


def private_uids(slot: int) -> int:
    """The first of 8 uids (``slot``: 0 to 15) of the sandbox's range that no other test, nor
    another test process on the machine, uses (uids are owned machine-wide, and a test that
    leaves uids handed out keeps them locked for its process's life)."""
    assert 0 <= slot < 16
    return LIMITS.uid + 48_000 + _own_block() * _BLOCK + slot * 8


def proc_path(pid: int, path: str) -> str:
    """A path inside a live session's own filesystem, as the host (root) sees it."""
    return f"/proc/{pid}/root{path}"


# Waits on a condition under the suite-wide deadline (tests/waiting.py).
wait_for = until


# Code that writes forged answer frames on every descriptor the worker may hold (`seq`: the
# number of the call in progress, read off the worker's frames).
FORGE = """import sys, os, json, struct
f, seq = sys._getframe(), None
while f is not None:
    if f.f_code.co_name == 'serve' and 'seq' in f.f_locals:
        seq = f.f_locals['seq']
    f = f.f_back
def forge(n, stdout='FORGED'):
    payload = json.dumps({"status": "ok", "stdout": stdout, "stderr": "", "value": None, "error": None,
                          "truncated": False}).encode()
    for fd in range(3, 32):
        try:
            os.write(fd, struct.pack('>IQ', len(payload), n) + payload)
        except OSError:
            pass
"""


# Processes hostile code leaves behind are looked for machine-wide (one that escaped the
# session's tree must still be found), so their command lines carry this run's own tag: a
# second test run on the machine, running the same cases, never counts as this one's.
RUN_TAG = str(os.getpid())
SPIN = f"['sh', '-c', 'while :; do :; done; echo agentenv-spinner-{RUN_TAG}']"


def spinners() -> list[psutil.Process]:
    mark = f"agentenv-spinner-{RUN_TAG}"
    return [p for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or [])]


def sleep_tag(seconds: int) -> str:
    """A `sleep` argument unique to this run: ``seconds`` plus this run's tag as a fraction."""
    return f"{seconds}.{RUN_TAG}"


def sleepers(tag: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", tag]]


LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def syscall(nr: int, *args: int | bytes) -> str:
    """Code that makes a raw syscall and evaluates to (return value, errno); a child that a
    clone somehow created exits at once."""
    return (LIBC + f"ctypes.set_errno(0)\nr = libc.syscall({nr}, *{args!r})\n"
            "if r == 0 and os.getpid() != 1:\n    os._exit(0)\n(r, ctypes.get_errno())")
