"""Real agents from PyPI, unmodified (examples/agents/): a plain ``openai`` SDK tool loop, the
OpenAI Agents SDK, LangGraph's prebuilt ReAct agent and a command-form script, each through
the gateway.

Two ways: a scripted model (``agentenv.testing.ScriptedEngine``) that calls the ``python``
tool once and then answers from its output, so that each framework's second request must
extend its first, and the tool must run; and a real ``agentenv rollout`` on the bundled
tiny-hermes model with the embedded engine (slow). Every row of every program is checked
against what the gateway saw: the trainer's ids with loss mask 1 are the ids the engine
sampled, and the row decodes to the chat template's rendering of the conversation the agent
sent, with the model's replies as sampled. Nothing may leave the machine: a process-wide audit
hook records every connection and name lookup to a host that is not loopback."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from agentenv import Reactor, RolloutConfig
from agentenv.gateway.branches import render
from agentenv.gateway.messages import for_template
from agentenv.gateway.session import ProgramSession
from agentenv.registry import make
from agentenv.sandboxes.local import LocalSandbox
from agentenv.testing import ScriptedEngine
from agentenv.trajectory import Trajectory

from .test_gateway import HERMES, sampled

EXAMPLES = Path(__file__).parent.parent / "examples" / "agents"
#: style -> (the example's env spec, the module it needs).
STYLES = {
    "openai-loop": ("openai_tool_loop.py:ToolLoopMath", "openai"),
    "agents-sdk": ("agents_sdk.py:AgentsSdkMath", "agents"),
    "agents-sdk-responses": ("agents_sdk.py:AgentsSdkResponsesMath", "agents"),
    "langgraph": ("langgraph_react.py:LangGraphMath", "langgraph.prebuilt"),
    "command": ("subprocess_agent.py:CommandMath", "openai"),
}
#: Telemetry off, as docs/agents.md says to run the frameworks.
QUIET = {"OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGCHAIN_TRACING_V2": "false", "LANGSMITH_TRACING": "false"}
_LOOPBACK = {"127.0.0.1", "::1", "localhost", "0.0.0.0", None}
_OFF_MACHINE: list[tuple[str, object]] | None = None  # recording while a list


def _audit(event: str, args: tuple) -> None:
    if _OFF_MACHINE is None:
        return
    if event == "socket.getaddrinfo" and args[0] not in _LOOPBACK:
        _OFF_MACHINE.append((event, args[0]))
    elif event == "socket.connect" and isinstance(args[1], tuple) and args[1][0] not in _LOOPBACK:
        _OFF_MACHINE.append((event, args[1]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only while a test holds the list


@pytest.fixture
def offline(monkeypatch):
    """The test's off-machine attempts (connections, name lookups), asserted none at the end."""
    global _OFF_MACHINE
    for k, v in QUIET.items():
        monkeypatch.setenv(k, v)
    _OFF_MACHINE = []
    try:
        yield _OFF_MACHINE
        assert not _OFF_MACHINE, f"reached off the machine: {_OFF_MACHINE[:5]}"
    finally:
        _OFF_MACHINE = None


@pytest.fixture
def seen(monkeypatch):
    """Every request the gateway answered, by program: the branch it went to, the messages and
    tools the agent sent, the ids and logprobs the engine sampled (the real method runs)."""
    calls = defaultdict(list)
    real = ProgramSession._complete

    async def complete(self, req, role):
        before = [b.calls for b in self.branches.all]
        answer = await real(self, req, role)
        after = [b.calls for b in self.branches.all]
        # None: a reply with nothing sampled that would have started a branch starts none.
        branch = next((i for i, n in enumerate(after) if i >= len(before) or n != before[i]), None)
        gen = answer.gen
        calls[self.program].append(
            {
                "branch": branch,
                "messages": req.messages,
                "tools": req.tools,
                "ids": list(gen.token_ids),
                "lp": list(gen.logprobs),
                "eos": gen.stop_token_id is not None and gen.stop_token_id == self.tokenizer.eos_token_id,
            }
        )
        return answer

    monkeypatch.setattr(ProgramSession, "_complete", complete)
    return calls


