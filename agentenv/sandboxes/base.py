"""The sandbox interface every execution backend implements.

A :class:`Sandbox` is a backend (a pool of local workers, an E2B account). It hands out
:class:`Session` objects: one stateful interpreter per program, where variables survive
across calls like a notebook. Both are async context managers whose ``aclose()`` is
idempotent and always releases what they hold (processes, remote sandboxes).

A call never raises for anything the *code* did: timeouts, crashes, exceptions and huge
output all come back as an :class:`ExecResult` with a status. ``SandboxError`` is raised
only when the backend itself cannot serve (closed, cannot start a worker).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

ExecStatus = Literal["ok", "error", "timeout", "crashed"]


@dataclass(slots=True)
class ExecResult:
    status: ExecStatus
    stdout: str = ""
    stderr: str = ""
    value: str | None = None  # repr() of the trailing expression, notebook-style
    error: str | None = None  # short traceback or reason
    duration_s: float = 0.0
    truncated: bool = False
    state_lost: bool = False  # the worker was replaced: variables from earlier calls are gone

    def render(self, restored: int | None = None) -> str:
        """The text the model sees as the tool's output (``restored``: how many earlier calls
        were run again in the replacement session)."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.truncated:
            parts.append("[output truncated]")
        if self.value is not None:
            parts.append(self.value)
        if self.error:
            parts.append(self.error.rstrip("\n"))
        if self.state_lost:
            parts.append(
                "[session restarted: earlier variables are lost]"
                if restored is None
                else f"[session restarted: {restored} earlier call{'s were' if restored != 1 else ' was'} run again]"
            )
        return "\n".join(parts)


class Session(abc.ABC):
    """One program's stateful interpreter."""

    @abc.abstractmethod
    async def run(self, code: str, timeout: float | None = None) -> ExecResult: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Sandbox(abc.ABC):
    """A backend that creates sessions."""

    @abc.abstractmethod
    async def session(self, setup_code: str | None = None) -> Session:
        """A new session; ``setup_code`` runs in it first (an environment's helpers)."""

    async def prepare(self, setup_code: str | None = None, n: int = 1, *, wait: bool = False) -> int:
        """Start ``n`` sessions for ``setup_code`` ahead of need, so that :meth:`session` hands
        them out at once (e.g. while the engine loads). Returns how many it starts; a backend
        that cannot prepare ahead starts none and its sessions start on demand."""
        return 0

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
