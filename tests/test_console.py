"""The CLI's console (``agentenv.console``): rich on a terminal; off one (a pipe, a file) plain
lines, never folded and free of ANSI escapes, whatever ``$COLUMNS`` says. The CLI itself is
run in this process with its output captured (not a terminal)."""

from __future__ import annotations

import os
import sys

import pytest
from rich.table import Table

from agentenv.cli import main
from agentenv.console import PLAIN_WIDTH, console, on_terminal, phrases

LONG = "agentenv rollout: env=retool-math model=/a/rather/long/path/to/a/model/directory engine=embedded tasks=32"
ROW = "engine under half its decode slots (the run's tail, mostly)"


@pytest.fixture
def narrow(monkeypatch):
    """Rich's width off a terminal is $COLUMNS (80 without it): 40 would fold every line here."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "40")


def body_cells(err: str) -> list[list[str]]:
    """The cells of each row line of the tables in ``err`` (lines drawn as ``│ a │ b │``)."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in err.splitlines() if line.startswith("│")]


def test_off_a_terminal_lines_are_plain_and_whole(capsys, narrow):
    con = console()
    assert not on_terminal(con) and con.width == PLAIN_WIDTH and con.color_system is None
    con.print(f"[bold]{LONG}[/] [bold red]and a warning in red[/]")
    t = Table(title="title", show_header=False)
    t.add_row(ROW, "77.4%")
    con.print(t)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "[bold" not in err  # the styles are dropped, not printed as markup
    assert f"{LONG} and a warning in red" in err.splitlines()
    assert body_cells(err) == [[ROW, "77.4%"]]


def test_on_a_terminal_it_is_rich(monkeypatch, narrow):
    leader, follower = os.openpty()
    with open(follower, "w", closefd=True) as tty, open(leader, "rb", closefd=True):
        monkeypatch.setattr(sys, "stderr", tty)
        monkeypatch.setenv("TERM", "xterm-256color")
        con = console()
        assert on_terminal(con) and con.color_system is not None and con.width == 40


def test_on_an_80_column_terminal_the_header_breaks_between_phrases_only():
    """Rich folds a long line at any space ("tasks=32 x" / "group 4"): the run's header is
    packed into lines of whole phrases, each within the width; off a terminal it is one line."""
    import io

    from rich.console import Console

    parts = ["[bold]agentenv[/] rollout:", "env=retool-math", "model=/a/rather/long/path/to/a/model/directory/x",
             "engine=embedded", "tasks=32 x group 4", "on Ray, 2 workers, 1 engine actors"]
    buf = io.StringIO()
    con = Console(file=buf, width=80, force_terminal=True, color_system=None)
    con.print(phrases(con, *parts))
    lines = buf.getvalue().splitlines()
    plain = [p.replace("[bold]", "").replace("[/]", "") for p in parts]
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines)
    assert lines == ["agentenv rollout: env=retool-math", "  " + " ".join(plain[2:4]),
                     "  " + " ".join(plain[4:])]  # whole phrases, the lines after the first indented
    wide = Console(file=io.StringIO(), width=PLAIN_WIDTH)
    assert phrases(wide, *parts).count("\n") == 0


@pytest.mark.slow
def test_the_cli_off_a_terminal_folds_no_line(tmp_path, capsys, narrow, model_dir):
    """``agentenv eval`` (the rollout's header and summary table, then the evaluation's table)
    with stderr captured and $COLUMNS at 40: each record on one line of its own."""
    out, report = tmp_path / "e.jsonl", tmp_path / "report.json"
    rc = main(["eval", "--tasks", "2", "--k", "2", "--max-new-tokens", "48", "--model", model_dir,
               "--out", str(out), "--report", str(report)])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = err.splitlines()
    assert "\x1b" not in err and not [line for line in lines if line.startswith("rollouts")]  # nor a progress bar
    header = next(line for line in lines if line.startswith("agentenv eval: "))
    # eval names the group size by its flag, --k
    assert "env=retool-math" in header and header.endswith("tasks=2 x k 2")
    cells = body_cells(err)
    assert cells and all(len(row) == 2 and all(row) for row in cells), cells  # a folded row leaves a cell empty
    rows = dict(cells)
    assert rows["programs"] == "4" and rows["wall time"].endswith("with start-up (model, sandbox)")
    assert {ROW, "prefix-cache hits (all prompt tokens)", "pass@1", "tool calls per sample"} <= set(rows)
    assert "4 trajectories -> " + str(out) in lines
