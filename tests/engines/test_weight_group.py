"""Weights into vLLM over a weight-update group (gloo here): the bytes broadcast between real
processes, the in-process engine and a `vllm serve` loading what was sent, the host path when
no group forms, and a two-rank training run whose engine gets its weights over the group
serving, bit for bit, what the host-path run's engine serves."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest
import torch

pytest.importorskip("vllm")

from agentenv.engines.weight_group import GroupLink, buckets, join, leave, listen, metadata, receive, send  # noqa: E402
from agentenv.errors import EngineError  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def test_buckets_hold_the_tensors_in_order_within_the_limit():
    meta = [("a", "float32", [4]), ("b", "bfloat16", [2, 3]), ("c", "float32", [100]), ("d", "int64", [1])]
    # 16 + 12 bytes fit in 32; c (400 bytes) is over the limit and goes alone; d starts the next.
    assert buckets(meta, limit=32) == [[0, 1], [2], [3]]
    assert buckets(meta) == [[0, 1, 2, 3]]
    assert buckets([]) == []


def test_a_broadcast_carries_every_tensor_bit_for_bit(monkeypatch):
    """Rank 0 sends (in buckets: a small limit splits them), rank 1 receives views of the same
    bytes: every dtype, a scalar, an empty tensor, one larger than a bucket."""
    import agentenv.engines.weight_group as wg

    monkeypatch.setattr(wg, "BUCKET_BYTES", 256)
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(7, 5, generator=gen), "h": torch.randn(300, generator=gen).to(torch.bfloat16),
               "s": torch.tensor(3.5, dtype=torch.float64), "e": torch.empty(0, 4), "i": torch.arange(9)}
    sock = listen("127.0.0.1")
    port = sock.getsockname()[1]
    got: dict[str, torch.Tensor] = {}

    def worker() -> None:
        group = join("127.0.0.1", port, 1, 2, backend_name="gloo", timeout_s=30)
        got.update(receive(group, metadata(tensors)))
        leave(group)

    t = threading.Thread(target=worker)
    t.start()
    group = join("127.0.0.1", port, 0, 2, backend_name="gloo", listen_socket=sock, timeout_s=30)
    sent = send(group, tensors)
    t.join(30)
    leave(group)
    assert sent == sum(v.numel() * v.element_size() for v in tensors.values())
    assert list(got) == list(tensors)
    for name, v in tensors.items():
        assert got[name].dtype == v.dtype and got[name].shape == v.shape and torch.equal(got[name], v), name


def test_an_unknown_weight_sync_is_refused():
    from agentenv.errors import ConfigError

    with pytest.raises(ConfigError, match="auto, group or host"):
        GroupLink("nccl")


def perturbed(model_dir: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """The bundled model's tensors moved by a little noise (every one of them differs)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in
            load_file(f"{model_dir}/model.safetensors").items()}


async def served(rpc, names: list[str]) -> dict[str, torch.Tensor]:
    """The engine's parameters ``names``, read from its worker."""
    return {n: torch.tensor(v, dtype=torch.float64) for n, v in (await rpc("agentenv_read_weights", names))[0].items()}


def same(got: torch.Tensor, sent: torch.Tensor) -> bool:
    """A served parameter holds exactly the sent tensor (vLLM pads the embedding's rows to a
    multiple of 64: the rows past the vocabulary are not the model's)."""
    return torch.equal(got[: sent.shape[0]], sent.double())


#: Parameters vLLM serves as loaded (not repacked for the CPU's GEMM): comparable to the sent ones.
PLAIN = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]


@pytest.fixture(scope="module")
async def vengine(model_dir):
    from agentenv.engines.vllm import VLLMEngine

    eng = await VLLMEngine.create(model_dir, max_model_len=512)
    yield eng
    await eng.aclose()


def _rpc(eng):
    return lambda method, *args: eng.llm.collective_rpc(method, args=args)


@pytest.mark.slow
async def test_the_engine_serves_exactly_the_tensors_sent_over_the_group(vengine, model_dir):
    """Over the group (formed at the first update), the workers load what was sent: the plain
    parameters equal the sent tensors, and every served parameter equals, bit for bit, what
    the host path serves for the same tensors. The version is stamped as on the host path."""
    from agentenv import testing
    from agentenv.engines.base import SamplingParams

    vengine.weight_group = GroupLink("auto")
    new = perturbed(model_dir)
    version = await vengine.load_weights(new)
    assert vengine.weight_group.on and vengine.weight_group.host_reason is None
    assert vengine.weight_group.sender.sent_bytes == sum(t.numel() * t.element_size() for t in new.values())
    got = await served(_rpc(vengine), PLAIN)
    for n in PLAIN:
        assert same(got[n], new[n]), n
    over_group = (await _rpc(vengine)("agentenv_weights_digest"))[0]
    g = await vengine.generate(testing.chat_prompt(vengine, "Compute 2 + 2."), SamplingParams(max_tokens=4), "wg-0")
    assert g.weight_version == version == vengine.weight_version

    vengine.weight_group.close()
    vengine.weight_group = GroupLink("host")
    await vengine.load_weights(perturbed(model_dir, seed=2))  # something else first
    assert (await _rpc(vengine)("agentenv_weights_digest"))[0] != over_group
    await vengine.load_weights(new)
    assert (await _rpc(vengine)("agentenv_weights_digest"))[0] == over_group
    assert vengine.weight_version == version + 2


