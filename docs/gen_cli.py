"""Generate the CLI synopses in the docs from the CLI's own parser.

    python docs/gen_cli.py           # rewrite the synopses in docs/cli.md and docs/training.md
    python docs/gen_cli.py --check   # exit 1 when a page differs from what it would write

The options of ``rollout``, ``eval`` and ``train`` are fields of their config dataclasses
(``agentenv.options``), grouped by concern as ``--help`` groups them. Each page holds a block
between ``<!-- synopsis:COMMAND:start -->`` and ``<!-- synopsis:COMMAND:end -->``; this writes
there, one line per group (the group's name, then its flags, with the default where it is a
plain value and the metavar otherwise), so the pages cannot drift from the flags.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentenv.cli import build_parser  # noqa: E402

PAGES = {"rollout": ROOT / "docs" / "cli.md", "eval": ROOT / "docs" / "cli.md", "train": ROOT / "docs" / "training.md"}
WIDTH = 110


def _flag(action: argparse.Action, exclusive: dict[str, str]) -> str | None:
    """One option as the synopsis shows it; None for --help and the second of an exclusive pair."""
    if not action.option_strings or action.dest == "help" or action.help == argparse.SUPPRESS:
        return None
    name = action.option_strings[0]
    if name in exclusive:
        return exclusive[name] or None
    if action.nargs == 0:
        return f"[{name}]"
    if action.choices:
        value = "|".join(str(c) for c in action.choices)
    elif type(action.default) in (int, float, str) and action.default != "":  # a plain value, not a flag's bool
        value = str(action.default)
    else:
        value = action.metavar or action.dest.upper()
    repeat = "..." if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction) else ""
    return f"[{name} {value}]{repeat}"


def _exclusive(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each mutually exclusive group shown once, at its first option: ``[--resume | --overwrite]``."""
    out: dict[str, str] = {}
    for group in parser._mutually_exclusive_groups:
        names = [a.option_strings[0] for a in group._group_actions]
        out[names[0]] = "[" + " | ".join(names) + "]"
        out.update({n: "" for n in names[1:]})
    return out


def synopsis(command: str) -> str:
    """``agentenv COMMAND``'s synopsis: a line per option group, wrapped under its group's name."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    exclusive = _exclusive(sub)
    groups = [(g.title.split(" (")[0], [f for a in g._group_actions if (f := _flag(a, exclusive))])
              for g in sub._action_groups]
    groups = [(title, flags) for title, flags in groups if flags]
    pad = max(len(t) for t, _ in groups) + 2
    lines = [f"agentenv {command}"]
    for title, flags in groups:
        line = f"  {title:<{pad}}"
        for i, flag in enumerate(flags):  # wrapped between options, never inside one
            if i and len(line) + 1 + len(flag) > WIDTH:
                lines.append(line)
                line = " " * (pad + 2)
            line += ("" if line.isspace() or not i else " ") + flag
        lines.append(line)
    return "\n".join(lines)


def render(text: str, command: str) -> str:
    start, end = f"<!-- synopsis:{command}:start -->", f"<!-- synopsis:{command}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{PAGES[command]} has no {start} ... {end} block")
    block = f"{start}\n```\n{synopsis(command)}\n```\n{end}"
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, count=1, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a page differs instead of writing it")
    args = ap.parse_args(argv)
    stale = []
    for page in dict.fromkeys(PAGES.values()):
        old = page.read_text("utf-8")
        new = old
        for command in (c for c, p in PAGES.items() if p == page):
            new = render(new, command)
        if new != old:
            stale.append(str(page.relative_to(ROOT) if page.is_relative_to(ROOT) else page))
            if not args.check:
                page.write_text(new, "utf-8")
    if stale:
        print(("differs from the parser: " if args.check else "wrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
