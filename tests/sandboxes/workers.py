"""A real session worker on its own (``python -I worker.py`` over pipes, as the E2B test server
runs it), spoken to in the session protocol's frames, for the tests of the worker and the
protocol."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from agentenv.sandboxes.local.protocol import HEADER

from ..waiting import DEADLINE_S

WORKER = Path(__file__).resolve().parents[2] / "agentenv" / "sandboxes" / "local" / "worker.py"


class Standalone:
    """One worker process; :meth:`call` sends a request and returns the frame that answers it."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=cwd, env={"PATH": os.environ.get("PATH", "")})

    def send(self, code: str, seq: int = 7, max_output: int = 4000) -> None:
        payload = json.dumps({"code": code, "max_output": max_output}).encode()
        self.proc.stdin.write(HEADER.pack(len(payload), seq) + payload)
        self.proc.stdin.flush()

    def _read(self, n: int) -> bytes:
        out, end = b"", time.monotonic() + DEADLINE_S
        fd = self.proc.stdout.fileno()
        while len(out) < n:
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                raise AssertionError(f"no answer from the worker within {DEADLINE_S:.0f} s")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError(f"the worker closed its channel after {len(out)} of {n} bytes")
            out += chunk
        return out

    def frame(self) -> tuple[int, bytes]:
        """The next frame: its call number and raw payload."""
        n, seq = HEADER.unpack(self._read(HEADER.size))
        return seq, self._read(n)

    def call(self, code: str, seq: int = 7, max_output: int = 4000) -> dict:
        self.send(code, seq, max_output)
        got, payload = self.frame()
        assert got == seq, f"the answer to call {seq} carried number {got}"
        return json.loads(payload)

    def close(self) -> int:
        """Close its channel (EOF) and wait for it to exit; its exit status."""
        self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        finally:
            self.proc.stdout.close()
