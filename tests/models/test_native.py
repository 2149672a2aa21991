"""A model's own tool-call format (agentenv.models.native), and an environment that does not
pin one taking it (agentenv.env.bind_tool_format): the bundled models, a directory with only
a chat template, a known family, the default, and the warning for a pinned mismatch."""

from __future__ import annotations

import json

import pytest

from agentenv.checker import check_env
from agentenv.cli import main
from agentenv.config import RolloutConfig
from agentenv.engines.embedded import load_tokenizer
from agentenv.engines.instant import InstantEngine
from agentenv.env import Environment, Task, bind_tool_format
from agentenv.envs.retool_math import HERMES_PROMPT, SYSTEM_PROMPT, RetoolMathEnv
from agentenv.formats import HermesFormat, ReToolFormat
from agentenv.models import BUNDLED, default_model
from agentenv.models.families import LLAMA3_TEMPLATE, QWEN3_TEMPLATE
from agentenv.formats import get_format
from agentenv.models.native import NativeFormat, default_model_for, native_format
from agentenv.reactor import Reactor


def test_the_bundled_models_declare_their_format():
    assert native_format("tiny-hermes") == NativeFormat("hermes", "training.json")
    assert native_format("tiny-retool") == NativeFormat("retool", "agentenv.json")
    assert native_format(load_tokenizer(str(BUNDLED["tiny-hermes"]))).name == "hermes"  # by its directory


def test_without_a_model_a_run_takes_the_bundled_model_that_speaks_the_pinned_format():
    assert default_model_for("hermes") == BUNDLED["tiny-hermes"]
    assert default_model_for(get_format("hermes")) == BUNDLED["tiny-hermes"]  # an environment's pinned format
    assert default_model_for("retool") == default_model_for(None) == default_model() == BUNDLED["tiny-retool"]
    assert default_model_for("llama3-json") == BUNDLED["tiny-retool"]  # none speaks it: the default, and a warning


def test_check_tokenizer_without_a_model_checks_the_bundled_model_of_the_format(capsys):
    assert main(["check-tokenizer", "--format", "hermes"]) == 0
    assert "tiny-hermes with the 'hermes' format: the token bridge is EXACT" in capsys.readouterr().out


