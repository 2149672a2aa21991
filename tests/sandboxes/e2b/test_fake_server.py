"""``agentenv.sandboxes.e2b.fake_server``: the local server that speaks E2B's wire protocols,
spoken to over real HTTP on loopback (the real SDK against it is test_e2b.py's): the control
plane, rate-limited creates, contexts that are real interpreters, and the execution stream."""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest

from agentenv.sandboxes.e2b.fake_server import WORKER, FakeE2BServer


@pytest.fixture
def server():
    with FakeE2BServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def execute(client: httpx.Client, context: str, code: str) -> list[dict]:
    r = client.post("/execute", json={"context_id": context, "code": code})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in r.text.splitlines()]


def test_sandboxes_are_created_and_killed_once_each(server, client):
    r = client.post("/v2/sandboxes", json={"templateID": "my-template"})
    assert r.status_code == 201
    body = r.json()
    sid = body["sandboxID"]
    assert body["templateID"] == "my-template" and body["envdAccessToken"] and server.created == [sid]
    other = client.post("/v2/sandboxes", json={}).json()["sandboxID"]
    assert server.alive == [sid, other]
    assert client.delete(f"/sandboxes/{sid}").status_code == 204
    assert client.delete(f"/sandboxes/{sid}").status_code == 404  # killed already
    assert client.delete("/sandboxes/sbx-unknown").status_code == 404
    assert server.killed == [sid] and server.alive == [other]
    assert client.get("/health").status_code == 204
    assert client.get("/nowhere").status_code == client.post("/nowhere").status_code == 404


def test_the_first_creates_are_rate_limited_as_asked():
    with FakeE2BServer(rate_limited_creates=2) as srv, httpx.Client(base_url=srv.url) as client:
        codes = [client.post("/v2/sandboxes", json={}).status_code for _ in range(3)]
        assert codes == [429, 429, 201] and len(srv.created) == 1 and srv.rate_limited_creates == 0


def test_a_context_is_a_persistent_interpreter_whose_execution_streams_as_events(client):
    ctx = client.post("/contexts", json={"language": "python", "cwd": "/w"}).json()
    assert ctx["language"] == "python" and ctx["cwd"] == "/w"
    assert [c["id"] for c in client.get("/contexts").json()] == [ctx["id"]]
    first = execute(client, ctx["id"], "x = 21\nprint('hi')\nx * 2")
    assert [e["type"] for e in first] == ["stdout", "result", "number_of_executions", "end_of_execution"]
    assert first[0]["text"] == "hi\n" and first[1]["text"] == "42" and first[1]["is_main_result"]
    assert first[2]["execution_count"] == 1
    second = execute(client, ctx["id"], "import sys\nsys.stderr.write('careful')\nx")
    assert [(e["type"], e.get("text")) for e in second[:2]] == [("stderr", "careful"), ("result", "21")]
    assert second[2]["execution_count"] == 2
    error = execute(client, ctx["id"], "raise KeyError('k')")
    (err,) = [e for e in error if e["type"] == "error"]
    assert (err["name"], err["value"]) == ("KeyError", "'k'") and "Traceback" in err["traceback"]
    assert error[-1] == {"type": "end_of_execution"}


def test_a_restart_gives_a_fresh_interpreter_and_unknown_contexts_are_not_found(server, client):
    cid = client.post("/contexts", json={}).json()["id"]
    execute(client, cid, "keep = 1")
    assert client.post(f"/contexts/{cid}/restart").status_code == 204
    assert server.restarts == 1
    fresh = execute(client, cid, "'keep' in globals()")
    assert fresh[0]["text"] == "False" and fresh[1]["execution_count"] == 1  # state and count start again
    assert client.post("/contexts/nope/restart").status_code == 404
    assert client.post("/execute", json={"context_id": "nope", "code": "1"}).status_code == 404
    kernel = server.contexts[cid]
    assert client.delete(f"/contexts/{cid}").status_code == 204
    assert kernel.proc.poll() is not None and server.contexts == {}  # its interpreter is gone
    assert client.delete(f"/contexts/{cid}").status_code == 404


def test_stopping_the_server_ends_every_interpreter():
    srv = FakeE2BServer().start()
    with httpx.Client(base_url=srv.url) as client:
        for _ in range(2):
            client.post("/contexts", json={})
    kernels = list(srv.contexts.values())
    srv.stop()
    assert [k.proc.poll() is not None for k in kernels] == [True, True] and srv.contexts == {}
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/health", timeout=5)



def _cmdline(p: psutil.Process) -> str:
    """``p``'s command line once its exec has finished. ``Popen`` returns when the exec has
    closed the child's descriptors, which is before the new image has its arguments: until then
    the command line reads empty (a busy machine can hold a child there for a while)."""
    while not (line := " ".join(p.cmdline())) and p.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.001)
    return line


def kernels() -> set[int]:
    """The pids of this process's fake-E2B interpreters still running."""
    out = set()
    for p in psutil.Process().children():
        try:
            if str(WORKER) in _cmdline(p) and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:  # gone, or a zombie, meanwhile
            pass
    return out


def test_a_context_made_after_stop_is_killed_not_left_running():
    """A create in flight when the server stops finishes after the stop's clean-up: its kernel
    is killed there and no context is added, and the stop kills every kernel it holds (the stop
    iterated the contexts while a create could add one, and a late one outlived the test)."""
    before = kernels()  # another test's server may still be stopping its own
    srv = FakeE2BServer().start()
    held = srv.contexts[srv.add_context()]
    assert held.proc.pid in kernels()
    srv.stop()
    assert held.proc.poll() is not None and srv.contexts == {}
    assert srv.add_context() is None and srv.contexts == {}
    assert kernels() - before == set()
