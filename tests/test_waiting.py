"""The tests' own waiting helpers (``tests/waiting.py``): a hang is reported with what the
process said, not only as a timeout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .waiting import ended, wait_for


def test_a_process_that_does_not_end_is_killed_and_its_stderr_reported(tmp_path):
    # It says where it waits, then never ends: ended() kills it and the failure carries the line.
    said = tmp_path / "said"
    code = ("import pathlib, sys, time\nsys.stderr.write('waiting on the server\\n')\nsys.stderr.flush()\n"
            f"pathlib.Path({str(said)!r}).touch()\ntime.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    wait_for(said.exists, "the process wrote its line", unless=lambda: proc.poll() is not None)
    with pytest.raises(AssertionError, match=r"(?s)not within 0 s: the command stopped.*waiting on the server"):
        ended(proc, "the command stopped", timeout=0.1)
    assert proc.poll() is not None  # killed, not left behind


def test_a_process_that_ends_gives_its_output():
    proc = subprocess.Popen([sys.executable, "-c", "print('done')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = ended(proc, "the command ended")
    assert (out.strip(), err, proc.returncode) == (b"done", b"", 0)