def test_a_rollout_of_a_hermes_environment_without_a_model_runs_tiny_hermes(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["rollout", "--env", "retool-math", "--env-arg", "format=hermes", "--tasks", "1", "--group-size", "1",
                 "--max-new-tokens", "8", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"model={BUNDLED['tiny-hermes']}" in err and "tool format:" not in err


@pytest.mark.parametrize("files, expected", [
    ({"chat_template.jinja": QWEN3_TEMPLATE}, ("hermes", "its chat template's tool syntax")),
    ({"tokenizer_config.json": {"chat_template": LLAMA3_TEMPLATE}}, ("llama3-json", "its chat template's tool syntax")),
    ({"tokenizer_config.json": {"chat_template": [{"name": "tool_use", "template": "<tool_call>{{ x }}"}]}},
     ("hermes", "its chat template's tool syntax")),
    ({"chat_template.jinja": QWEN3_TEMPLATE, "agentenv.json": {"tool_format": "retool"}}, ("retool", "agentenv.json")),
    ({"config.json": {"model_type": "qwen2"}}, ("hermes", "the qwen2 family")),
    ({"config.json": {"model_type": "llama", "vocab_size": 128256}}, ("llama3-json", "the Llama 3 family")),
    ({"config.json": {"model_type": "llama", "vocab_size": 32000}}, (None, "no tool syntax in its files")),
])
def test_a_directory_declares_or_implies_its_format(tmp_path, files, expected):
    model = tmp_path / "m"
    model.mkdir()
    for name, content in files.items():
        (model / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert native_format(model) == NativeFormat(*expected)


def test_a_family_by_name_and_a_tokenizer_by_its_template(tmp_path):
    (tmp_path / "Meta-Llama-3.1-8B-Instruct").mkdir()
    assert native_format(tmp_path / "Meta-Llama-3.1-8B-Instruct").name == "llama3-json"
    tok = load_tokenizer(str(BUNDLED["tiny-retool"]))
    tok.name_or_path, tok.chat_template = "served-model", QWEN3_TEMPLATE
    assert native_format(tok) == NativeFormat("hermes", "its chat template's tool syntax")


class Plain(Environment):
    """No tool format of its own."""

    def tasks(self, n, seed=0):
        return [Task(str(i), "q") for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0


class Pinned(Plain):
    tool_format = "retool"


def test_an_unpinned_environment_takes_the_models_format_and_its_prompt():
    env = RetoolMathEnv()
    assert bind_tool_format(env, "tiny-hermes") is None
    assert isinstance(env.tool_format, HermesFormat) and env.system_prompt == HERMES_PROMPT
    env = RetoolMathEnv(calls_in_think=True)
    bind_tool_format(env, "tiny-hermes")
    assert env.tool_format.calls_in_think
    env = RetoolMathEnv()
    bind_tool_format(env, "tiny-retool")
    assert isinstance(env.tool_format, ReToolFormat) and env.system_prompt == SYSTEM_PROMPT
    env = Plain()
    bind_tool_format(env, load_tokenizer(str(BUNDLED["tiny-retool"])))
    assert env.tool_format.name == "retool"


def test_a_model_whose_format_cannot_be_told_gets_retool(tmp_path):
    env = Plain()
    assert bind_tool_format(env, tmp_path) is None and env.tool_format.name == "retool"


def test_a_pinned_format_the_model_does_not_speak_gives_one_line_naming_both_and_the_switch():
    env = RetoolMathEnv(format="retool")
    assert bind_tool_format(env, "tiny-hermes") == (
        "tool format: retool-math pins 'retool' but the model speaks 'hermes' (from training.json); "
        "--env-arg format=hermes switches to it")
    assert isinstance(env.tool_format, ReToolFormat)  # pinned stays pinned
    assert bind_tool_format(Pinned(), "tiny-hermes").endswith("set tool_format = None in Pinned to follow the model")
    assert bind_tool_format(RetoolMathEnv(format="hermes"), "tiny-hermes") is None
    assert bind_tool_format(Pinned(), "tiny-retool") is None


def test_the_reactor_gives_an_unpinned_environment_its_engines_models_format():
    tok = load_tokenizer(str(BUNDLED["tiny-hermes"]))
    env = RetoolMathEnv()
    Reactor(InstantEngine(tok, reply=[tok.eos_token_id], turn_tokens=1), env, None, RolloutConfig())
    assert isinstance(env.tool_format, HermesFormat) and env.prompt(env.tasks(1)[0])[0]["content"] == HERMES_PROMPT


def test_check_env_and_check_tokenizer_say_which_format_and_why(capsys):
    tok = load_tokenizer(str(BUNDLED["tiny-hermes"]))
    report = check_env(RetoolMathEnv, tokenizer=tok)
    assert report.checks["tool format"] == "hermes (the model's own: training.json)"
    assert check_env(RetoolMathEnv(format="retool"), tokenizer=tok).warnings[0].startswith(
        "tool format: retool-math pins 'retool' but the model speaks 'hermes'")
    assert main(["check-tokenizer", "--model", "tiny-hermes"]) == 0
    assert "with the 'hermes' format (the model's own: training.json): the token bridge is EXACT" in \
        capsys.readouterr().out


def test_a_rollout_without_env_args_runs_the_models_calls_and_a_pinned_mismatch_warns(tmp_path, capsys):
    """The CLI with tiny-hermes and no --env-arg: the header names no warning and the calls parse;
    pinned to retool: the one warning line."""
    out = tmp_path / "r.jsonl"
    # 8 programs: sampled at temperature 1 at extra_digits=2, any 4 may all slip in their JSON.
    assert main(["rollout", "--model", "tiny-hermes", "--tasks", "4", "--group-size", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "tool format:" not in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert any(c["status"] != "malformed" for r in rows for c in r["tool_calls"])
    assert main(["rollout", "--model", "tiny-hermes", "--env-arg", "format=retool", "--tasks", "1", "--group-size",
                 "1", "--out", str(tmp_path / "pinned.jsonl")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "tool format:" in line]
    assert lines == ["warning: tool format: retool-math pins 'retool' but the model speaks 'hermes' (from "
                     "training.json); --env-arg format=hermes switches to it"]
