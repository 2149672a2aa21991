"""Tools from real MCP servers (examples/mcp_calc_server.py, built with the official ``mcp``
SDK), started by the tests: listing, calls through a real reactor run, a server that dies
mid-call and one that hangs (each a tool error for that call, then restarted), a server per
program, and a streamable-HTTP server on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import anyio
import psutil
import pytest

pytest.importorskip("mcp")

from agentenv.config import RolloutConfig  # noqa: E402
from agentenv.engines.embedded import load_tokenizer  # noqa: E402
from agentenv.engines.instant import InstantEngine  # noqa: E402
from agentenv.env import Environment, Task  # noqa: E402
from agentenv.errors import ConfigError  # noqa: E402
from agentenv.mcp_tools import MCPServer, MCPTools  # noqa: E402
from agentenv.models import BUNDLED  # noqa: E402
from agentenv.reactor import Reactor  # noqa: E402
from agentenv.tools import ToolContext  # noqa: E402

from .waiting import wait_for  # noqa: E402

SERVER = str(Path(__file__).resolve().parents[1] / "examples" / "mcp_calc_server.py")


def exited(proc: psutil.Process) -> bool:
    """Gone (a process given its pid since is not it), or a zombie its parent has not reaped."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stdio(*extra: str, **kw) -> MCPServer:
    return MCPServer(command=[sys.executable, SERVER, *extra], **kw)


@pytest.fixture(scope="module")
def faulty():
    """One pool server with the fault tools (crash, hang, pid); 1.5 s per call."""
    pool = MCPTools(stdio("--faults", call_timeout=1.5))
    yield pool, {t.name: t for t in pool.tools()}
    anyio.run(pool.aclose)


def call(tool, **arguments):
    return anyio.run(lambda: tool(ToolContext(None, 5.0), **arguments))


def test_the_servers_tools_are_listed_with_its_names_descriptions_and_schemas(faulty):
    pool, tools = faulty
    assert {"python", "add", "kv_set", "kv_get", "crash", "hang", "pid"} <= set(tools)
    add = tools["add"].schema()["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"] and add["parameters"]["properties"]["a"]["type"] == "integer"
    assert tools["add"].check_arguments({"a": 1}) == "wrong arguments for add: 'b' is a required property"
    assert tools["add"].check_arguments({"a": 1, "b": 2}) is None
    assert pool.tools()[0] is pool.tools()[0]  # listed once


def test_a_call_answers_and_the_key_value_state_lives_in_the_server(faulty):
    _, tools = faulty
    assert (call(tools["add"], a=2, b=40).text, call(tools["python"], code="x = 6\nprint(x * 7)").text) == ("42", "42")
    assert call(tools["kv_set"], key="k", value="v").status == "ok" and call(tools["kv_get"], key="k").text == "v"
    bad = call(tools["python"], code="import os")
    assert bad.status == "error" and "not arithmetic" in bad.text and bad.error.startswith("tool error:")


def test_a_server_that_dies_mid_call_is_that_calls_error_and_is_restarted(faulty):
    pool, tools = faulty
    before, restarts = int(call(tools["pid"]).text), pool.stats()["restarts"]
    server = psutil.Process(before)  # held as a process: a busy machine may reuse its pid once it is gone
    out = call(tools["crash"])
    assert out.status == "error" and "restarted" in out.text and out.error.startswith("server failed")
    after = int(call(tools["pid"]).text)
    assert after != before and pool.stats()["restarts"] == restarts + 1
    wait_for(lambda: exited(server), "the dead server's process is gone")


def test_a_server_that_hangs_times_out_at_the_deadline_and_is_replaced(faulty):
    pool, tools = faulty
    before = int(call(tools["pid"]).text)
    server = psutil.Process(before)
    out = call(tools["hang"])  # blocks the whole server process
    assert out.status == "timeout" and out.error == "no answer within 1.5s; server restarted"
    assert int(call(tools["pid"]).text) != before  # a new process answers
    wait_for(lambda: not server.is_running(), "the hung server was stopped")


class AddEnv(Environment):
    """Add two numbers with the MCP server's add tool."""

    id = "mcp-add"

    def __init__(self, per: str = "pool") -> None:
        super().__init__()
        self.mcp = MCPTools(stdio("--faults", per=per))

    def tasks(self, n, seed=0):
        return [Task(f"add/{i}", "2 + 40?", 42) for i in range(n)]

    def tools(self):
        return self.mcp.tools()

    async def reward(self, task, trajectory):
        return float(any(c.output == "42" for c in trajectory.tool_calls))

    async def aclose(self):
        await self.mcp.aclose()


