"""Escapes an independent audit found (issue 9), one class per section, each with cases of
our own: every one must fail closed, leave the host unchanged and the pool healthy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import psutil
import pytest

from agentenv.errors import SandboxError
from agentenv.sandboxes.local import LocalSandbox, _Cgroups
from agentenv.sandboxes.local.uids import _Uids

from ..waiting import until
from .hostile import (FRAME, LIMITS, SIBLING_CHECK, SIBLING_OK, check_sibling, host_state, hostile, proc_path, sibling,
                      wait_for, x86_64)

pytestmark = pytest.mark.anyio

LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def syscall(nr: int, *args: int | bytes) -> str:
    """Code that makes a raw syscall and evaluates to (return value, errno); a child that a
    clone somehow created exits at once."""
    return (LIBC + f"ctypes.set_errno(0)\nr = libc.syscall({nr}, *{args!r})\n"
            "if r == 0 and os.getpid() != 1:\n    os._exit(0)\n(r, ctypes.get_errno())")


# -- 1. host kernel settings ----------------------------------------------------------------
@pytest.mark.parametrize("knob", ["kernel/core_pattern", "vm/panic_on_oom", "kernel/pid_max", "vm/drop_caches",
                                  "vm/overcommit_memory", "user/max_user_namespaces"])
async def test_proc_sys_is_not_writable(sandbox, knob):
    r = await hostile(sandbox, f"open('/proc/sys/{knob}', 'w').write('3')")
    assert r.status == "error" and ("Read-only file system" in r.error or "Permission denied" in r.error)


async def test_proc_is_mounted_read_only_and_kernel_leaks_read_empty(sandbox):
    code = ("opts = [l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] == '/proc']\n"
            "(opts[-1].split(',')[0], [open(p, 'rb').read() for p in ('/proc/keys', '/proc/timer_list', "
            "'/proc/kallsyms') if os.path.exists(p)])")
    r = await hostile(sandbox, "import os\n" + code)
    assert r.status == "ok", r.error
    mode, leaks = eval(r.value)
    assert mode == "ro" and all(x == b"" for x in leaks)


async def test_runs_as_its_own_unprivileged_uid_without_capabilities(sandbox):
    code = ("import os\nstatus = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "(os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), "
            "[status[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')])")
    r = await hostile(sandbox, code)
    assert r.status == "ok", r.error
    uid, euid, gid, groups, caps = eval(r.value)
    assert LIMITS.uid <= uid < LIMITS.uid + LIMITS.uids and euid == gid == uid and groups in ([], [gid])
    assert caps == ["0000000000000000"] * 4 + ["1", "2"]
    # Locked securebits (noroot, no_setuid_fixup, no_cap_ambient_raise, keep_caps_locked).
    r = await hostile(sandbox, LIBC + "libc.prctl(27, 0, 0, 0, 0)")
    assert r.value == str(0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80), r.render()


async def test_cannot_regain_root_or_capabilities(sandbox):
    code = (LIBC + "out = []\nfor call in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.setgroups([0]),\n"
            "             lambda: os.chown('/tmp', 0, 0), lambda: os.chmod('/tmp', 0o777)):\n"
            "    try:\n        call()\n        out.append('ALLOWED')\n    except PermissionError:\n"
            "        out.append('denied')\n"
            "hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)\ndata = (ctypes.c_uint32 * 6)(0xffffffff, 0, 0xffffffff, 0, 0, 0)\n"
            "out.append(libc.capset(hdr, data))\nout")
    r = await hostile(sandbox, code)
    assert r.value == "['denied', 'denied', 'denied', 'denied', 'denied', -1]"


async def test_sysfs_and_cgroup_release_agent_are_read_only(sandbox):
    code = ("import glob\nout = []\nfor p in glob.glob('/sys/fs/cgroup/*/release_agent')[:2] + "
            "['/sys/kernel/mm/transparent_hugepage/enabled', '/sys/fs/cgroup/pids/cgroup.procs']:\n"
            "    try:\n        open(p, 'w').write('/tmp/x')\n        out.append('WROTE ' + p)\n"
            "    except OSError as e:\n        out.append(e.errno)\nout")
    r = await hostile(sandbox, code)
    assert r.status == "ok" and "WROTE" not in r.value


async def test_the_hosts_cgroup_tree_is_hidden(sandbox):
    """It would name every cgroup on the machine, list the pids in each (host processes',
    other sessions') and show their memory and CPU use."""
    if not os.listdir("/sys/fs/cgroup"):
        pytest.skip("the host has no cgroup tree to hide")
    mine = (await hostile(sandbox, "open('/proc/self/cgroup').read()")).value
    assert "agentenv-" in mine  # the session is in its own cgroups all the same
    code = ("import glob, os\n(os.listdir('/sys/fs/cgroup'), "
            "glob.glob('/sys/fs/cgroup/**/cgroup.procs', recursive=True)[:3])")
    r = await hostile(sandbox, code)
    assert r.status == "ok" and r.value == "([], [])", r


# -- 2. capabilities regained through a new user namespace ----------------------------------
@x86_64
@pytest.mark.parametrize("flag", [0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x02000000, 0x00000080],
                         ids=["user", "mount", "net", "pid", "cgroup", "time"])
async def test_clone_into_new_namespaces_is_denied(sandbox, flag):
    r = await hostile(sandbox, syscall(56, flag | 17, 0, 0, 0, 0))  # clone(flag | SIGCHLD)
    assert r.value == "(-1, 1)"  # EPERM


@x86_64
async def test_clone3_is_unavailable_so_its_flags_cannot_hide(sandbox):
    r = await hostile(sandbox, LIBC + "args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)\n"
                                      "ctypes.set_errno(0)\nr = libc.syscall(435, args, 88)\n"
                                      "if r == 0:\n    os._exit(0)\n(r, ctypes.get_errno())")
    assert r.value == "(-1, 38)"  # ENOSYS: libc falls back to clone(), which the filter reads


@x86_64
@pytest.mark.parametrize("nr,args", [(430, (b"tmpfs", 0)), (428, (-100, b"/", 1)), (429, (-100, b"/tmp", -100, b"/mnt", 0)),
                                     (433, (-100, b"/", 0)), (442, (-100, b"/", 0x8000, 0, 32))],
                         ids=["fsopen", "open_tree", "move_mount", "fspick", "mount_setattr"])
async def test_new_mount_api_is_denied(sandbox, nr, args):
    r = await hostile(sandbox, syscall(nr, *args))
    assert r.value == "(-1, 1)"


async def test_threads_and_subprocesses_still_work_under_the_clone_filter(sandbox):
    code = ("import threading, subprocess, multiprocessing\nout = []\n"
            "t = threading.Thread(target=lambda: out.append('thread'))\nt.start()\nt.join()\n"
            "out.append(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
            "with multiprocessing.Pool(2) as p:\n    out.append(sum(p.map(abs, [-1, -2])))\nout")
    r = await hostile(sandbox, code, timeout=10)
    assert r.value == "['thread', 'child', 3]", r.error


async def test_unshare_binary_fails(sandbox):
    r = await hostile(sandbox, "import subprocess\np = subprocess.run(['unshare', '-U', '-r', 'id', '-u'], "
                               "capture_output=True, text=True)\n(p.returncode, p.stdout)")
    assert r.status == "ok" and eval(r.value)[0] != 0 and eval(r.value)[1] == ""


@x86_64
@pytest.mark.parametrize("nr,args", [(250, (0, 0, 0, 0)), (248, (b"user", b"x", b"y", 1, -3)), (321, (0, 0, 0)),
                                     (298, (0, 0, -1, -1, 0)), (323, (0,)), (425, (8, 0)), (135, (0x0040000,)),
                                     (103, (3, 0, 0))],
                         ids=["keyctl", "add_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
                              "personality", "syslog"])
async def test_kernel_surface_syscalls_are_denied(sandbox, nr, args):
    r = await hostile(sandbox, syscall(nr, *args))
    assert r.value == "(-1, 1)"


# -- 3. host devices ------------------------------------------------------------------------
async def test_dev_holds_only_the_minimal_devices(sandbox):
    r = await hostile(sandbox, "import os\nsorted(os.listdir('/dev'))")
    assert r.value == repr(sorted(["null", "zero", "full", "random", "urandom", "shm", "fd", "stdin", "stdout",
                                   "stderr"]))


@pytest.mark.parametrize("dev", ["kvm", "loop-control", "loop0", "console", "kmsg", "zram0", "cpu_dma_latency",
                                 "fuse", "userfaultfd", "mem", "vda", "net/tun"])
async def test_host_devices_are_absent(sandbox, dev):
    r = await hostile(sandbox, f"open('/dev/{dev}', 'r+b')")
    assert r.status == "error" and "FileNotFoundError" in r.error


async def test_cannot_create_device_nodes(sandbox):
    r = await hostile(sandbox, "import os, stat\nos.mknod('/tmp/kvm', 0o666 | stat.S_IFCHR, os.makedev(10, 232))")
    assert r.status == "error" and "PermissionError" in r.error


async def test_the_minimal_devices_work_and_shm_is_private_and_capped(sandbox):
    open("/dev/shm/agentenv-host-mark", "w").close()
    try:
        code = ("import os\nopen('/dev/null', 'w').write('x')\nz = open('/dev/zero', 'rb').read(4)\n"
                "u = len(open('/dev/urandom', 'rb').read(8))\nseen = os.listdir('/dev/shm')\nfull = None\n"
                "try:\n    with open('/dev/shm/big', 'wb') as f:\n        f.write(b'x' * (LIMIT + 1) * 2**20)\n"
                "except OSError as e:\n    full = e.errno\n(z, u, seen, full)").replace("LIMIT", str(LIMITS.shm_mb))
        r = await hostile(sandbox, code)
    finally:
        os.unlink("/dev/shm/agentenv-host-mark")
    assert r.value == "(b'\\x00\\x00\\x00\\x00', 8, [], 28)", r.error  # ENOSPC past shm_mb


# -- 4. socket families that ignore network namespaces --------------------------------------
@pytest.mark.parametrize("family,kind", [(40, 1), (16, 3), (17, 3), (15, 3), (38, 5), (31, 1), (44, 3), (30, 2),
                                         (21, 5), (29, 3)],
                         ids=["vsock", "netlink", "packet", "key", "alg", "bluetooth", "xdp", "tipc", "rds", "can"])
async def test_other_socket_families_are_denied(sandbox, family, kind):
    r = await hostile(sandbox, LIBC + f"ctypes.set_errno(0)\n(libc.socket({family}, {kind}, 0), ctypes.get_errno())")
    assert r.value == "(-1, 97)"  # EAFNOSUPPORT


@x86_64
async def test_family_with_high_bits_set_is_denied(sandbox):
    r = await hostile(sandbox, syscall(41, (1 << 32) | 40, 1, 0))  # socket(): the kernel reads an int
    assert r.value == "(-1, 97)"


async def test_unix_and_inet_sockets_still_work(sandbox):
    code = ("import socket\na, b = socket.socketpair()\na.send(b'hi')\ns = socket.socket(socket.AF_INET6)\n"
            "s.close()\nb.recv(2)")
    r = await hostile(sandbox, code)
    assert r.value == "b'hi'"


# -- 5. a forged result channel -------------------------------------------------------------
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


async def test_a_forged_result_never_shifts_later_calls(sandbox):
    # Code can make its own call return what it likes (it could print it, too); the genuine
    # answer that follows is caught at the next call (it carries the old call's number), the
    # session killed and that call an error: no call ever gets another call's result.
    s = await sandbox.session()
    try:
        r1 = await s.run(FORGE + "forge(seq)\n'genuine-1'")
        assert r1.stdout in ("FORGED", "") and len(r1.stdout) <= sandbox.max_output
        r2 = await s.run("'genuine-2'")
        assert r2.status == "error" and r2.state_lost and "SandboxError" in r2.error and r2.value is None
        assert (await s.run("'genuine-3'")).value == "'genuine-3'"
    finally:
        await s.aclose()
    await hostile(sandbox, FORGE + "forge(seq)", session_survives=False)


async def test_a_huge_forged_frame_is_refused_by_size(sandbox):
    code = FORGE + "forge(seq, 'z' * 15 * 2**20)\n'genuine'"
    r = await hostile(sandbox, code, timeout=10, session_survives=False)
    assert r.status == "error" and r.state_lost and "byte result" in r.error and len(r.stdout) == 0


async def test_a_frame_for_another_call_number_is_refused(sandbox):
    r = await hostile(sandbox, FORGE + "forge(seq + 1)\n'genuine'", session_survives=False)
    assert r.status == "error" and "answered call" in r.error


async def test_a_frame_written_by_a_thread_after_the_call_is_refused(sandbox):
    # The session is frozen between calls (section 14): the thread writes its frame during the
    # next call, before or after that call's answer; either way a call refuses it.
    s = await sandbox.session()
    try:
        code = FORGE + "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), forge(seq + 1))).start()"
        assert (await s.run(code)).status == "ok"
        results = [await s.run("import time\ntime.sleep(0.2)\n'next'"), await s.run("'after'")]
        refused = [r for r in results if r.status == "error"]
        assert len(refused) == 1 and refused[0].state_lost and "answered call" in refused[0].error, results
        assert (await s.run("'then'")).value == "'then'"
    finally:
        await s.aclose()


async def test_the_session_is_the_trust_boundary(sandbox):
    # Code can rewrite its own interpreter (here: the worker's execute), so later calls in that
    # session answer what it likes, within the caps; a fresh session is never affected.
    code = ("import sys\nw = sys.modules['worker']\n"
            "w.execute = lambda code, ns, cap: dict(status='ok', stdout='P' * 5000, stderr='', value=None, "
            "error=None, truncated=False)")
    s = await sandbox.session()
    try:
        assert (await s.run(code)).status == "ok"
        r = await s.run("'anything'")
        assert r.stdout == "P" * sandbox.max_output and r.truncated
    finally:
        await s.aclose()
    other = await sandbox.session()
    try:
        assert (await other.run("'anything'")).value == "'anything'"
    finally:
        await other.aclose()


async def test_output_caps_hold_on_the_host_too(sandbox):
    code = FORGE + "forge(seq, 'q' * (50 * 2000))\n'genuine'"
    r = await hostile(sandbox, code, session_survives=False)
    assert len(r.stdout) <= sandbox.max_output and len(r.render()) < 3 * sandbox.max_output + 500


# -- 6. CPU isolation and background processes ----------------------------------------------
SPIN = "['sh', '-c', 'while :; do :; done; echo agentenv-spinner']"


def spinners() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "agentenv-spinner" in " ".join(p.info["cmdline"] or [])]


