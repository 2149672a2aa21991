"""The gateway end to end: real HTTP on loopback, the real ``openai`` SDK as the agent's
client, the reactor's scheduler, and a scripted engine (``agentenv.testing.ScriptedEngine``)
whose replies are known, so that every token of every row can be checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import httpx
import openai
import pytest

import agentenv.models
from agentenv import AgentEnvironment, Reactor, RolloutConfig, Task
from agentenv.engines.embedded import load_tokenizer
from agentenv.gateway import role_client
from agentenv.testing import ScriptedEngine

from .waiting import DEADLINE_S, until

pytestmark = pytest.mark.anyio

HERMES = Path(agentenv.models.__file__).parent / "tiny-hermes"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HERMES)


def calculator(prompt: str, n: int) -> str:
    """A model that calls ``add`` until it has seen a tool response, then answers."""
    last = prompt.rsplit("<|im_start|>", 2)[-2]
    if "<tool_response>" in last:
        return "The sum is 5."
    if "Critique" in prompt:
        return "Looks right."
    return "I will add.\n" + CALL


class Calc(AgentEnvironment):
    id = "calc"
    max_turns = 8

    def tasks(self, n, seed=0):
        return [Task(f"calc/{i}", "What is 2 + 3?", 5) for i in range(n)]

    async def agent(self, task, client, model):
        messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": task.question}]
        for _ in range(4):
            r = await client.chat.completions.create(model=model, messages=messages, tools=[ADD])
            m = r.choices[0].message
            messages.append(m)
            if not m.tool_calls:
                return m.content
            for c in m.tool_calls:
                a = json.loads(c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(a["a"] + a["b"])})
        return None

    async def reward(self, task, trajectory):
        return float(str(task.answer) in (trajectory.text or ""))


async def collect(env, engine, n=2, group=2, **cfg):
    config = RolloutConfig(**{"max_new_tokens": 1024, **cfg})
    async with Reactor(engine, env, None, config) as reactor:
        groups = await reactor.collect(env.tasks(n), group)
    return [t for g in groups for t in g.trajectories]


def sampled(traj):
    """Each sequence's sampled ids, as the trainer sees them (mask 1), and its model segments."""
    rows = traj.sequences()
    return [[i for i, m in zip(r.input_ids, r.loss_mask) if m] for r in rows], rows


