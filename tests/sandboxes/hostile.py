"""Helpers for the hostile-code suites: run code in a fresh session of a real pool, then check
that the host is unchanged, the session still works and the pool still serves."""

from __future__ import annotations

import glob
import os
import platform
import socket

import psutil
import pytest

from agentenv.sandboxes.local import Limits

LIMITS = Limits(memory_mb=512, cpu_s=20, fsize_mb=8, nofile=128, pids=32, tmp_mb=16, shm_mb=4)
SECRET = "AGENTENV_TEST_SECRET"
MARK = "/tmp/agentenv-hostile-mark"  # on the host: must never be written by sandboxed code
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


def host_state() -> dict:
    """What hostile code must never change on the host."""
    return {
        "sysctl": {name: _read(f"/proc/sys/{name}") for name in SYSCTLS},
        "loop devices": sorted((p, _read(p)) for p in glob.glob("/sys/block/loop*/loop/backing_file")),
        "mounts": _read("/proc/self/mountinfo"),
        "hostname": socket.gethostname(),
        "mark": os.path.exists(MARK),
        "dev": sorted(os.listdir("/dev")),
    }


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def hostile(sandbox, code: str, timeout: float = 2.0, *, session_survives: bool = True):
    """Run ``code`` in a fresh session; check the host is unchanged, and that the session (or,
    when the code got it killed, its replacement) and the pool still work."""
    before = host_state()
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
    assert host_state() == before, "hostile code changed the host"
    assert psutil.Process(os.getpid()).is_running()
    return res
