"""``agentenv.options``: a config dataclass's fields become flags (their form from the
annotation, their help and checks from the declaration) and the parsed values become the
config again; on small configs of its own, through a real ``argparse`` parser."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest

from agentenv.errors import ConfigError
from agentenv.options import (POSITIVE, UNIT, Check, add_options, build, concern, flat_concern, groups_of, option,
                              option_of, resume_keys, resume_settings, same_as, validate, walk)


def _pairs(items: list[str], earlier: dict[str, Any]) -> dict[str, str]:
    return {k: f"{earlier['name']}:{v}" for k, _, v in (i.partition("=") for i in items)}


@dataclass(frozen=True)
class Inner:
    GROUP: ClassVar[str] = "inner"

    rate: float = option(0.5, "a rate (default {default}; 1: all)", check=UNIT)
    mode: Literal["fast", "slow"] = option("fast", "how", resume=True)


@dataclass(frozen=True)
class Outer:
    GROUP: ClassVar[str] = "outer"

    name: str = option("x", "a name", resume="the_name")
    count: int = option(3, "how many", check=POSITIVE, group="inner")
    out: Path | None = option(None, "where")
    quiet: bool = option(False, "say less")
    color: bool = option(True, "no colour", flag="--no-color")
    tags: list[str] = option(factory=list, flag="--tag", help="a tag, repeatable")
    pairs: dict[str, str] = option(factory=dict, flag="--pair", metavar="K=V", convert=_pairs, help="K=V, repeatable")
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        validate(self)


def parser(**kw: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_options(p, Outer, **kw)
    return p


def parse(argv: list[str], **kw: Any) -> Outer:
    return build(Outer, vars(parser(**kw).parse_args(argv)))


def test_every_field_is_walked_with_its_dotted_path():
    assert [path for path, _, _ in walk(Outer)] == ["name", "count", "out", "quiet", "color", "tags", "pairs",
                                                     "inner.rate", "inner.mode"]


def test_defaults_parse_back_to_the_default_config():
    assert parse([]) == Outer()


def test_each_annotation_gives_its_flags_form():
    got = parse(["--name", "y", "--count", "7", "--out", "o.txt", "--quiet", "--no-color", "--tag", "a", "--tag", "b",
                 "--pair", "k=v", "--rate", "1", "--mode", "slow"])
    assert got == Outer(name="y", count=7, out=Path("o.txt"), quiet=True, color=False, tags=["a", "b"],
                        pairs={"k": "y:v"}, inner=Inner(rate=1.0, mode="slow"))
    # convert saw the fields declared before it in its config: name was already "y".


def test_a_check_refuses_the_value_as_it_is_parsed_naming_the_flag():
    with pytest.raises(argparse.ArgumentError, match=r"argument --count: must be > 0, got 0"):
        parser().parse_args(["--count", "0"])
    with pytest.raises(argparse.ArgumentError, match=r"argument --rate: must be > 0 and <= 1, got 2"):
        parser().parse_args(["--rate", "2"])
    with pytest.raises(argparse.ArgumentError, match=r"argument --count: expected a number, got 'many'"):
        parser().parse_args(["--count", "many"])
    with pytest.raises(argparse.ArgumentError, match=r"argument --mode: invalid choice: 'medium'"):
        parser().parse_args(["--mode", "medium"])


def test_a_config_built_in_python_is_checked_the_same_way():
    with pytest.raises(ConfigError, match=r"^count must be > 0, got -1$"):
        Outer(count=-1)
    with pytest.raises(ConfigError, match=r"^mode must be fast or slow, got 'medium'$"):
        validate(Inner(mode="medium"))  # type: ignore[arg-type]


def test_help_says_the_default_once_and_short_placeholders():
    helps = {a.dest: a for a in parser()._actions}
    assert helps["inner.rate"].help == "a rate (default 0.5; 1: all)"  # {default} filled in, no second one added
    assert helps["count"].help == "how many (default 3)"
    assert helps["quiet"].help == "say less" and helps["out"].help == "where"  # nothing said: no default shown
    assert (helps["count"].metavar, helps["inner.rate"].metavar, helps["out"].metavar) == ("N", "X", "PATH")
    assert helps["pairs"].metavar == "K=V" and helps["inner.mode"].metavar is None  # {fast,slow}


def test_defaults_and_changes_apply_for_one_command_only():
    p = parser(defaults={"count": 9}, changes={"name": {"flag": "--label", "help": "a label"}})
    got = build(Outer, vars(p.parse_args(["--label", "z"])))
    assert (got.name, got.count) == ("z", 9)
    assert Outer().count == 3


def test_groups_come_from_the_option_or_its_config_and_order_the_help():
    assert groups_of(Outer) == {"name": "outer", "count": "inner", "out": "outer", "quiet": "outer",
                                "color": "outer", "tags": "outer", "pairs": "outer", "inner.rate": "inner",
                                "inner.mode": "inner"}
    text = parser(groups={"inner": "the inner things", "outer": "the outer things"}).format_help()
    text = text.split("\n\n", 1)[1]  # past the usage line
    assert text.index("the inner things:") < text.index("--count") < text.index("the outer things:") < \
        text.index("--name")
    with pytest.raises(ConfigError, match=r"options in groups \['outer'\] that have no heading"):
        parser(groups={"inner": "the inner things"})


def test_same_as_declares_the_same_option_with_its_changes_and_group():
    @dataclass
    class Again:
        count: int = same_as(Outer, "count", default=5)
        name: str = same_as(Outer, "name", help="another name")

    f = Again.__dataclass_fields__
    assert (f["count"].default, option_of(f["count"]).check, option_of(f["count"]).group) == (5, POSITIVE, "inner")
    assert (option_of(f["name"]).help, option_of(f["name"]).group) == ("another name", "outer")


def test_resume_settings_are_the_marked_fields_by_their_settings_name():
    assert resume_keys(Outer) == ("the_name", "mode")
    assert resume_settings(Outer(name="n"), mode="resolved") == {"the_name": "n", "mode": "resolved"}


def test_a_former_flag_still_sets_its_field_and_is_not_shown():
    @dataclass(frozen=True)
    class Renamed:
        lookahead: int = option(4, "how far ahead", former=("--peek",))

    p = argparse.ArgumentParser(prog="t")
    add_options(p, Renamed)
    assert build(Renamed, vars(p.parse_args(["--peek", "6"]))).lookahead == 6
    assert "--lookahead" in p.format_help() and "--peek" not in p.format_help()


def _named(items: list[str], earlier: dict[str, Any]) -> list[str]:
    return [f"{earlier['name']}:{item}" for item in items]


@dataclass(frozen=True)
class Later:
    GROUP: ClassVar[str] = "later"

    labels: list[str] = option(factory=list, flag="--label", convert=_named, help="a label, typed by Holder's name")


FAST = Check(lambda v: v == "fast", "must be fast here")


@dataclass(frozen=True)
class Holder:
    """Holds Inner in part (its mode only, not resumed here, and 'slow' refused by a check)."""

    name: str = option("x", "a name", group="outer")
    inner: Inner = concern(Inner, only=("mode",), mode={"resume": False, "check": FAST})
    later: Later = concern(Later)

    def __post_init__(self) -> None:
        validate(self)


def test_a_concern_held_in_part_gives_only_its_options_as_its_holder_declares_them():
    assert [path for path, _, _ in walk(Holder)] == ["name", "inner.mode", "later.labels"]
    assert groups_of(Holder) == {"name": "outer", "inner.mode": "inner", "later.labels": "later"}
    assert resume_keys(Holder) == () and resume_keys(Inner) == ("mode",)
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_options(p, Holder)
    assert "--rate" not in p.format_help()  # the option the holder does not take keeps its default
    # A held concern's convert sees the options built before it, in the concerns before its own.
    built = build(Holder, vars(p.parse_args(["--name", "n", "--label", "a"])))
    assert built == Holder(name="n", later=Later(labels=["n:a"])) and built.inner == Inner()
    with pytest.raises(ConfigError, match=r"^mode must be fast here, got 'slow'$"):
        Holder(inner=Inner(mode="slow"))
    with pytest.raises(ConfigError, match=r"Inner has no options \['speed'\]"):
        concern(Inner, only=("speed",))


@flat_concern("inner")
@dataclass(frozen=True)
class Middle:
    """Holds Inner whole, its options taken and read by their own names too."""

    GROUP: ClassVar[str] = "middle"

    size: int = option(2, "a size", check=POSITIVE)
    inner: Inner = concern(Inner)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class Top:
    """Holds Middle in part, and of the Inner that Middle holds only the rate, re-declared."""

    middle: Middle = concern(Middle, only=("inner",), inner=concern(Inner, only=("rate",), rate={"check": POSITIVE,
                                                                                                   "resume": True}))

    def __post_init__(self) -> None:
        validate(self)


def test_a_holder_takes_a_concern_held_inside_another_as_it_declares():
    assert [path for path, _, _ in walk(Top)] == ["middle.inner.rate"]
    assert groups_of(Top) == {"middle.inner.rate": "inner"} and resume_keys(Top) == ("rate",)
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_options(p, Top)
    assert "--size" not in p.format_help() and "--mode" not in p.format_help()
    assert build(Top, vars(p.parse_args(["--rate", "0.25"]))) == Top(middle=Middle(inner=Inner(rate=0.25)))
    assert resume_settings(Top(middle=Middle(rate=0.75))) == {"rate": 0.75}
    # Middle holds Inner whole, as Inner declares it: a rate of 0 is Middle's to take, Top's to refuse.
    assert [path for path, _, _ in walk(Middle)] == ["size", "inner.rate", "inner.mode"]
    assert Middle(rate=0).rate == 0
    with pytest.raises(ConfigError, match=r"^rate must be > 0, got 0$"):
        Top(middle=Middle(rate=0))  # Top's, on the Inner inside Middle
    with pytest.raises(ConfigError, match=r"Middle.inner is re-declared with concern\(Inner, ...\), got \{"):
        concern(Middle, inner={"check": POSITIVE})
    with pytest.raises(ConfigError, match=r"Middle.size is re-declared with Option settings, got "):
        concern(Middle, size=concern(Inner))


def test_a_flat_concern_is_given_and_read_by_its_options_names():
    import dataclasses
    import pickle

    m = Middle(rate=0.25, size=3)
    assert m.inner == Inner(rate=0.25) and (m.rate, m.mode, m.size) == (0.25, "fast", 3)
    assert m == Middle(inner=Inner(rate=0.25), size=3)
    assert Middle(inner=Inner(mode="slow"), rate=0.5).inner == Inner(rate=0.5, mode="slow")  # over the one given
    assert dataclasses.replace(m, mode="slow").inner == Inner(rate=0.25, mode="slow")
    assert dataclasses.replace(m, inner=Inner(mode="slow")).rate == Inner().rate
    assert dataclasses.replace(m, size=4).inner is m.inner
    assert pickle.loads(pickle.dumps(m)) == m
    with pytest.raises(TypeError, match="speed"):
        Middle(speed=1)
    with pytest.raises(ConfigError, match=r"Outer.name holds no config"):
        flat_concern("name")(Outer)

    @dataclass(frozen=True)
    class Clash:
        rate: float = option(1.0, "its own rate")
        inner: Inner = concern(Inner)

    with pytest.raises(ConfigError, match=r"^Clash has options \['rate'\] of its own: inner's cannot be taken"):
        flat_concern("inner")(Clash)
