"""A local server that speaks the E2B wire protocols the ``e2b-code-interpreter`` SDK uses.

For tests (and for trying the E2B backend without an account): point the *real* SDK at it
with ``api_url=server.url, sandbox_url=server.url`` (or ``E2B_API_URL``/``E2B_SANDBOX_URL``)
and any API key. It implements:

* control plane: ``POST /v2/sandboxes`` (create), ``DELETE /sandboxes/{id}`` (kill);
* code interpreter (port 49999 in the cloud): ``POST /contexts``, ``GET /contexts``,
  ``POST /contexts/{id}/restart``, ``DELETE /contexts/{id}``, and ``POST /execute``, which
  streams newline-delimited JSON events (``stdout``, ``stderr``, ``result``, ``error``,
  ``number_of_executions``, ``end_of_execution``) as the real service does.

Each context is a real persistent Python interpreter (``agentenv/sandboxes/local/worker.py`` over
pipes), so state, errors and slow code behave for real. It records what happened (sandboxes
created and killed, contexts, restarts) for assertions, and can answer the first N creates
with HTTP 429 to exercise rate-limit retries.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "local" / "worker.py"


# Kernels die with the thread that started them (PR_SET_PDEATHSIG is per thread), and request
# handler threads are short-lived: start every kernel from one long-lived thread.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-e2b-spawner")


class _Kernel:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc = self._spawn()
        self.count = 0

    @staticmethod
    def _spawn() -> subprocess.Popen:
        return _SPAWNER.submit(
            subprocess.Popen, [sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        ).result()

    def execute(self, code: str) -> dict:
        with self.lock:
            proc = self.proc
            self.count += 1
        payload = json.dumps({"code": code, "max_output": 100_000}).encode()
        try:
            proc.stdin.write(struct.pack(">IQ", len(payload), 1) + payload)  # worker.py's framing
            proc.stdin.flush()
            head = proc.stdout.read(12)
            n, _ = struct.unpack(">IQ", head)
            return json.loads(proc.stdout.read(n))
        except (OSError, struct.error, ValueError):
            return {"status": "error", "stdout": "", "stderr": "", "value": None,
                    "error": "KernelDied: the kernel was restarted or died"}

    def restart(self) -> None:
        with self.lock:
            old, self.proc = self.proc, self._spawn()
            self.count = 0
        old.kill()
        old.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class FakeE2BServer:
    def __init__(self, rate_limited_creates: int = 0) -> None:
        self.rate_limited_creates = rate_limited_creates
        self.created: list[str] = []
        self.killed: list[str] = []
        self.restarts = 0
        self.contexts: dict[str, _Kernel] = {}
        self.lock = threading.Lock()  # created, killed, contexts and stopped
        self.stopped = False
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def alive(self) -> list[str]:
        return [s for s in self.created if s not in self.killed]

    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self, port: int = 0) -> "FakeE2BServer":
        server = self

        class Handler(_Handler):
            fake = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def add_context(self) -> str | None:
        """A new context's id, its kernel started; None once the server is stopped. A request
        in flight when :meth:`stop` runs may get here after it: its kernel is killed, not left
        running with no one to stop it."""
        kernel, cid = _Kernel(), uuid.uuid4().hex[:12]  # the spawn is slow: not under the lock
        with self.lock:
            if not self.stopped:
                self.contexts[cid] = kernel
                return cid
        kernel.kill()
        return None

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()  # handler threads still running go on (daemon threads)
            self._httpd.server_close()
        with self.lock:
            self.stopped = True
            kernels = list(self.contexts.values())
            self.contexts.clear()
        for k in kernels:
            k.kill()

    def __enter__(self) -> "FakeE2BServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeE2BServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def _json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/contexts":
            with self.fake.lock:
                ids = list(self.fake.contexts)
            self._json(200, [{"id": c, "language": "python", "cwd": "/home/user"} for c in ids])
        elif self.path == "/health":
            self._empty(204)
        else:
            self._json(404, {"message": "not found"})

    def do_DELETE(self) -> None:  # noqa: N802
        parts = self.path.strip("/").split("/")
        if parts[0] == "sandboxes" and len(parts) == 2:
            with self.fake.lock:
                known = parts[1] in self.fake.created and parts[1] not in self.fake.killed
                if known:
                    self.fake.killed.append(parts[1])
            self._empty(204 if known else 404)
        elif parts[0] == "contexts" and len(parts) == 2:
            with self.fake.lock:
                kernel = self.fake.contexts.pop(parts[1], None)
            if kernel:
                kernel.kill()
            self._empty(204 if kernel else 404)
        else:
            self._json(404, {"message": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        parts = self.path.strip("/").split("/")
        if parts == ["v2", "sandboxes"]:
            with self.fake.lock:
                if self.fake.rate_limited_creates > 0:
                    self.fake.rate_limited_creates -= 1
                    return self._json(429, {"code": 429, "message": "rate limit exceeded"})
                sid = "sbx" + uuid.uuid4().hex[:10]
                self.fake.created.append(sid)
            return self._json(201, {"templateID": body.get("templateID", "code-interpreter-v1"), "sandboxID": sid,
                                    "clientID": "fake", "envdVersion": "0.2.4", "envdAccessToken": "tok"})
        if parts == ["contexts"]:
            cid = self.fake.add_context()
            if cid is None:
                return self._json(503, {"message": "the server is stopping"})
            return self._json(200, {"id": cid, "language": body.get("language") or "python",
                                    "cwd": body.get("cwd") or "/home/user"})
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            kernel = self.fake.contexts.get(parts[1])
            if kernel is None:
                return self._json(404, {"message": "context not found"})
            kernel.restart()
            self.fake.restarts += 1
            return self._empty(204)
        if parts == ["execute"]:
            return self._execute(body)
        self._json(404, {"message": "not found"})

    def _execute(self, body: dict) -> None:
        kernel = self.fake.contexts.get(body.get("context_id") or "")
        if kernel is None:
            return self._json(404, {"message": "context not found"})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()
        res = kernel.execute(body["code"])
        ts = time.time()
        events = []
        if res.get("stdout"):
            events.append({"type": "stdout", "text": res["stdout"], "timestamp": ts})
        if res.get("stderr"):
            events.append({"type": "stderr", "text": res["stderr"], "timestamp": ts})
        if res.get("value") is not None:
            events.append({"type": "result", "text": res["value"], "is_main_result": True})
        if res.get("error"):
            tb = res["error"]
            last = tb.strip().splitlines()[-1] if tb.strip() else "Error"
            name, _, value = last.partition(": ")
            events.append({"type": "error", "name": name, "value": value, "traceback": tb})
        events.append({"type": "number_of_executions", "execution_count": kernel.count})
        events.append({"type": "end_of_execution"})
        try:
            for e in events:
                self.wfile.write((json.dumps(e) + "\n").encode())
                self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True
