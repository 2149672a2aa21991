"""The session's system-call policy (``syscalls.py``): the allow-list and the names denied
with EPERM against this architecture's syscall table, the argument filter's rules (evaluated
here as the kernel would, every value of the arguments they read), the compiled programs,
and the three outcomes in a real session."""

from __future__ import annotations

import errno
import platform
import re

import pytest

from agentenv.sandboxes.local import syscalls

from .hostile import LIBC, hostile, x86_64

pytestmark = pytest.mark.anyio
pyseccomp = pytest.importorskip("pyseccomp")


def denies(call: str, *args: int) -> int | None:
    """The errno the argument filter fails ``call(*args)`` with, None if it lets it through
    (each rule is a conjunction of comparisons of 64-bit argument values, as libseccomp's)."""
    for err, name, conditions in syscalls.arg_rules():
        if name != call:
            continue
        held = True
        for arg, op, datum, *value in conditions:
            x = args[arg] if arg < len(args) else 0
            held &= {"MASKED_EQ": lambda: x & datum == value[0], "EQ": lambda: x == datum,
                     "GT": lambda: x > datum, "GE": lambda: x >= datum}[op]()
        if held:
            return err
    return None


def test_madvise_is_denied_for_every_advice_but_the_allowed_ones():
    for advice in [*range(300), 1 << 20, (1 << 32) | 4, (1 << 63) | 4, 2**64 - 1]:
        expected = None if advice in syscalls.MADV_ALLOWED else errno.EPERM
        assert denies("madvise", 0, 4096, advice) == expected, advice


def test_socket_families_fadvise_and_nowait_reads_are_denied_by_argument():
    for call in ("socket", "socketpair"):
        for family in [*range(64), (1 << 32) | 1, 2**64 - 1]:  # a high bit: the kernel reads an int
            expected = None if family in syscalls.ALLOWED_FAMILIES else errno.EAFNOSUPPORT
            assert denies(call, family, 1, 0) == expected, (call, family)
    assert [denies("fadvise64", 3, 0, 0, advice) for advice in range(7)] == [None] * 4 + [errno.EPERM] * 3
    for call in ("preadv2", "pwritev2"):
        assert denies(call, 3, 0, 1, 0, 0, syscalls.RWF_NOWAIT | 1) == errno.EPERM
        assert denies(call, 3, 0, 1, 0, 0, 1) is None  # RWF_HIPRI: waits, allowed


def test_namespace_flags_watches_leases_and_peer_credentials_are_denied_by_argument():
    sigchld = 17
    for flag in syscalls.NAMESPACE_FLAGS:
        assert denies("clone", flag | sigchld) == errno.EPERM, hex(flag)
    assert denies("clone", sigchld) is None and denies("clone", 0x3D0F00) is None  # fork, a thread
    high = 1 << 32
    for cmd in syscalls.FCNTL_DENY:
        assert denies("fcntl", 3, cmd) == denies("fcntl", 3, high | cmd) == errno.EPERM
    assert denies("fcntl", 3, 4) is None  # F_SETFL
    for call, opts in (("getsockopt", syscalls.PEER_GETSOCKOPT), ("setsockopt", syscalls.PEER_SETSOCKOPT)):
        for opt in opts:
            assert denies(call, 3, syscalls.SOL_SOCKET, high | opt) == errno.EPERM, (call, opts[opt])
            assert denies(call, 3, 6, opt) is None  # the same number at another level (TCP) is another option
    assert denies("getsockopt", 3, syscalls.SOL_SOCKET, 3) is None  # SO_TYPE


def test_the_filters_compile_to_two_classic_bpf_programs():
    allow, args = syscalls.compile_filters()
    assert allow and args and len(allow) % 8 == 0 and len(args) % 8 == 0  # whole sock_filter instructions
    assert len(allow) // 8 < 4096 and len(args) // 8 < 4096  # BPF_MAXINSNS: the kernel loads each


# Numbers the installed libseccomp may not know yet (x86_64), from the kernel's syscall table.
NEWER_X86_64 = {
    335: "uretprobe",
    336: "uprobe",
    457: "statmount",
    458: "listmount",
    459: "lsm_get_self_attr",
    460: "lsm_set_self_attr",
    461: "lsm_list_modules",
    462: "mseal",
    463: "setxattrat",
    464: "getxattrat",
    465: "listxattrat",
    466: "removexattrat",
    467: "open_tree_attr",
    468: "file_getattr",
    469: "file_setattr",
}
TABLE_TOP = 512
# Calls the kernel passes through seccomp unfiltered: only a uprobe's own trampoline may make
# them, and anyone else gets SIGILL (test_escapes_fourth_audit.py checks).
KERNEL_EXEMPT = {"uretprobe", "uprobe"}


