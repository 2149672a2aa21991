"""Import weight: ``import agentenv`` and the CLI's argument parsing load neither torch nor
transformers nor the trainer; those load when first used. Each check runs a fresh interpreter
(this test process may already hold torch) and asserts on what it imported, not on time."""

import json
import os
import subprocess
import sys

import pytest

def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "120"})


def test_import_agentenv_loads_no_torch_or_transformers():
    code = ("import agentenv, json, sys; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('agentenv.train'))))")
    r = python("-c", code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_engine_interface_modules_load_no_torch():
    """The engine interface and the engines that only name torch in type hints."""
    code = ("import agentenv.engines, agentenv.engines.openai, agentenv.engines.actors, agentenv.train.config, json, "
            "sys; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))")
    r = python("-c", code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def imported(importtime_stderr: str) -> set[str]:
    """Module names from ``python -X importtime``'s report."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("args, message", [
    (["rollout", "--tasks", "0"], "agentenv: error: argument --tasks: must be > 0, got 0"),
    (["eval", "--tasks", "0"], "agentenv: error: argument --tasks: must be > 0, got 0"),
    (["train", "--lr", "-1"], "agentenv: error: argument --lr: must be > 0, got -1"),
    (["envs", "--bogus"], "agentenv: error: unrecognized arguments: --bogus"),
    (["plot"], "agentenv: error: the following arguments are required: run"),
    (["check-tokenizer", "--format", "x"], "agentenv: error: argument --format: invalid choice: "
                                            "'x' (choose from 'retool', 'hermes', 'llama3-json')"),
])
def test_an_argument_error_imports_no_torch_transformers_or_trainer(args, message):
    r = python("-X", "importtime", "-m", "agentenv.cli", *args)
    lines = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert (r.returncode, lines, r.stdout) == (2, [message], "")
    modules = imported(r.stderr)
    assert "agentenv.errors" in modules  # the report lists the package's own imports
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers")}
    assert not {m for m in modules if m.startswith("agentenv.train.") and m != "agentenv.train.config"}


def test_lazy_train_names_resolve_to_their_modules():
    import agentenv
    import agentenv.train as train
    from agentenv.train import config, trainer

    assert train.TrainConfig is config.TrainConfig is trainer.TrainConfig
    assert train.train is trainer.train
    for name in train.__all__:
        assert getattr(train, name).__name__ == name
    assert set(train.__all__) <= set(dir(train))
    assert agentenv.RolloutProducer is train.RolloutProducer
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        train.nope  # noqa: B018
