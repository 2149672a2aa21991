"""E2B cloud sandboxes behind the Sandbox interface (``pip install agentenv[e2b]``).

E2B caps concurrent sandboxes and the creation rate (Hobby: 20 sandboxes, 1 create/s), so
many program sessions share one sandbox through *code contexts* (an isolated interpreter
each): a sandbox serves up to ``sessions_per_sandbox`` sessions, and at most
``max_sandboxes`` exist at once (a session waits for room beyond that).

Dependability, from what users of peers report:

* tenacity retries with exponential backoff for rate limits and transient errors, on
  sandbox creation, context creation and context restarts;
* our own deadline per call (the SDK's ``timeout`` fires at about twice the value asked);
  after a timed-out call the context is *restarted* rather than reused (a call right after a
  timeout can otherwise hang), and the result says the session state was lost;
* every sandbox is recorded the moment it exists (creation is shielded from cancellation)
  and killed on ``aclose``, on cancellation and on errors: nothing is left running.

Credentials come from ``E2B_API_KEY`` as usual; ``**sandbox_opts`` go to
``AsyncSandbox.create`` (``api_key``, ``domain``, ``api_url``, ``sandbox_url``, ...).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
from agentenv.errors import SandboxError
from agentenv.retry import retry_async

from ..base import ExecResult, Sandbox, Session

log = logging.getLogger(__name__)


def _transient(exc: BaseException) -> bool:
    import httpx
    from e2b import RateLimitException, ServiceBusyException, TimeoutException

    if isinstance(exc, (RateLimitException, ServiceBusyException, TimeoutException, httpx.TransportError)):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("429", "rate limit", "502", "503", "504", "temporarily"))


class _Box:
    """One E2B sandbox and the sessions it hosts."""

    def __init__(self, sbx: Any) -> None:
        self.sbx = sbx
        self.sessions = 0
        self.dead = False


class E2BSession(Session):
    def __init__(self, backend: "E2BSandbox", box: _Box, context: Any) -> None:
        self._backend, self._box, self._ctx = backend, box, context
        self._lock = anyio.Lock()
        self._closed = False

    async def run(self, code: str, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SandboxError("session is closed")
        timeout = self._backend.default_timeout if timeout is None else timeout
        async with self._lock:
            start = time.perf_counter()
            execution = None
            try:
                with anyio.move_on_after(timeout):
                    # The SDK's own timeout is a backstop only: ours fires first.
                    execution = await self._box.sbx.run_code(code, context=self._ctx, timeout=timeout * 2 + 5)
            except Exception as exc:  # noqa: BLE001 - the service failed this call
                await self._restart()
                return ExecResult("crashed", error=f"E2B call failed: {type(exc).__name__}: {exc}",
                                  duration_s=time.perf_counter() - start, state_lost=True)
            if execution is None:
                await self._restart()
                return ExecResult("timeout", error=f"TimeoutError: execution exceeded {timeout:g}s; the context was "
                                  "restarted", duration_s=time.perf_counter() - start, state_lost=True)
            return self._result(execution, time.perf_counter() - start)

    def _result(self, execution: Any, duration: float) -> ExecResult:
        cap = self._backend.max_output
        stdout, stderr = "".join(execution.logs.stdout), "".join(execution.logs.stderr)
        truncated = len(stdout) > cap or len(stderr) > cap
        value = None
        for r in execution.results:
            if getattr(r, "is_main_result", False) and r.text is not None:
                value = r.text[:cap]
        error = None
        if execution.error is not None:
            e = execution.error
            error = (e.traceback or f"{e.name}: {e.value}")[-2000:]
        return ExecResult("error" if error else "ok", stdout=stdout[:cap], stderr=stderr[:cap], value=value,
                          error=error, duration_s=duration, truncated=truncated)

    async def _restart(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._backend._retry(self._box.sbx.restart_code_context, self._ctx)
            except Exception as exc:  # noqa: BLE001
                log.warning("E2B context restart failed (%s); creating a new context", exc)
                self._ctx = await self._backend._retry(self._box.sbx.create_code_context)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                with anyio.move_on_after(10):
                    await self._box.sbx.remove_code_context(self._ctx)
            except Exception:  # noqa: BLE001 - the sandbox is killed at the end anyway
                pass
            await self._backend._release(self._box)


class E2BSandbox(Sandbox):
    def __init__(
        self,
        *,
        sessions_per_sandbox: int = 16,
        max_sandboxes: int = 20,
        template: str | None = None,
        sandbox_lifetime: int = 3600,
        default_timeout: float = 10.0,
        max_output: int = 2000,
        retries: int = 6,
        **sandbox_opts: Any,
    ) -> None:
        from agentenv.extras import require

        require("e2b_code_interpreter", "e2b", "httpx", extra="e2b", what="the E2B sandbox")
        from e2b_code_interpreter import AsyncSandbox
        self._cls = AsyncSandbox
        self.sessions_per_sandbox = sessions_per_sandbox
        self.max_sandboxes = max_sandboxes
        self.template = template
        self.sandbox_lifetime = sandbox_lifetime
        self.default_timeout = default_timeout
        self.max_output = max_output
        self.retries = retries
        self.sandbox_opts = sandbox_opts
        self._boxes: list[_Box] = []
        self._room = anyio.Condition()
        self._creating = 0
        self._closed = False

    @property
    def sandbox_ids(self) -> list[str]:
        return [b.sbx.sandbox_id for b in self._boxes if not b.dead]

    async def _retry(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await retry_async(fn, *args, attempts=self.retries, transient=_transient, **kwargs)

    async def _acquire_box(self) -> _Box:
        async with self._room:
            while True:
                if self._closed:
                    raise SandboxError("sandbox backend is closed")
                for box in self._boxes:
                    if not box.dead and box.sessions < self.sessions_per_sandbox:
                        box.sessions += 1
                        return box
                # One creation at a time (E2B limits the creation rate anyway); waiters re-check
                # for room in the new sandbox before creating another.
                if not self._creating and len([b for b in self._boxes if not b.dead]) < self.max_sandboxes:
                    self._creating += 1
                    break
                await self._room.wait()
        # A created sandbox must always be recorded (for close to kill it), so its creation
        # and its recording are shielded from cancellation together.
        with anyio.CancelScope(shield=True):
            try:
                sbx = await self._retry(self._cls.create, template=self.template, timeout=self.sandbox_lifetime,
                                        **self.sandbox_opts)
            except Exception as exc:
                async with self._room:
                    self._creating -= 1
                    self._room.notify_all()
                raise SandboxError(f"cannot create an E2B sandbox: {type(exc).__name__}: {exc}") from exc
            box = _Box(sbx)
            box.sessions = 1
            async with self._room:
                self._creating -= 1
                self._boxes.append(box)
                self._room.notify_all()
        return box

    async def _release(self, box: _Box) -> None:
        async with self._room:
            box.sessions -= 1
            self._room.notify_all()

    async def session(self, setup_code: str | None = None) -> E2BSession:
        box = await self._acquire_box()
        try:
            ctx = await self._retry(box.sbx.create_code_context)
        except BaseException as exc:  # cancelled too: the box's place is given back
            with anyio.CancelScope(shield=True):
                await self._release(box)
            if isinstance(exc, Exception):
                raise SandboxError(f"cannot create an E2B code context: {type(exc).__name__}: {exc}") from exc
            raise
        s = E2BSession(self, box, ctx)
        if setup_code:
            res = await s.run(setup_code, timeout=max(60.0, self.default_timeout))
            if res.status != "ok":
                await s.aclose()
                raise SandboxError(f"environment setup code failed: {res.render()[-500:]}")
        return s

    async def aclose(self) -> None:
        """Kill every sandbox this backend created. Idempotent; survives cancellation."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            for box in self._boxes:
                if box.dead:
                    continue
                box.dead = True
                try:
                    with anyio.move_on_after(30):
                        await self._retry(box.sbx.kill)
                except Exception as exc:  # noqa: BLE001
                    log.error("could not kill E2B sandbox %s: %s", box.sbx.sandbox_id, exc)
            async with self._room:
                self._room.notify_all()
