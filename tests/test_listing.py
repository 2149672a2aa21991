"""``agentenv envs``: plain text from reST docstrings, format ids, the flags ``agentenv train``
takes from an environment, and the note on what the bundled model can do."""

from __future__ import annotations

import shlex

import pytest

from agentenv import Environment, Task, registry
from agentenv.cli import build_parser, main
from agentenv.listing import BUNDLED_MODEL_NOTE, cli_spelling, format_text, listing, plain_text, train_flags
from agentenv.formats import FORMATS, HermesFormat
from agentenv.registry import describe, env_kwargs
from agentenv.train.config import TrainConfig


@pytest.mark.parametrize("text, plain", [
    (":class:`Task`", "Task"),
    (":class:`~agentenv.env.Task`", "Task"),
    (":func:`agentenv.registry.make`", "agentenv.registry.make"),
    (":py:meth:`~Environment.reward`", "reward"),
    (":func:`the checker <agentenv.checker.check_env>`", "the checker"),
    ("``extra_digits`` makes the numbers longer", "extra_digits makes the numbers longer"),
    ("``--env-arg source=x.jsonl``", "--env-arg source=x.jsonl"),
    ("the `sandbox` argument", "the sandbox argument"),
    ("reward 1 for the right answer in \\boxed{}.", "reward 1 for the right answer in \\boxed{}."),
    ("two\n    lines,   one   line", "two lines, one line"),
    ("don't touch it's apostrophes", "don't touch it's apostrophes"),
])
def test_plain_text_drops_rest_markup_and_keeps_the_words(text, plain):
    assert plain_text(text) == plain


@pytest.mark.parametrize("text, cli", [
    ('format="hermes" asks for Hermes calls', "format=hermes asks for Hermes calls"),
    ("calls_in_think=True runs them; strict=False; limit=None",
     "calls_in_think=true runs them; strict=false; limit=null"),
    ("name='' and n=3 stay", "name= and n=3 stay"),
])
def test_a_description_spells_arguments_as_env_arg_takes_them(text, cli):
    assert cli_spelling(text) == cli


def test_the_retool_math_entry_spells_its_arguments_for_the_command_line():
    entry = " ".join(listing(None).split("retool-math  (", 1)[1].split("\n")[:2])
    assert 'format=hermes asks' in entry and "calls_in_think=true runs" in entry and '"' not in entry


def test_format_ids_are_the_ones_the_cli_accepts():
    assert [format_text(f) for f in FORMATS] == list(FORMATS)
    assert format_text("trace") == "trace (the environment's own format)"
    assert format_text(None) == "the model's own"
    # A format object is named by its id, not its class.
    assert describe("trace")["tool_format"] == "trace"


def test_train_defaults_are_shown_as_the_flags_that_set_them():
    """The flags shown for retool-math, given to ``agentenv train`` for an environment without
    training defaults of its own, set exactly retool-math's ``train_defaults``."""
    defaults = describe("retool-math")["train_defaults"]
    flags = train_flags(defaults)
    assert "--lr 0.0002" in flags and "--steps 100" in flags and "--env-arg extra_digits=1" in flags
    argv = ["train", "--env", "dataset", *shlex.split(flags)]
    parsed = vars(build_parser(argv).parse_args(argv))
    for name, value in defaults.items():
        if name == "env_kwargs":
            assert env_kwargs("retool-math", parsed["config.env.env_kwargs"]) == value
        else:
            assert parsed[f"config.{TrainConfig.PATHS[name]}"] == value, name
    # Without the flags the parser's defaults differ, so the flags are what set them.
    plain = vars(build_parser(argv[:3]).parse_args(argv[:3]))
    assert all(plain[f"config.{TrainConfig.PATHS[n]}"] != v for n, v in defaults.items() if n != "env_kwargs")


def test_switches_repeats_and_unknown_names_in_train_defaults():
    # --resume defaults to False: True shows the switch, False (the default) needs none.
    assert train_flags({"resume": True}) == "--resume"
    assert train_flags({"resume": False}) == ""
    assert train_flags({"report_to": ["tensorboard", "wandb"]}) == "--report-to tensorboard --report-to wandb"
    assert train_flags({"env_kwargs": {"split": "test", "tools": False}}) == \
        "--env-arg split=test --env-arg tools=false"
    assert train_flags({"nosuch": 3}) == "nosuch=3"


class SumEnv(Environment):
    """Sums of :class:`~agentenv.env.Task` numbers; ``n`` sets how many, see
    :func:`agentenv.registry.make`.

    The second paragraph is not part of the summary."""

    tool_format = HermesFormat()
    max_turns = 2
    tool_timeout = 9.0
    train_defaults = {"steps": 7, "kl_coef": 0.01}

    def __init__(self, n: int = 3, label: str | None = None) -> None:
        super().__init__()
        self.n = n

    def tasks(self, count, seed=0):
        return [Task(f"sum/{seed}/{i}", "1 + 1?", 2) for i in range(count)]

    async def reward(self, task, trajectory):
        return 0.0


def test_listing_shows_each_env_in_plain_words(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "sum-env", SumEnv)
    text = listing()
    block = text.split("\n\n")[[b.split()[0] for b in text.split("\n\n")].index("sum-env")]
    assert block.splitlines() == [
        f"sum-env  ({__name__}:SumEnv)",
        "    Sums of Task numbers; n sets how many, see agentenv.registry.make.",
        "    tool format: hermes; max_turns 2; tool_timeout 9.0 s",
        "    --env-arg: n: int = 3, label: str | None = None",
        "    agentenv train --env sum-env uses: --steps 7 --kl-coef 0.01",
    ]
    for markup in ("``", ":class:", ":func:", "Format;", "Format "):
        assert markup not in text, markup
    assert text.rstrip("\n").split("\n\n")[-1] == BUNDLED_MODEL_NOTE


def test_a_width_wraps_lines_under_their_indent_and_keeps_arguments_whole():
    whole, wrapped = listing(), listing(width=60)
    assert " ".join(whole.split()) == " ".join(wrapped.split())  # the same words
    assert max(map(len, whole.splitlines())) > 60
    assert all(len(line) <= 60 for line in wrapped.splitlines())
    lines = wrapped.splitlines()
    args = lines[next(i for i, ln in enumerate(lines) if ln.startswith("    --env-arg: source: str"))]
    assert args.endswith(",") and all(ln.startswith("      ") for ln in lines[lines.index(args) + 1:][:2])
    # An argument with its type and default is never split across lines.
    assert "id_column: str | None = None" in wrapped and "prompt_template: str | None = None" in wrapped


def test_agentenv_envs_prints_the_listing_and_the_note(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert out == listing()  # not a terminal: whole lines
    heads = [ln.split()[0] for ln in out.splitlines() if ln and not ln.startswith(" ")]
    # other tests may have registered envs of their own in this process: the bundled ones are there, in order
    assert [h for h in heads if h in {"dataset", "retool-math", "trace"}] == ["dataset", "retool-math", "trace"]
    assert heads[:-1] == sorted(heads[:-1]) and heads[-1] == "Note:"
    assert "tool format: trace (the environment's own format)" in out and "TraceFormat" not in out
    assert "trained only on retool-math" in out and "--model DIR" in out