async def test_setsid_background_processes_end_with_the_call(sandbox):
    code = (f"import subprocess, os\nfor _ in range(4):\n    subprocess.Popen({SPIN}, start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n"
            "        while True:\n            time.sleep(1)\n    os._exit(0)\n"
            "import os\nlen([p for p in os.listdir('/proc') if p.isdigit()])")
    r = await hostile(sandbox, code)
    assert r.status == "ok" and int(r.value) >= 5
    assert not spinners()


async def test_a_session_full_of_spinners_gets_one_cpu_share(sandbox):
    bench = "import time\nt = time.perf_counter()\nsum(range(4_000_000))\ntime.perf_counter() - t"
    fresh = await sandbox.session()
    spinner = await sandbox.session()
    try:
        alone = min([float((await fresh.run(bench)).value) for _ in range(3)])
        loaded: list[float] = []

        async def measure():
            await anyio.sleep(0.3)
            for _ in range(3):
                loaded.append(float((await fresh.run(bench)).value))

        async with anyio.create_task_group() as tg:
            tg.start_soon(measure)
            r = await spinner.run(f"import subprocess, time\nps = [subprocess.Popen({SPIN}) for _ in range(8)]\n"
                                  "time.sleep(2.0)\nlen(ps)", timeout=10)
        assert r.value == "8"
    finally:
        await fresh.aclose()
        await spinner.aclose()
    assert min(loaded) < 2.5 * alone, (alone, loaded)  # 8 spinners vs 1 without cgroups: ~4.5x on 2 cores
    assert not spinners()


