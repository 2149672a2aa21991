"""Weights into vLLM over a weight-update group (gloo here): the bytes broadcast between real
processes, the in-process engine and a `vllm serve` loading what was sent, the host path when
no group forms, and a two-rank training run whose engine gets its weights over the group
serving, bit for bit, what the host-path run's engine serves (and, into a `vllm serve`, the
trainer's weights, sent by its rank 0)."""

from __future__ import annotations

import logging
import os
import threading

import anyio
import pytest
import torch

pytest.importorskip("vllm")

from agentenv.engines.weight_group import GroupLink, buckets, join, leave, listen, metadata, receive, send  # noqa: E402
from agentenv.errors import EngineError  # noqa: E402

from ..waiting import until  # noqa: E402

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


def _running(*functions: str) -> bool:
    """Whether some thread is inside one of weight_group's ``functions`` now."""
    import sys

    import agentenv.engines.weight_group as wg

    frames = list(sys._current_frames().values())
    for frame in frames:
        while frame is not None:
            if frame.f_code.co_filename == wg.__file__ and frame.f_code.co_name in functions:
                return True
            frame = frame.f_back
    return False


def _listening(port: int) -> bool:
    import psutil

    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.Process().net_connections("tcp"))


async def test_a_formation_that_fails_ends_its_join_and_closes_its_socket():
    """The workers' side fails while this end waits at the rendezvous (timeout 60 s): the
    failure is raised, this end's join has ended and its listening socket is closed, long
    before the timeout."""
    from agentenv.engines.weight_group import GroupSender

    ports: list[int] = []

    async def ask_join(host: str, port: int, world: int, backend_name: str) -> None:
        ports.append(port)
        await until(lambda: _running("_wait_for_ranks"), "this end waiting at the rendezvous", timeout=30)
        raise RuntimeError("the workers could not join")

    with pytest.raises(RuntimeError, match="could not join"):
        await GroupSender.form("127.0.0.1", 2, ask_join, timeout_s=60)
    await until(lambda: not _running("_join", "join"), "the join thread ends", timeout=10)
    assert not _listening(ports[0])


def _watch_leave(monkeypatch) -> list[bool]:
    """Each time a group is left (the real ``leave``): whether this end's broadcast (``send``)
    was in flight."""
    import agentenv.engines.weight_group as wg

    calls: list[bool] = []
    real = wg.leave

    def watched(group) -> None:
        calls.append(_running("send"))
        real(group)

    monkeypatch.setattr(wg, "leave", watched)
    return calls


async def _formed(timeout_s: float):
    """A group of this end (``GroupSender``) and one worker (a thread here, rank 1)."""
    from agentenv.engines.weight_group import GroupSender

    peer: list = []

    async def ask_join(host: str, port: int, world: int, backend_name: str) -> None:
        peer.append(await anyio.to_thread.run_sync(
            lambda: join(host, port, 1, world, backend_name=backend_name, timeout_s=timeout_s)))

    return await GroupSender.form("127.0.0.1", 1, ask_join, timeout_s=timeout_s), peer[0]


async def test_a_failed_update_leaves_the_group_only_after_its_broadcast(monkeypatch):
    """The workers' answer fails while this end broadcasts (16 MiB in 1 MiB buckets: more than
    the sockets buffer, so the broadcast waits for its peer): the update raises at once, but
    the group is not left under the broadcast: the worker, late, still receives every tensor
    bit for bit, and only then does this end's sending thread leave the group."""
    import agentenv.engines.weight_group as wg

    monkeypatch.setattr(wg, "BUCKET_BYTES", 1024**2)
    left = _watch_leave(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(256 * 1024, generator=gen) for i in range(16)}
    sender, peer = await _formed(timeout_s=30)

    async def ask_receive(meta):
        await until(lambda: _running("_broadcast"), "this end broadcasting", timeout=30)
        raise RuntimeError("a worker failed")

    with pytest.raises(RuntimeError, match="a worker failed"):
        await sender.update(tensors, ask_receive)
    assert sender.group is None and sender.sent_bytes == 0
    got = await anyio.to_thread.run_sync(lambda: dict(receive(peer, metadata(tensors))))
    assert list(got) == list(tensors) and all(torch.equal(got[n], t) for n, t in tensors.items())
    await until(lambda: not _running("broadcast"), "the sending thread ends", timeout=30)
    assert left == [False]  # left once, with no broadcast in flight
    leave(peer)


