"""The session protocol's framing, shared by the host, the supervisor and the worker.

Every frame is a header ``>IQ`` (payload length, call sequence number) and a JSON payload.
The host numbers its calls 1, 2, 3, ...; a response must carry its call's number. The worker
runs untrusted code in its own process, so anything it sends is data, not truth: the
supervisor (which runs no user code) and the host both check lengths and numbers, and the
host caps every field again. A frame numbered ``VIOLATION`` comes from the supervisor itself
and says the worker broke the framing (its payload says how); the session is then dead.
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
