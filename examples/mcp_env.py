"""An environment whose tool comes from an MCP server: retool-math's problems, solved with the
calculator of examples/mcp_calc_server.py instead of the sandbox.

    pip install 'agentenv[mcp]'
    agentenv rollout --env examples/mcp_env.py:McpMathEnv --model tiny-hermes --tasks 16
    agentenv rollout --env examples/mcp_env.py:McpMathEnv --model tiny-hermes --env-arg per=program
    python examples/mcp_calc_server.py --http 8765 &     # or a server that is already running:
    agentenv rollout --env examples/mcp_env.py:McpMathEnv --model tiny-hermes --env-arg url=http://127.0.0.1:8765/mcp

The server's ``python`` tool takes the calls the bundled models write
(``{"name": "python", "arguments": {"code": "print(31 * 24533 + 63)"}}``) and evaluates the
arithmetic in them; the tool format is the model's own (Hermes for ``tiny-hermes``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.mcp_tools import MCPServer, MCPTools

SERVER = Path(__file__).with_name("mcp_calc_server.py")


class McpMathEnv(RetoolMathEnv):
    """retool-math with its tool from an MCP server (the example calculator): ``per="pool"``
    (one server process for the run) or ``"program"`` (one per program); ``url=`` uses a
    streamable-HTTP server already running on loopback instead; ``tools_in_prompt=True`` lets
    the chat template list every tool of the server (the bundled models were trained without
    that list: leave it off for them)."""

    id = "mcp-math"

    def __init__(self, extra_digits: int = 2, format: str | None = None, per: str = "pool", url: str | None = None,
                 call_timeout: float = 5.0, tools_in_prompt: bool = False) -> None:
        super().__init__(extra_digits=extra_digits, format=format)
        server = (MCPServer(url=url, call_timeout=call_timeout) if url else
                  MCPServer(command=[sys.executable, str(SERVER)], per=per, call_timeout=call_timeout))  # type: ignore[arg-type]
        self.mcp = MCPTools(server)
        self.tools_in_prompt = tools_in_prompt  # type: ignore[misc]

    def tools(self):
        return self.mcp.tools() if self.tools_in_prompt else [t for t in self.mcp.tools() if t.name == "python"]

    async def aclose(self) -> None:
        await self.mcp.aclose()


if __name__ == "__main__":
    import anyio

    from agentenv import Reactor, RolloutConfig
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.models import model_dir

    async def main() -> None:
        env = McpMathEnv()
        engine = EmbeddedEngine(str(model_dir("tiny-hermes")), seed=0)
        try:
            groups = await Reactor(engine, env, None, RolloutConfig()).collect(env.tasks(4), group_size=2)
            for g in groups:
                for t in g.trajectories:
                    print(t.reward, [(c.name, c.status, c.output) for c in t.tool_calls])
        finally:
            engine.close()
            await env.aclose()

    anyio.run(main)