async def test_a_cpu_cap_throttles_a_session():
    from dataclasses import replace

    async with LocalSandbox(limits=replace(LIMITS, cpus=0.5), prewarm=0) as sb:
        s = await sb.session()
        try:
            # Until the spinners have used 0.3 s of CPU between them: at a cap of half a CPU
            # that takes at least 0.6 s, so the cap has throttled them by then, however slow
            # the machine (utime is field 14 of /proc/PID/stat, in 1/100 s).
            r = await s.run(f"import subprocess, time\nps = [subprocess.Popen({SPIN}) for _ in range(4)]\n"
                            "def cpu():\n    return sum(int(open(f'/proc/{p.pid}/stat').read().rsplit(')', 1)[1]"
                            ".split()[11]) for p in ps)\n"
                            "while cpu() < 30:\n    time.sleep(0.05)\nlen(ps)", timeout=120)
            assert r.value == "4"
            cpu_dir = next(d for d in s._cgroups if "/cpu/" in d)

            def stat() -> dict[str, str]:
                return dict(line.split() for line in Path(cpu_dir, "cpu.stat").read_text().splitlines())

            # The kernel adds a throttled period's time when the period ends: it may lag the count.
            await until(lambda: int(stat()["throttled_time"]) > 0 or int(stat()["nr_throttled"]) == 0,
                        "the throttled time was accounted")
            stat = stat()
            quota = int(Path(cpu_dir, "cpu.cfs_quota_us").read_text())
            period = int(Path(cpu_dir, "cpu.cfs_period_us").read_text())
        finally:
            await s.aclose()
    assert quota == period // 2 and int(stat["nr_throttled"]) > 0 and int(stat["throttled_time"]) > 0
    assert not spinners()


