"""The session worker (``worker.py``) on its own: a real ``python -I worker.py`` spoken to
over its pipes in the session protocol's frames. Each call's answer carries its number; state
persists between calls; output is captured and capped per call; tracebacks show only the
code's frames; nothing the code writes or forks reaches the channel; the host's SIGINT makes
a call a timeout."""

from __future__ import annotations

import os
import signal

import pytest

from ..waiting import wait_for
from .workers import Standalone


@pytest.fixture
def worker(tmp_path):
    w = Standalone(tmp_path)
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


def test_each_answer_carries_its_calls_number_and_state_persists(worker):
    r = worker.call("x = 6 * 7\nprint('hi')\nx + 1", seq=0)
    assert (r["status"], r["stdout"], r["stderr"], r["value"], r["error"], r["truncated"]) == \
        ("ok", "hi\n", "", "43", None, False)
    assert worker.call("x", seq=2**64 - 2)["value"] == "42"  # any number below VIOLATION
    assert worker.call("None")["value"] is None and worker.call("y = 1")["value"] is None
    assert worker.call("import sys\nprint('e', file=sys.stderr)\ninput()")["stderr"] == "e\n"
    assert worker.close() == 0  # EOF on its channel: it exits


def test_output_is_capped_per_call_and_the_rest_counted(worker):
    r = worker.call("import sys\nprint('a' * 500)\nsys.stderr.write('b' * 500)", max_output=100)
    assert r["stdout"] == "a" * 100 and r["stderr"] == "b" * 100 and r["truncated"]
    r = worker.call("'y' * 500", max_output=100)
    assert r["value"] == "'" + "y" * 99 + "..." and not r["truncated"]  # a value is cut, not counted
    r = worker.call("print('short')", max_output=100)
    assert r["stdout"] == "short\n" and not r["truncated"]  # a fresh buffer for every call
    r = worker.call("import sys\nsys.stdout.write(b'x')")
    assert r["status"] == "error" and "TypeError: write() argument must be str, not bytes" in r["error"]


def test_errors_show_only_the_codes_frames_and_exits_are_errors(worker):
    r = worker.call("import json\ndef f():\n    return json.loads('{')\nf()")
    assert r["status"] == "error" and "JSONDecodeError" in r["error"]
    files = [line.strip() for line in r["error"].splitlines() if line.strip().startswith("File ")]
    assert len(files) == 2 and all(f.startswith('File "<code>"') for f in files), r["error"]
    assert "worker.py" not in r["error"] and "json" + os.sep not in r["error"]
    r = worker.call("class E(Exception):\n    def __str__(self):\n        raise KeyboardInterrupt\nraise E()")
    assert r["status"] == "error" and r["error"].startswith("Traceback") and "\nE: <" in r["error"]
    assert worker.call("import sys\nsys.exit(3)")["error"] == "SystemExit: 3"
    r = worker.call("import sys\nclass C:\n    def __repr__(self):\n        raise RuntimeError\nsys.exit(C())")
    assert r["error"] == "SystemExit: <C>"  # its repr is never run
    assert worker.call("1 +")["error"].rstrip().endswith("SyntaxError: invalid syntax")
    assert worker.call("'still serving'")["value"] == "'still serving'"


def test_writes_to_the_standard_descriptors_never_reach_the_channel(worker):
    r = worker.call("import os\nos.write(1, b'\\xff' * 64)\nos.write(2, b'junk')\nos.write(0, b'x')\n'ok'", seq=11)
    assert r["value"] == "'ok'"  # fds 0-2 are /dev/null: the next frame is still the worker's own
    assert worker.call("'next'", seq=12)["value"] == "'next'"


def test_a_process_the_code_forks_never_answers(worker):
    # The child finishes the call as well and returns into the worker's loop: it must exit
    # there without writing. The parent waits for it, so a frame of the child's would come first.
    r = worker.call("import os\npid = os.fork()\nif pid:\n    os.waitpid(pid, 0)\n'child' if pid == 0 else 'parent'",
                    seq=21)
    assert r["value"] == "'parent'"
    assert worker.call("'after'", seq=22)["value"] == "'after'"  # nothing stray before it


def test_the_hosts_sigint_makes_the_call_a_timeout_whatever_the_code_does(worker, tmp_path):
    worker.call("kept = 'state'")
    for code in ("import time\nopen('running', 'w').close()\ntime.sleep(600)",
                 "import time\nopen('running', 'w').close()\ntry:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n"
                 "    pass\n'I finished in time'"):
        worker.send(code, seq=31)
        wait_for(lambda: (tmp_path / "running").exists(), "the call is running")
        worker.proc.send_signal(signal.SIGINT)
        seq, payload = worker.frame()
        r = __import__("json").loads(payload)
        assert seq == 31 and (r["status"], r["value"]) == ("timeout", None), r
        assert r["error"] == "TimeoutError: execution exceeded the time limit"
        (tmp_path / "running").unlink()
    assert worker.call("kept", seq=32)["value"] == "'state'"
    r = worker.call("raise KeyboardInterrupt")  # raised by the code itself: an error, not a timeout
    assert r["status"] == "error" and "KeyboardInterrupt" in r["error"]


def test_a_late_sigint_after_the_answer_is_ignored_and_the_state_kept(worker):
    # The host's deadline signal can arrive just as the answer goes out: the worker may still be
    # in the write, its sweep or back at the read. None of these may end it (sent right after an
    # answer, the signal finds the worker still in its write in about two rounds of five).
    worker.call("kept = 0")
    for i in range(10):
        worker.proc.send_signal(signal.SIGINT)
        r = worker.call("kept += 1\nkept", seq=40 + i)
        assert (r["status"], r["value"]) == ("ok", str(i + 1)), r
