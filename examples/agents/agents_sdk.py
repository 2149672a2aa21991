"""The OpenAI Agents SDK (``openai-agents``), unmodified, trained through the gateway.

    pip install 'agentenv[agents-frameworks]'
    agentenv rollout --env examples/agents/agents_sdk.py:AgentsSdkMath --model agentenv/models/tiny-hermes \
        --tasks 8 --group-size 2 --max-new-tokens 512 --out agents_sdk.jsonl

An ``agents.Agent`` with one function tool, ``python``, whose code runs in the run's sandbox
pool, on the Chat Completions API of the client the gateway hands over
(``OpenAIChatCompletionsModel``); ``AgentsSdkResponsesMath`` is the same agent on the SDK's
default, the Responses API (``OpenAIResponsesModel``, the gateway's ``POST /v1/responses``):

    agentenv rollout --env examples/agents/agents_sdk.py:AgentsSdkResponsesMath ...

Tracing is off: its exporter would post spans to api.openai.com, and a rollout sends nothing
off the machine.
"""

from __future__ import annotations

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig, Runner
from agents import function_tool, set_tracing_disabled

from agentenv import AgentEnvironment
from agentenv.agent import sandbox_session
from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv

set_tracing_disabled(True)


@function_tool
async def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: the program to run.
    """
    result = await (await sandbox_session()).run(code, timeout=5.0)
    return result.render()


class AgentsSdkMath(AgentEnvironment):
    id = "agents-sdk-math"
    max_turns = 4
    uses_sandbox = True

    def __init__(self, extra_digits: int = 1) -> None:
        super().__init__()
        self.math = RetoolMathEnv(extra_digits=extra_digits, format="hermes")

    def tasks(self, n, seed=0):
        return self.math.tasks(n, seed)

    def sdk_model(self, client, model):
        return OpenAIChatCompletionsModel(model=model, openai_client=client)

    async def agent(self, task, client, model):
        solver = Agent(name="solver", instructions=HERMES_PROMPT, tools=[python], model=self.sdk_model(client, model))
        try:
            result = await Runner.run(solver, task.question, max_turns=self.max_turns,
                                      run_config=RunConfig(tracing_disabled=True))
        except MaxTurnsExceeded:
            return None  # no final answer within max_turns: the reward sees none
        return result.final_output

    async def reward(self, task, trajectory):
        return await self.math.reward(task, trajectory)


class AgentsSdkResponsesMath(AgentsSdkMath):
    """The same agent on the Responses API, the Agents SDK's default model: the whole
    conversation goes as input items each turn (no ``previous_response_id``: the gateway keeps
    no responses)."""

    id = "agents-sdk-responses-math"

    def sdk_model(self, client, model):
        return OpenAIResponsesModel(model=model, openai_client=client)
