import pytest

import agentenv
from agentenv import Environment, EnvCheckError, EnvNotFoundError, Task, check_env, make, register


class GoodEnv(Environment):
    def tasks(self, n, seed=0):
        return [Task(f"good/{seed}/{i}", f"what is {i}+{seed}?", i + seed) for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0


def test_make_builtin_and_entry_point():
    env = make("retool-math")
    assert env.id == "retool-math"
    assert "retool-math" in agentenv.registered()


def test_did_you_mean():
    with pytest.raises(EnvNotFoundError, match="Did you mean 'retool-math'"):
        make("retool-mat")


def test_module_path_and_register():
    env = make("tests.test_registry:GoodEnv")
    assert isinstance(env, GoodEnv)
    register("good-env", GoodEnv)
    assert isinstance(make("good-env"), GoodEnv)
    with pytest.raises(EnvNotFoundError, match="cannot import"):
        make("tests.test_registry:Missing")


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
