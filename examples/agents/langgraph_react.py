"""LangGraph's prebuilt ReAct agent over ``langchain-openai``, unmodified, trained through the
gateway.

    pip install 'agentenv[agents-frameworks]'
    agentenv rollout --env examples/agents/langgraph_react.py:LangGraphMath --model agentenv/models/tiny-hermes \
        --tasks 8 --group-size 2 --max-new-tokens 512 --out langgraph.jsonl

``langgraph.prebuilt.create_react_agent`` with a ``python`` tool whose code runs in the run's
sandbox pool; its model is ``ChatOpenAI`` pointed at the gateway (the base URL and key of the
client the gateway hands over). LangSmith tracing stays off unless ``LANGSMITH_TRACING`` /
``LANGCHAIN_TRACING_V2`` turn it on: leave them unset or false, a rollout sends nothing off the
machine.
"""

from __future__ import annotations

import warnings

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from agentenv import AgentEnvironment
from agentenv.agent import sandbox_session
from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv


@tool
async def python(code: str) -> str:
    """Run Python code and return what it prints."""
    result = await (await sandbox_session()).run(code, timeout=5.0)
    return result.render()


class LangGraphMath(AgentEnvironment):
    id = "langgraph-math"
    max_turns = 4
    uses_sandbox = True

    def __init__(self, extra_digits: int = 1) -> None:
        super().__init__()
        self.math = RetoolMathEnv(extra_digits=extra_digits, format="hermes")

    def tasks(self, n, seed=0):
        return self.math.tasks(n, seed)

    async def agent(self, task, client, model):
        llm = ChatOpenAI(model=model, base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
        with warnings.catch_warnings():  # LangGraph 1.x points to langchain.agents.create_agent (another package)
            warnings.simplefilter("ignore", DeprecationWarning)
            graph = create_react_agent(llm, tools=[python], prompt=HERMES_PROMPT)
        try:
            # Each model call and each tool step is a graph step: max_turns calls need 2 * max_turns.
            state = await graph.ainvoke({"messages": [("user", task.question)]},
                                        config={"recursion_limit": 2 * self.max_turns})
        except GraphRecursionError:
            return None  # no final answer within max_turns: the reward sees none
        return state["messages"][-1].content

    async def reward(self, task, trajectory):
        return await self.math.reward(task, trajectory)
