"""The session protocol's framing, shared by the host and the worker.

Every frame is a header ``>IQ`` (payload length, call sequence number) and a JSON payload.
The host gives each call a fresh random number; an answer must carry its call's number. The
worker runs untrusted code in its own process, and that code can write to the session socket
too, so whatever arrives is data to check, not truth: the host refuses a frame with another
call's number (a forged or stale answer, which cannot guess the next call's number), over
``frame_cap`` bytes or malformed, kills that session and reports the call as an error; it
caps every field itself. A frame numbered
``VIOLATION`` says the session is unusable (its payload says why; e.g. the worker could not
confine itself, and never ran code).
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">IQ")
VIOLATION = 2**64 - 1
MAX_REQUEST = 64 * 1024 * 1024  # code sent to a session
ERROR_CAP = 4000  # characters of a formatted exception


def frame_cap(max_output: int) -> int:
    """The largest response payload a worker may send for ``max_output``: stdout, stderr and
    the value at ``max_output`` characters each and the error at ``ERROR_CAP``, every
    character escaped as a surrogate pair (``ensure_ascii``: 12 bytes), plus the envelope."""
    return 12 * (3 * (max_output + 3) + ERROR_CAP) + 4096