def env_of(style: str):
    spec, module = STYLES[style]
    pytest.importorskip(module)
    return make(str(EXAMPLES / spec))


def _raw(tok, call) -> str:
    ids = call["ids"][:-1] if call["eos"] else call["ids"]
    return tok.decode(ids, skip_special_tokens=False)


def conversation_text(tok, calls) -> str:
    """The chat template's rendering of one sequence's last request, each earlier reply of the
    sequence (where the next request carries it back) and the last reply as the model sampled
    them; ending as the last reply ended (at the end-of-turn token, or cut short)."""
    last = calls[-1]
    messages = [for_template(m) for m in last["messages"]]
    for c in calls[:-1]:
        messages[len(c["messages"])] = {"role": "assistant", "content": _raw(tok, c)}
    text = render(tok, [*messages, {"role": "assistant", "content": _raw(tok, last)}], last["tools"],
                  generation_prompt=False)
    end = tok.eos_token + "\n"
    assert text.endswith(end)
    return text[: -1 if last["eos"] else -len(end)]


def check_token_exact(tok, traj: Trajectory, calls: list[dict]) -> None:
    """Each row the trainer takes from ``traj`` against the gateway's record of its calls."""
    g = traj.metadata["gateway"]
    unbranched = [c for c in calls if c["branch"] is None]
    assert all(c["ids"] == [] for c in unbranched)
    assert g["calls"] == len(calls) == g["extended"] + g["branched"] + len(unbranched), (g, len(calls))
    ids, rows = sampled(traj)
    by_branch = defaultdict(list)
    for c in calls:
        if c["branch"] is not None:
            by_branch[c["branch"]].append(c)
    assert len(by_branch) == g["branched"] == len(traj.branches) + 1
    assert len(rows) == len(by_branch)  # a branch always holds its prompt: never left out
    for row_ids, row, b in zip(ids, rows, sorted(by_branch)):
        mine = by_branch[b]
        assert row_ids == [i for c in mine for i in c["ids"]], "the trainer's ids are not the ones sampled"
        assert [lp for lp, m in zip(row.logprobs, row.loss_mask) if m] == [x for c in mine for x in c["lp"]]
        assert row.loss_mask.count(1) == row.num_sampled_tokens
        assert tok.decode(row.input_ids, skip_special_tokens=False) == conversation_text(tok, mine)


# -- a scripted model: one python call, then the answer from its output ----------------------

def solver(prompt: str, n: int) -> str:
    last = prompt.rsplit("<|im_start|>", 2)[-2]
    out = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.S)
    if out:
        return f"The answer is \\boxed{{{out.group(1).strip()}}}."
    expression = re.search(r"Compute ([\d+*() -]+)\.", prompt).group(1)
    call = {"name": "python", "arguments": {"code": f"print({expression})"}}
    return f"I will compute it.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def compute_tasks(env, n):
    """Tasks ``Compute <arithmetic>.`` (what :func:`solver` reads)."""
    found = [t for t in env.tasks(64) if re.fullmatch(r"Compute [\d+*() -]+\.", t.question)]
    assert len(found) >= n
    return found[:n]


@pytest.mark.anyio
@pytest.mark.parametrize("style", list(STYLES))
async def test_each_agent_style_extends_its_history_and_runs_its_tool(style, offline, seen):
    env = env_of(style)
    tok = _tokenizer()
    engine = ScriptedEngine(solver, tok)
    tasks = compute_tasks(env, 2)
    async with LocalSandbox() as sb:
        async with Reactor(engine, env, sb, RolloutConfig(max_new_tokens=512)) as reactor:
            groups = await reactor.collect(tasks, 2)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 4
    for t in trajs:
        assert t.finish_reason == "stop", t.error
        assert t.reward == 1.0, (t.text, t.reward)  # the tool ran and its output came back
        g = t.metadata["gateway"]
        assert (g["calls"], g["extended"], g["branched"], g["malformed_tool_calls"]) == (2, 1, 1, 0), g
        assert [(c.name, c.status) for c in t.tool_calls] == [("python", "ok")]
        check_token_exact(tok, t, seen[t.id])


