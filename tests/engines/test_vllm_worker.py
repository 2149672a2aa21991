"""The server middleware that names the engine behind each response (``instance_header``).

The end-to-end path (a real ``vllm serve`` with the worker extension, restarted under the
client) is in ``test_openai.py``. Here the middleware runs in a FastAPI app, added as vLLM
adds it, over ASGI HTTP, with an engine client that answers ``collective_rpc`` the way vLLM's does
(``Call to collective_rpc method failed: ...``), so the failures it must tell apart can be
made to happen on cue.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from agentenv.engines import vllm_worker
from agentenv.engines.vllm_worker import INSTANCE_HEADER

pytestmark = pytest.mark.anyio


class EngineClient:
    """Answers ``collective_rpc("agentenv_instance")`` from a script of outcomes."""

    def __init__(self, *outcomes: list | Exception) -> None:
        self.outcomes, self.calls = list(outcomes), 0

    async def collective_rpc(self, method: str) -> list:
        assert method == "agentenv_instance"
        self.calls += 1
        out = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(out, Exception):
            raise out
        return out


@pytest.fixture
def clock(monkeypatch):
    """A fresh middleware (its module state reset) on a clock the test moves."""
    now = [1000.0]
    monkeypatch.setattr(vllm_worker, "_served_by", None)
    monkeypatch.setattr(vllm_worker, "_ask_after", 0.0)
    monkeypatch.setattr(vllm_worker, "_now", lambda: now[0])
    return now


@pytest.fixture
def warnings_logged(monkeypatch):
    """The middleware's warnings, read off its own logger, whatever logging config ran before
    in this process (the full suite's left caplog empty: vLLM configures "vllm.*" logging when
    an engine starts, and other libraries configure theirs)."""
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(vllm_worker.log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)  # a logging.disable() elsewhere
    vllm_worker.log.manager._clear_cache()
    level = vllm_worker.log.level
    vllm_worker.log.setLevel(logging.WARNING)
    vllm_worker.log.addHandler(handler)
    yield seen
    vllm_worker.log.removeHandler(handler)
    vllm_worker.log.setLevel(level)  # clears the level cache too


def app_with(client: EngineClient) -> httpx.AsyncClient:
    app = FastAPI()  # as vLLM's server: a FastAPI app, ``--middleware`` added with app.middleware("http")
    app.post("/v1/completions")(lambda: {"text": "ok"})
    app.middleware("http")(vllm_worker.instance_header)
    app.state.engine_client = client
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server")


async def test_a_failed_question_is_asked_again_later_not_taken_as_no_extension(clock, warnings_logged):
    client = EngineClient(Exception("Call to collective_rpc method failed: engine core busy"), ["w1"])
    async with app_with(client) as http:
        first = await http.post("/v1/completions")
        assert first.status_code == 200 and INSTANCE_HEADER not in first.headers
        assert len(warnings_logged) == 1 and "asked again" in warnings_logged[0]
        clock[0] += vllm_worker.RETRY_S / 2  # too soon: not asked again
        assert INSTANCE_HEADER not in (await http.post("/v1/completions")).headers
        assert client.calls == 1
        clock[0] += vllm_worker.RETRY_S
        assert (await http.post("/v1/completions")).headers[INSTANCE_HEADER] == "w1"
        assert (await http.post("/v1/completions")).headers[INSTANCE_HEADER] == "w1"
    assert client.calls == 2  # answered once: not asked on every response


@pytest.mark.parametrize("missing", [
    # vllm serve 0.32 on CPU (a multiprocess executor), as its log read without the extension:
    "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute "
    "'agentenv_instance'', please check the stack trace above for the root cause",
    "Call to collective_rpc method failed: Method 'agentenv_instance' is not implemented.",  # in-process worker
])
async def test_without_the_worker_extension_the_header_is_left_out_and_never_asked_again(clock, missing):
    client = EngineClient(Exception(missing))
    async with app_with(client) as http:
        for _ in range(3):
            clock[0] += 10 * vllm_worker.RETRY_S
            r = await http.post("/v1/completions")
            assert r.status_code == 200 and INSTANCE_HEADER not in r.headers
    assert client.calls == 1


async def test_tensor_parallel_ranks_make_one_engine_id(clock):
    client = EngineClient(["w2", "w1"])
    async with app_with(client) as http:
        assert (await http.post("/v1/completions")).headers[INSTANCE_HEADER] == "w1,w2"