async def test_a_broadcast_no_peer_takes_ends_at_the_groups_timeout(monkeypatch):
    """Nobody receives (16 MiB, more than the sockets buffer): the update raises at once; the
    broadcast left in flight ends at the group's timeout (3 s here), and its thread leaves
    the group then."""
    left = _watch_leave(monkeypatch)
    sender, peer = await _formed(timeout_s=3)

    async def ask_receive(meta):
        await until(lambda: _running("_broadcast"), "this end broadcasting", timeout=30)
        raise RuntimeError("the workers are gone")

    with pytest.raises(RuntimeError, match="the workers are gone"):
        await sender.update({"w": torch.ones(4 * 1024**2)}, ask_receive)
    assert _running("broadcast")  # the broadcast waits on: the peer has not taken it
    await until(lambda: not _running("broadcast"), "the broadcast ends at the group's timeout", timeout=60)
    assert sender.group is None and left == [False]
    leave(peer)


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


@pytest.fixture(scope="module")
def vserver(model_dir, tmp_path_factory):
    """One `vllm serve` on loopback for the module (a start costs about 50 s)."""
    from .test_openai import Server, stop_server

    srv = Server(model_dir, tmp_path_factory.mktemp("vllm") / "server.log")
    yield srv
    stop_server(srv.proc)


@pytest.mark.slow
async def test_a_vllm_server_loads_over_the_group_what_the_in_process_engine_does(vengine, vserver, model_dir):
    """The OpenAI engine forms a group with `vllm serve`'s worker through the dev
    ``/collective_rpc`` endpoint; the server then serves, bit for bit, what the in-process
    engine serves for the same tensors."""
    from agentenv.engines.openai import OpenAIEngine

    new = perturbed(model_dir, seed=4)
    vengine.weight_group = GroupLink("auto")
    await vengine.load_weights(new)
    expected = (await _rpc(vengine)("agentenv_weights_digest"))[0]
    eng = await OpenAIEngine.create(vserver.url, model_dir, block_size=32)
    try:
        assert await eng.load_weights(new) == 1
        assert eng.weight_groups[0].on and eng.weight_groups[0].sender.sent_bytes > 0
        assert (await eng._rpc(0, "agentenv_weights_digest"))[0] == expected
    finally:
        await eng.aclose()


@pytest.mark.slow
async def test_rank_zero_of_a_two_rank_run_sends_its_weights_into_a_vllm_server(ray_cluster, vserver, model_dir,
                                                                                 tmp_path):
    """Two steps of a two-rank (Ray, gloo) run whose engine is a `vllm serve` (the OpenAI
    engine, weight_sync=group): rank 0 sent every step's weights into the server's worker
    itself (the sender is the rank-0 actor's process, which reports both steps' bytes), the
    versions are stamped as the steps, and the server serves exactly the trainer's final
    weights (its last checkpoint's tensors; that checkpoint, loaded again through the host,
    changes none of them)."""
    from safetensors.torch import load_file

    from agentenv.engines.openai import OpenAIEngine
    from agentenv.train import TrainConfig, Trainer
    from agentenv.train.rank_weights import RankSender

    from ..train.conftest import AlternatingReward

    eng = await OpenAIEngine.create(vserver.url, model_dir, block_size=32, weight_sync="group")
    host = await OpenAIEngine.create(vserver.url, model_dir, block_size=32, weight_sync="host")
    try:
        cfg = TrainConfig(steps=2, groups_per_step=2, group_size=2, max_new_tokens=48, concurrency=4, lr=1e-3,
                          mode="sync", seed=0, out_dir=str(tmp_path), checkpoint_every=2, cluster="ray",
                          trainer_ranks=2, engine="openai", weight_sync="group")
        await Trainer(cfg, engine=eng, env=AlternatingReward(), print_steps=False).run()
        assert eng.weight_version == 2
        sender = eng.weight_groups[0].sender
        start = load_file(f"{model_dir}/model.safetensors")
        # Not a GroupSender of this process's: the rank-0 actor sent both steps' weights. Unless a
        # request found the server unreachable (a busy machine): then everything was pushed again
        # from here (the group dropped), and rank 0's group, formed again, sent the last step.
        assert isinstance(sender, RankSender) and sender.pid == sender.origin.pids[0] != os.getpid()
        size = sum(t.numel() * t.element_size() for t in start.values())
        assert sender.sent_bytes == (2 if eng.resyncs == [0] else 1) * size, eng.resyncs
        trained = load_file(str(tmp_path / "checkpoints" / "step-000002" / "model.safetensors"))
        assert any(not torch.equal(trained[n], start[n]) for n in start)  # the steps moved the weights
        got = await served(lambda method, *args: eng._rpc(0, method, *args), PLAIN)
        assert all(same(got[n], trained[n]) for n in PLAIN)
        over_group = (await eng._rpc(0, "agentenv_weights_digest"))[0]
        await host.load_weights(trained)
        assert not host.weight_groups[0].on
        assert (await eng._rpc(0, "agentenv_weights_digest"))[0] == over_group
    finally:
        await eng.aclose()
        await host.aclose()


