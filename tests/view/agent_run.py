"""A real agent program's run for the viewer's tests: an ``AgentEnvironment`` whose agent talks
to the real gateway (the ``openai`` SDK over loopback HTTP) and asks in three contexts, so its
trajectory holds the main sequence and two branches of different roles:

* main: the first call (``role main``), which calls the ``add`` tool;
* branch 1 (``role main``): the same question again under another system prompt, with the tool's
  result: a rewritten history, so a new sequence; then a user's question after its reply,
  which extends it (the question spliced in with loss mask 0, and a second reply);
* branch 2 (``role critic``): a critic (``agentenv.gateway.role_client``) in a fresh context.

The engine is ``agentenv.testing.ScriptedEngine`` on tiny-hermes's tokenizer (its replies are
known text, each sampled token with its own logprob); the reactor writes the event log as the
rollout CLI does, with the model's directory in its header, so the viewer decodes the tokens
with that tokenizer. :func:`write_agent_run` writes ``OUT`` (one trajectory per line) and
``OUT.log``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio

import agentenv.models
from agentenv import AgentEnvironment, Reactor, RolloutConfig, Task, journal
from agentenv.gateway import role_client

HERMES = Path(agentenv.models.__file__).parent / "tiny-hermes"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def script(prompt: str, n: int) -> str:
    """The model: it calls ``add`` until it sees the tool's result, then answers; asked again,
    it holds to it; as a critic, it approves."""
    last = prompt.rsplit("<|im_start|>", 2)[-2]  # the message before the generation prompt
    if "Critique" in prompt:
        return "Looks right."
    if "Are you sure?" in last:
        return "Yes: 2 + 3 = 5."
    if "<tool_response>" in last:
        return "The sum is 5."
    return "I will add.\n" + CALL


class TwoRoles(AgentEnvironment):
    """Asks once, asks again with a rewritten history and goes on in it, then asks a critic."""

    id = "two-roles"
    max_turns = 8

    def tasks(self, n, seed=0):
        return [Task(f"two-roles/{i}", "What is 2 + 3?", 5) for i in range(n)]

    async def agent(self, task, client, model):
        first = [{"role": "system", "content": "You add."}, {"role": "user", "content": task.question}]
        r = await client.chat.completions.create(model=model, messages=first, tools=[ADD])
        reply = r.choices[0].message
        again = [{"role": "system", "content": "You add carefully."}, {"role": "user", "content": task.question},
                 reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
        r2 = await client.chat.completions.create(model=model, messages=again, tools=[ADD])
        sure = [*again, r2.choices[0].message, {"role": "user", "content": "Are you sure?"}]
        await client.chat.completions.create(model=model, messages=sure, tools=[ADD])
        critic = role_client(client, "critic")
        r3 = await critic.chat.completions.create(model=model, messages=[
            {"role": "user", "content": f"Critique: {r2.choices[0].message.content}"}])
        return f"{r2.choices[0].message.content} ({r3.choices[0].message.content})"

    async def reward(self, task, trajectory):
        return float(str(task.answer) in (trajectory.text or ""))


async def _run(out: Path, tasks: int, group_size: int) -> None:
    from agentenv.engines.embedded import load_tokenizer
    from agentenv.testing import ScriptedEngine

    env = TwoRoles()
    log = journal.Journal.create(Path(f"{out}.log"), {"model": str(HERMES), "env": env.id, "tasks": tasks,
                                                      "group_size": group_size})
    try:
        async with Reactor(ScriptedEngine(script, load_tokenizer(HERMES)), env, None,
                           RolloutConfig(max_new_tokens=1024), journal=log) as reactor:
            groups = await reactor.collect(env.tasks(tasks), group_size)
        with open(out, "w", encoding="utf-8") as f:
            for t in (t for g in groups for t in g.trajectories):
                f.write(json.dumps(t.to_dict()) + "\n")
                log.done(t)
    finally:
        log.close()


def write_agent_run(out: Path, tasks: int = 1, group_size: int = 2) -> Path:
    """Run :class:`TwoRoles` and write its trajectories to ``out`` and its event log beside it.
    The run has a thread of its own: the caller's may be running an event loop already
    (Playwright's sync API keeps one running in the browser tests' thread)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(anyio.run, _run, out, tasks, group_size).result()
    return out
