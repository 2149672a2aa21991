"""The instant engine (agentenv.engines.instant, exported by agentenv.testing): the engine
contract, trace and replayed turn lengths, stop tokens, the rate and its priority order,
abort, the KV capacity's LRU, and a real reactor run of a trace workload on it."""

from __future__ import annotations

import json
import time

import anyio
import pytest

from agentenv import Reactor, RolloutConfig, make
from agentenv.engines import SamplingParams
from agentenv.testing import InstantEngine, chat_prompt, check_weight_update, engine_contract
from agentenv.workload import WorkloadSpec, program_trace

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tokenizer():
    from agentenv.engines.embedded import load_tokenizer
    from agentenv.models import default_model

    return load_tokenizer(default_model())


@pytest.mark.parametrize("tok_s", [None, 50_000.0])
async def test_contract(tokenizer, tok_s):
    async with InstantEngine(tokenizer, tok_s=tok_s) as engine:
        await engine_contract(engine)
        await check_weight_update(engine, chat_prompt(engine, "hi"), {"w": 1})
        assert engine.weight_version == 1
        assert engine.cpu_s > 0 and engine.requests > 0


async def test_turns_take_max_tokens_or_the_cap(tokenizer):
    engine = InstantEngine(tokenizer, turn_tokens=10)
    g = await engine.generate_turn("p", [1] * 40, SamplingParams(max_tokens=7), "p-0")
    assert g.token_ids == [engine.filler] * 7 and g.finish_reason == "length" and g.stop_token_id is None
    g = await engine.generate_turn("p", [1] * 40 + g.token_ids, SamplingParams(max_tokens=64, stop_token_ids=(99,)),
                                   "p-1")
    # Shorter than its cap: the turn ends on the first stop token.
    assert len(g.token_ids) == 10 and g.token_ids[-1] == 99 and g.finish_reason == "stop" and g.stop_token_id == 99
    assert g.logprobs == [-0.5] * 10 and g.versions == [0] * 10
    # The program's first turn left 47 tokens of KV: two whole blocks of 16 are cached.
    assert g.cached_tokens == 32 and g.prompt_tokens == 47


async def test_replayed_lengths_from_a_rollout_file(tokenizer, tmp_path):
    path = tmp_path / "rollouts.jsonl"
    rows = [{"turns": [{"new_tokens": 5}, {"new_tokens": 3}]}, {"turns": [{"new_tokens": 9}]}, {"turns": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = InstantEngine.from_rollouts(path, tokenizer)
    params = SamplingParams(max_tokens=8, stop_token_ids=(tokenizer.eos_token_id,))
    lengths = {p: [len((await engine.generate_turn(p, [1, 2, 3], params, f"{p}-{i}")).token_ids) for i in range(2)]
               for p in ("a", "b", "c")}
    # a takes the first trajectory's turns, b the second's (cut at max_tokens, then max_tokens
    # when its plan runs out), c the first's again.
    assert lengths == {"a": [5, 3], "b": [8, 8], "c": [5, 3]}
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match="no trajectory with turns"):
        InstantEngine.from_rollouts(empty, tokenizer)


async def test_a_reply_with_a_stop_token_ends_there(tokenizer):
    engine = InstantEngine(tokenizer, reply=[7, 8, 9, 10])
    g = await engine.generate([1] * 20, SamplingParams(max_tokens=6, stop_token_ids=(9,)), "r")
    assert g.token_ids == [engine.filler, engine.filler, 7, 8, 9] and g.stop_token_id == 9
    g = await engine.generate([1] * 20, SamplingParams(max_tokens=3, stop_token_ids=(9,)), "r2")
    assert g.token_ids == [8, 9] and g.finish_reason == "stop"
    g = await engine.generate([1] * 20, SamplingParams(max_tokens=6), "r3")
    assert g.token_ids == [engine.filler, engine.filler, 7, 8, 9, 10] and g.finish_reason == "length"


async def test_the_rate_serves_the_most_urgent_first(tokenizer):
    engine = InstantEngine(tokenizer, tok_s=20_000)
    order = []

    async def one(name: str, priority: int) -> None:
        await engine.generate([1] * 20, SamplingParams(max_tokens=200), name, priority=priority)
        order.append(name)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "first", 9)
        await anyio.lowlevel.checkpoint()  # it holds the engine: the others wait behind it
        for name, priority in (("late", 5), ("urgent", 1), ("middle", 3)):
            tg.start_soon(one, name, priority)
    # 800 tokens at 20,000 tok/s cannot take less than 40 ms.
    assert time.perf_counter() - t0 >= 0.04
    assert order == ["first", "urgent", "middle", "late"]


async def test_abort_a_waiting_request(tokenizer):
    engine = InstantEngine(tokenizer, tok_s=1_000)
    got = {}

    async def one(name: str) -> None:
        got[name] = await engine.generate([1] * 20, SamplingParams(max_tokens=100), name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "long")
        await anyio.lowlevel.checkpoint()
        tg.start_soon(one, "queued")
        await anyio.lowlevel.checkpoint()
        await engine.abort("queued")
        await engine.abort("long")
    assert got["queued"].finish_reason == "abort" and got["queued"].token_ids == []
    assert got["long"].finish_reason == "abort"
    # The engine serves on afterwards.
    g = await engine.generate([1] * 20, SamplingParams(max_tokens=2), "after")
    assert len(g.token_ids) == 2


async def test_kv_capacity_evicts_least_recently_used(tokenizer):
    engine = InstantEngine(tokenizer, kv_capacity_tokens=100)
    params = SamplingParams(max_tokens=16)
    await engine.generate_turn("a", [1] * 44, params, "a-0")  # holds 60
    await engine.generate_turn("b", [2] * 44, params, "b-0")  # 120 > 100: a is evicted
    assert engine.evictions == 1
    ga = await engine.generate_turn("a", [1] * 64, params, "a-1")
    assert ga.cached_tokens == 0  # and b is evicted in turn
    engine.release("a")  # a ended: evicted first
    await engine.generate_turn("c", [3] * 5, params, "c-0")  # 80 + 21 > 100
    assert engine.evictions == 3 and list(engine._kv) == ["c"]


async def test_a_trace_workload_through_the_reactor(tokenizer):
    spec = dict(tool_median=0.0, mean_turns=4, turn_tokens=20, max_turn_tokens=40)
    env = make("trace", sandbox=False, **spec)
    engine = InstantEngine(tokenizer)
    cfg = RolloutConfig(concurrency=8, max_turns=64, max_new_tokens=100_000, max_tokens_per_turn=4096)
    async with Reactor(engine, env, None, cfg) as reactor:
        groups = await reactor.collect(env.tasks(6), 2)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12
    for t in trajs:
        trace = program_trace(WorkloadSpec(**spec), f"0/{t.task_id.split('/')[-1]}/{t.sample_index}")
        assert t.finish_reason == "stop", t.error
        assert tuple(x.new_tokens for x in t.turns) == trace.turn_tokens
        assert all(x.cached_tokens > 0 for x in t.turns[1:])  # each turn resumes the last one's KV
    assert engine.generated == sum(t.num_sampled_tokens for t in trajs)
    # One gap per turn after a program's first.
    assert len(engine.gaps) == sum(len(t.turns) - 1 for t in trajs) and all(g >= 0 for g in engine.gaps)
