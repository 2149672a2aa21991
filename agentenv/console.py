"""Where the CLI's human-readable output goes: :func:`console`, the one place that decides
between rich output (on a terminal) and plain text (anywhere else).

On a terminal the output is rich's: colour, styles and tables fitted to the window. Off one
(a pipe, a file, a CI log) it is plain text a program can read: no colour or ANSI escapes,
markup's styles dropped, and no width limit, so that a header, a table row or a warning is
never folded mid-phrase (rich otherwise assumes 80 columns, or ``$COLUMNS``, off a terminal).
A table stays aligned, one row per line.

    con = console()               # stderr, as the CLI's reports go
    con.print(summary_table(...))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

#: The width of a plain console: wider than any line the CLI prints, so none is folded.
#: Renderables that fill the console's width (a ``Rule``, an expanded ``Panel``) would fill
#: this much; the CLI prints none off a terminal.
PLAIN_WIDTH = 10_000


def console(*, stderr: bool = True) -> "Console":
    """A rich Console on stderr (or stdout): rich's own when it is a terminal (rich's test,
    which honours ``FORCE_COLOR`` and ``TTY_COMPATIBLE``, and a notebook counts), otherwise
    plain text: no colour, no highlighting, no emoji codes, no width limit."""
    from rich.console import Console

    rich = Console(stderr=stderr)
    if rich.is_terminal or rich.is_jupyter:
        return rich
    return Console(stderr=stderr, width=PLAIN_WIDTH, color_system=None, no_color=True, highlight=False,
                   emoji=False, soft_wrap=True, force_terminal=False, force_interactive=False)


def phrases(con: "Console", *parts: str, indent: str = "  ") -> str:
    """``parts`` (rich markup, each a phrase such as ``tasks=32 x group 4``) joined by spaces
    in lines no wider than ``con``: broken between phrases only, never inside one, the lines
    after the first indented (a phrase wider than a line stands on a line of its own). Off a
    terminal the console is wide enough for one line."""
    from rich.text import Text

    lines: list[str] = []
    width = 0
    for part in parts:
        cells = Text.from_markup(part).cell_len
        if lines and width + 1 + cells <= con.width:
            lines[-1] += " " + part
            width += 1 + cells
        else:
            lines.append(part if not lines else indent + part)
            width = cells + (len(indent) if len(lines) > 1 else 0)
    return "\n".join(lines)


def on_terminal(con: "Console") -> bool:
    """Whether ``con`` draws for a person at a terminal (a live progress bar is worth it)."""
    return con.is_terminal or con.is_jupyter


__all__ = ["PLAIN_WIDTH", "console", "on_terminal", "phrases"]