async def test_a_tool_loop_extends_its_history_token_exact(tok):
    eng = ScriptedEngine(calculator, tok)
    gens = []
    real = eng._make
    eng._make = lambda *a: gens.append(real(*a)) or gens[-1]
    trajs = await collect(Calc(), eng)
    assert len(trajs) == 4 and all(t.finish_reason == "stop" and t.reward == 1.0 for t in trajs)
    pairs = {(tuple(g.token_ids), tuple(g.logprobs)) for g in gens}  # each generation's logprobs are distinct
    for t in trajs:
        g = t.metadata["gateway"]
        assert (g["calls"], g["extended"], g["branched"]) == (2, 1, 1) and not t.branches
        assert [c.name for c in t.tool_calls] == ["add"] and t.tool_calls[0].arguments == {"a": 2, "b": 3}
        model = [s for s in t.segments if s.kind == "model"]
        assert all((tuple(s.token_ids), tuple(s.logprobs)) in pairs for s in model), "not what the engine sampled"
        ids, _ = sampled(t)
        assert ids == [[i for s in model for i in s.token_ids]]
        # Decoding the row gives the conversation the agent saw, as the chat template renders it.
        convo = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2 + 3?"},
                 {"role": "assistant", "content": "I will add.", "tool_calls": [
                     {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                 {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The sum is 5."}]
        text = tok.apply_chat_template(convo, tools=[ADD], tokenize=False)
        assert tok.decode(t.input_ids, skip_special_tokens=False) == text.rstrip("\n")
        assert t.loss_mask.count(1) == t.num_sampled_tokens


class Rewriter(Calc):
    """Calls once, then asks again with a new system prompt (a rewritten history), then asks a
    critic role in a fresh context."""

    async def agent(self, task, client, model):
        first = [{"role": "system", "content": "You add."}, {"role": "user", "content": task.question}]
        r = await client.chat.completions.create(model=model, messages=first, tools=[ADD])
        again = [{"role": "system", "content": "You add carefully."}, {"role": "user", "content": task.question},
                 r.choices[0].message, {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id,
                                        "content": "5"}]
        r2 = await client.chat.completions.create(model=model, messages=again, tools=[ADD])
        critic = role_client(client, "critic")
        r3 = await critic.chat.completions.create(model=model, messages=[
            {"role": "user", "content": f"Critique: {r2.choices[0].message.content}"}])
        return f"{r2.choices[0].message.content} ({r3.choices[0].message.content})"


async def test_a_rewritten_history_and_a_role_start_their_own_sequences(tok):
    from agentenv.reactor import Group
    from agentenv.train.batch import collate

    trajs = await collect(Rewriter(), ScriptedEngine(calculator, tok), n=1, group=2)
    for t in trajs:
        g = t.metadata["gateway"]
        assert (g["calls"], g["extended"], g["branched"]) == (3, 0, 3), g
        assert g["roles"] == ["main", "main", "critic"] and [b.role for b in t.branches] == ["main", "critic"]
        rows = t.sequences()
        assert len(rows) == 3 and all(r.loss_mask.count(1) == r.num_sampled_tokens > 0 for r in rows)
        assert "You add carefully." in tok.decode(rows[1].prompt_ids) and "Critique" in tok.decode(rows[2].prompt_ids)
        assert tok.decode(rows[2].completion_ids, skip_special_tokens=False) == "Looks right.<|im_end|>"
        assert type(t).from_dict(json.loads(json.dumps(t.to_dict()))).sequences()[2].input_ids == rows[2].input_ids
    batch = collate([Group(trajs[0].metadata and Task("calc/0", "q"), trajs)], pad_id=0)
    assert batch.size == 6  # every sequence of every program is a row
    for i, row in enumerate(r for t in trajs for r in t.sequences()):
        n = len(row.input_ids)
        assert batch.input_ids[i, :n].tolist() == row.input_ids
        assert batch.mask[i, 1:n].tolist() == [float(m) for m in row.loss_mask[1:]]


class Probe(Calc):
    """Sends bad requests itself, and keeps its key and URL for after the program."""

    seen: dict = {}

    async def agent(self, task, client, model):
        url, key = str(client.base_url).rstrip("/"), client.api_key
        Probe.seen.update(url=url, key=key)
        async with httpx.AsyncClient() as h:
            head = {"Authorization": f"Bearer {key}"}
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            out = {
                "missing": await h.post(f"{url}/chat/completions", json=body),
                "foreign": await h.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
                "json": await h.post(f"{url}/chat/completions", content=b"{not json", headers=head),
                "big": await h.post(f"{url}/chat/completions", content=b" " * (9 << 20), headers=head),
                "n": await h.post(f"{url}/chat/completions", json={**body, "n": 2}, headers=head),
                "role": await h.post(
                    f"{url}/chat/completions", json={**body, "messages": [{"role": "x"}]}, headers=head
                ),
                # well-formed, but the model's chat template cannot render an image part
                "template": await h.post(
                    f"{url}/chat/completions",
                    headers=head,
                    json={
                        **body,
                        "messages": [
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
                        ],
                    },
                ),
                "models": await h.get(f"{url}/models", headers=head),
            }
        Probe.seen.update({k: (r.status_code, r.json()) for k, r in out.items()})
        return "done"


async def test_bad_keys_and_bodies_get_openai_errors_and_an_ended_program_410(tok):
    env = Probe()
    async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig()) as reactor:
        groups = await reactor.collect(env.tasks(1), 1)
        async with httpx.AsyncClient() as h:
            after = await h.post(f"{Probe.seen['url']}/chat/completions", headers={
                "Authorization": f"Bearer {Probe.seen['key']}"}, json={"model": "m", "messages": [
                    {"role": "user", "content": "hi"}]})
    s = Probe.seen
    assert groups[0].trajectories[0].finish_reason == "stop"
    assert s["missing"][0] == s["foreign"][0] == 401 and s["missing"][1]["error"]["code"] == "invalid_api_key"
    for k in ("json", "big", "n", "role", "template"):
        assert s[k][0] == 400 and s[k][1]["error"]["type"] == "invalid_request_error", (k, s[k])
    assert "chat template cannot render" in s["template"][1]["error"]["message"]
    assert "n=2" in s["n"][1]["error"]["message"] and s["n"][1]["error"]["param"] == "n"
    assert s["models"][0] == 200 and s["models"][1]["data"][0]["id"] == "tiny-hermes"
    assert after.status_code == 410 and after.json()["error"]["code"] == "program_ended"


async def test_the_gateways_connections_send_without_delay(tok):
    """Each reply leaves in two writes (headers, body): a connection with Nagle on holds the
    second until the client's delayed ACK (~40 ms a call)."""
    import socket

    from agentenv.gateway.server import start_gateway

    gateway = await start_gateway(tok)
    try:
        async with httpx.AsyncClient() as h:
            assert (await h.get(f"{gateway.url}/models")).status_code == 401  # a connection now open
            conns = gateway._server.server_state.connections
            assert conns, "the gateway holds the client's connection"
            for c in conns:
                sock = c.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), "Nagle is on for a connection"
    finally:
        await gateway.aclose()



class HoldsFirst(ScriptedEngine):
    """Holds its first turn until ``let_go`` is set, or it is cancelled (and says when it
    started and ended)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.holding, self.cancelled, self.let_go, self.turns = anyio.Event(), anyio.Event(), anyio.Event(), 0

    async def generate_turn(self, *a, **kw):
        self.turns += 1
        if self.turns == 1:
            self.holding.set()
            try:
                await self.let_go.wait()
            finally:
                self.cancelled.set()
        return await super().generate_turn(*a, **kw)


class GivesUp(Calc):
    """Gives up on its first call while the engine holds it (the connection closed, as a
    client's own timeout or a cancelled task closes it), then asks again."""

    engine: HoldsFirst

    async def agent(self, task, client, model):
        messages = [{"role": "user", "content": task.question}]
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: client.chat.completions.create(model=model, messages=messages, tools=[ADD]))
            await GivesUp.engine.holding.wait()
            tg.cancel_scope.cancel()
        await GivesUp.engine.cancelled.wait()  # the gateway saw the client go and cancelled the call
        return await Calc.agent(self, task, client, model)


async def test_a_call_the_client_gave_up_on_is_cancelled_and_not_in_the_sequences(tok):
    eng = GivesUp.engine = HoldsFirst(calculator, tok)
    with anyio.fail_after(DEADLINE_S):
        (traj,) = await collect(GivesUp(), eng, n=1, group=1)
    g = traj.metadata["gateway"]
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    # The two calls the agent saw answered, in one sequence; the first, unseen call in none.
    assert (g["calls"], g["extended"], g["branched"]) == (2, 1, 1) and not traj.branches, g
    assert eng.turns == 3
    ids, _ = sampled(traj)
    model = [s for s in traj.segments if s.kind == "model"]
    assert len(model) == 2 and ids == [[i for s in model for i in s.token_ids]]


def waiting_for_a_slot(reactor) -> list[int]:
    return [p.pid for p in reactor._sched.programs.values() if p.wanting and p.state.value == "ready"]


class GivesUpWaiting(Calc):
    """On one decode slot: task 0's first turn holds the slot in the engine; task 1's first
    call, waiting for the slot, is given up on, and asked again once task 0 may go on."""

    engine: HoldsFirst
    reactor: Reactor

    async def agent(self, task, client, model):
        if task.id == "calc/1":
            me = GivesUpWaiting
            await me.engine.holding.wait()
            messages = [{"role": "user", "content": task.question}]
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: client.chat.completions.create(model=model, messages=messages, tools=[ADD]))
                await until(lambda: waiting_for_a_slot(me.reactor), "task 1's call waits for the slot")
                tg.cancel_scope.cancel()
            await until(lambda: not waiting_for_a_slot(me.reactor), "the gateway withdrew the turn given up on")
            me.engine.let_go.set()
        return await Calc.agent(self, task, client, model)


async def test_a_call_given_up_on_while_it_waits_for_a_slot_gives_the_slot_back(tok):
    # A turn withdrawn while it waited is not submitted later: that would keep the slot from
    # every other program and refuse the agent's retry (a program that wants a turn while
    # decoding).
    env, eng = GivesUpWaiting(), HoldsFirst(calculator, tok)
    GivesUpWaiting.engine = eng
    with anyio.fail_after(DEADLINE_S):
        async with Reactor(eng, env, None, RolloutConfig(max_new_tokens=1024, concurrency=1)) as reactor:
            GivesUpWaiting.reactor = reactor
            groups = await reactor.collect(env.tasks(2), 1)
    trajs = [t for g in groups for t in g.trajectories]
    assert [(t.finish_reason, t.reward) for t in trajs] == [("stop", 1.0)] * 2, [t.error for t in trajs]
    assert all(t.metadata["gateway"]["calls"] == 2 for t in trajs) and eng.turns == 4
    assert reactor._sched.in_flight == 0


async def endless_body(url: str, key: str) -> bytes:
    """POST a chunked body that never ends (9 MiB sent, no last chunk) and read the answer: a
    gateway that waits for the whole body before checking its size never answers."""
    from urllib.parse import urlsplit

    at = urlsplit(url)
    head = (f"POST {at.path}/chat/completions HTTP/1.1\r\nHost: {at.netloc}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    answer = bytearray()
    async with await anyio.connect_tcp(at.hostname, at.port) as conn, anyio.create_task_group() as tg:
        async def send() -> None:
            try:
                await conn.send(head + chunk(b'{"model": "m", "messages": "'))
                for _ in range(9):
                    await conn.send(chunk(b"x" * (1 << 20)))
            except (anyio.BrokenResourceError, OSError):
                pass  # the gateway answered and closed the connection: what the reader waits for

        tg.start_soon(send)
        with anyio.fail_after(DEADLINE_S):
            while b"}}" not in answer:  # the end of the error object
                try:
                    answer += await conn.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    break
        tg.cancel_scope.cancel()
    return bytes(answer)


class Hostile(Calc):
    """Sends what broke the gateway (a 500, text for an error, no answer) before its agent's loop."""

    seen: dict = {}

    async def agent(self, task, client, model):
        url, key = str(client.base_url).rstrip("/"), client.api_key
        head = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        msg = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}], "n": 2}'
        async with httpx.AsyncClient() as h:
            for name, body in {"lone": msg % b"\\ud800 x", "paired": msg % b"\\ud83d\\ude00 \\uD83D\\uDE00",
                               "deep": b"[" * 100_000 + b"]" * 100_000,
                               "nan": b'{"model": "m", "messages": [], "temperature": NaN}'}.items():
                r = await h.post(f"{url}/chat/completions", content=body, headers=head)
                Hostile.seen[name] = (r.status_code, r.json()["error"])
            r = await h.get(f"{url}/chat/completions", headers=head)
            Hostile.seen["get"] = (r.status_code, r.json()["error"])
        try:
            await client.completions.create(model=model, prompt="2 + 3 =")  # the legacy API, not served
        except Exception as exc:  # noqa: BLE001 - what the SDK raises is the finding
            Hostile.seen["legacy"] = exc
        Hostile.seen["endless"] = await endless_body(url, key)
        return await super().agent(task, client, model)


