"""Execution backends for tool code: ``sandboxes.local`` (default) and, later, E2B."""

from .base import ExecResult, ExecStatus, Sandbox, Session

__all__ = ["ExecResult", "ExecStatus", "Sandbox", "Session", "default_sandbox"]


def default_sandbox(**kwargs) -> Sandbox:
    from .local import LocalSandbox

    return LocalSandbox(**kwargs)
