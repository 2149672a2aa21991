"""Program-aware routing over engine replicas: pure and synchronous (no I/O), shared by the
engines that spread programs over several replicas (``OpenAIEngine`` over HTTP servers,
``RayEngine`` over engine actors).

* A program sticks to the replica that holds its prefix (request ids are ``<program>-<turn>``),
  so each resume is served from that replica's prefix cache.
* A new program, or one whose KV was released (``release``: it finished, or the scheduler
  paused it), goes to the replica with the most free KV tokens (capacity minus what programs
  hold there), ties to the fewest requests in flight. Without capacities: the fewest requests
  in flight, ties to the fewest programs. So a paused program is restored where there is room,
  which keeps memory balanced across replicas.
* What a replica holds is what this router sent there (each program's last known length),
  or, where the replica reports it (an engine actor serving several clients counts every
  client's programs), its last report plus what this router routed or released there since.
* A replica that failed (``down``) gets no new programs for ``probe_after`` seconds while
  another one is up; the programs it held are routed afresh.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class Router:
    def __init__(self, replicas: int, capacity: list[int] | None = None, *, sticky: int = 100_000,
                 probe_after: float = 2.0) -> None:
        if replicas < 1:
            raise ValueError("at least one replica")
        if capacity is not None and len(capacity) != replicas:
            raise ValueError(f"{len(capacity)} capacities for {replicas} replicas")
        self.n = replicas
        self.capacity = list(capacity) if capacity is not None else None
        self.inflight = [0] * replicas  # requests in flight (the caller counts them)
        self.assigned = [0] * replicas  # programs routed to each replica
        self.held = [0] * replicas  # KV tokens held on each replica (see the module doc)
        self._since = [0] * replicas  # this router's changes to ``held`` since the replica's last report
        self._tokens: dict[str, int] = {}  # program -> its last known length
        self._route: OrderedDict[str, int] = OrderedDict()
        self._sticky = sticky
        self._down_until = [0.0] * replicas
        self._probe_after = probe_after

    @staticmethod
    def program_of(request_id: str) -> str:
        return request_id.rsplit("-", 1)[0]

    def where(self, program: str) -> int | None:
        return self._route.get(program)

    def routes(self) -> dict[str, int]:
        """Every program routed and not released, and its replica."""
        return dict(self._route)

    def route(self, request_id: str, tokens: int, now: float | None = None) -> int:
        """The replica for this request, whose prompt plus budget is ``tokens`` long."""
        program = self.program_of(request_id)
        idx = self._route.get(program)
        if idx is None:
            idx = self._place(time.monotonic() if now is None else now)
            self._route[program] = idx
            self.assigned[idx] += 1
            if len(self._route) > self._sticky:  # forget the least recently used program's route
                self._forget(next(iter(self._route)))
        else:
            self._route.move_to_end(program)
        self._add(idx, tokens - self._tokens.get(program, 0))
        self._tokens[program] = tokens
        return idx

    def _add(self, idx: int, tokens: int) -> None:
        self.held[idx] += tokens
        self._since[idx] += tokens

    def _place(self, now: float) -> int:
        up = [i for i in range(self.n) if self._down_until[i] <= now] or list(range(self.n))
        if self.capacity is not None:
            cap = self.capacity
            return max(up, key=lambda i: (cap[i] - self.held[i], -self.inflight[i], -i))
        return min(up, key=lambda i: (self.inflight[i], self.assigned[i], i))

    def _forget(self, program: str) -> None:
        idx = self._route.pop(program, None)
        held = self._tokens.pop(program, 0)
        if idx is not None:
            self._add(idx, -held)
            self.assigned[idx] -= 1

    def release(self, program: str) -> None:
        """The program's KV is not needed any more: its next request may go anywhere."""
        self._forget(program)

    def report(self, idx: int, held: int) -> None:
        """The replica says it holds ``held`` tokens for all of its clients' programs (counted
        as their requests reach it, so what this router sent since may not be in it yet)."""
        self.held[idx] = held
        self._since[idx] = 0

    def down(self, idx: int, now: float | None = None) -> None:
        """The replica failed: new programs avoid it for a while; its programs route afresh."""
        self._down_until[idx] = (time.monotonic() if now is None else now) + self._probe_after
        for program in [p for p, i in self._route.items() if i == idx]:
            self._forget(program)

    def free(self, idx: int) -> int | None:
        return None if self.capacity is None else self.capacity[idx] - self.held[idx]