async def test_bodies_nested_too_deeply_with_lone_surrogates_or_without_end_get_400(tok):
    trajs = await collect(Hostile(), ScriptedEngine(calculator, tok), n=1, group=1)
    s = Hostile.seen
    assert s["lone"][0] == 400 and s["lone"][1]["code"] == "invalid_unicode"  # not the tokenizer's 500
    assert "lone UTF-16 surrogate" in s["lone"][1]["message"]
    assert s["paired"][0] == 400 and s["paired"][1]["param"] == "n"  # a surrogate pair is text: n is the fault
    assert s["deep"][0] == 400 and s["deep"][1]["message"] == "the request body is nested too deeply"
    assert s["nan"][0] == 400 and s["nan"][1]["code"] == "invalid_json" and "NaN is not a JSON value" in s["nan"][1][
        "message"]
    assert s["endless"].startswith(b"HTTP/1.1 400") and b'"code":"body_too_large"' in s["endless"]
    assert s["get"][0] == 405 and s["get"][1]["code"] == "unknown_url"  # OpenAI's error object, not text
    assert isinstance(s["legacy"], openai.NotFoundError) and "POST /v1/completions is not served" in str(s["legacy"])
    assert trajs[0].finish_reason == "stop" and trajs[0].text == "The sum is 5."  # the gateway served on

