"""Escapes an independent audit found (issue 9), one class per section, each with cases of
our own: every one must fail closed, leave the host unchanged and the pool healthy."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from agentenv.sandboxes.local import LocalSandbox, _Cgroups

from ..waiting import until
from .hostile import FORGE, LIBC, LIMITS, SPIN, hostile, spinners, syscall, x86_64

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

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
    code = ("import os\nstatus = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if "
            "':\\t' in l)\n"
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
            "hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)\ndata = (ctypes.c_uint32 * 6)(0xffffffff, 0, 0xffffffff, 0, "
            "0, 0)\n"
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
    s = await sandbox.session()
    try:
        assert (await s.run("1")).value == "1"
        with open(f"/proc/{s.pid}/cgroup") as f:
            assert "agentenv-" in f.read()  # the session is in its own cgroups all the same
    finally:
        await s.aclose()
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
@pytest.mark.parametrize(
    "nr,args",
    [
        (430, (b"tmpfs", 0)),
        (428, (-100, b"/", 1)),
        (429, (-100, b"/tmp", -100, b"/mnt", 0)),
        (433, (-100, b"/", 0)),
        (442, (-100, b"/", 0x8000, 0, 32)),
    ],
    ids=["fsopen", "open_tree", "move_mount", "fspick", "mount_setattr"],
)
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
    mark = f"/dev/shm/agentenv-host-mark-{os.getpid()}"  # this run's: a run beside it makes its own
    open(mark, "w").close()
    try:
        code = ("import os\nopen('/dev/null', 'w').write('x')\nz = open('/dev/zero', 'rb').read(4)\n"
                "u = len(open('/dev/urandom', 'rb').read(8))\nseen = os.listdir('/dev/shm')\nfull = None\n"
                "try:\n    with open('/dev/shm/big', 'wb') as f:\n        f.write(b'x' * (LIMIT + 1) * 2**20)\n"
                "except OSError as e:\n    full = e.errno\n(z, u, seen, full)").replace("LIMIT", str(LIMITS.shm_mb))
        r = await hostile(sandbox, code)
    finally:
        os.unlink(mark)
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


async def test_a_forged_result_never_shifts_later_calls(sandbox):
    # Code can make its own call return what it likes (it could print it, too); the genuine
    # answer that follows carries the old call's number and is dropped at the next call
    # (issue 48: stale, not fatal): no call ever gets another call's result.
    s = await sandbox.session()
    try:
        r1 = await s.run(FORGE + "forge(seq)\n'genuine-1'")
        assert r1.stdout in ("FORGED", "") and len(r1.stdout) <= sandbox.max_output
        r2 = await s.run("'genuine-2'")
        assert r2.status == "ok" and r2.value == "'genuine-2'" and not r2.state_lost, r2
        assert (await s.run("'genuine-3'")).value == "'genuine-3'"
    finally:
        await s.aclose()
    await hostile(sandbox, FORGE + "forge(seq)")


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
        code = (
            FORGE
            + "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), forge(seq + 1))).start()"
        )
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
async def test_setsid_background_processes_end_with_the_call(sandbox):
    code = (f"import subprocess, os\nfor _ in range(4):\n    subprocess.Popen({SPIN}, start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n"
            "        while True:\n            time.sleep(1)\n    os._exit(0)\n"
            "import os\nlen([p for p in os.listdir('/proc') if p.isdigit()])")
    r = await hostile(sandbox, code)
    assert r.status == "ok" and int(r.value) >= 5
    assert not spinners()


def cpu_usage_us(session) -> int:
    """The CPU time (µs) every process of ``session`` has used, from its own cgroup."""
    for d in session._cgroups:
        stat = Path(d, "cpu.stat")
        if stat.exists() and (usage := [ln for ln in stat.read_text().splitlines() if ln.startswith("usage_usec ")]):
            return int(usage[0].split()[1])
    raise AssertionError(f"no cgroup of the session accounts its CPU (usage_usec in cpu.stat): {session._cgroups}")


async def test_a_session_full_of_spinners_gets_one_cpu_share(sandbox):
    # Both sessions want the CPUs at once: one process in one, eight spinners in the other. What
    # each gets is read from its own cgroup over the same window, so the machine's other load
    # (another test run, a build) takes from both alike and only their ratio is compared: about
    # 1 with a share per session, 8 if the spinners were scheduled as eight processes.
    fresh = await sandbox.session()
    spinner = await sandbox.session()
    one = "import time\nwhile time.process_time() < 1.5:\n    pass\n'done'"
    eight = (f"import subprocess, time\nps = [subprocess.Popen({SPIN}) for _ in range(8)]\n"
             "def cpu():\n    return sum(sum(map(int, open(f'/proc/{p.pid}/stat').read().rsplit(')', 1)[1]"
             ".split()[11:13])) for p in ps)\n"
             "while cpu() < 400:\n    time.sleep(0.05)\nlen(ps)")  # 4 s of the spinners' CPU, in 1/100 s
    ended: list[str] = []
    try:
        async def run(session, code: str) -> None:
            ended.append((await session.run(code, timeout=120)).value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, spinner, eight)
            await until(lambda: len(spinners()) == 8, "the eight spinners run")
            tg.start_soon(run, fresh, one)
            start = cpu_usage_us(fresh)
            await until(lambda: cpu_usage_us(fresh) > start or ended, "the one process runs")
            f0, s0 = cpu_usage_us(fresh), cpu_usage_us(spinner)
            # a window of 0.4 s of the one process's CPU, or less if either call ends first
            await until(lambda: cpu_usage_us(fresh) - f0 >= 400_000 or ended, "the window of CPU")
            window = cpu_usage_us(fresh) - f0, cpu_usage_us(spinner) - s0
        assert sorted(ended) == ["'done'", "8"], ended
    finally:
        await fresh.aclose()
        await spinner.aclose()
    assert window[0] > 0, window
    assert window[1] < 3 * window[0], f"CPU in one window (µs), the one process's and the eight spinners': {window}"
    assert not spinners()


async def test_a_cpu_cap_throttles_a_session():
    from dataclasses import replace

    # A cap of a twentieth of a CPU: four spinners exceed it even on a machine so busy that
    # they get a small share of a core between them, so the cap, not the load, is what is seen.
    async with LocalSandbox(limits=replace(LIMITS, cpus=0.05), prewarm=0) as sb:
        s = await sb.session()
        try:
            # Until the spinners have used 0.1 s of CPU between them: at the cap that takes at
            # least 2 s, twenty periods of 0.1 s, so the cap has throttled them by then however
            # slow the machine (utime is field 14 of /proc/PID/stat, in 1/100 s).
            r = await s.run(f"import subprocess, time\nps = [subprocess.Popen({SPIN}) for _ in range(4)]\n"
                            "def cpu():\n    return sum(int(open(f'/proc/{p.pid}/stat').read().rsplit(')', 1)[1]"
                            ".split()[11]) for p in ps)\n"
                            "while cpu() < 10:\n    time.sleep(0.05)\nlen(ps)", timeout=120)
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
    assert quota == max(1000, int(0.05 * period)) and int(stat["nr_throttled"]) > 0 and int(stat["throttled_time"]) > 0
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
                 "        if pid == 0:\n            time.sleep(600)\n            os._exit(0)\n        "
                 "kids.append(pid)\n"
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
    r = await hostile(
        sandbox, "class V:\n    def __repr__(self):\n        while True:\n            pass\nV()", timeout=1
    )
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
                f"def reach(fam, addr):\n    s = socket.socket(fam)\n    try:\n        s.connect(addr)\n        "
                f"return True\n"
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


