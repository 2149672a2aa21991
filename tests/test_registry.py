import os

import pytest

import agentenv
from agentenv import Environment, EnvNotFoundError, Task, make, register
from agentenv.errors import ConfigError


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


USER_FILE = '''
from typing import Literal, Optional

from agentenv import Environment, Task, register


class FileEnv(Environment):
    """An environment in a user's file."""

    def __init__(self, size: int = 2, rate: float = 0.5, on: bool = False, name: Optional[str] = None,
                 mode: Literal["a", "b"] = "a", tags: list = ()):
        super().__init__()
        self.size, self.rate, self.on, self.name, self.mode, self.tags = size, rate, on, name, mode, tags

    def tasks(self, n, seed=0):
        return [Task(f"f/{seed}/{i}", f"q{i}") for i in range(n)]

    async def reward(self, task, trajectory):
        return 0.0


register("{id}", FileEnv)
'''


def test_an_environment_from_a_file_path_a_module_in_the_working_directory_or_env_var(tmp_path, monkeypatch):
    from agentenv import registry

    (tmp_path / "user_env_a.py").write_text(USER_FILE.replace("{id}", "file-env-a"))
    (tmp_path / "user_env_b.py").write_text(USER_FILE.replace("{id}", "file-env-b"))
    (tmp_path / "user_env_c.py").write_text(USER_FILE.replace("{id}", "file-env-c"))
    env = make(f"{tmp_path / 'user_env_a.py'}:FileEnv", size=3)  # an absolute path
    assert type(env).__name__ == "FileEnv" and env.size == 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert make("./user_env_a.py:FileEnv").size == 2  # relative; the same module, not a second copy
    assert type(make("./user_env_a.py:FileEnv")) is type(env)
    assert type(make("user_env_b:FileEnv")).__module__ == "user_env_b"  # beside the user, as `python -m`
    with pytest.raises(EnvNotFoundError, match="no environment 'file-env-c'"):
        make("file-env-c")
    monkeypatch.setenv("AGENTENV_ENV_MODULES", "user_env_c")
    assert make("file-env-c").id == "file-env-c"
    with pytest.raises(EnvNotFoundError, match="no such file"):
        make("./missing.py:FileEnv")
    (tmp_path / "broken_env.py").write_text("def oops(:\n")
    with pytest.raises(EnvNotFoundError, match="cannot import ./broken_env.py: SyntaxError"):
        make("./broken_env.py:X")
    # Arguments: the constructor's names, converted by its annotations.
    kw = registry.env_kwargs("file-env-c", ["size=4", "rate=0.25", "on=yes", "name=none", "mode=b", "tags=[1, 2]"])
    assert kw == {"size": 4, "rate": 0.25, "on": True, "name": None, "mode": "b", "tags": [1, 2]}
    assert registry.env_kwargs("file-env-c", ["name=x"]) == {"name": "x"}
    for bad, message in ((["sizes=1"], "no argument 'sizes'; it takes: size: int = 2, rate: float = 0.5"),
                         (["size=1.5"], "size='1.5': not a valid int"), (["on=maybe"], "not a valid bool"),
                         (["mode=c"], "mode='c': not a valid"), (["tags=1"], "not a valid list"),
                         (["size"], "wants KEY=VALUE")):
        with pytest.raises(agentenv.ConfigError, match=message):
            registry.env_kwargs("file-env-c", bad)
    with pytest.raises(agentenv.ConfigError, match="no argument 'sizes'"):
        make("file-env-c", sizes=1)
    d = registry.describe("file-env-c")
    assert d["description"] == "An environment in a user's file." and d["tool_format"] is None
    assert d["args"].startswith("size: int = 2, rate: float = 0.5, on: bool = False")


def test_the_trace_env_shows_and_checks_its_workload_fields():
    from agentenv.registry import describe, env_kwargs

    assert "mean_turns: float = 6.0" in describe("trace")["args"] and "(any)" not in describe("trace")["args"]
    assert env_kwargs("trace", ["mean_turns=3", "sandbox=no"]) == {"mean_turns": 3.0, "sandbox": False}
    with pytest.raises(ConfigError, match="has no argument 'nosuch'"):
        env_kwargs("trace", ["nosuch=1"])