async def test_a_malformed_call_is_content_and_data_not_an_error(tok):
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
    trajs = await collect(Calc(), ScriptedEngine(lambda p, n: broken, tok), n=1, group=1)
    t = trajs[0]
    assert t.finish_reason == "stop" and t.text == broken
    assert [c.status for c in t.tool_calls] == ["malformed"] and "not valid JSON" in t.tool_calls[0].error
    assert t.metadata["gateway"]["malformed_tool_calls"] == 1



class Streamer(Calc):
    async def agent(self, task, client, model):
        messages = [{"role": "user", "content": task.question}]
        stream = await client.chat.completions.create(model=model, messages=messages, tools=[ADD], stream=True,
                                                      logprobs=True, top_logprobs=1)
        content, calls = "", []
        async for chunk in stream:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                calls += ch.delta.tool_calls or []
        plain = await client.chat.completions.create(model=model, messages=messages, tools=[ADD], logprobs=True)
        m = plain.choices[0].message
        assert content == m.content and [c.function.arguments for c in calls] == [
            c.function.arguments for c in m.tool_calls]
        assert plain.choices[0].finish_reason == "tool_calls"
        return json.dumps([x.logprob for x in plain.choices[0].logprobs.content])


async def test_streaming_and_logprobs_give_what_was_sampled(tok):
    t = (await collect(Streamer(), ScriptedEngine(calculator, tok), n=1, group=1))[0]
    assert t.finish_reason == "stop", t.error
    second = t.branches[0].segments[-1]  # the same messages again: a new branch
    assert json.loads(t.text) == second.logprobs[: len(json.loads(t.text))]


