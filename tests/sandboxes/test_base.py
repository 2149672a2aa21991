"""The sandbox interface (``base.py``): the text a call's result shows the model, and what the
base classes give every backend (``prepare`` that starts nothing, ``async with`` that closes)."""

from __future__ import annotations

import pytest

from agentenv.sandboxes.base import ExecResult, Sandbox, Session

pytestmark = pytest.mark.anyio


def test_the_rendered_result_is_output_then_marker_value_and_error_in_that_order():
    r = ExecResult("error", stdout="out\n\n", stderr="warn\n", value="42", error="Traceback\nValueError: x\n",
                   truncated=True)
    assert r.render() == "out\nwarn\n[output truncated]\n42\nTraceback\nValueError: x"  # trailing newlines dropped
    assert ExecResult("ok").render() == "" and ExecResult("ok", value="None").render() == "None"
    assert ExecResult("ok", stdout="", value="''").render() == "''"  # an empty string's repr still shows


@pytest.mark.parametrize("restored, line", [
    (None, "[session restarted: earlier variables are lost]"),
    (0, "[session restarted: 0 earlier calls were run again]"),
    (1, "[session restarted: 1 earlier call was run again]"),
    (3, "[session restarted: 3 earlier calls were run again]"),
])
def test_a_lost_state_is_said_last_with_how_many_calls_were_run_again(restored, line):
    r = ExecResult("crashed", error="the interpreter process died", state_lost=True)
    assert r.render(restored) == "the interpreter process died\n" + line
    assert ExecResult("ok", value="1").render(restored) == "1"  # nothing lost: nothing said


class Plain(Sandbox):
    """A backend with only what the interface requires."""

    def __init__(self) -> None:
        self.closed = 0

    async def session(self, setup_code: str | None = None) -> Session:
        return Notebook(setup_code)

    async def aclose(self) -> None:
        self.closed += 1


class Notebook(Session):
    def __init__(self, setup: str | None) -> None:
        self.ns: dict = {}
        self.closed = False
        if setup:
            exec(setup, self.ns)

    async def run(self, code: str, timeout: float | None = None) -> ExecResult:
        return ExecResult("ok", value=repr(eval(code, self.ns)))

    async def aclose(self) -> None:
        self.closed = True


async def test_a_backend_prepares_nothing_unless_it_can_and_closes_on_leaving_its_block():
    with pytest.raises(TypeError, match="abstract"):
        Sandbox()  # type: ignore[abstract]
    async with Plain() as sb:
        assert await sb.prepare("X = 1", 8, wait=True) == 0  # starts on demand instead
        async with await sb.session("X = 41") as s:
            assert (await s.run("X + 1")).value == "42"
        assert s.closed
    assert sb.closed == 1