async def test_background_processes_may_outlive_a_call_when_allowed():
    from dataclasses import replace

    async with LocalSandbox(limits=replace(LIMITS, background=True), prewarm=0) as sb:
        s = await sb.session()
        await s.run("import subprocess\np = subprocess.Popen(['sleep', '30'])")
        assert (await s.run("p.poll() is None")).value == "True"
        await s.aclose()


# -- 7. cgroups per pool --------------------------------------------------------------------
async def test_two_pools_in_one_process_do_not_share_limits():
    async with LocalSandbox(limits=LIMITS, prewarm=0) as a, LocalSandbox(limits=LIMITS, prewarm=0) as b:
        sa, sb = await a.session(), await b.session()
        assert not set(sa._cgroups) & set(sb._cgroups)
        # The flood's children live until its call ends (the call's sweep kills them); the other
        # pool's session starts a process once the flood's pids cgroup is full.
        flood = ("import os, time\nkids = []\ntry:\n    while True:\n        pid = os.fork()\n"
                 "        if pid == 0:\n            time.sleep(600)\n            os._exit(0)\n        kids.append(pid)\n"
                 "except OSError:\n    pass\ntime.sleep(5)\nlen(kids)")
        other = "import subprocess\nsubprocess.run(['true']).returncode"
        full = Path(next(d for d in sa._cgroups if "/pids/" in d), "pids.current")
        results: dict[str, object] = {}

        async def run(name, session, code, ready=None):
            if ready is not None:
                await until(ready, "the flood filled its pids cgroup")
            results[name] = await session.run(code, timeout=60)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "flood", sa, flood)
            tg.start_soon(run, "other", sb, other, lambda: int(full.read_text()) >= LIMITS.pids - 1)
        assert int(results["flood"].value) >= LIMITS.pids - 4  # it hit its own pids limit
        assert results["other"].value == "0", results["other"]  # the other pool's session was unaffected