class Failing(Calc):
    agent_timeout = 2.0

    async def agent(self, task, client, model):
        i = int(task.id.split("/")[1])
        if i == 0:
            raise ValueError("the agent broke")
        if i == 1:
            await anyio.sleep_forever()
        return await Calc.agent(self, task, client, model)


async def test_an_agent_that_raises_or_hangs_is_a_failed_trajectory_and_others_go_on(tok, caplog, monkeypatch):
    from agentenv.gateway import program

    monkeypatch.setattr(program, "_logged", set())  # this environment's first traceback is logged in this test
    env = Failing()
    order, traces = [], {}
    async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig(max_new_tokens=512)) as reactor:
        async with reactor.rollouts(env.tasks(4), 1) as results:
            async for item in results:
                if not hasattr(item, "trajectories"):
                    order.append((item.task_id, item.finish_reason, item.error))
                    traces[item.task_id] = item.metadata["gateway"].get("traceback")
    by = {tid: (r, e) for tid, r, e in order}
    assert by["calc/0"] == ("error:agent", "ValueError: the agent broke")
    # Its traceback, down to the agent's own line, is on the row and logged once.
    assert 'raise ValueError("the agent broke")' in traces["calc/0"] and "in agent" in traces["calc/0"]
    assert traces["calc/2"] is None and traces["calc/1"] is None
    logged = [r.getMessage() for r in caplog.records if "the agent raised ValueError" in r.getMessage()]
    assert len(logged) == 1 and 'raise ValueError("the agent broke")' in logged[0]
    assert by["calc/1"][0] == "error:agent_timeout"
    assert by["calc/2"][0] == by["calc/3"][0] == "stop"
    assert order[-1][0] == "calc/1", "the hanging agent held back the others"


class Silent(Calc):
    async def agent(self, task, client, model):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": task.question}])
        return None  # the mistake: the answer never returned


async def test_an_agent_that_returns_nothing_ends_stop_without_text_and_says_so_once(tok, caplog, monkeypatch):
    from agentenv.gateway import program

    monkeypatch.setattr(program, "_logged", set())
    env = Silent()
    async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig(max_new_tokens=256)) as reactor:
        rows = [t for g in await reactor.collect(env.tasks(2), 1) for t in g.trajectories]
    assert [(t.finish_reason, t.text) for t in rows] == [("stop", None), ("stop", None)]
    said = [r.getMessage() for r in caplog.records if "the agent returned None" in r.getMessage()]
    assert len(said) == 1 and "return the final answer" in said[0]


AGENT_SCRIPT = """
import json, os, sys
from openai import OpenAI
task = json.loads(sys.stdin.read())
assert json.loads(os.environ["AGENTENV_TASK"]) == task
if task["id"].endswith("/1"):
    sys.exit(3)
c = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
r = c.chat.completions.create(model="any", messages=[{"role": "user", "content": task["question"]}])
print(r.choices[0].message.content)
"""


async def test_a_command_agent_reads_the_environment_and_a_nonzero_exit_fails(tok, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)

    class Command(Calc):
        agent_command = [sys.executable, str(script)]
        agent = AgentEnvironment.agent  # the command form: no agent() of its own

    trajs = await collect(Command(), ScriptedEngine(lambda p, n: "The sum is 5.", tok), n=2, group=1)
    by = {t.task_id: t for t in trajs}
    assert by["calc/0"].finish_reason == "stop" and by["calc/0"].text == "The sum is 5."
    assert by["calc/0"].reward == 1.0 and by["calc/0"].metadata["gateway"]["calls"] == 1
    assert by["calc/1"].finish_reason == "error:agent_exit" and "exited with 3" in by["calc/1"].error