@pytest.mark.anyio
async def test_the_agents_sdk_streams_on_the_responses_api(offline, seen):
    """``Runner.run_streamed`` on ``OpenAIResponsesModel`` (the SDK's default model): the raw
    Responses events arrive through the SDK, the tool runs, and the second turn extends the
    first, token-exact."""
    import inspect

    from agents import Agent, RunConfig, Runner

    base = type(env_of("agents-sdk-responses"))
    example = inspect.getmodule(base)
    kinds: list[str] = []

    class Streamed(base):
        async def agent(self, task, client, model):
            solver = Agent(name="solver", instructions=example.HERMES_PROMPT, tools=[example.python],
                           model=self.sdk_model(client, model))
            run = Runner.run_streamed(solver, task.question, max_turns=self.max_turns,
                                      run_config=RunConfig(tracing_disabled=True))
            async for event in run.stream_events():
                if event.type == "raw_response_event":
                    kinds.append(event.data.type)
            return run.final_output

    env, tok = Streamed(), _tokenizer()
    async with LocalSandbox() as sb:
        async with Reactor(ScriptedEngine(solver, tok), env, sb, RolloutConfig(max_new_tokens=512)) as reactor:
            t = (await reactor.collect(compute_tasks(env, 1), 1))[0].trajectories[0]
    assert t.finish_reason == "stop" and t.reward == 1.0, (t.error, t.text)
    g = t.metadata["gateway"]
    assert (g["calls"], g["extended"], g["branched"], g["malformed_tool_calls"]) == (2, 1, 1, 0), g
    assert [(c.name, c.status) for c in t.tool_calls] == [("python", "ok")]
    assert kinds.count("response.completed") == 2 and "response.function_call_arguments.delta" in kinds
    assert kinds.count("response.output_text.delta") == 2  # "I will compute it." and the answer
    check_token_exact(tok, t, seen[t.id])


def _tokenizer():
    from agentenv.engines.embedded import load_tokenizer

    return load_tokenizer(HERMES)


def test_the_command_agent_prompt_is_the_one_tiny_hermes_learned():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import math_agent
    finally:
        sys.path.remove(str(EXAMPLES))
    from agentenv.envs.retool_math import HERMES_PROMPT

    assert math_agent.PROMPT == HERMES_PROMPT
    assert math_agent.run_python("x = 3 * 4\nprint(x + 2)\nx // 5") == "14\n2"
    assert math_agent.run_python("import os").startswith("Error: ValueError: not supported here")


# -- a real rollout on tiny-hermes --------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("style", list(STYLES))
def test_a_rollout_on_tiny_hermes_writes_token_exact_rows(style, offline, seen, tmp_path, capsys):
    from agentenv.cli import main

    env_of(style)  # skips where the framework is not installed
    out = tmp_path / "rows.jsonl"
    rc = main(["rollout", "--env", str(EXAMPLES / STYLES[style][0]), "--model", str(HERMES), "--tasks", "3",
               "--group-size", "2", "--max-new-tokens", "256", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    rows = [Trajectory.from_dict(json.loads(x)) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all(t.finish_reason == "stop" for t in rows), [t.error for t in rows]
    tok = _tokenizer()
    for t in rows:
        check_token_exact(tok, t, seen[t.id])
    total = {k: sum(t.metadata["gateway"][k] for t in rows) for k in ("calls", "extended", "branched")}
    assert f"{total['calls']} ({total['extended']} / {total['branched']} / 0)" in err  # the summary's counts