async def test_a_closed_sessions_cgroups_are_reused_only_once_empty_and_still_limit():
    # Making and removing cgroups takes the kernel's global cgroup lock, so a pool reuses a
    # closed session's directories: never while a process (or zombie) is left in them.
    cg = _Cgroups()
    if cg.missing:
        pytest.skip("no cgroup v1 hierarchy")
    try:
        first = await cg.acquire(LIMITS)
        child = await anyio.open_process(["sleep", "30"])
        for d in first:
            Path(d, "cgroup.procs").write_text(str(child.pid))
        cg.release(first)
        assert set(await cg.acquire(LIMITS)).isdisjoint(first)  # occupied: new directories instead
        child.kill()
        await child.wait()  # reaped: nothing left in it
        assert await cg.acquire(LIMITS) == first
    finally:
        for dirs in [first] + list(cg.free):
            cg.release(dirs)
        assert cg.remove_all()
        cg.remove_roots()
    # And in a pool, a session on reused directories is held to the same limits.
    async with LocalSandbox(limits=LIMITS, prewarm=0) as sb:
        await (await sb.session()).aclose()
        released, made = [list(d) for d in sb._cgroups.free], sb._cgroups.n
        await until(lambda: not sb._cgroups._busy(released[0]), "the closed session's cgroups emptied")
        b = await sb.session()
        assert b._cgroups in released and sb._cgroups.n == made
        flood = ("import os, time\nkids = []\ntry:\n    while True:\n        pid = os.fork()\n"
                 "        if pid == 0:\n            time.sleep(3)\n            os._exit(0)\n        kids.append(pid)\n"
                 "except OSError:\n    pass\nlen(kids)")
        r = await b.run(flood, timeout=10)
        assert LIMITS.pids - 4 <= int(r.value) < LIMITS.pids, r
        await b.aclose()