def test_killed_mid_run_and_resumed_replays_agents_from_the_journal(tmp_path, tok):
    """kill -9 of a real ``agentenv rollout`` (the embedded engine, the bundled model) while
    every agent program is in flight after one call, then ``--resume``: each agent runs again
    from its start, its first call answered from the journal with the ids sampled before the
    kill, the rest live; nothing lost, nothing written twice."""
    import os
    import signal
    import subprocess

    from agentenv import journal
    from agentenv.trajectory import Trajectory

    from .test_durability import summary_of
    from .waiting import wait_for

    out, go = tmp_path / "agents.jsonl", tmp_path / "go"
    env = {**os.environ, "AGENTENV_TEST_GO": str(go)}
    args = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", str(Path(__file__).parent / "agent_envs.py")
            + ":ThreeCalls", "--model", str(HERMES), "--tasks", "2", "--group-size", "2", "--no-progress",
            "--out", str(out)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    calls = lambda: [r for r in journal.read(Path(f"{out}.log"))[0] if r.get("e") == "call"] \
        if Path(f"{out}.log").exists() else []
    wait_for(
        lambda: len(calls()) >= 4, "every program's first call in the journal", unless=lambda: proc.poll() is not None
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {r["k"]: r["g"]["ids"] for r in calls()}
    assert len(before) == 4 and not out.read_text()
    go.touch()
    done = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    _, rows = summary_of(done.stderr)
    assert rows["gateway calls (extended / branched / from the journal)"] == "12 (8 / 4 / 4)", rows
    lines = [Trajectory.from_dict(json.loads(x)) for x in out.read_text().splitlines()]
    assert sorted((t.task_id, t.sample_index) for t in lines) == sorted({(t.task_id, t.sample_index) for t in lines})
    assert len(lines) == 4
    for t in lines:
        g = t.metadata["gateway"]
        assert (g["calls"], g["extended"], g["branched"], g["replayed"], g["restarts"]) == (3, 2, 1, 1, 0), g
        first = next(s for s in t.segments if s.kind == "model")
        assert first.token_ids == before[t.id], "the replayed call's ids are not the ones sampled before the kill"
        text = tok.decode(t.input_ids, skip_special_tokens=False)
        assert "Go on (0)." in text and "Go on (1)." in text and t.loss_mask.count(1) == t.num_sampled_tokens


class Recorder:
    """A program log (``agentenv.journal.ProgramLog``) that keeps the gateway's call records."""

    def __init__(self):
        self.calls = {}

    def start(self, traj):
        self.calls[traj.id] = []

    def resumed(self, traj):
        pass

    def turn(self, traj, mark):
        pass

    def finished(self, traj):
        pass

    def call(self, key, n, digest, role, generation):
        self.calls[key].append({"d": digest, "role": role, "g": generation})


async def test_a_replay_answers_from_the_log_and_a_mismatch_restarts_the_agent_fresh(tok):
    await replay_then_tamper(tok, Calc())


async def replay_then_tamper(tok, env):
    """``env``'s program run, replayed from its log (no live call), then replayed from a log
    whose first digest was changed (restarted fresh)."""
    from agentenv.journal import LogState
    from agentenv.trajectory import Trajectory

    log = Recorder()
    async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig(), journal=log) as reactor:
        first = (await reactor.collect(env.tasks(1), 1))[0].trajectories[0]
    logged = log.calls[first.id]
    assert len(logged) == 2

    async def resume(records):
        partial = Trajectory(first.id, "", "calc/0", first.group_id, 0, [], metadata={"gateway_log": records})
        state = LogState({}, {("calc/0", 0): partial}, set())
        eng = ScriptedEngine(lambda p, n: "Something else.", tok)  # live calls would differ from the log
        async with Reactor(eng, env, None, RolloutConfig(), journal=Recorder()) as reactor:
            async with reactor.rollouts(env.tasks(1), 1, resume=state) as results:
                return [x async for x in results if isinstance(x, Trajectory)][0], eng.requests

    again, live = await resume(logged)
    assert live == 0 and again.metadata["gateway"]["replayed"] == 2 and again.input_ids == first.input_ids
    assert again.logprobs == first.logprobs and again.text == first.text
    tampered = [{**logged[0], "d": "0" * 32}, logged[1]]
    fresh, live = await resume(tampered)
    g = fresh.metadata["gateway"]
    assert (g["restarts"], g["replayed"], g["calls"]) == (1, 0, 1) and live == 1
    assert fresh.text == "Something else." and fresh.finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_agent_environment_trains_and_stops_with_agents_in_flight(tmp_path):
    """``agentenv train`` on the gateway example: the steps run, and when the run stops with
    agent requests still waiting for their turn (2 decode slots for the next step's 8 agents),
    each is answered 410 (no traceback)."""
    import subprocess

    example = Path(__file__).resolve().parents[1] / "examples" / "agents" / "short_answers.py"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentenv.cli",
            "train",
            "--env",
            f"{example}:BoxedAnswer",
            "--model",
            "tiny-hermes",
            "--steps",
            "3",
            "--groups-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "48",
            "--eval-every",
            "0",
            "--concurrency",
            "2",
            "--out-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["first_reward"] is not None, summary