class Both:
    """The engine a run trains with: generation on ``group`` (weights over the weight-update
    group); every weight update also sent to ``host`` (the serialised path), in the same order
    and with the same versions."""

    def __init__(self, group, host) -> None:
        self.group, self.host = group, host

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    async def load_weights(self, weights, version=None):
        # As the run gives them: a Ray policy's are held by its rank 0 (the host path fetches them).
        await self.host.load_weights(weights, version=version)
        return await self.group.load_weights(weights, version=version)


@pytest.mark.slow
async def test_a_two_rank_run_over_the_group_serves_the_host_paths_weights(ray_cluster, model_dir, tmp_path):
    """The issue's done-means: three steps of a two-rank (Ray, gloo) run, each step's weights
    sent to one vLLM engine over the weight-update group and to another through the host;
    after the run both serve the same weights bit for bit, and those are the trainer's (its
    final checkpoint, loaded again through the host, changes none of them). Over the group,
    rank 0 sent them: the sender is the rank-0 actor's (another process), which reports every
    step's bytes, and the driver formed no group of its own until it sent weights of its own.

    The two paths are fed by one run: two runs of the same seed do not sample the same tokens
    (vLLM's requests carry no seed of their own here), so their weights differ before any sync."""
    from safetensors.torch import load_file

    from agentenv.engines.vllm import VLLMEngine
    from agentenv.engines.weight_group import GroupSender
    from agentenv.train import TrainConfig, Trainer
    from agentenv.train.rank_weights import RankSender

    from ..train.conftest import AlternatingReward

    group = await VLLMEngine.create(model_dir, max_model_len=1024, seed=0, weight_sync="group")
    host = await VLLMEngine.create(model_dir, max_model_len=1024, seed=0, weight_sync="host")
    try:
        cfg = TrainConfig(steps=3, groups_per_step=2, group_size=2, max_new_tokens=48, concurrency=4, lr=1e-3,
                          mode="sync", seed=0, out_dir=str(tmp_path), checkpoint_every=3, cluster="ray",
                          trainer_ranks=2, engine="vllm", weight_sync="group")
        await Trainer(cfg, engine=Both(group, host), env=AlternatingReward(), print_steps=False).run()
        assert group.weight_version == host.weight_version == 3
        assert group.weight_group.on and not host.weight_group.on
        sender = group.weight_group.sender
        model_bytes = sum(t.numel() * t.element_size() for t in load_file(f"{model_dir}/model.safetensors").values())
        # Not a GroupSender of the driver's: the rank-0 actor (another process) sent every step's weights.
        assert isinstance(sender, RankSender) and sender.pid != os.getpid()
        assert sender.sent_bytes == 3 * model_bytes
        over_group = (await _rpc(group)("agentenv_weights_digest"))[0]
        assert over_group == (await _rpc(host)("agentenv_weights_digest"))[0]
        start = load_file(f"{model_dir}/model.safetensors")
        trained = load_file(str(tmp_path / "checkpoints" / "step-000003" / "model.safetensors"))
        assert any(not torch.equal(trained[n], start[n]) for n in start)  # the steps moved the weights
        await host.load_weights(trained)
        assert (await _rpc(host)("agentenv_weights_digest"))[0] == over_group
        # Weights of this process (the ranks are gone): the group is formed again, with this end.
        await group.load_weights(trained)
        assert isinstance(group.weight_group.sender, GroupSender) and group.weight_version == 4
        assert (await _rpc(group)("agentenv_weights_digest"))[0] == over_group
    finally:
        await group.aclose()
        await host.aclose()


def test_an_update_that_fails_is_not_kept_for_a_restarted_core():
    # The engine keeps a host copy of every update so that a restarted core serves it; an update
    # that raised (a group that failed under weight_sync=group) must not be installed by a
    # later restart, under the older version's label.
    from agentenv.engines.vllm import _kept

    served = {"a": torch.zeros(2)}
    with pytest.raises(EngineError):
        with _kept(served, [("a", torch.ones(2)), ("b", torch.ones(1))]):
            assert served["a"].sum() == 2 and "b" in served  # kept while the install runs
            raise EngineError("the group failed")
    assert torch.equal(served["a"], torch.zeros(2)) and "b" not in served
    with _kept(served, [("b", torch.ones(1))]):
        pass
    assert torch.equal(served["b"], torch.ones(1))