async def test_stale_cgroups_of_a_dead_process_are_reaped_at_start():
    proc = await anyio.open_process(["true"])
    await proc.wait()
    stale = [Path("/sys/fs/cgroup", ctl, f"agentenv-{proc.pid}-deadbeef") for ctl in ("pids", "memory")]
    stale.append(Path("/sys/fs/cgroup/cpu", f"agentenv-{proc.pid}-deadbeef.s1"))
    if not _Cgroups().bases:
        pytest.skip("no cgroup v1 hierarchy")
    for d in stale[:2]:
        (d / "s1").mkdir(parents=True)
    stale[2].mkdir()
    async with LocalSandbox(limits=LIMITS, prewarm=0) as sb:
        s = await sb.session()
        dirs = list(s._cgroups)
        assert all(f"agentenv-{os.getpid()}-" in d for d in dirs)
        await s.aclose()
    assert not [d for d in stale if d.exists()]
    assert not [d for d in dirs if os.path.exists(d)]  # and its own are gone after close


# -- 8. deadlines that exception formatting cannot swallow ---------------------------------
async def test_hanging_exception_str_is_a_timeout(sandbox):
    code = "class E(Exception):\n    def __str__(self):\n        while True:\n            pass\nraise E()"
    r = await hostile(sandbox, code, timeout=1)
    assert r.status == "timeout" and not r.state_lost


async def test_exception_str_that_swallows_the_interrupt_is_a_timeout(sandbox):
    code = ("class E(Exception):\n    def __str__(self):\n        while True:\n            try:\n"
            "                while True:\n                    pass\n            except BaseException:\n"
            "                pass\nraise E()")
    r = await hostile(sandbox, code, timeout=1)
    assert r.status == "timeout" and r.state_lost


async def test_code_that_swallows_the_interrupt_and_returns_is_still_a_timeout(sandbox):
    code = "import time\ntry:\n    time.sleep(10)\nexcept KeyboardInterrupt:\n    pass\n'I finished in time'"
    r = await hostile(sandbox, code, timeout=0.5)
    assert r.status == "timeout" and r.value is None


async def test_hanging_repr_of_the_value_is_a_timeout(sandbox):
    r = await hostile(sandbox, "class V:\n    def __repr__(self):\n        while True:\n            pass\nV()", timeout=1)
    assert r.status == "timeout"


async def test_raising_keyboard_interrupt_itself_is_an_error_not_a_timeout(sandbox):
    r = await hostile(sandbox, "raise KeyboardInterrupt")
    assert r.status == "error" and "KeyboardInterrupt" in r.error


async def test_hostile_exit_code_object(sandbox):
    r = await hostile(sandbox, "import sys\nclass C:\n    def __str__(self):\n        while True:\n            pass\n"
                               "    __repr__ = __str__\nsys.exit(C())", timeout=1)
    assert r.status == "error" and "SystemExit: <C>" in r.error


# -- 9. sessions forked from one isolated template share nothing writable ---------------------
NS_IDS = "import os\n{k: os.readlink(f'/proc/self/ns/{k}') for k in ('mnt', 'net', 'pid', 'ipc', 'uts')}"