# -- the Responses API ------------------------------------------------------------------------

#: ``ADD`` in the Responses API's flat form.
ADD_FLAT = {"type": "function", **ADD["function"]}


class ResponsesCalc(Calc):
    """:class:`Calc` on the Responses API: each turn sends the whole conversation as input
    items (the output items sent back, a ``function_call_output`` per call)."""

    async def agent(self, task, client, model):
        items = [{"role": "user", "content": task.question}]
        for _ in range(4):
            r = await client.responses.create(model=model, instructions="You add.", input=items, tools=[ADD_FLAT])
            assert r.status == "completed" and r.usage.output_tokens > 0
            items += [item.model_dump(exclude_none=True) for item in r.output]
            calls = [item for item in r.output if item.type == "function_call"]
            if not calls:
                return r.output_text
            for c in calls:
                a = json.loads(c.arguments)
                items.append({"type": "function_call_output", "call_id": c.call_id, "output": str(a["a"] + a["b"])})
        return None


async def test_a_responses_tool_loop_extends_its_history_as_the_same_chat_would(tok):
    """A function_call and its function_call_output sent back extend the sequence; the row is
    the one the same conversation on Chat Completions gives, and the requests log the same
    digests (so either API replays the other's journal)."""
    chat_log, responses_log = Recorder(), Recorder()
    rows = {}
    for env, log in ((Calc(), chat_log), (ResponsesCalc(), responses_log)):
        async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig(max_new_tokens=1024),
                           journal=log) as reactor:
            t = (await reactor.collect(env.tasks(1), 1))[0].trajectories[0]
        assert t.finish_reason == "stop" and t.reward == 1.0, t.error
        g = t.metadata["gateway"]
        assert (g["calls"], g["extended"], g["branched"]) == (2, 1, 1) and not t.branches, g
        assert [c.name for c in t.tool_calls] == ["add"] and t.tool_calls[0].arguments == {"a": 2, "b": 3}
        model = [s for s in t.segments if s.kind == "model"]
        assert sampled(t)[0] == [[i for s in model for i in s.token_ids]]
        assert t.loss_mask.count(1) == t.num_sampled_tokens
        rows[type(env)] = (tok.decode(t.input_ids, skip_special_tokens=False), [s.token_ids for s in t.segments])
    assert rows[Calc] == rows[ResponsesCalc]
    digests = lambda log: [c["d"] for calls in log.calls.values() for c in calls]
    assert digests(chat_log) == digests(responses_log) and len(digests(chat_log)) == 2


class ResponsesStreamer(Calc):
    """The same request three ways through the ``openai`` SDK: ``stream=True`` events, the
    SDK's stream helper, and plain with logprobs; returns what each gave."""

    async def agent(self, task, client, model):
        ask = {"model": model, "input": task.question, "tools": [ADD_FLAT]}
        kinds, text, args = [], "", ""
        async for e in await client.responses.create(**ask, stream=True):
            kinds.append(e.type)
            text += e.delta if e.type == "response.output_text.delta" else ""
            args += e.delta if e.type == "response.function_call_arguments.delta" else ""
        async with client.responses.stream(**ask) as stream:
            helper = [e.type async for e in stream]
            final = await stream.get_final_response()
        plain = await client.responses.create(**ask, include=["message.output_text.logprobs"])
        calls = [i for i in plain.output if i.type == "function_call"]
        return json.dumps({"kinds": kinds, "helper": helper, "text": text, "args": args,
                           "final": [i.model_dump(exclude_none=True) for i in final.output],
                           "plain": [i.model_dump(exclude_none=True) for i in plain.output],
                           "plain_text": plain.output_text, "calls": [c.arguments for c in calls],
                           "lp": [x.logprob for x in plain.output[0].content[0].logprobs]})


