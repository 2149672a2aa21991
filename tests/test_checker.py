"""``check_env`` (``agentenv.checker``): each broken contract is named with what to fix; with
a tokenizer (the bundled one) the chat template and the format's stop tags are checked too."""

import pytest

from agentenv import Environment, EnvCheckError, EnvReport, Task, check_env, make
from agentenv.agent import AgentEnvironment
from agentenv.formats import ReToolFormat
from agentenv.tools import FunctionTool, PythonTool


class GoodEnv(Environment):
    def tasks(self, n, seed=0):
        return [Task(f"good/{seed}/{i}", f"what is {i}+{seed}?", i + seed) for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0


class NoReward(Environment):
    def tasks(self, n, seed=0):
        return [Task(str(i), "q") for i in range(n)]


class SyncReward(GoodEnv):
    def reward(self, task, trajectory):  # type: ignore[override]
        return 1.0


class Unseeded(GoodEnv):
    def tasks(self, n, seed=0):
        import random

        return [Task(str(i), str(random.random())) for i in range(n)]


class DupIds(GoodEnv):
    def tasks(self, n, seed=0):
        return [Task("same", "q") for _ in range(n)]


class BadPrompt(GoodEnv):
    def prompt(self, task):
        return "just a string"


@pytest.mark.parametrize(
    "cls, message",
    [
        (NoReward, "must override reward"),
        (SyncReward, "must be 'async def'"),
        (Unseeded, "not deterministic"),
        (DupIds, "unique"),
        (BadPrompt, "non-empty list"),
    ],
)
def test_check_env_explains_what_to_fix(cls, message):
    with pytest.raises(EnvCheckError, match=message):
        check_env(cls())


def test_check_env_with_tokenizer(tokenizer):
    check_env(make("retool-math"), tokenizer=tokenizer)

    class Hermes(GoodEnv):
        tool_format = "hermes"

    # </tool_call> is a single token in the bundled tokenizer too.
    check_env(Hermes(), tokenizer=tokenizer)


class ZeroTurns(GoodEnv):
    max_turns = 0


class NoId(GoodEnv):
    id = None  # type: ignore[assignment]


class NeedsArg(GoodEnv):
    def __init__(self, level: int) -> None:
        super().__init__()


def test_check_env_takes_a_class_and_checks_the_limits_and_id():
    check_env(GoodEnv)  # a class, as the README shows, is created with no arguments
    with pytest.raises(EnvCheckError, match="max_turns must be an int >= 1, got 0"):
        check_env(ZeroTurns)
    with pytest.raises(EnvCheckError, match="id must be a string"):
        check_env(NoId())
    with pytest.raises(EnvCheckError, match=r"cannot be created with no arguments .*check_env\(MyEnv\(\.\.\.\)\)"):
        check_env(NeedsArg)
    with pytest.raises(EnvCheckError, match="must subclass agentenv.Environment"):
        check_env(int)


class Raises(GoodEnv):
    def tasks(self, n, seed=0):
        raise OSError("the dataset is missing")


class TooFew(GoodEnv):
    def tasks(self, n, seed=0):
        return super().tasks(n - 1, seed)


class TwoPythons(GoodEnv):
    def tools(self):
        return [PythonTool(), FunctionTool(lambda code: code, name="python")]


class NoTimeout(GoodEnv):
    tool_timeout = 0


class UnknownFormat(GoodEnv):
    tool_format = "xml"


class SyncHook(GoodEnv):
    def on_turn(self, task, trajectory, turn_text):  # type: ignore[override]
        return None


@pytest.mark.parametrize("env, message", [
    (Raises(), r"tasks\(n, seed\) raised OSError: the dataset is missing"),
    (TooFew(), r"tasks\(4, seed=0\) must return a list of 4 Task objects"),
    (TwoPythons(), "tool names must be unique"),
    (NoTimeout(), "tool_timeout must be a number of seconds > 0, got 0"),
    (UnknownFormat(), "unknown tool-call format 'xml'"),
    (SyncHook(), r"on_turn\(\) must be 'async def'"),
])
def test_each_broken_contract_is_named_with_the_class(env, message):
    with pytest.raises(EnvCheckError, match=f"^{type(env).__name__}: {message}"):
        check_env(env)


class MultiTokenStop(ReToolFormat):
    stop_strings = ("</end of the call>",)


class MultiTokenEnv(GoodEnv):
    tool_format = MultiTokenStop()


def test_a_stop_tag_the_engine_cannot_stop_on_is_found_only_with_the_tokenizer(tokenizer):
    check_env(MultiTokenEnv())  # without a tokenizer this cannot be known
    with pytest.raises(EnvCheckError, match="'</end of the call>' is not a single token for this tokenizer"):
        check_env(MultiTokenEnv(), tokenizer=tokenizer)


class Documented(GoodEnv):
    """Sums, documented."""


class NoTools(Documented):
    def tools(self):
        return []


def test_check_env_returns_a_report_of_what_it_checked(tokenizer):
    report = check_env(Documented)
    assert isinstance(report, EnvReport) and report.env == "Documented"
    assert list(report.checks) == ["an Environment", "limits", "overrides", "async hooks", "tool format", "tasks",
                                   "prompts", "tools"]
    assert report.checks["tools"] == "python" and report.checks["tool format"].startswith("retool (not pinned")
    assert "'good/0/0'" in report.checks["tasks"]
    assert report.warnings == ["no tokenizer given: the chat template and the format's stop tags were not checked "
                               "(check_env(env, tokenizer=...) does)"]
    text = str(report)
    assert repr(report) == text  # what the REPL shows
    assert text.splitlines()[0] == "Documented passes check_env (8 checks, 1 warning)"
    assert "  [ok] limits: max_turns 4, tool_timeout 5.0 s" in text.splitlines()
    assert text.splitlines()[-1].startswith("  warning: no tokenizer given")

    with_tok = check_env(Documented(), tokenizer=tokenizer)
    assert with_tok.warnings == [] and str(with_tok).splitlines()[0] == "Documented passes check_env (10 checks)"
    assert with_tok.checks["stop tags"] == "'</code>' is a single token"


def test_the_report_warns_of_what_works_but_may_not_be_meant():
    assert any("has no docstring" in w for w in check_env(GoodEnv).warnings)
    report = check_env(NoTools)
    assert report.checks["tools"] == "none"
    assert "no tools: the model has nothing to call (a chat-only environment)" in report.warnings


class GoodAgent(AgentEnvironment):
    def tasks(self, n, seed=0):
        return [Task(f"agent/{seed}/{i}", f"what is {i}+{seed}?", i + seed) for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0

    async def agent(self, task, client, model):
        return "0"


class SyncAgent(GoodAgent):
    def agent(self, task, client, model):  # type: ignore[override]  (the mistake: client.chat.completions.create unawaited)
        return "0"


class CommandAgent(GoodAgent):
    agent = AgentEnvironment.agent  # the default: runs agent_command
    agent_command = ["python", "my_agent.py"]


class NoAgentAtAll(CommandAgent):
    agent_command = None


def test_an_agent_environment_needs_an_async_agent_or_a_command():
    assert "agent() are 'async def'" in check_env(GoodAgent()).checks["async hooks"]
    check_env(CommandAgent())
    with pytest.raises(EnvCheckError, match=r"SyncAgent.*agent\(\) must be 'async def' and await the client's calls"):
        check_env(SyncAgent())
    with pytest.raises(EnvCheckError, match=r"NoAgentAtAll.*must override agent\(\) .* or set agent_command"):
        check_env(NoAgentAtAll())