def rollout(env, reply_text, n=2, group=2):
    tok = load_tokenizer(str(BUNDLED["tiny-hermes"]))
    reply = tok.encode(reply_text, add_special_tokens=False)
    engine = InstantEngine(tok, reply=reply, turn_tokens=len(reply))

    async def go():
        try:
            groups = await Reactor(engine, env, None, RolloutConfig(max_turns=2, concurrency=4)).collect(
                env.tasks(n), group)
        finally:
            await env.aclose()
        return tok, [t for g in groups for t in g.trajectories]

    return anyio.run(go)


def test_a_rollout_calls_the_server_in_the_models_format_and_splices_the_result_with_loss_mask_0():
    env = AddEnv()
    tok, trajs = rollout(env, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>')
    assert env.tool_format.name == "hermes"  # not pinned: tiny-hermes's own
    assert len(trajs) == 4
    for t in trajs:
        t.validate()
        assert [(c.name, c.status, c.output) for c in t.tool_calls] == [("add", "ok", "42")]  # then max_turns
        env_segments = [s for s in t.segments if s.kind == "env"]
        assert env_segments and all(s.mask == 0 for s in env_segments)
        assert sum(t.loss_mask) == sum(len(s.token_ids) for s in t.segments if s.kind == "model")
        assert "<tool_response>\n42\n</tool_response>" in tok.decode(env_segments[0].token_ids)
        assert t.reward == 1.0


def test_a_server_per_program_is_started_for_each_program_and_stopped_when_it_ends():
    env = AddEnv(per="program")
    _, trajs = rollout(env, '<tool_call>\n{"name": "pid", "arguments": {}}\n</tool_call>', n=2, group=1)
    pids = {int(t.tool_calls[0].output) for t in trajs}
    assert len(pids) == 2 and all(int(c.output) in pids for t in trajs for c in t.tool_calls)
    assert all(len({c.output for c in t.tool_calls}) == 1 for t in trajs)  # one process per program
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), "the programs' servers were stopped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_http_on_a_free_port() -> tuple[subprocess.Popen, int]:
    """The example server over streamable HTTP, listening when this returns. A port found free
    may be taken by another process before the server binds it (the server then exits): such a
    port is replaced by another."""
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

        def listening():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        if wait_for(listening, f"the HTTP server listens on {port}", unless=lambda: proc.poll() is not None):
            if proc.poll() is None:  # listening, and it is this server that listens
                return proc, port
            proc.kill()
        proc.wait(30)
    raise AssertionError("three free ports were each taken before the HTTP server could listen on them")


def test_a_streamable_http_server_on_loopback():
    proc, port = serve_http_on_a_free_port()
    try:
        pool = MCPTools(MCPServer(url=f"http://127.0.0.1:{port}/mcp"))
        try:
            tools = {t.name: t for t in pool.tools()}
            assert call(tools["add"], a=1, b=2).text == "3"
        finally:
            anyio.run(pool.aclose)
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of command"),
    ({"url": "http://10.1.2.3:8000/mcp"}, "only a streamable-HTTP server on loopback"),
    ({"command": "python server.py"}, "non-empty list of arguments"),
    ({"url": "http://127.0.0.1:1/mcp", "per": "program"}, "use per='pool'"),
    ({"command": ["x"], "call_timeout": 0}, "call_timeout must be a number of seconds > 0"),
])
def test_bad_server_settings_say_what_to_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MCPServer(**kwargs)


def test_a_server_that_cannot_start_is_named():
    pool = MCPTools(MCPServer(command=[sys.executable, "-c", "import sys; sys.exit(2)"], start_timeout=60))
    with pytest.raises(ConfigError, match="cannot start it and list its tools"):
        pool.tools()
    anyio.run(pool.aclose)


def test_tools_in_prompt_has_the_chat_template_list_the_servers_tools(faulty):
    _, tools = faulty

    class Listed(AddEnv):
        tools_in_prompt = True

        def __init__(self) -> None:
            Environment.__init__(self)

        def tools(self):
            return [tools["add"], tools["kv_get"]]

    tok = load_tokenizer(str(BUNDLED["tiny-hermes"]))
    env = Listed()
    reactor = Reactor(InstantEngine(tok, reply=[tok.eos_token_id], turn_tokens=1), env, None, RolloutConfig())
    prompt = tok.decode(reactor._ctx.prompt_ids(env.tasks(1)[0]))
    assert '"name": "add", "description": "Add two integers."' in prompt and '"required": ["a", "b"]' in prompt
    assert "<tools>" in prompt and '"name": "kv_get"' in prompt
    env.tools_in_prompt = False
    assert "<tools>" not in tok.decode(Reactor(reactor.engine, env, None, RolloutConfig())._ctx.prompt_ids(
        env.tasks(1)[0]))