async def test_sessions_of_one_template_are_isolated_from_each_other(sandbox):
    a, b = await sandbox.session(), await sandbox.session()
    sandbox.spawned.update((a.pid, b.pid))
    try:
        ns_a, ns_b = [eval((await s.run(NS_IDS)).value) for s in (a, b)]
        assert all(ns_a[k] != ns_b[k] for k in ns_a), (ns_a, ns_b)  # a namespace of each kind per session
        leave = ("import os, socket\nopen('/tmp/left', 'w').write('a')\nopen('/dev/shm/left', 'w').write('a')\n"
                 "srv = socket.socket()\nsrv.bind(('127.0.0.1', 0))\nsrv.listen()\nport = srv.getsockname()[1]\n"
                 "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0agentenv-left')\nu.listen()\n(os.getpid(), port)")
        pid, port = eval((await a.run(leave)).value)
        assert pid == 1
        look = (f"import os, socket\nfound = [p for p in ('/tmp/left', '/dev/shm/left') if os.path.exists(p)]\n"
                f"def reach(fam, addr):\n    s = socket.socket(fam)\n    try:\n        s.connect(addr)\n        return True\n"
                f"    except OSError:\n        return False\n"
                f"(found, reach(socket.AF_INET, ('127.0.0.1', {port})), reach(socket.AF_UNIX, '\\0agentenv-left'), "
                f"os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
        found, tcp, unix, pid_b, procs = eval((await b.run(look)).value)
        assert (found, tcp, unix, pid_b, procs) == ([], False, False, 1, [1])
        # What lies under a session's own /tmp and /dev/shm (the template's view) is not writable.
        r = await b.run("import os\nos.statvfs('/').f_flag & os.ST_RDONLY, os.statvfs('/tmp').f_flag & os.ST_RDONLY")
        assert r.value == "(1, 0)"
        assert (await a.run("open('/tmp/left').read()")).value == "'a'"  # a's own state is intact
    finally:
        await a.aclose()
        await b.aclose()


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
    assert host_state() == before
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
    before = {p.pid for p in sleepers("4343")}  # another run's, if any: not this session's
    async with LocalSandbox(limits=LIMITS, prewarm=0, isolate=False) as sb:
        s = await sb.session()
        r = await s.run("import subprocess\np = subprocess.Popen(['sh', '-c', 'sleep 4343 & wait'], "
                        "start_new_session=True)\np.pid")
        assert r.status == "ok"
        await wait_for(lambda: {p.pid for p in sleepers("4343")} - before, "the session's sleeper started")
        await s.aclose()
        await wait_for(lambda: not {p.pid for p in sleepers("4343")} - before, "every process of the closed session gone")
    await check_sibling(sandbox)


def sleepers(tag: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", tag]]


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
            "    fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)\n    out = 'LEASED'\nexcept OSError as e:\n    out = e.errno\nout")
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
    open('/tmp/ready', 'w').write(repr(state))
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
    code = ("import resource as r\n[r.getrlimit(x)[0] for x in (r.RLIMIT_NPROC, r.RLIMIT_MSGQUEUE, r.RLIMIT_SIGPENDING, "
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


async def test_a_uid_is_reused_only_once_its_last_worker_is_reaped():
    uids = _Uids(private_uids(2), 8)
    try:
        first = uids.acquire()
        proc = await anyio.open_process(["sleep", "30"])
        uids.release(first, os.pidfd_open(proc.pid))
        second = uids.acquire()
        assert second != first  # its process still runs: a new uid instead
        proc.kill()
        await proc.wait()  # reaped
        assert uids.acquire() == first
    finally:
        uids.close()


def private_uids(slot: int) -> int:
    """The first of 8 uids of the sandbox's range that no other test, nor another test process
    on the machine, uses (uids are owned machine-wide, and a test that leaves uids handed out
    keeps them locked for its process's life)."""
    return LIMITS.uid + 48_000 + (os.getpid() % 1_000) * 16 + slot * 8


async def test_two_pools_and_two_processes_never_share_a_uid():
    base = private_uids(0)
    script = ("import sys\nsys.path.insert(0, '.')\nfrom agentenv.sandboxes.local.uids import _Uids\n"
              f"u = _Uids({base}, 6)\nprint([u.acquire() for _ in range(3)], flush=True)\n"
              "sys.stdin.read()\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        theirs = set(eval(other.stdout.readline()))
        a, b = _Uids(base, 6), _Uids(base, 6)
        try:
            ours = [a.acquire(), b.acquire(), a.acquire()]
            assert len(set(ours)) == 3 and not set(ours) & theirs
            with pytest.raises(SandboxError, match="every sandbox uid"):
                b.acquire()  # 3 + 3 of 6: none left on this machine
        finally:
            for pool, uid in zip((a, b, a), ours):
                pool.release(uid, None)
            a.close()
            b.close()
    finally:
        other.stdin.close()
        other.wait()
    c = _Uids(base, 6)  # the other process exited: its uids are free again
    try:
        assert len({c.acquire() for _ in range(6)}) == 6
    finally:
        c.close()


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
        assert (await s.run("6 * 7", timeout=10)).value == "42"  # thawed for its call, then frozen again
        await wait_for(lambda: is_frozen(s), "frozen again after the next call")
    finally:
        await s.aclose()
    await wait_for(lambda: not spinners(), "no spinner outlives the session")
    await check_sibling(sandbox)


async def test_nothing_is_written_on_the_channel_between_calls(sandbox):
    s = await sandbox.session()
    try:
        code = FORGE + "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), forge(seq + 1))).start()"
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
