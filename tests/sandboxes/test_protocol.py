"""The session protocol's framing (``protocol.py``): the header both sides pack, the number
no call carries, the frame cap the host reads answers under (checked against the largest
answers a real worker gives) and the request limit (checked in a real session)."""

from __future__ import annotations

import json

import pytest

from agentenv.sandboxes.local.protocol import ERROR_CAP, HEADER, MAX_REQUEST, VIOLATION, frame_cap

from .workers import Standalone

pytestmark = pytest.mark.anyio
E = chr(0x1F600)  # outside the BMP: escaped as a surrogate pair, 12 bytes, the most a character takes


def test_the_header_is_a_length_and_a_64_bit_call_number_and_violation_is_the_largest():
    assert HEADER.size == 12 and HEADER.pack(5, 1) == b"\x00\x00\x00\x05" + b"\x00" * 7 + b"\x01"  # big-endian
    assert HEADER.unpack(HEADER.pack(2**32 - 1, VIOLATION)) == (2**32 - 1, 2**64 - 1)
    with pytest.raises(Exception):
        HEADER.pack(0, VIOLATION + 1)  # no number above it: a call's (below it) can never be it


@pytest.mark.parametrize("max_output", [1, 100, 2000])
def test_the_largest_answers_a_worker_gives_fit_the_frame_cap(tmp_path, max_output):
    fill = f"print(E * {max_output + 50}, end='')\nprint(E * {max_output + 50}, end='', file=sys.stderr)\n"
    cases = {
        "value": f"import sys\nE = {E!r}\n{fill}E * {max_output + 50}",
        "error": f"import sys\nE = {E!r}\n{fill}raise ValueError(E * {10 * ERROR_CAP})",
        "exit": f"import sys\nE = {E!r}\n{fill}sys.exit(E * {10 * ERROR_CAP})",
    }
    worker = Standalone(tmp_path)
    try:
        for what, code in cases.items():
            worker.send(code, max_output=max_output)
            _, payload = worker.frame()
            answer = json.loads(payload)
            assert answer["truncated"] and len(answer["stdout"]) == len(answer["stderr"]) == max_output, what
            assert len(payload) <= frame_cap(max_output), (what, len(payload), frame_cap(max_output))
            assert (answer["value"] or answer["error"]).count(E) >= (min(max_output, 600) - 2) // 2, what  # filled
    finally:
        assert worker.close() == 0


async def test_a_request_over_the_limit_is_refused_before_it_is_sent_and_the_session_lives_on(sandbox):
    s = await sandbox.session()
    try:
        await s.run("kept = 41")
        r = await s.run("#" + "x" * MAX_REQUEST)
        assert (r.status, r.state_lost) == ("error", False), r
        assert r.error.startswith("SandboxError: code of ") and f"exceeds the {MAX_REQUEST}-byte" in r.error
        assert (await s.run("kept + 1")).value == "42"  # nothing was sent: the session is as it was
    finally:
        await s.aclose()
