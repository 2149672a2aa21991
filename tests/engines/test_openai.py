"""The engine contract over HTTP: the openai SDK against a real `vllm serve` on loopback."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import anyio
import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from agentenv import testing  # noqa: E402
from agentenv.engines.base import SamplingParams  # noqa: E402

from ..waiting import ended, until  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """``vllm serve`` could not listen on its port: another process took it after it was found free."""


def start_server(model_dir: str, port: int, log) -> subprocess.Popen:
    """A real ``vllm serve`` on loopback, healthy when this returns."""
    import httpx

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes", str(256 * 1024**2),
           "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
           "--enable-prompt-tokens-details", "--logprobs-mode", "processed_logprobs",
           "--worker-extension-cls", "agentenv.engines.vllm_worker.WeightSyncExtension",
           "--middleware", "agentenv.engines.vllm_worker.instance_header"]
    with open(log, "a") as out:
        since = out.tell()  # this start's own lines (the log is appended to by each start)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                f.seek(since)
                said = f.read()
            if "address already in use" in said.lower():
                raise PortTaken(f"port {port} was taken before vllm serve could listen on it")
            raise RuntimeError(f"vllm serve exited: {said[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"vllm serve not healthy in time: {log.read_text()[-3000:]}")


def start_on_a_free_port(model_dir: str, log) -> tuple[subprocess.Popen, int]:
    """``start_server`` on a port free a moment before; another process on the machine (a
    second test run, a connection's own port) may take it while vllm serve loads, so a port
    found taken is replaced by another."""
    for _ in range(3):
        port = _free_port()
        try:
            return start_server(model_dir, port, log), port
        except PortTaken:
            continue
    raise RuntimeError("three free ports were each taken before vllm serve could listen on them")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Server:
    """The module's ``vllm serve``; the fault tests kill it and start it again on its port
    (a start costs about 50 s, so they share it rather than start their own)."""

    def __init__(self, model_dir: str, log) -> None:
        self.model_dir, self.log = model_dir, log
        self.proc, self.port = start_on_a_free_port(model_dir, log)
        self.url = f"http://127.0.0.1:{self.port}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        stop_server(self.proc, sig)

    def start(self) -> None:
        self.proc = start_server(self.model_dir, self.port, self.log)


@pytest.fixture(scope="module")
def module_server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("vllm") / "server.log")
    yield srv
    stop_server(srv.proc)


@pytest.fixture
def server(module_server):
    """The module's server, up: a fault test that failed before starting it again does not
    take the tests after it down too."""
    if module_server.proc.poll() is not None:
        module_server.start()
    return module_server


@pytest.fixture
async def oengine(server, model_dir):
    from agentenv.engines.openai import OpenAIEngine

    eng = await OpenAIEngine.create(server.url, model_dir, block_size=32)
    yield eng
    await eng.aclose()


@pytest.mark.slow
async def test_engine_contract(oengine):
    assert oengine.max_model_len == 1024
    # The interface's attributes: the server's block size as given, its capacity from /metrics.
    assert oengine.page_size == 32 and oengine.sampling is None and oengine.kv_capacity_tokens
    await testing.engine_contract(oengine)


@pytest.mark.slow
async def test_resume_is_served_from_the_prefix_cache(oengine):
    prompt = testing.chat_prompt(oengine, "Compute 4364 + 83 * 54.", system="Solve the problem with Python. " * 6)
    g = await oengine.generate(prompt, SamplingParams(max_tokens=40), "o-resume-0")
    resumed = prompt + g.token_ids + oengine.tokenizer.encode("\n<interpreter>\n8846\n</interpreter>\n")
    g2 = await oengine.generate(resumed, SamplingParams(max_tokens=8), "o-resume-1")
    assert g2.cached_tokens >= ((len(prompt) + len(g.token_ids) - 1) // 32) * 32 > 0


@pytest.mark.slow
async def test_weight_update_over_http(oengine, model_dir):
    import torch
    from safetensors.torch import load_file

    weights = load_file(f"{model_dir}/model.safetensors")
    norm, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    prompt = testing.chat_prompt(oengine, "Compute 12 * 34.")
    try:
        v = await oengine.load_weights({"model.norm.weight": torch.zeros_like(norm)})
        g = await oengine.generate(prompt, SamplingParams(max_tokens=6), "o-upd-0")
        assert g.weight_version == v == 1
        assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs)
    finally:
        await oengine.load_weights({"model.norm.weight": norm})


@pytest.mark.slow
async def test_sticky_routing_and_least_loaded(server, model_dir):
    from agentenv.engines.openai import OpenAIEngine

    # Two "replicas" (two URLs of the same server): routing is visible per generation.
    other = server.url.replace("127.0.0.1", "localhost")
    eng = await OpenAIEngine.create([server.url, other], model_dir)
    try:
        prompt = testing.chat_prompt(eng, "Compute 1 + 2.")
        p = SamplingParams(max_tokens=4)
        a0 = await eng.generate(prompt, p, "progA-0")
        b0 = await eng.generate(prompt, p, "progB-0")
        a1 = await eng.generate(prompt + a0.token_ids, p, "progA-1")
        assert a1.extra["server"] == a0.extra["server"]  # a program stays on its replica
        assert {a0.extra["server"], b0.extra["server"]} == {server.url, other}  # new ones spread
    finally:
        await eng.aclose()


async def test_dead_server_is_a_clear_engine_error(model_dir):
    from agentenv.engines.openai import OpenAIEngine
    from agentenv.errors import EngineError

    # A port this test holds, bound and not listening: a connection is refused, and no other
    # process on the machine (a second test run) can start listening there meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(EngineError, match=re.escape(f"cannot reach {url}: APIConnectionError: Connection error. "
                                                        "(is a server running there? start one with `vllm serve "
                                                        "MODEL")):
            await OpenAIEngine.create(url, model_dir, retries=2)


@pytest.mark.slow
async def test_kv_capacity_from_metrics_and_routing_by_kv_room(server, model_dir):
    from agentenv.engines.openai import OpenAIEngine

    other = server.url.replace("127.0.0.1", "localhost")
    eng = await OpenAIEngine.create([server.url, other], model_dir)
    try:
        # 256 MiB of float32 KV for 4 layers x 2 KV heads x 32 dims: 131,072 tokens per server.
        assert eng.router.capacity == [131_072, 131_072] and eng.kv_capacity_tokens == 262_144
        p = SamplingParams(max_tokens=4)
        long_prompt = testing.chat_prompt(eng, "Compute 1 + 2. " * 60)
        short = testing.chat_prompt(eng, "Compute 1 + 2.")
        big = await eng.generate(long_prompt, p, "big-0")
        # The next two new programs both go where there is more room, not round robin.
        s1 = await eng.generate(short, p, "small1-0")
        s2 = await eng.generate(short, p, "small2-0")
        assert s1.extra["server"] == s2.extra["server"] != big.extra["server"]
        # A released (finished or paused) program's KV no longer counts; its next request is
        # placed afresh where there is room.
        eng.release("small1")
        eng.release("small2")
        eng.release("big")
        assert eng.router.held == [0, 0]
    finally:
        await eng.aclose()


@pytest.mark.slow
async def test_a_restarted_server_is_reconnected_and_gets_the_weights_again(server, model_dir):
    """The server is killed (SIGKILL) with requests in flight and started again on the same
    port: every request completes, after the engine pushed the trained weights to it again."""
    import torch
    from safetensors.torch import load_file

    from agentenv.engines.openai import OpenAIEngine

    eng = await OpenAIEngine.create(server.url, model_dir, reconnect_s=240)
    weights = load_file(f"{model_dir}/model.safetensors")
    norm, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]
    try:
        # A zero final norm: every logit 0, every sampled token's logprob exactly -log(V).
        await eng.load_weights({"model.norm.weight": torch.zeros_like(norm)})
        prompt = testing.chat_prompt(eng, "Compute 3 + 4.")
        results: dict[int, object] = {}

        async def one(i: int, round_: int) -> None:
            results[i] = await eng.generate(prompt, SamplingParams(max_tokens=900), f"restart-{round_}-{i}")

        killed_with = []  # requests in flight at the kill, per round
        for round_ in range(3):  # a round whose requests all finished before the kill runs again
            results.clear()
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i, round_)
                # Killed once all four are at the server, or once one has come back while others
                # are still there. Nothing is awaited between the router's count and the kill:
                # what it counts is in flight at the kill.
                def ready() -> bool:
                    n = sum(eng.router.inflight)
                    return n == 4 or (n > 0 and bool(results)) or len(results) == 4

                await until(ready, "requests at the server")
                killed_with.append(sum(eng.router.inflight))
                if killed_with[-1]:
                    server.kill(signal.SIGKILL)
                    await anyio.to_thread.run_sync(server.start)
            if killed_with[-1]:
                break
        assert killed_with[-1] > 0, f"every round's requests finished before the kill: {killed_with}"
        for g in results.values():
            assert len(g.token_ids) == 900 and g.weight_version == 1
            assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs), "served without the pushed weights"
    finally:
        with contextlib.suppress(Exception):  # the shared server gets its own weights back
            await eng.load_weights({"model.norm.weight": norm})
        await eng.aclose()


@pytest.mark.slow
async def test_a_server_restarted_with_nothing_in_flight_gets_the_weights_before_it_serves(server, model_dir):
    """Killed and started again between two requests, the server reloads its checkpoint and no
    request sees the connection drop. Its next response names a new engine: the engine
    discards it, pushes the weights again and sends the request again."""
    import httpx
    import torch
    from safetensors.torch import load_file

    from agentenv.engines.openai import OpenAIEngine

    eng = await OpenAIEngine.create(server.url, model_dir)
    weights = load_file(f"{model_dir}/model.safetensors")
    norm, vocab = weights["model.norm.weight"], weights["model.embed_tokens.weight"].shape[0]

    def pushed(logprobs: list[float]) -> bool:  # a zero final norm: every logprob exactly -log(V)
        return all(abs(lp + math.log(vocab)) < 1e-3 for lp in logprobs)

    try:
        await eng.load_weights({"model.norm.weight": torch.zeros_like(norm)})
        prompt = testing.chat_prompt(eng, "Compute 3 + 4.")
        first = await eng.generate(prompt, SamplingParams(max_tokens=16), "idle-0")
        assert pushed(first.logprobs) and sum(eng.router.inflight) == 0
        server.kill(signal.SIGKILL)
        await anyio.to_thread.run_sync(server.start)
        # What a request to the restarted server gets unless the weights are pushed again:
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(f"{server.url}/v1/completions", json={
                "model": eng.model, "prompt": prompt, "max_tokens": 16, "logprobs": 0})
        assert not pushed(r.json()["choices"][0]["logprobs"]["token_logprobs"]), "the restart kept the weights"
        again = await eng.generate(prompt, SamplingParams(max_tokens=16), "idle-1")
        assert again.weight_version == 1
        assert pushed(again.logprobs), "the restarted server served its checkpoint under the pushed version"
    finally:
        with contextlib.suppress(Exception):  # the shared server gets its own weights back
            await eng.load_weights({"model.norm.weight": norm})
        await eng.aclose()


def kill_the_server_mid_run(server, args: list, ready, **popen) -> tuple[int, str]:
    """Run the CLI (``args``); SIGKILL the server once ``ready()`` is true; return the CLI's
    exit status and stderr. The CLI must still be running at the kill (asserted here)."""
    cli = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.time() + 300
    while time.time() < deadline and cli.poll() is None and not ready():
        time.sleep(0.05)
    alive = cli.poll() is None
    server.kill(signal.SIGKILL)
    _, err = ended(cli, "the run ended after its server was killed", timeout=300)
    assert alive, f"the run ended before the server was killed (exit {cli.returncode}): {err[-3000:]}"
    return cli.returncode, err


@pytest.mark.slow
def test_when_the_server_stays_down_programs_are_held_back_and_resume_finishes_them(server, tmp_path):
    """The CLI against a server that dies for good mid-run: once reconnecting gives up, the
    in-flight programs are not written as results (exit 1, one message); with the server back,
    ``--resume`` finishes every one of them, each (task, sample) exactly once."""
    import json

    from agentenv.trajectory import Trajectory

    (tmp_path / "long_env.py").write_text(LONG_ENV)
    out = tmp_path / "r.jsonl"
    args = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", "long_env:LongRuns", "--engine", "openai",
            "--base-url", server.url, "--engine-arg", "reconnect_s=2", "--tasks", "4", "--group-size", "2",
            "--concurrency", "4", "--max-new-tokens", "300", "--no-progress", "--out", str(out)]
    # Killed once a program plans its turn 2 (its env marks it), not once the event log shows a
    # turn: the log is written through a buffer, and on a short run can show it only at the end.
    rc, err = kill_the_server_mid_run(server, args, lambda: (tmp_path / "marks").is_dir(), cwd=tmp_path)
    assert rc == 1, err[-2000:]
    assert "stopped because the engine failed" in err and "--resume" in err
    first = out.read_text().splitlines()
    assert len(first) < 8
    server.start()
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert lines[: len(first)] == first
    keys = [(d["task_id"], d["sample_index"]) for d in map(json.loads, lines)]
    assert len(keys) == len(set(keys)) == 8
    for line in lines:
        t = Trajectory.from_dict(json.loads(line))
        assert not t.finish_reason.startswith("error"), t.error


LONG_ENV = """
from pathlib import Path

from agentenv.env import TurnPlan
from agentenv.envs.retool_math import RetoolMathEnv

MARKS = Path(__file__).parent / "marks"


class LongRuns(RetoolMathEnv):
    max_turns = 16

    def plan_turn(self, task, trajectory, turn):
        # Every program runs 40-token turns until its token budget ends it, and marks its
        # turn 2 (the test kills the server at the first mark, with most of the run to go).
        if turn == 2:
            MARKS.mkdir(exist_ok=True)
        return TurnPlan(max_tokens=40, stop=False)
"""


GROUP_ENV = """
from pathlib import Path

from agentenv.env import TurnPlan
from agentenv.envs.retool_math import RetoolMathEnv

MARKS = Path(__file__).parent / "marks"


class WholeGroup(RetoolMathEnv):
    max_turns = 16

    def plan_turn(self, task, trajectory, turn):
        # Sample 0 ends after one short turn; sample 1 runs 15 40-token turns, so the
        # server dies (the test kills it once a sample 1 plans its turn 2: a file, written
        # here in the worker, not the driver's event log, which a Ray run writes from its
        # one-second polls) with its group's sample 0 finished and sample 1 under way.
        if trajectory.sample_index == 0:
            return TurnPlan(max_tokens=8, stop=False, last=True)
        if turn == 2:
            MARKS.mkdir(exist_ok=True)
            (MARKS / task.id.replace("/", "-")).touch()
        return TurnPlan(max_tokens=40, stop=False)

    async def group_reward(self, task, trajectories):
        total = sum(t.reward for t in trajectories)
        return [1000.0 * len(trajectories) + total + t.sample_index for t in trajectories]
"""


@pytest.mark.parametrize("cluster", [[], ["--cluster", "ray", "--workers", "2"]], ids=["local", "ray"])
@pytest.mark.slow
def test_a_group_with_a_sample_the_engine_failed_on_is_written_whole_after_resume(server, tmp_path, cluster):
    """An environment with a group reward, and a server that dies for good mid-run: a group
    whose sample 1 the engine failed on does not write its finished sample 0 with a reward
    scored without sample 1 (nor sample 1: exit 1). Sample 0 waits in the log, and
    ``--resume`` writes both, sample 0 not run again, every line scored by the whole group.
    The same on a local Ray cluster (two rollout workers, each a client of the server; the
    workers make the driver's env class, a subclass that keeps retool-math's id)."""
    import json

    (tmp_path / "whole_group_env.py").write_text(GROUP_ENV)
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # the CLI starts a local cluster for the run, and stops it
    args = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", "whole_group_env:WholeGroup", "--engine",
            "openai", "--base-url", server.url, "--engine-arg", "reconnect_s=2", "--tasks", "4",
            "--group-size", "2", "--concurrency", "4", "--max-new-tokens", "600", "--no-progress", "--out", str(out),
            *cluster]
    rc, err = kill_the_server_mid_run(server, args, lambda: (tmp_path / "marks").is_dir(), cwd=tmp_path, env=env)
    assert rc == 1, err[-3000:]
    assert out.read_text() == ""  # no group was complete: no line
    records = [json.loads(x[9:]) for x in open(f"{out}.log")]
    held = {(r["task"], r["sample"]): r["traj"] for r in records if r["e"] == "held"}
    assert held and {i for _, i in held} == {0}, sorted(held)
    assert f"nor are the {len(held)} finished samples of their groups" in " ".join(err.split())
    server.start()
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and len({(x["task_id"], x["sample_index"]) for x in rows}) == 8
    for x in rows:
        assert not x["finish_reason"].startswith("error"), x["error"]
        if (x["task_id"], x["sample_index"]) in held:  # it did not run again: the very tokens
            assert x["segments"] == held[(x["task_id"], x["sample_index"])]["segments"]
    for tid in {x["task_id"] for x in rows}:
        group = [x for x in rows if x["task_id"] == tid]
        total = sum(x["metadata"]["sample_reward"]["reward"] for x in group)
        assert all(x["reward"] == 2000.0 + total + x["sample_index"] for x in group), group
