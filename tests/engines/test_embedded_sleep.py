"""``agentenv.engines.embedded_sleep``: the embedded engine's sleep mode on the bundled model,
what each level frees and how it comes back: the KV cache's tensor gone and its memory back
with the system, level 1's weights kept, level 2's released until ``load_weights``; requests
submitted asleep wait for the engine to wake (and for the weights)."""

from __future__ import annotations

import gc
import os
import weakref

import anyio
import pytest
import torch

from agentenv import testing
from agentenv.engines.base import SamplingParams
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.errors import EngineError

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
async def greedy(model_dir):
    eng = EmbeddedEngine(model_dir, temperature=0.0, seed=0)
    try:
        yield eng
    finally:
        await eng.aclose()


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


async def test_sleep_frees_the_kv_cache_and_wake_up_restores_it(greedy):
    prompt = testing.chat_prompt(greedy, "Compute 12 * 34.")
    before = await greedy.generate(prompt, GREEDY, "before")
    kv_bytes, held = greedy.kv_cache_bytes, weakref.ref(greedy._mgr.batch_processor.cache.cache_tensor)
    saved = weights(greedy)
    assert kv_bytes >= 100 * 2**20 and not await greedy.is_sleeping()
    gc.collect()
    awake_rss = rss()

    await greedy.sleep(1)
    gc.collect()
    assert await greedy.is_sleeping()
    assert held() is None and greedy.kv_cache_bytes == 0  # the KV cache's tensor is gone
    assert awake_rss - rss() >= 0.8 * kv_bytes  # and its memory went back to the system
    await greedy.wake_up()

    assert not await greedy.is_sleeping() and greedy.kv_cache_bytes == kv_bytes
    assert all(torch.equal(t, saved[n]) for n, t in weights(greedy).items())  # level 1 keeps the weights
    after = await greedy.generate(prompt, GREEDY, "after")
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert after.cached_tokens == 0  # the prefix cache went with the KV cache


async def test_level_2_drops_the_weights_until_load_weights(greedy):
    prompt = testing.chat_prompt(greedy, "Compute 7 * 89.")
    before = await greedy.generate(prompt, GREEDY, "before")
    saved = weights(greedy)
    await greedy.sleep(2)
    assert sum(p.numel() for p in greedy.model.parameters()) == 0
    await greedy.wake_up()
    assert not await greedy.is_sleeping()
    got: list = []
    async with anyio.create_task_group() as tg:
        async def ask() -> None:
            got.append(await greedy.generate(prompt, GREEDY, "after"))

        tg.start_soon(ask)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # awake, but no weights to serve with: the request waits for them
        with pytest.raises(EngineError, match="level 2"):  # nothing to load into while asleep
            await greedy.sleep(2)
            await greedy.load_weights(saved)
        await greedy.wake_up()
        await greedy.load_weights(saved, version=3)
    assert got[0].token_ids == before.token_ids and got[0].weight_version == 3


async def test_a_request_submitted_asleep_waits_for_wake_up(greedy):
    prompt = testing.chat_prompt(greedy, "Compute 5 * 6.")
    before = await greedy.generate(prompt, GREEDY, "before")
    await greedy.sleep(1)
    got: list = []
    async with anyio.create_task_group() as tg:
        async def ask() -> None:
            got.append(await greedy.generate(prompt, GREEDY, "asleep"))

        tg.start_soon(ask)
        await anyio.wait_all_tasks_blocked()
        assert got == []  # it waits, neither served nor refused
        await greedy.wake_up()
    assert got[0].token_ids == before.token_ids


async def test_weights_loaded_asleep_at_level_1_are_served_after_wake_up(greedy):
    prompt = testing.chat_prompt(greedy, "Compute 3 * 41.")
    lm_head = greedy.model.lm_head.weight.detach().clone()
    await greedy.sleep(1)
    await greedy.load_weights({"lm_head.weight": torch.zeros_like(lm_head)}, version=1)
    await greedy.wake_up()
    g = await greedy.generate(prompt, GREEDY, "zeroed")
    vocab = lm_head.shape[0]
    assert g.weight_version == 1 and all(abs(lp + float(torch.log(torch.tensor(float(vocab))))) < 1e-3
                                         for lp in g.logprobs)