def syscall_table() -> dict[int, str]:
    """The running architecture's syscall numbers and names, from libseccomp's resolver and
    (for numbers it does not know) the table above."""
    pyseccomp = pytest.importorskip("pyseccomp")
    table = dict(NEWER_X86_64) if platform.machine() == "x86_64" else {}
    for nr in range(TABLE_TOP):
        try:
            table[nr] = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr).decode()
        except ValueError:
            pass
    return table


def test_every_syscall_of_the_table_is_allowed_with_a_reason_or_denied():
    table = syscall_table()
    names = set(table.values())
    allowed = {n for n in names if n in syscalls.ALLOWED}
    denied_by_name = {n for n in names if n in syscalls.DENIED}
    exempt = names & KERNEL_EXEMPT
    by_default = names - allowed - denied_by_name - exempt  # the allow-list's default: ENOSYS
    unknown = names - allowed - denied_by_name - by_default - exempt
    assert not set(syscalls.ALLOWED) & set(syscalls.DENIED)
    assert all(syscalls.ALLOWED[n].strip() for n in allowed)
    if platform.machine() == "x86_64":  # a typo in the allow-list would allow nothing, silently
        assert set(syscalls.ALLOWED) <= names, set(syscalls.ALLOWED) - names
    print(f"\nsyscall table ({platform.machine()}, {len(names)} calls): allowed with a reason {len(allowed)}, "
          f"denied by name {len(denied_by_name)}, denied by default {len(by_default)}, exempt by the kernel "
          f"{len(exempt)}, unknown {len(unknown)}")
    assert not unknown and len(allowed) + len(denied_by_name) + len(by_default) + len(exempt) == len(names)


def test_no_newer_variant_of_a_denied_call_is_allowed():
    """``quotactl`` denied means ``quotactl_fd`` too; ``open_tree``, ``open_tree_attr``;
    ``mount``, ``mount_setattr``; ``inotify_init``, ``inotify_init1``: no name that is a denied
    one with a variant's suffix is allowed."""
    names = set(syscall_table().values())
    denied = names - set(syscalls.ALLOWED)
    suffix = re.compile(r"(_fd|_attr|_setattr|_getattr|[0-9]+|at|at2|_at)")
    variants = [(d, n) for d in denied for n in names
                if n.startswith(d) and suffix.fullmatch(n[len(d):]) and n in syscalls.ALLOWED]
    assert not variants, variants
    assert {"quotactl_fd", "mount_setattr", "open_tree_attr", "inotify_init1"} <= denied


@x86_64
@pytest.mark.slow
async def test_every_call_off_the_allow_list_fails_in_a_session(sandbox):
    """Called for real, with zero arguments, in a child: each is refused before the kernel
    runs it (EPERM when denied by name, ENOSYS otherwise)."""
    table = syscall_table()
    nrs = sorted(nr for nr in range(TABLE_TOP) if table.get(nr) not in set(syscalls.ALLOWED) | KERNEL_EXEMPT)
    code = (LIBC + f"nrs = {nrs!r}\nr, w = os.pipe()\npid = os.fork()\nif pid == 0:\n"
            "    bad = []\n    for nr in nrs:\n        ctypes.set_errno(0)\n        ret = libc.syscall(nr, 0, 0, 0, "
            "0, 0, 0)\n"
            "        if ret != -1 or ctypes.get_errno() not in (1, 38):\n            bad.append((nr, ret, "
            "ctypes.get_errno()))\n"
            "    os.write(w, repr(bad).encode())\n    os._exit(0)\nos.close(w)\nout = os.read(r, 1 << 16)\n"
            "_, status = os.waitpid(pid, 0)\n(out.decode(), status)")
    r = await hostile(sandbox, code, timeout=20)
    assert r.value == "('[]', 0)", r


async def test_a_session_gets_eperm_for_a_denied_call_and_enosys_for_one_off_the_list(sandbox):
    names = {"denied": "flock", "unlisted": "sync", "allowed": "getppid"}
    assert "flock" in syscalls.DENIED and "sync" not in syscalls.ALLOWED and "sync" not in syscalls.DENIED
    nrs = {k: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, v) for k, v in names.items()}
    code = (LIBC + "out = {}\n"
            f"for what, nr in {nrs!r}.items():\n"
            "    ctypes.set_errno(0)\n    out[what] = (libc.syscall(nr, 0, 2), ctypes.get_errno())\nout")
    r = await hostile(sandbox, code)
    assert eval(r.value) == {"denied": (-1, errno.EPERM), "unlisted": (-1, errno.ENOSYS), "allowed": (0, 0)}, r