@pytest.mark.slow
async def test_a_group_that_cannot_form_leaves_the_host_path_with_a_log_line(vengine, model_dir, caplog):
    """An address the workers cannot meet at (192.0.2.1 is no address of this machine): auto
    says why once and updates through the host; group raises."""
    new = perturbed(model_dir, seed=3)
    vengine.weight_group = GroupLink("auto", host="192.0.2.1")
    with caplog.at_level(logging.WARNING, logger="agentenv.engines.weight_group"):
        v = await vengine.load_weights(new)
        await vengine.load_weights(new)
    lines = [r.getMessage() for r in caplog.records if "weights go through the host" in r.getMessage()]
    assert len(lines) == 1 and "could not be formed at 192.0.2.1" in lines[0], lines
    assert not vengine.weight_group.on and vengine.weight_version == v + 1
    got = await served(_rpc(vengine), PLAIN)
    assert all(same(got[n], new[n]) for n in PLAIN)

    vengine.weight_group = GroupLink("group", host="192.0.2.1")
    with pytest.raises(EngineError, match="weight_sync=group"):
        await vengine.load_weights(new)
    vengine.weight_group = GroupLink("auto")


@pytest.mark.slow
async def test_a_vllm_server_loads_over_the_group_what_the_in_process_engine_does(vengine, model_dir, tmp_path):
    """The OpenAI engine forms a group with `vllm serve`'s worker through the dev
    ``/collective_rpc`` endpoint; the server then serves, bit for bit, what the in-process
    engine serves for the same tensors."""
    from agentenv.engines.openai import OpenAIEngine

    from .test_openai import Server, stop_server

    new = perturbed(model_dir, seed=4)
    vengine.weight_group = GroupLink("auto")
    await vengine.load_weights(new)
    expected = (await _rpc(vengine)("agentenv_weights_digest"))[0]
    srv = Server(model_dir, tmp_path / "server.log")
    try:
        eng = await OpenAIEngine.create(srv.url, model_dir, block_size=32)
        try:
            assert await eng.load_weights(new) == 1
            assert eng.weight_groups[0].on and eng.weight_groups[0].sender.sent_bytes > 0
            assert (await eng._rpc(0, "agentenv_weights_digest"))[0] == expected
        finally:
            await eng.aclose()
    finally:
        stop_server(srv.proc)


async def _two_rank_run(model_dir: str, out, weight_sync: str) -> tuple[dict[str, str], bool]:
    """Three steps of a two-rank (Ray, gloo) run whose vLLM engine gets its weights by
    ``weight_sync``; the engine's served weights' digests, after checking that loading the
    trainer's final checkpoint through the host changes none of them."""
    from safetensors.torch import load_file

    from agentenv.engines.vllm import VLLMEngine
    from agentenv.train import TrainConfig, Trainer

    from ..train.conftest import AlternatingReward

    eng = await VLLMEngine.create(model_dir, max_model_len=1024, seed=0, weight_sync=weight_sync)
    try:
        # One program at a time and sync mode: both runs sample the same tokens.
        cfg = TrainConfig(steps=3, groups_per_step=2, group_size=2, max_new_tokens=48, concurrency=1, lr=1e-3,
                          mode="sync", seed=0, out_dir=str(out), checkpoint_every=3, cluster="ray", trainer_ranks=2,
                          engine="vllm", weight_sync=weight_sync)
        await Trainer(cfg, engine=eng, env=AlternatingReward(), print_steps=False).run()
        assert eng.weight_version == 3
        digest = (await _rpc(eng)("agentenv_weights_digest"))[0]
        used_group = eng.weight_group.on
        eng.weight_group = GroupLink("host")
        await eng.load_weights(load_file(str(out / "checkpoints" / "step-000003" / "model.safetensors")))
        assert (await _rpc(eng)("agentenv_weights_digest"))[0] == digest  # it served the trainer's weights
        return digest, used_group
    finally:
        await eng.aclose()


@pytest.mark.slow
async def test_a_two_rank_run_over_the_group_serves_the_host_path_runs_weights(ray_cluster, model_dir, tmp_path):
    """The issue's done-means: same seed and settings, one run's weights sent over the group,
    the other's through the host; after 3 steps both engines serve the same weights bit for
    bit, and each serves its trainer's."""
    group, used = await _two_rank_run(model_dir, tmp_path / "group", "group")
    host, host_used = await _two_rank_run(model_dir, tmp_path / "host", "host")
    assert used and not host_used
    assert group == host
