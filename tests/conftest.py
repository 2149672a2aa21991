"""Shared fixtures: the bundled tiny model on the real embedded engine, real sandboxes."""

from __future__ import annotations

import os

import psutil
import pytest

from agentenv.models import default_model


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir():
    path = os.environ.get("AGENTENV_TEST_MODEL") or str(default_model())
    assert os.path.isfile(os.path.join(path, "config.json")), f"bundled model missing at {path}"
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from agentenv.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_dir, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from agentenv.engines.embedded import load_tokenizer

    return load_tokenizer(model_dir)


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}