async def test_responses_stream_through_the_sdk_and_give_what_was_sampled(tok):
    t = (await collect(ResponsesStreamer(), ScriptedEngine(calculator, tok), n=1, group=1))[0]
    assert t.finish_reason == "stop", t.error
    got = json.loads(t.text)
    assert got["kinds"] == got["helper"] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert got["text"] == got["plain_text"] == "I will add." and got["calls"] == [got["args"]]
    assert json.loads(got["args"]) == {"a": 2, "b": 3}
    for part in got["plain"][0]["content"]:
        del part["logprobs"]  # asked for on the plain request only
    assert [i["id"] for i in got["plain"]] == ["msg_" + t.id + "_2", "fc_" + t.id + "_2_0"]
    assert got["plain"][1]["call_id"] == "call_2_0"  # ids are named after the request: the same on a replay
    unnamed = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]
    assert unnamed(got["final"]) == unnamed(got["plain"])
    # The three requests are the same messages: each a new branch; the logprobs are the third's.
    assert t.metadata["gateway"]["branched"] == 3
    third = t.branches[1].segments[-1]
    assert got["lp"] == third.logprobs  # every sampled token's, the call's included (as on the chat path)


class ResponsesProbe(Calc):
    """Sends bad Responses requests itself; keeps its key and URL for after the program."""

    seen: dict = {}

    async def agent(self, task, client, model):
        url, key = str(client.base_url).rstrip("/"), client.api_key
        ResponsesProbe.seen.update(url=url, key=key)
        good = {"model": model, "input": "hi"}
        bad = {
            "previous_response_id": {**good, "previous_response_id": "resp_1"},
            "store": {**good, "store": True},
            "conversation": {**good, "conversation": "conv_1"},
            "tools[0]": {**good, "tools": [{"type": "web_search"}]},
            "input[1]": {**good, "input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "x"}]},
            "input[0].content[0]": {**good, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input": {"model": model},
            "n": {**good, "n": 2},
            "tool_choice": {**good, "tool_choice": {"type": "web_search"}},
        }
        async with httpx.AsyncClient() as h:
            head = {"Authorization": f"Bearer {key}"}
            out = {k: await h.post(f"{url}/responses", json=body, headers=head) for k, body in bad.items()}
            out["missing"] = await h.post(f"{url}/responses", json=good)
            out["ok"] = await h.post(f"{url}/responses", json={**good, "store": False}, headers=head)
        ResponsesProbe.seen.update({k: (r.status_code, r.json()) for k, r in out.items()})
        return "done"


async def test_bad_responses_requests_get_400_naming_the_field_and_an_ended_program_410(tok):
    env = ResponsesProbe()
    async with Reactor(ScriptedEngine(calculator, tok), env, None, RolloutConfig()) as reactor:
        groups = await reactor.collect(env.tasks(1), 1)
        async with httpx.AsyncClient() as h:
            s = ResponsesProbe.seen
            after = await h.post(f"{s['url']}/responses", headers={"Authorization": f"Bearer {s['key']}"},
                                 json={"model": "m", "input": "hi"})
    assert groups[0].trajectories[0].finish_reason == "stop"
    for param in ("previous_response_id", "store", "conversation", "tools[0]", "input[1]", "input[0].content[0]",
                  "input", "n", "tool_choice"):
        status, body = s[param]
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (param, body)
        assert body["error"]["param"] == param and body["error"]["message"].startswith(param), (param, body)
    assert "send the whole conversation as input items" in s["previous_response_id"][1]["error"]["message"]
    assert "function tools only" in s["tools[0]"][1]["error"]["message"]
    assert "'item_reference'" in s["input[1]"][1]["error"]["message"]
    assert s["missing"][0] == 401 and s["missing"][1]["error"]["code"] == "invalid_api_key"
    assert s["ok"][0] == 200 and s["ok"][1]["object"] == "response" and s["ok"][1]["store"] is False
    assert after.status_code == 410 and after.json()["error"]["code"] == "program_ended"


async def test_a_responses_program_replays_from_the_log_and_restarts_on_a_mismatch(tok):
    await replay_then_tamper(tok, ResponsesCalc())
