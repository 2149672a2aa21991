"""Execution backends for tool code: ``agentenv.sandboxes.local`` (default) and ``agentenv.sandboxes.e2b``."""

from .base import ExecResult, ExecStatus, Sandbox, Session

__all__ = ["ExecResult", "ExecStatus", "Sandbox", "Session", "default_sandbox"]


def default_sandbox(kind: str = "local", **kwargs) -> Sandbox:
    """``local`` (the hardened local pool, default) or ``e2b`` (needs ``agentenv[e2b]``)."""
    if kind == "local":
        from .local import LocalSandbox

        return LocalSandbox(**kwargs)
    if kind == "e2b":
        from .e2b import E2BSandbox

        return E2BSandbox(**kwargs)
    from agentenv.errors import ConfigError

    raise ConfigError(f"unknown sandbox {kind!r}; choose local or e2b")
