"""Fuzzing the host's reader of answer frames (``frames.py``): arbitrary bytes, JSON of any
shape, depth and size, through the decoder, through a real socket and from inside real
sessions. It never raises; a session that sent a bad frame is replaced and the next call works.
Then ``FrameReader``'s own rules: earlier calls' frames dropped, another number refused, and a
read cancelled mid-frame resumed where it stopped."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct

import anyio
import pytest

from agentenv.sandboxes.local.frames import (MALFORMED, FrameReader, decode_answer, decode_violation, read_frame,
                                             send_all)
from agentenv.sandboxes.local.protocol import VIOLATION

from .hostile import FRAME, hostile

pytestmark = pytest.mark.anyio
SEED = 35
KEYS = ("status", "stdout", "stderr", "value", "error", "truncated", "duration_s", "violation", "x")


def scalar(rng: random.Random):
    return rng.choice([
        None, True, False, rng.randint(-(2**70), 2**70), rng.random() * 1e300, "ok", "error", "timeout",
        "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 8))), float("nan"),
    ])


def shape(rng: random.Random, depth: int):
    """A random JSON value, nested up to ``depth``."""
    if depth <= 0 or rng.random() < 0.3:
        return scalar(rng)
    if rng.random() < 0.5:
        return [shape(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): shape(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def payload(rng: random.Random) -> bytes:
    """One hostile payload: random bytes, a random JSON shape, a plausible answer with one field
    wrong, or a nesting deep enough to exhaust the parser's recursion."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.choice([0, 1, 7, 100, 5000]))
    if kind == 1:
        return json.dumps(shape(rng, rng.randint(1, 6))).encode()
    if kind == 2:
        ans = {"status": "ok", "stdout": "", "stderr": "", "value": None, "error": None, "truncated": False}
        ans[rng.choice(KEYS)] = shape(rng, 2)
        return json.dumps(ans).encode()
    depth = rng.choice([100, 1000, 2048, 5000, 20000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    inner = opener * depth + b"1" + closer * depth
    return inner if kind == 3 else b'{"status": "ok", "stdout": ' + inner + b"}"


def checked(out) -> None:
    """What the decoder may return: a reason, or an answer of exactly the expected types."""
    if isinstance(out, str):
        return
    assert isinstance(out, dict) and out["status"] in ("ok", "error", "timeout"), out
    assert all(out[k] is None or isinstance(out[k], str) for k in ("stdout", "stderr", "value", "error"))
    assert isinstance(out["truncated"], bool) and set(out) == {"status", "stdout", "stderr", "value", "error",
                                                               "truncated"}


def test_the_decoders_never_raise_on_any_payload():
    rng = random.Random(SEED)
    for _ in range(4000):
        p = payload(rng)
        checked(decode_answer(p))
        assert isinstance(decode_violation(p), str)
    assert decode_answer(b"[" * 100000) == MALFORMED  # far past the recursion limit


async def test_the_reader_never_raises_on_any_byte_stream():
    rng = random.Random(SEED + 1)
    for i in range(300):
        a, b = socket.socketpair()
        stream = await anyio.abc.UNIXSocketStream.from_socket(a)
        try:
            body = payload(rng)
            n = rng.choice([len(body), len(body) + rng.randint(1, 9), max(0, len(body) - 3), 2**32 - 1])
            seq = rng.choice([7, VIOLATION, rng.getrandbits(64)])
            raw = struct.pack(">IQ", n, seq) + body if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 20))
            await anyio.to_thread.run_sync(b.sendall, raw)
            b.close()  # a short frame ends at EOF, never waits
            with anyio.fail_after(10):
                out = await read_frame(stream, 7, 1 << 20)
            checked(out)
        finally:
            await stream.aclose()
            b.close()


async def test_sessions_that_send_random_frames_are_replaced_and_the_next_call_works(sandbox):
    rng = random.Random(SEED + 2)
    for _ in range(40):
        body = payload(rng)
        if len(body) > 60000:
            body = body[:60000]
        n = rng.choice([None, None, -1])
        code = FRAME + f"frame({body!r}, {n})\n'genuine'"
        r = await hostile(sandbox, code, timeout=10, session_survives=False)
        if r.status != "ok":  # a frame that happens to be a valid answer is the code's own answer
            assert r.status == "error" and r.state_lost and "SandboxError" in r.error, r


def answer(stdout: str) -> bytes:
    return json.dumps({"status": "ok", "stdout": stdout, "stderr": "", "value": None, "error": None,
                       "truncated": False}).encode()


def framed(seq: int, payload: bytes) -> bytes:
    return struct.pack(">IQ", len(payload), seq) + payload


async def test_the_reader_drops_stale_frames_and_refuses_unknown_numbers():
    a, b = socket.socketpair()
    stream = await anyio.abc.UNIXSocketStream.from_socket(a)
    try:
        reader = FrameReader(stream)
        b.sendall(framed(1, answer("old")) + framed(2, answer("older")) + framed(3, answer("mine")))
        with anyio.fail_after(10):
            got = await reader.read(3, 1 << 20, stale=[1, 2, 3])
        assert got["stdout"] == "mine"
        b.sendall(framed(99, answer("forged")))
        with anyio.fail_after(10):
            assert "answered call 99 during call 4" in await reader.read(4, 1 << 20, stale=[1, 2, 3])
    finally:
        await stream.aclose()
        b.close()


async def test_a_read_cancelled_mid_frame_loses_nothing():
    a, b = socket.socketpair()
    stream = await anyio.abc.UNIXSocketStream.from_socket(a)
    try:
        reader = FrameReader(stream)
        raw = framed(5, answer("x" * 5000))
        b.sendall(raw[:3000])  # the header and part of the payload
        with anyio.move_on_after(0.2) as scope:
            await reader.read(5, 1 << 20)
        assert scope.cancelled_caught
        b.sendall(raw[3000:])
        with anyio.fail_after(10):
            got = await reader.read(5, 1 << 20)
        assert got["stdout"] == "x" * 5000
    finally:
        await stream.aclose()
        b.close()


async def test_send_all_writes_every_byte_as_the_peer_reads():
    a, b = socket.socketpair()
    a.setblocking(False)
    data = random.Random(SEED).randbytes(3 << 20)  # more than the socket buffer holds
    got = bytearray()

    async def read() -> None:
        while len(got) < len(data):
            await anyio.wait_readable(b)
            got.extend(b.recv(1 << 16))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await send_all(a, data)
        assert bytes(got) == data
    finally:
        a.close()
        b.close()


async def test_a_send_cancelled_as_its_socket_turns_writable_reports_nothing_to_the_event_loop():
    # The pass of the event loop that finds the socket writable also runs the task that cancels
    # the waiting send (anyio's raw-socket stream then has the selector set the result of the
    # cancelled future: an InvalidStateError in the loop's exception handler).
    loop = asyncio.get_running_loop()
    handler, reported = loop.get_exception_handler(), []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        for _ in range(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all, a, bytes(4 << 20))
                await anyio.wait_all_tasks_blocked()  # the send waits: the buffer is full
                with pytest.raises(BlockingIOError):
                    while b.recv(1 << 20):
                        pass  # a is writable again
                await asyncio.sleep(0)  # resumes in the pass whose poll found it writable
                tg.cancel_scope.cancel()
            await asyncio.sleep(0)
        assert reported == []
    finally:
        loop.set_exception_handler(handler)
        a.close()
        b.close()
