"""The local sandbox: one persistent Python worker process per program session.

This first version gives a notebook-like stateful session per program, a per-call wall-clock
timeout (SIGINT, then kill-and-replace), output caps, a private temporary working directory,
a clean environment (the parent's variables, and so its secrets, are not passed), and
workers that die with their parent. It does NOT yet confine the code: no namespaces,
rlimits or seccomp (that is the hardened pool of a later issue). Do not run untrusted code
with it outside a throwaway machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

import anyio
from anyio.abc import Process

from ..base import ExecResult, Sandbox, Session
from agentenv.errors import SandboxError

WORKER = Path(__file__).with_name("worker.py")
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}


def _clean(s: str | None) -> str | None:
    # Lone surrogates (from undecodable bytes) would break UTF-8 JSONL later.
    return None if s is None else s.encode("utf-8", "replace").decode("utf-8")


class LocalSession(Session):
    def __init__(self, sandbox: "LocalSandbox") -> None:
        self._sandbox = sandbox
        self._proc: Process | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="agentenv-sbx-"))
        self._lock = anyio.Lock()
        self._closed = False
        self._setup_code: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def _start(self) -> None:
        try:
            self._proc = await anyio.open_process(
                [sys.executable, "-I", "-u", str(WORKER)],
                stdin=-1,
                stdout=-1,
                stderr=-3,  # DEVNULL
                cwd=str(self._tmp),
                env={**CLEAN_ENV, "HOME": str(self._tmp), "TMPDIR": str(self._tmp)},
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start a sandbox worker: {exc}") from exc
        self._sandbox._live.add(self)
        if self._setup_code:
            res = await self._call(self._setup_code, self._sandbox.setup_timeout)
            if res.status != "ok":
                raise SandboxError(f"environment setup code failed: {res.render()[-500:]}")

    async def _read_exact(self, n: int) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        buf = bytearray()
        while len(buf) < n:
            buf += await self._proc.stdout.receive(n - len(buf))
        return bytes(buf)

    async def _call(self, code: str, timeout: float) -> ExecResult:
        assert self._proc is not None and self._proc.stdin is not None
        payload = json.dumps({"code": code, "max_output": self._sandbox.max_output}).encode()
        start = time.perf_counter()
        await self._proc.stdin.send(struct.pack(">I", len(payload)) + payload)
        resp = None
        with anyio.move_on_after(timeout):
            resp = await self._read_frame()
        if resp is None:  # deadline: interrupt the code, give it a moment to unwind
            self._signal(signal.SIGINT)
            with anyio.move_on_after(self._sandbox.kill_grace):
                resp = await self._read_frame()
            if resp is None:
                await self._kill()
                return ExecResult(
                    "timeout",
                    error=f"TimeoutError: execution exceeded {timeout:g}s and was killed",
                    duration_s=time.perf_counter() - start,
                    state_lost=True,
                )
        if resp == "eof":
            await self._kill()
            return ExecResult(
                "crashed",
                error="the interpreter process died (crash or exit)",
                duration_s=time.perf_counter() - start,
                state_lost=True,
            )
        return ExecResult(
            status=resp["status"],
            stdout=_clean(resp["stdout"]) or "",
            stderr=_clean(resp["stderr"]) or "",
            value=_clean(resp["value"]),
            error=_clean(resp["error"]),
            duration_s=time.perf_counter() - start,
            truncated=resp["truncated"],
        )

    async def _read_frame(self):
        try:
            (n,) = struct.unpack(">I", await self._read_exact(4))
            return json.loads(await self._read_exact(n))
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return "eof"

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._sandbox._live.discard(self)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with anyio.CancelScope(shield=True):
            await proc.aclose()

    async def run(self, code: str, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("session is closed")
        timeout = self._sandbox.default_timeout if timeout is None else timeout
        async with self._lock:
            restarted = False
            if self._proc is None:
                restarted = True
                await self._start()
            try:
                res = await self._call(code, timeout)
            except BaseException:
                # Cancelled or broken mid-call: the worker's state is unknown, so drop it.
                with anyio.CancelScope(shield=True):
                    await self._kill()
                raise
            res.state_lost = res.state_lost or (restarted and self._started_once)
            self._started_once = True
            return res

    _started_once = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)


class LocalSandbox(Sandbox):
    """Hands out :class:`LocalSession` objects and closes every one still open on ``aclose``."""

    def __init__(
        self,
        default_timeout: float = 5.0,
        max_output: int = 2000,
        kill_grace: float = 0.5,
        setup_timeout: float = 60.0,
    ) -> None:
        self.default_timeout = default_timeout
        self.max_output = max_output
        self.kill_grace = kill_grace
        self.setup_timeout = setup_timeout
        self._live: set[LocalSession] = set()
        self._sessions: set[LocalSession] = set()
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        return [s.pid for s in self._live if s.pid is not None]

    async def session(self, setup_code: str | None = None) -> LocalSession:
        if self._closed:
            raise SandboxError("sandbox is closed")
        s = LocalSession(self)
        s._setup_code = setup_code
        self._sessions.add(s)
        # Start eagerly so a broken host fails here, and setup code runs before the first call.
        async with s._lock:
            await s._start()
            s._started_once = True
        return s

    async def aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            for s in list(self._sessions):
                await s.aclose()
        self._sessions.clear()
