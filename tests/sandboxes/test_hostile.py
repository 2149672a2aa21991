"""Hostile code against the local sandbox: every case must be contained, and the pool must
keep serving afterwards. Real worker processes, real namespaces, real limits."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

import agentenv

from ..conftest import child_pids
from .hostile import LIMITS, MARK, SECRET, hostile, sleep_tag, sleepers, wait_for

pytestmark = pytest.mark.anyio

# -- resource exhaustion --------------------------------------------------------------------
async def test_fork_bomb(sandbox):
    # Counted in this test's own process tree (the pool's fork server and its sessions are
    # pytest's descendants), never machine-wide: other work on the machine must not fail it.
    before = len(child_pids())
    r = await hostile(
        sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout=2
    )
    assert r.status in ("timeout", "error", "crashed")
    assert len(child_pids()) < before + 40  # nothing of the bomb outlived its call


async def test_the_sessions_pids_limit_holds_while_its_processes_live(sandbox):
    # Children that stay alive while the parent forks on: the session's cgroup refuses the
    # fork that would exceed pids.max (the worker itself and its threads count too).
    code = ("import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nn")
    r = await hostile(sandbox, code, timeout=10)
    assert r.status == "ok", r
    assert 0 < int(r.value) < LIMITS.pids


async def test_memory_bomb_single_allocation(sandbox):
    r = await hostile(sandbox, "x = bytearray(8 * 1024**3)")
    assert r.status == "error" and "MemoryError" in r.error


async def test_memory_bomb_incremental(sandbox):
    r = await hostile(sandbox, "a = []\nwhile True:\n    a.append(bytearray(10**7))", timeout=10)
    assert r.status in ("error", "crashed") and (r.status == "crashed" or "MemoryError" in r.error)


async def test_infinite_loop(sandbox):
    r = await hostile(sandbox, "while True:\n    pass", timeout=2)
    assert r.status == "timeout" and not r.state_lost


async def test_cpu_spin_in_thread_ignoring_interrupts(sandbox):
    code = ("import threading\ndef spin():\n    while True:\n        pass\n"
            "t = threading.Thread(target=spin, daemon=True)\nt.start()\nt.join()")
    r = await hostile(sandbox, code, timeout=2)
    assert r.status == "timeout"


async def test_busy_c_extension_loop_is_killed(sandbox):
    # sum() over a range runs in C and never checks for signals: only a kill stops it.
    r = await hostile(sandbox, "sum(range(10**13))", timeout=2)
    assert r.status == "timeout" and r.state_lost


async def test_infinite_recursion(sandbox):
    r = await hostile(sandbox, "def f(n):\n    return f(n + 1)\nf(0)")
    assert r.status == "error" and "RecursionError" in r.error


async def test_sleeping_forever(sandbox):
    r = await hostile(sandbox, "import time\ntime.sleep(10**6)", timeout=2)
    assert r.status == "timeout" and not r.state_lost


async def test_ignoring_sigint_is_killed(sandbox):
    r = await hostile(
        sandbox, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", timeout=2
    )
    assert r.status == "timeout" and r.state_lost


async def test_too_many_open_files(sandbox):
    r = await hostile(sandbox, "fs = [open('/dev/null') for _ in range(10000)]")
    assert r.status == "error" and "Too many open files" in r.error


async def test_filling_the_temp_disk(sandbox):
    r = await hostile(
        sandbox, "with open('/tmp/big', 'wb') as f:\n    for _ in range(100):\n        f.write(b'x' * 10**6)"
    )
    assert r.status in ("error", "crashed")  # EFBIG / ENOSPC / SIGXFSZ


# -- network --------------------------------------------------------------------------------
async def test_tcp_egress(sandbox):
    r = await hostile(sandbox, "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)")
    assert r.status == "error" and ("unreachable" in r.error or "OSError" in r.error)


async def test_udp_egress(sandbox):
    r = await hostile(sandbox, "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                               "s.sendto(b'x', ('8.8.8.8', 53))")
    assert r.status == "error" and "unreachable" in r.error


async def test_dns_lookup(sandbox):
    r = await hostile(sandbox, "import socket\nsocket.getaddrinfo('example.com', 80)")
    assert r.status == "error"


async def test_host_loopback_services_unreachable(sandbox):
    r = await hostile(sandbox, "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert r.status == "error"


async def test_only_a_loopback_interface(sandbox):
    r = await hostile(sandbox, "sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:])")
    assert r.value == "['lo']"


# -- filesystem -----------------------------------------------------------------------------
async def test_write_outside_temp_dir(sandbox):
    for path in ("/etc/agentenv-pwn", "/usr/agentenv-pwn", sys.executable + "-pwn"):
        r = await hostile(sandbox, f"open({path!r}, 'w').write('x')")
        assert r.status == "error" and ("Read-only" in r.error or "No such file" in r.error), path
        assert not os.path.exists(path)
    # The checkout: hidden, or (when it lies under /tmp) inside the sandbox's private tmpfs.
    path = os.path.abspath("pwn.txt")
    await hostile(sandbox, f"open({path!r}, 'w').write('x')")
    assert not os.path.exists(path)


async def test_host_tmp_is_not_the_sandbox_tmp(sandbox):
    r = await hostile(sandbox, f"open({MARK!r}, 'w').write('x')")
    assert r.status == "ok" and not os.path.exists(MARK)


async def test_reading_private_host_files(sandbox):
    # A hidden directory is absent from the session's root; /root holds only what the Python
    # installation needs where it lives there.
    r = await hostile(sandbox, "import os\nls = lambda d: os.listdir(d) if os.path.isdir(d) else []\n"
                               "(open('/etc/shadow').read(), ls('/root'), ls('/home'))")
    assert r.status == "ok"
    shadow, root, home = eval(r.value)
    assert shadow == "" and root in ([], [".pyenv"]) and home == []


async def test_reading_the_repository(sandbox):
    # This file, and the checkout's root files beside the package (an editable install puts
    # that root on sys.path; the sandbox must not keep it visible for that).
    root = os.path.dirname(os.path.dirname(os.path.abspath(agentenv.__file__)))
    for path in (os.path.abspath(__file__), os.path.join(root, "pyproject.toml")):
        r = await hostile(sandbox, f"open({path!r}).read()")
        assert r.status == "error" and "No such file" in r.error, path


async def test_remount_is_refused(sandbox):
    r = await hostile(sandbox, "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                               "(libc.mount(b'none', b'/', None, 32 | 4096, None), ctypes.get_errno())")
    assert r.value == "(-1, 1)"  # EPERM: no CAP_SYS_ADMIN


async def test_deleting_its_own_files_and_changing_cwd(sandbox):
    r = await hostile(sandbox, "import os, shutil\nos.chdir('/')\nshutil.rmtree('/tmp', ignore_errors=True)\n"
                               "os.listdir('/tmp')", timeout=10)  # correctness, not speed: a loaded machine
    assert r.status == "ok"


# -- processes, signals, environment --------------------------------------------------------
async def test_reading_the_parent_environment(sandbox):
    r = await hostile(sandbox, f"import os\n(os.environ.get({SECRET!r}), open('/proc/1/environ', 'rb').read())")
    assert r.status == "ok" and "hunter2" not in r.value


async def test_cannot_see_host_processes(sandbox):
    r = await hostile(sandbox, "import os\n[p for p in os.listdir('/proc') if p.isdigit()]")
    assert r.value == "['1']"


async def test_killing_the_parent_and_everyone(sandbox):
    me = os.getpid()
    r = await hostile(sandbox, f"import os, signal\nfor pid in (os.getppid(), {me}, -1):\n    try:\n"
                               "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass")
    assert r.status in ("crashed", "ok", "error")
    assert psutil.pid_exists(me)


async def test_killing_a_sibling_session(sandbox):
    other = await sandbox.session()
    sandbox.spawned.add(other.pid)
    try:
        await hostile(sandbox, f"import os\nos.kill({other.pid}, 9)")
        assert (await other.run("'alive'")).value == "'alive'" and not (await other.run("1")).state_lost
    finally:
        await other.aclose()


async def test_signals_to_itself(sandbox):
    # The worker is pid 1 of its namespace: signals without a handler, sent from inside, are
    # dropped by the kernel; whatever happens, the host and the pool are unaffected.
    r = await hostile(sandbox, "import os, signal\nfor s in (signal.SIGTERM, signal.SIGSEGV, signal.SIGSTOP):\n"
                               "    os.kill(os.getpid(), s)\n'still here'")
    assert r.status in ("ok", "crashed")


async def test_os_exit(sandbox):
    r = await hostile(sandbox, "import os\nos._exit(7)")
    assert r.status == "crashed"


async def test_sys_exit(sandbox):
    r = await hostile(sandbox, "import sys\nsys.exit(3)")
    assert r.status == "error" and "SystemExit" in r.error


async def test_segfault_via_ctypes(sandbox):
    r = await hostile(sandbox, "import ctypes\nctypes.string_at(0)")
    assert r.status == "crashed"


async def test_spawning_subprocesses(sandbox):
    tag = sleep_tag(4242)
    r = await hostile(sandbox, f"import subprocess\np = subprocess.Popen(['sleep', '{tag}'])\np.pid")
    assert r.status == "ok"
    await wait_for(lambda: not sleepers(tag),
                   "the call's subprocess was killed with the call")


async def test_forked_child_cannot_answer_for_the_worker(sandbox):
    r = await hostile(
        sandbox, "import os, time\nif os.fork() == 0:\n    time.sleep(0.2)\nelse:\n    time.sleep(0.5)\n'parent'"
    )
    assert r.value == "'parent'"


async def test_leaving_daemon_threads(sandbox):
    r = await hostile(
        sandbox, "import threading, time\nthreading.Thread(target=time.sleep, args=(1000,), daemon=True).start()"
    )
    assert r.status == "ok"


async def test_stdin_reads(sandbox):
    r = await hostile(sandbox, "input('give me data: ')")
    assert r.status == "error" and "EOFError" in r.error


async def test_privilege_escalation_via_setuid_binary(sandbox):
    r = await hostile(
        sandbox, "import subprocess\nsubprocess.run(['su', '-c', 'id'], capture_output=True, timeout=2).returncode"
    )
    assert r.status in ("ok", "error") and r.value != "0"


# -- output ---------------------------------------------------------------------------------
async def test_huge_stdout(sandbox):
    r = await hostile(sandbox, "for _ in range(1000):\n    print('x' * 100000)")
    assert r.status == "ok" and r.truncated and len(r.stdout) <= sandbox.max_output


async def test_huge_trailing_value(sandbox):
    r = await hostile(sandbox, "'y' * 10**7")
    assert r.status == "ok" and len(r.value) <= sandbox.max_output + 3


async def test_invalid_utf8_and_binary_output(sandbox):
    r = await hostile(sandbox, "import sys\nprint(bytes(range(256)).decode('latin-1'))\n"
                               "print(b'\\xff\\xfe'.decode('utf-8', 'surrogateescape'))")
    assert r.status == "ok"
    r.render().encode("utf-8")


async def test_garbage_on_the_protocol_socket(sandbox):
    r = await hostile(sandbox, "import os\nfor fd in range(3, 64):\n    try:\n"
                               "        os.write(fd, b'\\xff' * 64)\n    except OSError:\n        pass")
    # A frame that answers no call: the session is killed, the call an error.
    assert r.status == "error" and r.state_lost and "SandboxError" in r.error and "killed" in r.error


async def test_seccomp_denies_kernel_surface(sandbox):
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "out = []\nfor call in (lambda: libc.unshare(0x10000000), lambda: libc.ptrace(16, 1, 0, 0)):\n"
            "    ctypes.set_errno(0)\n    out.append((call(), ctypes.get_errno()))\nout")
    r = await hostile(sandbox, code)
    assert r.value == "[(-1, 1), (-1, 1)]"  # user namespaces and ptrace: EPERM


async def test_only_system_dirs_and_the_python_installation_are_visible(sandbox):
    # An allowlist: whatever the host's root holds (a checkout under /check, /data, ...), every
    # top-level entry outside the system dirs is empty, apart from the Python installation and
    # agentenv's own package (not every sys.path entry: an editable install puts the checkout's
    # root there).
    package = os.path.dirname(os.path.abspath(agentenv.__file__))
    code = ("import os, sys\n"
            "system = {'/bin','/sbin','/lib','/lib32','/lib64','/libx32','/usr','/etc','/dev','/proc','/sys','/tmp'}\n"
            f"keep = {{os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, {package!r})}}\n"
            "leaks = []\n"
            "for name in os.listdir('/'):\n"
            "    top = '/' + name\n"
            "    if top in system or os.path.islink(top):\n"
            "        continue\n"
            "    if os.path.isfile(top):\n"
            "        leaks += [top] if open(top, 'rb').read() else []\n"
            "        continue\n"
            "    for d, subdirs, files in os.walk(top):\n"
            "        if any(d == k or d.startswith(k + '/') for k in keep):\n"
            "            subdirs[:] = []\n"
            "            continue\n"
            "        leaks += [os.path.join(d, f) for f in files]\n"
            "leaks")
    r = await hostile(sandbox, code)
    assert r.status == "ok", r.error
    assert r.value == "[]"
