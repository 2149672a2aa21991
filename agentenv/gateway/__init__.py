"""The OpenAI-compatible gateway between an agent program and the run's engine (see
``agentenv.gateway.server`` and docs/agents.md)."""

from .server import Gateway, role_client

__all__ = ["Gateway", "role_client"]
