"""``agentenv.engines.vllm_sleep``: the sleep mode the vLLM-driving engines share. ``Sleeper``'s
own logic (who waits, when they go in, what is refused) on a stand-in for vLLM's ``AsyncLLM``
(its ``sleep``/``wake_up`` only); and the real ``OpenAIEngine`` whose sleep reaches no server."""

from __future__ import annotations

import anyio
import pytest

from agentenv.engines.vllm_sleep import SLEEP_LEVELS, Sleeper
from agentenv.errors import ConfigError, EngineError

pytestmark = pytest.mark.anyio


class AsyncLLM:
    """What ``Sleeper`` calls on vLLM's ``AsyncLLM``, recorded; ``fail`` makes ``sleep`` raise."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: Exception | None = None

    async def sleep(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))
        if self.fail is not None:
            raise self.fail

    async def wake_up(self) -> None:
        self.calls.append(("wake_up",))


class Engine(Sleeper):
    def __init__(self) -> None:
        self.llm = AsyncLLM()
        self._update_lock = anyio.Lock()


async def admitted(engine: Engine) -> bool:
    """Whether a request would be admitted now (``_until_awake`` returns at once)."""
    with anyio.move_on_after(0) as scope:  # no wait: admitted only if it need not wait at all
        await engine._until_awake()
    return not scope.cancelled_caught


async def test_a_level_1_sleep_holds_requests_until_wake_up_and_refuses_weights_meanwhile():
    e = Engine()
    assert SLEEP_LEVELS == (1, 2) and e.sleep_levels == (1, 2)
    await e.sleep(1)
    await e.sleep(2)  # asleep already: nothing happens
    assert await e.is_sleeping() and e.llm.calls == [("sleep", 1, "wait")]  # in-flight requests finish first
    assert not await admitted(e)
    with pytest.raises(EngineError, match=r"the engine sleeps \(level 1\): wake_up before loading weights"):
        e._check_awake()
    got = []
    async with anyio.create_task_group() as tg:
        async def request() -> None:
            await e._until_awake()
            got.append("in")

        tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        await e.wake_up()
    assert got == ["in"] and not await e.is_sleeping() and await admitted(e)
    await e.wake_up()  # awake already: nothing happens
    assert e.llm.calls == [("sleep", 1, "wait"), ("wake_up",)]
    e._check_awake()


async def test_after_a_level_2_sleep_requests_wait_for_the_weights_even_through_another_sleep():
    e = Engine()
    await e.sleep(2)
    await e.wake_up()
    assert not await e.is_sleeping() and not await admitted(e)  # awake, but the weights were discarded
    await e.sleep(1)
    await e.wake_up()
    assert not await admitted(e)  # a level-1 sleep in between does not let them in before the weights
    e._weights_installed()
    assert await admitted(e)
    e._weights_installed()  # nothing was due: nothing changes
    assert await admitted(e)


async def test_a_sleep_waits_for_a_weight_update_in_progress():
    e = Engine()
    async with anyio.create_task_group() as tg:
        async with e._update_lock:
            tg.start_soon(e.sleep, 1)
            await anyio.wait_all_tasks_blocked()
            assert e.llm.calls == [] and not await e.is_sleeping()  # vLLM is not put to sleep mid-update
            assert not await admitted(e)  # but new requests already wait for the sleep
    assert e.llm.calls == [("sleep", 1, "wait")] and await e.is_sleeping()


async def test_a_sleep_that_fails_lets_the_held_requests_in_unless_weights_are_still_due():
    e = Engine()
    with pytest.raises(ConfigError, match=r"sleep level must be one of \(1, 2\), got 3"):
        await e.sleep(3)
    e.llm.fail = RuntimeError("vLLM said no")
    with pytest.raises(RuntimeError, match="vLLM said no"):
        await e.sleep(1)
    assert not await e.is_sleeping() and await admitted(e)
    e.llm.fail = None
    await e.sleep(2)
    await e.wake_up()
    e.llm.fail = RuntimeError("again")
    with pytest.raises(RuntimeError, match="again"):
        await e.sleep(1)
    assert not await e.is_sleeping() and not await admitted(e)  # still waiting for the level-2 sleep's weights


async def test_a_sleep_that_fails_leaves_the_engine_awake_and_serving(model_dir):
    """The sleep request reaches no server (a closed port): the error is raised, and requests
    are not held for a sleep that never happened."""
    from agentenv.engines.openai import OpenAIEngine

    eng = OpenAIEngine("http://127.0.0.1:9", model_dir, retries=0)
    with pytest.raises(Exception, match="onnect"):
        await eng.sleep(1)
    with anyio.fail_after(5):  # a hang guard: admission returns at once when awake
        await eng._until_awake()
