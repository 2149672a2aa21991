"""vLLM streaming-input requests (vLLM calls them sessions): one engine request per program,
kept alive across its turns.

A new request per turn lets the prefix cache serve the program's earlier tokens, but only in
whole KV blocks: each turn re-prefills the part of the last block the cache does not keep,
and the request is set up, hashed and looked up again. vLLM (>= 0.32) can instead keep one
request open and feed it each turn's new tokens (``AsyncLLM.generate`` with an async
generator of ``StreamingInput``): its KV stays allocated between turns and a turn prefills
only what is new (``bench/vllm_streams.py`` measures the difference).

The token contract holds exactly: between turns vLLM keeps only the *computed* tokens of the
last turn and drops the one sampled last (its KV was never computed; see vLLM's
``Scheduler._update_request_as_session``), so each later chunk starts with that token again,
and the engine's sequence is the trajectory's ids, token for token (a test checks it against
a request per turn). That holds only where a finished turn has exactly one uncomputed token:
streams are off under async scheduling or speculative decoding.

A stream is only continued when the new prompt extends what it holds, under the same weight
version, adapter and engine incarnation; otherwise it is closed and a new one opened (which
the prefix cache serves as before). ``release(program)`` (the reactor calls it when a program
ends or is paused) closes it, so its KV returns to the prefix cache and can be evicted. A
stream waiting for its next turn holds one of vLLM's ``max_num_seqs`` request slots, so at most
``limit`` are open; past that the least recently used idle one is closed first, and when
every open one is mid-turn the turn runs as a plain request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator


@dataclass(eq=False)
class InputStream:
    """One program's streaming-input request: the chunks fed to it, the outputs it streams
    back, and the token sequence the engine holds for it between turns."""

    program: str
    request_id: str
    version: int
    lora: str | None
    incarnation: int
    inputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # chunks, then None
    outputs: Any = None  # the async iterator ``AsyncLLM.generate`` returned
    seq: list[int] = field(default_factory=list)  # every token so far, the last sampled one included
    sampled: int = 0  # tokens sampled in earlier turns (where this turn's version spans start)
    busy: bool = False

    def chunk_for(self, prompt_ids: list[int]) -> list[int] | None:
        """The tokens to feed for a turn on ``prompt_ids``, or None when it does not extend
        this stream's sequence. vLLM dropped the last sampled token: it leads the chunk (which
        is all of it when the turn goes on with nothing spliced, after a per-turn cap)."""
        n = len(self.seq)
        if n == 0 or len(prompt_ids) < n or prompt_ids[:n] != self.seq:
            return None
        return [self.seq[-1], *prompt_ids[n:]]


async def feed(queue: asyncio.Queue, make: Any) -> AsyncIterator[Any]:
    """The stream's input: each queued chunk as a ``StreamingInput``; None ends it."""
    while (item := await queue.get()) is not None:
        yield make(*item)


class InputStreams:
    """A vLLM engine's open streaming-input requests, least recently used first; at most
    ``limit`` (0: streams are off)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.open: OrderedDict[str, InputStream] = OrderedDict()
        self._closing: list[InputStream] = []
        self._ids = itertools.count()
        #: Counts: streams opened, turns that continued one, streams closed to make room.
        self.opened = self.continued = self.evicted = 0

    def get(self, program: str) -> InputStream | None:
        return self.open.get(program)

    def new(self, program: str, version: int, lora: str | None, incarnation: int) -> InputStream | None:
        """A new stream for ``program`` (closing its old one), or None when every open
        stream is mid-turn and there is no room for another."""
        self.close(program)
        while len(self.open) >= self.limit:
            idle = next((p for p, s in self.open.items() if not s.busy), None)
            if idle is None:
                return None
            self.close(idle)
            self.evicted += 1
        s = InputStream(program, f"{program}-stream{next(self._ids)}", version, lora, incarnation)
        self.open[program] = s
        self.opened += 1
        return s

    def for_turn(self, program: str, prompt_ids: list[int], version: int, lora: str | None,
                 incarnation: int) -> tuple[InputStream | None, list[int], bool]:
        """The stream a turn of ``program`` on ``prompt_ids`` runs on, the chunk to feed it,
        and whether the stream is new (its request starts with this chunk). The program's
        stream is continued when it is idle, under the same weight version, adapter and
        engine incarnation, and the prompt extends its sequence; otherwise a new one is
        opened, fed the whole prompt. (None, [], True) when every open stream is mid-turn and
        there is no room for another (the turn runs as a plain request)."""
        s = self.open.get(program)
        if (s is not None and not s.busy and s.version == version and s.lora == lora
                and s.incarnation == incarnation):
            chunk = s.chunk_for(prompt_ids)
            if chunk is not None:
                self.continued += 1
                return s, chunk, False
        s = self.new(program, version, lora, incarnation)
        return s, (list(prompt_ids) if s is not None else []), True

    def end_turn(self, s: InputStream, prompt_ids: list[int], tokens: list[int], finish_reason: str | None) -> None:
        """A turn on ``s`` finished with ``tokens`` sampled: the stream holds the sequence
        for the next turn, or is closed when the turn did not end at a stop or the length
        limit (an abort: the request is over)."""
        s.busy = False
        s.sampled += len(tokens)
        s.seq = [*prompt_ids, *tokens]
        self.touch(s)
        if finish_reason not in ("stop", "length"):
            self.close(s.program)

    def touch(self, s: InputStream) -> None:
        if self.open.get(s.program) is s:
            self.open.move_to_end(s.program)

    def close(self, program: str) -> None:
        """End the program's stream: the engine finishes its request (the KV goes to the
        prefix cache); the Python side is cleaned up by ``reap``."""
        s = self.open.get(program)
        if s is not None:
            self.drop(s)

    def drop(self, s: InputStream) -> None:
        """End this stream (its program may have a newer one, which stays)."""
        if self.open.get(s.program) is s:
            del self.open[s.program]
        s.inputs.put_nowait(None)
        self._closing.append(s)

    def close_all(self) -> None:
        for program in list(self.open):
            self.close(program)

    async def reap(self) -> None:
        """Close the output iterators of ended streams (vLLM aborts what is left of them)."""
        while self._closing:
            s = self._closing.pop()
            if s.outputs is not None:
                try:
                    await s.outputs.aclose()
                except Exception:  # noqa: BLE001 - the engine may be dead: nothing left to free
                    pass


def stream_limit(config: Any) -> int:
    """Streaming-input requests an engine with vLLM config ``config`` may keep open: none where
    a finished turn may leave more than its last sampled token uncomputed (async scheduling,
    speculative decoding: see the module doc), else vLLM's request slots less a few for plain
    requests."""
    if getattr(config.scheduler_config, "async_scheduling", False) or getattr(config, "speculative_config", None):
        return 0
    slots = int(config.scheduler_config.max_num_seqs)
    return max(0, slots - max(4, slots // 8))
