"""The embedded engine keeps no state per request served: after many requests, some of them
cancelled mid-flight, its own maps, the manager's result handlers and the scheduler's and cache
allocator's per-request tables are empty, so nothing scanned per step grows with the number of
requests served (the prefix cache's hashed blocks are bounded by the KV cache's capacity)."""

import anyio
import pytest

from agentenv.engines.base import SamplingParams

pytestmark = pytest.mark.anyio


def per_request_state(engine) -> dict[str, int]:
    mgr = engine._mgr
    bp = mgr.batch_processor
    return {
        "cached": len(engine._cached),
        "internal": len(engine._internal),
        "result_handlers": len(mgr.output_router.result_handlers),
        "active": len(bp.scheduler.active_requests),
        "waiting": len(bp.scheduler.waiting_requests),
        "block_tables": sum(len(a.block_table) for a in bp.cache.cache_allocators.values()),
    }


async def test_no_per_request_state_is_left_after_requests_finish_or_are_cancelled(engine):
    short, long = SamplingParams(max_tokens=2, stop_token_ids=()), SamplingParams(max_tokens=200, stop_token_ids=())
    first_done = anyio.Event()

    async def one(i: int, params: SamplingParams) -> None:
        await engine.generate([3 + i % 50] * 40 + [7, 8, 9], params, f"growth-{i}")
        first_done.set()

    for wave in range(3):  # served to the end
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, 100 * wave + i, short)
    with anyio.CancelScope() as scope:  # cancelled in flight once a short request is back
        async with anyio.create_task_group() as tg:
            first_done = anyio.Event()
            for i in range(8):
                tg.start_soon(one, 1000 + i, long)
            tg.start_soon(one, 2000, short)
            await first_done.wait()
            scope.cancel()
    # A request served after the cancellations: the loop has dropped the cancelled ones by then.
    await engine.generate([5] * 20, short, "growth-after")
    assert per_request_state(engine) == dict.fromkeys(per_request_state(engine), 0)
