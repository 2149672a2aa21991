"""Engines as Ray actors on the real local Ray cluster: two embedded-engine actors behind one
``RayEngine``, the engine contract, routing by the KV every client holds, weights to every
replica, and an actor killed mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import asdict

import pytest

pytest.importorskip("ray")

from agentenv import testing  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402

from ..waiting import until, until_ok  # noqa: E402

pytestmark = pytest.mark.anyio
HALF = {"num_cpus": 0.5}  # the session cluster has 2 CPUs


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # Ray's object refs are awaited on asyncio


@pytest.fixture(scope="module")
async def rengine(ray_cluster, model_dir):
    from agentenv.engines.actors import RayEngine

    engine = await RayEngine.start("embedded", str(model_dir), replicas=2, options=HALF)
    yield engine
    await engine.aclose()


async def test_engine_contract_over_two_engine_actors(rengine):
    assert len(set(rengine.pids)) == 2
    assert rengine.kv_capacity_tokens and rengine.router.capacity and len(rengine.router.capacity) == 2
    # The interface's attributes, as the embedded engines in the actors report them.
    assert rengine.page_size == 16 and rengine.sampling == (1.0, 1.0, 0)
    await testing.engine_contract(rengine)
    release_all(rengine)


def release_all(engine) -> None:
    for program in engine.router.routes():  # as the reactor does when its programs end
        engine.release(program)


async def held_by_actors(engine) -> list[int]:
    """What each actor counts as held by its clients' programs, once the one-way releases land
    (or as it stands when the wait for them gives up)."""
    held: list[int] = []

    async def released() -> bool:
        held[:] = await asyncio.gather(*(a.load.remote() for a in engine.actors))
        if held != [0, 0]:
            raise LookupError(held)
        return True

    with contextlib.suppress(AssertionError):
        await until_ok(released, LookupError, "the actors saw every release", timeout=60)
    return held


async def test_weights_reach_every_replica(rengine, model_dir):
    import torch
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    original, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    prompt = testing.chat_prompt(rengine, "Compute 12 * 34.")
    try:
        await testing.check_weight_update(rengine, prompt, {"model.norm.weight": torch.zeros_like(original)})
        # A zero final norm: every logit 0, every sampled token's logprob exactly -log(V), on both.
        params = asdict(SamplingParams(max_tokens=4, stop_token_ids=()))
        replies = await asyncio.gather(*(a.generate.remote(prompt, params, f"w{i}-0", 0, 0)
                                         for i, a in enumerate(rengine.actors)))  # each actor asked directly
        for r in replies:
            assert r["weight_version"] == rengine.weight_version
            assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in r["logprobs"])
    finally:
        await rengine.load_weights({"model.norm.weight": original})
    for i, a in enumerate(rengine.actors):
        await a.release.remote(f"w{i}")
    release_all(rengine)


async def test_new_programs_go_where_every_clients_programs_leave_room(rengine, model_dir):
    from agentenv.engines.actors import RayEngine

    # A second client of the same actors (as a second rollout worker is).
    other = await RayEngine.connect(rengine.actors, str(model_dir), share=0.5)
    assert other.kv_capacity_tokens == rengine.kv_capacity_tokens // 2
    assert await held_by_actors(rengine) == [0, 0]
    p = SamplingParams(max_tokens=4)
    long_prompt = testing.chat_prompt(rengine, "Compute 1 + 2. " * 60)
    short = testing.chat_prompt(rengine, "Compute 1 + 2.")
    big = await other.generate(long_prompt, p, "big-0")  # the other client's program
    b = big.extra["replica"]
    # This client sent nothing to b: before placing a new program it asks every actor.
    rengine.refresh_s = 0.0
    try:
        s1 = await rengine.generate(short, p, "small1-0")
        assert rengine.router.held[b] >= len(long_prompt)
        s2 = await rengine.generate(short, p, "small2-0")
    finally:
        rengine.refresh_s = 1.0
    assert s1.extra["replica"] == s2.extra["replica"] != b  # away from the other client's big program
    again = await other.generate(long_prompt + big.token_ids, p, "big-1")
    assert again.extra["replica"] == b and again.cached_tokens > 0  # it stays with its prefix
    for prog in ("small1", "small2"):
        rengine.release(prog)
    other.release("big")
    assert await held_by_actors(rengine) == [0, 0]


@pytest.mark.slow
async def test_a_killed_engine_actor_is_restarted_and_no_request_is_lost(rengine, model_dir):
    import ray
    import torch
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    original, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    prompt = testing.chat_prompt(rengine, "Compute 4364 + 83 * 54.")
    await rengine.load_weights({"model.norm.weight": torch.zeros_like(original)})
    version, failures, pid0 = rengine.weight_version, rengine.failures, rengine.pids[0]
    try:
        p = SamplingParams(max_tokens=160)
        calls = [asyncio.ensure_future(rengine.generate(prompt, p, f"k{i}-0")) for i in range(12)]
        # Killed with requests under way on it: nothing is awaited between the router's count
        # and the kill, so what it counts is in flight at the kill.
        await until(lambda: min(rengine.router.inflight) > 0, "requests under way on both replicas")
        assert rengine.router.inflight[0] > 0
        ray.kill(rengine.actors[0], no_restart=False)  # Ray restarts it (max_restarts)
        gens = await asyncio.gather(*calls)
        for g in gens:  # every request served whole, by the weights it is stamped with
            assert len(g.token_ids) == 160 and g.finish_reason == "length"
            assert g.weight_version == version
            assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs)
        assert rengine.failures > failures  # some were in flight on the killed actor, and sent again
        # The restarted actor came back with its starting weights; a request routed to it is
        # refused as stale, and the client installs the weights pushed so far first.
        # Back once Ray has restarted it and it reopened its engine (slow under load).
        info = await until_ok(rengine.actors[0].info.remote, ray.exceptions.RayActorError,
                              "the killed engine actor came back")
        assert info["pid"] != pid0
        # A retried request may already have reached it once Ray restarted it (the router avoids
        # a failed replica for only 2 s), and then it was given the weights then; if not, it
        # still has its starting weights, and the request below finds it stale.
        assert info["weight_version"] in (0, version), info
        assert info["weight_version"] == 0 or rengine.resyncs >= 1
        rengine.router.down(1, now=float("inf"))  # steer new programs to the restarted replica
        g = await rengine.generate(prompt, SamplingParams(max_tokens=8), "after-restart-0")
        assert g.extra["replica"] == 0 and g.weight_version == version and rengine.resyncs >= 1
        assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs)
    finally:
        release_all(rengine)
        rengine.router = type(rengine.router)(2, rengine.router.capacity)
        await rengine.load_weights({"model.norm.weight": original})
