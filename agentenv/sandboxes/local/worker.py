"""A persistent, stateful Python worker: the process that runs a session's code.

In the local sandbox it is forked by the fork server (``forkserver.py``) and serves frames
from the host on the session socket (``serve``). Standalone, ``python -I worker.py`` speaks the
same frames on the stdin/stdout pipes it was started with (the E2B test server uses this),
then points fds 0-2 at /dev/null so that stray writes from user code (``os.write(1, ...)``)
cannot reach the channel directly. Python-level stdout/stderr are captured per call into
capped buffers. Framing (``protocol.py``): header ``>IQ`` (length, call number) + JSON.

Request:  {"code": str, "max_output": int}
Response: {"status": "ok"|"error"|"timeout", "stdout", "stderr", "value", "error",
           "truncated": bool, "duration_s": float}

A timeout is delivered by the host as SIGINT, which surfaces as KeyboardInterrupt inside
the user's code; the host kills the worker if that does not come back in time, and reports
``timeout`` whatever the worker says once the deadline has passed.
"""

import ast
import ctypes
import io
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import ERROR_CAP, HEADER  # noqa: E402

PR_SET_PDEATHSIG = 1


class CappedIO(io.TextIOBase):
    """A text sink that keeps the first ``cap`` characters and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[str] = []
        self.size = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = self.cap - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def getvalue(self) -> str:
        return "".join(self.parts)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


class _Interrupted:
    """Whether the host's SIGINT (its deadline) arrived during this call: then the call is a
    timeout whatever the code did with the KeyboardInterrupt (swallowed it, or hung in an
    exception's ``__str__`` while we formatted it). It interrupts only while ``execute`` runs
    the call (``armed``): one that arrives as the answer goes out (in the sweep, the write or
    back at the read) must not end the worker, whose call has been answered."""

    flag = False
    armed = False

    @classmethod
    def handler(cls, signum, frame):  # noqa: ANN001
        cls.flag = True
        if cls.armed:
            raise KeyboardInterrupt


def _code_frames_only(te: traceback.TracebackException, seen: set[int]) -> None:
    """Keep only the frames of the user's code (``<code>``) in ``te`` and every exception
    chained to it: the worker's own frames and the libraries' (e.g. ``ast.py`` for a
    ``SyntaxError``) would show host paths to the model."""
    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == "<code>"])
    for other in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if other is not None:
            _code_frames_only(other, seen)


def _short_traceback(exc: BaseException) -> str:
    """The traceback of the user's code only (``<code>`` frames), capped in length.
    Formatting runs the exception's own ``__str__``: that is user code too."""
    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
        _code_frames_only(te, set())
        text = "".join(te.format())
    except BaseException:  # noqa: BLE001 - a hostile __str__/__repr__, or the deadline
        text = f"{type(exc).__name__}: <the exception could not be formatted>"
    if len(text) > ERROR_CAP // 2:
        text = text[:600] + "\n...\n" + text[-1200:]
    return text


def execute(code: str, ns: dict, max_output: int) -> dict:
    out, err = CappedIO(max_output), CappedIO(max_output)
    status, value, error = "ok", None, None
    start = time.perf_counter()
    old_out, old_err, old_in = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO("")
    _Interrupted.flag, _Interrupted.armed = False, True
    try:
        tree = ast.parse(code, filename="<code>", mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<code>", "exec"), ns)
        if last is not None:
            result = eval(compile(last, "<code>", "eval"), ns)
            if result is not None:
                value = repr(result)
                if len(value) > max_output:
                    value = value[:max_output] + "..."
    except SystemExit as exc:
        code = exc.code if type(exc.code) in (int, str, type(None)) else f"<{type(exc.code).__name__}>"
        status, error = "error", f"SystemExit: {code}"[:ERROR_CAP]
    except BaseException as exc:  # noqa: BLE001 - user code may raise anything
        if _Interrupted.flag:
            status = "timeout"
        else:
            status, error = "error", _short_traceback(exc)
    finally:
        sys.stdout, sys.stderr, sys.stdin = old_out, old_err, old_in
    if _Interrupted.flag:
        status, value, error = "timeout", None, "TimeoutError: execution exceeded the time limit"
    _Interrupted.armed = False  # a signal from here on finds the call answered (the host says timeout)
    return {
        "status": status,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "value": value,
        "error": error,
        "truncated": bool(out.dropped or err.dropped),
        "duration_s": time.perf_counter() - start,
    }


def _read_exact(f, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _write_all(fd: int, data: bytes, _write=os.write) -> None:
    """Write ``data`` to ``fd`` with the ``os.write`` captured when this module loaded, before
    any user code ran: nothing user code can hook runs between the sweep and the answer."""
    view = memoryview(data)
    while view:
        view = view[_write(fd, view):]


def serve(rf, wf, ns: dict, after_call=None, _dumps=json.dumps, _pack=HEADER.pack) -> None:
    """Answer framed requests on (rf, wf) until EOF. ``after_call`` runs after each call's
    code, once its answer is serialised and just before it is written (the sandbox uses it to
    end the call's background processes): code hooked into the serialisation (a wrapped
    ``json.dumps``, an exception's ``__repr__``) runs before the sweep, never after it. The
    serialiser, header packer and writer are the ones this module captured at import."""
    signal.signal(signal.SIGINT, _Interrupted.handler)
    me, out = os.getpid(), wf.fileno()
    while True:
        try:
            n, seq = HEADER.unpack(_read_exact(rf, HEADER.size))
            req = json.loads(_read_exact(rf, n))
            resp = execute(req["code"], ns, int(req.get("max_output", 4000)))
            payload = _dumps(resp, ensure_ascii=True).encode()
            frame = _pack(len(payload), seq) + payload
        except KeyboardInterrupt:  # a late timeout signal between calls: ignore it
            continue
        except (EOFError, OSError):
            break
        if os.getpid() != me:  # a process the user's code forked must never answer
            os._exit(0)
        if after_call is not None:
            after_call()
        try:
            _write_all(out, frame)
        except (OSError, KeyboardInterrupt):
            break


def main() -> None:
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
    rf = os.fdopen(os.dup(0), "rb", buffering=0)
    wf = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    serve(rf, wf, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
