"""One retry policy for calls to remote services (engine servers, cloud sandboxes)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential


async def retry_async(
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    attempts: int,
    transient: Callable[[BaseException], bool],
    **kwargs: Any,
) -> Any:
    """``await fn(*args, **kwargs)``, retried with exponential backoff (0.2 s doubling, at most
    5 s apart) while it raises an exception ``transient`` accepts; the last error is re-raised."""
    async for attempt in AsyncRetrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.2, max=5),
        retry=retry_if_exception(transient),
        reraise=True,
    ):
        with attempt:
            return await fn(*args, **kwargs)
