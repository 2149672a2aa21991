"""Sessions that stop taking calls: code run in a session (each evaluates to 'armed') after
which the worker no longer reads its socket, or reads it too slowly to matter. Shared by
``test_deadlines.py`` and ``bench/sandbox_deadlines.py`` (the hang table)."""

from __future__ import annotations

# The worker's own reader replaced by one that sleeps forever (the host's interrupt at the
# deadline lands in it, the worker's loop ignores it and sleeps again).
STOPS_READING = """import sys, time
w = sys.modules['worker']
def _never(f, n):
    while True:
        time.sleep(3600)
w._read_exact = _never
'armed'"""

# At the next call, a thread takes the GIL and keeps it in one C call (libc sleep through
# ctypes.PyDLL, which holds the GIL); the worker's own thread, back in its read, can never
# run again. The thread says it is about to make the call; nothing in between lets go of
# the GIL in time (the worker would wait a switch interval, 5 ms, before asking for it).
HOLDS_GIL = """import ctypes, sys, threading
w = sys.modules['worker']
_read = w._read_exact
def _hold(ready):
    ready.set()
    ctypes.PyDLL(None).sleep(100000)
def _read_after_a_thread_took_the_gil(f, n):
    ready = threading.Event()
    threading.Thread(target=_hold, args=(ready,), daemon=True).start()
    ready.wait()
    return _read(f, n)
w._read_exact = _read_after_a_thread_took_the_gil
'armed'"""

# The worker's reader replaced by one that takes a byte a second.
TRICKLE = """import sys, time
w = sys.modules['worker']
def _trickle(f, n):
    buf = b''
    while len(buf) < n:
        buf += f.read(1)
        time.sleep(1)
    return buf
w._read_exact = _trickle
'armed'"""

# A SIGALRM handler that never returns (it swallows the host's interrupt too), armed to fire
# once the call is over: the signal interrupts the worker's read, and the handler loops in
# Python for good.
ALARM_LOOP = """import signal
def _spin(signum, frame):
    while True:
        try:
            while True:
                pass
        except KeyboardInterrupt:
            pass
signal.signal(signal.SIGALRM, _spin)
signal.setitimer(signal.ITIMER_REAL, 0.2)
'armed'"""

SIGALRM_BIT = 1 << (14 - 1)  # in /proc/PID/status ShdPnd: the alarm fired (the session was frozen)


def alarm_pending(pid: int) -> bool:
    """Whether the worker ``pid`` has its SIGALRM pending (``ALARM_LOOP`` is then armed for good)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("ShdPnd:"))
    return bool(int(line.split()[1], 16) & SIGALRM_BIT)


STALLS = {"stops reading": STOPS_READING, "holds the GIL": HOLDS_GIL, "a byte a second": TRICKLE,
          "handler loops": ALARM_LOOP}
SIZES = {"1 KB": 1 << 10, "64 KB": 64 << 10, "256 KB": 256 << 10, "1 MB": 1 << 20, "4 MB": 4 << 20,
         "16 MB": 16 << 20}


def request(size: int) -> str:
    """Code of about ``size`` bytes that would run at once (a comment padded out)."""
    return "1 + 1  #" + "x" * max(0, size - 8)
