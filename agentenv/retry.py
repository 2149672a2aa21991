"""One retry policy for calls to remote services (engine servers, cloud sandboxes)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential


async def retry_async(
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    attempts: int,
    transient: Callable[[BaseException], bool],
    unreachable: Callable[[BaseException], bool] | None = None,
    reconnect_s: float = 0.0,
    **kwargs: Any,
) -> Any:
    """``await fn(*args, **kwargs)``, retried with exponential backoff (0.2 s doubling, at most
    5 s apart) while it raises an exception ``transient`` accepts, at most ``attempts`` times;
    an ``unreachable`` one (the service is down or restarting) is retried for up to
    ``reconnect_s`` seconds instead. The last error is re-raised."""

    def stop(state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None and unreachable is not None and unreachable(exc):
            return state.seconds_since_start >= reconnect_s
        return state.attempt_number >= attempts

    async for attempt in AsyncRetrying(
        stop=stop,
        wait=wait_exponential(multiplier=0.2, max=5),
        retry=retry_if_exception(transient),
        reraise=True,
    ):
        with attempt:
            return await fn(*args, **kwargs)