def test_class_spec_makes_the_very_class_in_a_fresh_process(tmp_path):
    """What a Ray worker is told to make: the env's own class (a subclass that keeps its
    parent's id included), importable from a process given this one's sys.path; a module
    imported from a file is named by its file (two files here share a name)."""
    import subprocess
    import sys

    from agentenv import registry

    (tmp_path / "sub_env.py").write_text(
        "from agentenv.envs.retool_math import RetoolMathEnv\n\nclass Sub(RetoolMathEnv):\n    pass\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "sub_env.py").write_text("from agentenv.workload import TraceEnv\n\n"
                                                   "class Sub(TraceEnv):\n    pass\n")
    first = make(f"{tmp_path / 'sub_env.py'}:Sub")
    second = make(f"{tmp_path / 'other' / 'sub_env.py'}:Sub")  # the same stem, another module
    assert first.id == "retool-math" and registry.class_spec(first) == f"{(tmp_path / 'sub_env.py').resolve()}:Sub"
    assert registry.class_spec(second) == f"{(tmp_path / 'other' / 'sub_env.py').resolve()}:Sub"
    assert registry.class_spec(make("retool-math")) == "agentenv.envs.retool_math:RetoolMathEnv"
    for env, base in ((first, "RetoolMathEnv"), (second, "TraceEnv")):
        code = (f"import sys; sys.path.extend({sys.path!r}); from agentenv import make; "
                f"e = make({registry.class_spec(env)!r}); print(type(e).__name__, type(e).__mro__[1].__name__)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 0 and r.stdout.split() == ["Sub", base], r.stderr[-2000:]


def test_class_spec_of_a_class_in_the_users_script_names_the_script(tmp_path):
    """A class defined in the script being run (``__main__``): named by the script's file,
    which another process imports under its own name, so the script's main block stays put."""
    import subprocess
    import sys

    script = tmp_path / "my_script.py"
    script.write_text("from agentenv import registry\nfrom agentenv.envs.retool_math import RetoolMathEnv\n\n"
                      "class Mine(RetoolMathEnv):\n    pass\n\nif __name__ == '__main__':\n"
                      "    print(registry.class_spec(Mine()))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"{script.resolve()}:Mine", r.stderr[-2000:]
    code = f"from agentenv import make; e = make({r.stdout.strip()!r}); print(type(e).__name__, e.id)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0 and r.stdout.split() == ["Mine", "retool-math"], r.stderr[-2000:]


def test_a_portable_spec_carries_a_users_one_file_module_to_a_machine_without_it(tmp_path):
    """A Ray worker on another node has neither the driver's files nor its working directory:
    the spec carries the text of the env's module when it is one file of the user's own (a
    file, or a module beside the user), and the worker makes the very class from it. An
    installed module's class is named, not carried."""
    import shutil
    import subprocess
    import sys

    from agentenv import registry

    src = ("from agentenv.envs.retool_math import RetoolMathEnv\n\nclass Far(RetoolMathEnv):\n"
           "    max_turns = 3\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "far_env.py").write_text(src)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "beside_env.py").write_text(src.replace("Far", "Beside"))
    by_file = registry.portable_spec(make(f"{tmp_path / 'a' / 'far_env.py'}:Far"))
    code = ("import os, sys; sys.path.insert(0, os.getcwd()); from agentenv import registry; "
            "print(registry.portable_spec(registry.make('beside_env:Beside')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path / "b")
    assert r.returncode == 0, r.stderr[-2000:]
    beside = eval(r.stdout)  # noqa: S307 - the dict this test's own child printed
    assert beside["env"] == "beside_env:Beside" and beside["source"] == src.replace("Far", "Beside")
    assert by_file["source"] == src
    assert registry.portable_spec(make("retool-math")) == {"env": "agentenv.envs.retool_math:RetoolMathEnv",
                                                          "source": None}
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")  # neither file is anywhere now
    scratch = tmp_path / "tmp"  # the children's TMPDIR: make_portable leaves nothing there
    scratch.mkdir()
    for spec, name in ((by_file, "Far"), (beside, "Beside")):
        code = (f"import inspect, sys; sys.path.extend({sys.path!r}); from agentenv import registry; "
                f"e = registry.make_portable({spec!r}); print(type(e).__name__, e.id, e.max_turns); "
                "print(repr(inspect.getsource(type(e))))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                           env={**os.environ, "TMPDIR": str(scratch)})
        assert r.returncode == 0 and r.stdout.split("\n")[0].split() == [name, "retool-math", "3"], r.stderr[-2000:]
        # Its lines are still there for tracebacks and inspect, though its file is gone.
        assert eval(r.stdout.split("\n")[1]) == f"class {name}(RetoolMathEnv):\n    max_turns = 3\n"  # noqa: S307
        assert list(scratch.iterdir()) == []
        gone = subprocess.run([sys.executable, "-c", code.replace("registry.make_portable", "registry.make").replace(
            f"{spec!r}", f"{spec['env']!r}")], capture_output=True, text=True, timeout=120, cwd="/")
        assert gone.returncode != 0 and "EnvNotFoundError" in gone.stderr  # the spec alone would not do
